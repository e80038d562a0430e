"""CPU emulation of csrc/moe_dp4a.cu's gate+up arithmetic, to check tests/test_moe_dp4a_gpu.py's element-wise bar of
test_dp4a_product_is_exact_for_its_16_bit_activations against float32's own rounding (session 67: the GPU failed
it once, [sparse], one element 1.37 bf16 steps off). The kernel's per-block integer sums are exact; each lane adds
its blocks' (sum x scale) by fmaf in float32, then 32 lanes by a shuffle tree, then the SwiGLU in float32, bf16 out.
The bar and the kernel's codes are the test's own (tests/dp4a_bar.py).
Usage: python experiments/s67/dp4a_exactness_emulation.py [--bits 16] [--seeds 200] [--ref kernel|exact]"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from ds4.quant import dequant_fp4

sys.path.insert(0, "tests")  # (run from the repository's root)
from dp4a_bar import codes16, h_slack  # noqa: E402

DIM, INTER = 4096, 64


def x_of(kind, g):
    x = torch.randn(1, DIM, generator=g)
    if kind == "wide_range":
        x = x * torch.pow(2.0, torch.randint(-20, 8, (1, DIM), generator=g).float())
    if kind == "sparse":
        x = x * (torch.arange(DIM) // 32 % 3 == 0)
    return x.to(torch.bfloat16)


def kernel_like(x, d, bits):
    """float32 h's gate (or up) rows as the kernel forms them: exact block sums, float32 fmaf per lane, shuffle tree."""
    qmax = 2 ** (bits - 1) - 1
    xb = x.float().view(-1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    with np.errstate(divide="ignore"):
        inv = (np.float32(qmax) / amax.numpy().astype(np.float32))
    xs = (amax.numpy().astype(np.float32) / np.float32(qmax)).astype(np.float32)
    q = np.clip(np.rint(xb.numpy().astype(np.float32) * np.where(amax.numpy() > 0, inv, 0)), -qmax, qmax)
    nb = DIM // 32
    # exact block sums of q x w (w = dequantised weights / their block scale: E2M1 values, the scale apart)
    part = (torch.from_numpy(q).double().view(1, nb, 32) * d.double().view(-1, nb, 32)).sum(-1).numpy()  # [inter, nb]
    scale = np.broadcast_to(xs.reshape(1, nb), part.shape).astype(np.float32)
    terms = (part * scale.astype(np.float64))  # the weight scale is inside d already (a power of two: exact)
    acc = np.zeros((part.shape[0], 32), np.float32)
    for i in range(nb // 32):  # lane l takes blocks i * 32 + l; fmaf: one rounding of acc + term
        acc = (acc.astype(np.float64) + terms[:, i * 32:(i + 1) * 32]).astype(np.float32)
    d_ = 16
    while d_ > 0:  # shuffle xor tree
        acc = (acc + acc[:, np.arange(32) ^ d_]).astype(np.float32)
        d_ //= 2
    return acc[:, 0]


REF = "kernel"


def main():
    global REF
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", type=int, default=16)
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--ref", choices=["kernel", "exact"], default="kernel")
    args = ap.parse_args()
    REF = args.ref
    eps, tiny = float(torch.finfo(torch.bfloat16).eps), float(torch.finfo(torch.bfloat16).tiny)
    for kind in ("wide_range", "sparse", "normal"):
        worst_old = worst_new = 0.0
        fail_old = fail_new = 0
        eq = []
        for seed in range(args.seeds):
            g = torch.Generator().manual_seed(seed)
            w = torch.randint(-128, 128, (2, INTER, DIM // 2), dtype=torch.int8, generator=g)
            s = torch.randint(110, 114, (2, INTER, DIM // 32), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
            d = dequant_fp4(w, s, torch.float32)
            x = x_of(kind, g)
            if REF == "exact":  # the bar before session 67: q from the exact quotient 32767 / amax
                xb = x.double().view(-1, 32)
                am = xb.abs().amax(-1, keepdim=True)
                xq = (torch.round(xb * (32767 / am.clamp_min(1e-300))).clamp(-32767, 32767) * (am / 32767)).view(1, DIM)
            else:  # the kernel's own codes: q16_of's float32 quotients (IEEE, as nvcc builds without fast math)
                xq = codes16(x)
            gf, uf = torch.from_numpy(kernel_like(x, d[0], args.bits)), torch.from_numpy(kernel_like(x, d[1], args.bits))
            h = (gf / (1 + torch.exp(-gf)) * uf).to(torch.bfloat16).double()
            gg, uu = (xq @ d[0].double().t())[0], (xq @ d[1].double().t())[0]
            want = (gg * torch.sigmoid(gg) * uu).to(torch.bfloat16).double()
            step = eps * want.abs().clamp_min(tiny)
            off = (h - want).abs()
            slack = h_slack(gg, uu, xq, d[0], d[1], want)  # the new bar's float32 allowance
            worst_old = max(worst_old, float((off / step).max()))
            worst_new = max(worst_new, float((off / (step * 1.01 + slack)).max()))
            fail_old += int(not (off <= step * 1.01).all())
            fail_new += int(not (off <= step * 1.01 + slack).all())
            eq.append(float((h == want).double().mean()))
        print(f"ref {REF}, {args.bits}-bit {kind:10s}: cases failing the old bar (1 step) {fail_old}/{args.seeds}, worst "
              f"{worst_old:.2f} steps; the new bar (1 step + float32 slack) {fail_new}/{args.seeds}, worst "
              f"{worst_new:.2f}; bit-equal min {min(eq):.3f} mean {np.mean(eq):.3f}")


if __name__ == "__main__":
    main()
