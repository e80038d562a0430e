"""Session 48: where one V4-Flash layer's grouped prompt MoE (ds4.ops.moe_cuda.grouped_routed) spends its time.

256 routed experts in fp4t (random bytes, E8M0 scales near 1), n prompt tokens routed uniformly at random (6 distinct
experts a token). CUDA-event times, median of 5 after a warm-up: the whole routed sum at the default group size and at
one group of every expert; the dequantisation alone (all three matrices of every expert, the default groups; the
bytes it moves and their rate; with the staged and the direct stores, DS4_DEQUANT_STAGE); and the products alone (gather, two grouped GEMMs, SwiGLU, index_add on experts
dequantised once beforehand)."""
import os
import statistics

import torch

from ds4 import kernels
from ds4.ops.base import MoEWeights, QWeight
from ds4.ops.moe_cuda import GROUP_BYTES, Fp4TopkMoE, _expert_products, grouped_routed
from ds4.ops.dequant_cuda import dense
from ds4.ops.moe_torch import swiglu

kernels.load()
DEV, E, DIM, INTER, K = "cuda", 256, 4096, 2048, 6
g = torch.Generator(device=DEV).manual_seed(0)


def fp4(o, i):
    w = torch.randint(-128, 128, (E, o, i // 2), device=DEV, generator=g, dtype=torch.int8)
    s = torch.randint(116, 124, (E, o, i // 32), device=DEV, generator=g, dtype=torch.uint8)
    return QWeight("fp4", w, s.view(torch.float8_e8m0fnu))


def fp8(o, i):
    w = torch.randint(0, 120, (o, i), device=DEV, generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.full((-(-o // 128), -(-i // 128)), 120, device=DEV, dtype=torch.uint8)
    return QWeight("fp8", w, s.view(torch.float8_e8m0fnu))


mw = MoEWeights(gate=torch.zeros(E, DIM, device=DEV, dtype=torch.bfloat16), bias=None, tid2eid=None,
                w1=fp4(INTER, DIM), w2=fp4(DIM, INTER), w3=fp4(INTER, DIM), shared_w1=fp8(INTER, DIM),
                shared_w2=fp8(DIM, INTER), shared_w3=fp8(INTER, DIM), n_experts=E, expert_offset=0, topk=K,
                route_scale=1.5, swiglu_limit=10.0)
mw = Fp4TopkMoE().prepare(mw)
print("routed layout", mw.w1.fmt)


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def dequant_all():
    size = max(1, GROUP_BYTES // (3 * INTER * DIM * 2))
    w13 = torch.empty(size, 2 * INTER, DIM, dtype=torch.bfloat16, device=DEV)
    w2 = torch.empty(size, DIM, INTER, dtype=torch.bfloat16, device=DEV)
    for e0 in range(0, E, size):
        e1 = min(e0 + size, E)
        dense(mw.w1[e0:e1], torch.bfloat16, out=w13[:e1 - e0, :INTER])
        dense(mw.w3[e0:e1], torch.bfloat16, out=w13[:e1 - e0, INTER:])
        dense(mw.w2[e0:e1], torch.bfloat16, out=w2[:e1 - e0])


W13 = torch.cat([dense(mw.w1, torch.bfloat16), dense(mw.w3, torch.bfloat16)], dim=1)
W2 = dense(mw.w2, torch.bfloat16)
fp4_bytes = sum(q.weight.numel() + q.scale.numel() for q in (mw.w1, mw.w2, mw.w3))
bf16_bytes = 3 * E * INTER * DIM * 2
for stage in ("1", "0"):  # the staged stores (the default since session 48) and the direct ones
    os.environ["DS4_DEQUANT_STAGE"] = stage
    t_dq = timed(dequant_all)
    print(f"dequant of all {E} experts, DS4_DEQUANT_STAGE={stage}: {t_dq:.3f} ms, "
          f"{(fp4_bytes + bf16_bytes) / t_dq / 1e6:.0f} GB/s ({fp4_bytes / 1e9:.2f} GB read, {bf16_bytes / 1e9:.2f} GB "
          "written)")
del os.environ["DS4_DEQUANT_STAGE"]
print(f"{'tokens':>7} {'routed ms':>10} {'one group':>10} {'products':>9} {'GEMM TFLOP/s':>13}")
for n in (512, 2048, 8000):
    x = torch.randn(n, DIM, device=DEV, generator=g).to(torch.bfloat16)
    ids = torch.rand(n, E, device=DEV, generator=g).topk(K, dim=-1).indices
    w = torch.rand(n, K, device=DEV, generator=g)
    t_all = timed(lambda: grouped_routed(x, w, ids, mw))
    os.environ["DS4_PREFILL_GROUP_BYTES"] = str(1 << 40)
    t_one = timed(lambda: grouped_routed(x, w, ids, mw))
    del os.environ["DS4_PREFILL_GROUP_BYTES"]
    flat = ids.flatten()
    perm = flat.argsort(stable=True)
    offs = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)
    rows, rw = perm // K, w.flatten()[perm].unsqueeze(-1)

    def products():
        gu = _expert_products(x[rows], W13, offs, [], True)
        a = (swiglu(gu[:, :INTER], gu[:, INTER:], 10.0) * rw).to(torch.bfloat16)
        torch.zeros(n, DIM, device=DEV).index_add_(0, rows, _expert_products(a, W2, offs, [], True).float())

    t_pr = timed(products)
    flops = 2 * n * K * 3 * INTER * DIM
    print(f"{n:>7} {t_all:>10.3f} {t_one:>10.3f} {t_pr:>9.3f} {flops / t_pr / 1e9:>13.1f}")
