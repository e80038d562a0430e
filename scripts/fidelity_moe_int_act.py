"""What integer activations in the routed experts would cost in greedy agreement (a measurement for a possible
IDP4A MoE kernel, scripts/probe_dp4a.cu; not a ds4 option).

The torch reference on `small` (plain numerics, bf16) generates 256 greedy tokens; then, teacher-forced on them, the
same model with the routed experts' inputs (x before w1 / w3, the SwiGLU output before w2) rounded to B-bit integers
per 32-value block (scale amax / (2^(B-1) - 1), as the probe's kernel would take them), against the reference's
logits: overall top-1 agreement, agreement on the steps whose reference top-2 margin exceeds 2 (tests/test_gpu_e2e.py's
bar), and the rounding floor (the fp32 reference against the bf16 one) for scale. The decode steps' one-token MoE
(DequantMoE's gather form, moe_torch._mm) takes the rounding; the prompt's prefill (its grouped form) does not.

    python scripts/fidelity_moe_int_act.py [--bits 8,16] [--tokens 256] [--device cpu]
"""
from __future__ import annotations

import argparse

import torch

from ds4.model.args import small
from ds4.model.transformer import Transformer
from ds4.ops import moe_torch
from ds4.registry import Impls, build_ops
from ds4.runtime.generate import Generator
from ds4.weights.synthetic import random_weights

MARGIN = 2.0  # tests/test_gpu_e2e.py's confident-step bar


def int_block_sim(x: torch.Tensor, bits: int, block: int = 32) -> torch.Tensor:
    """x rounded to signed `bits`-bit integers per `block` values along the last dim, scale amax / (2^(bits-1) - 1);
    returned in x's dtype."""
    lim = 2 ** (bits - 1) - 1
    xb = x.float().unflatten(-1, (-1, block))
    s = xb.abs().amax(-1, keepdim=True).clamp(min=1e-30) / lim
    return ((xb / s).round().clamp(-lim, lim) * s).flatten(-2).to(x.dtype)


def agreement(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, int]:
    ref = ref.float().cpu()
    top2 = ref.topk(2, -1).values
    conf = (top2[:, 0] - top2[:, 1]) > MARGIN
    agree = got.cpu() == ref.argmax(-1)
    return agree.float().mean().item(), agree[conf].float().mean().item(), int(conf.sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", default="8,16")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    dev = torch.device(a.device)
    args = small()
    w = random_weights(args, seed=0, device=dev, include_mtp=False)

    def model(dtype=torch.bfloat16):
        m = Transformer(args, build_ops(Impls(), dev), "plain", dtype, dev)
        m.load_weights(w)
        return m

    prompt = [(17 * i + 3) % args.vocab_size for i in range(32)]
    ref = Generator(model(), 1, 512)
    toks = ref.generate([prompt], a.tokens, stop_at_eos=False).tokens[0]
    ref_logits = ref.teacher_forced_logits(prompt, toks)
    floor = agreement(Generator(model(torch.float32), 1, 512).teacher_forced_logits(prompt, toks).argmax(-1),
                      ref_logits)
    print(f"small, {a.tokens} tokens; rounding floor (fp32 reference against bf16): overall {floor[0]:.4f}, "
          f"confident {floor[1]:.4f} of {floor[2]}")
    orig_mm = moe_torch._mm
    for bits in (int(b) for b in a.bits.split(",")):
        # the routed experts' products take x (before w1 / w3) and a (before w2) rounded per block; the shared
        # expert (its own function) keeps bf16, as it would stay on the FP8 tensor-core path
        moe_torch._mm = lambda x, wt, b=bits: orig_mm(int_block_sim(x, b), wt)
        try:
            got = Generator(model(), 1, 512).teacher_forced_logits(prompt, toks)
        finally:
            moe_torch._mm = orig_mm
        o, c, n = agreement(got.argmax(-1), ref_logits)
        print(f"int{bits} per 32 in the routed experts: overall {o:.4f}, confident {c:.4f} of {n}")


if __name__ == "__main__":
    main()
