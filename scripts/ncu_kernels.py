#!/usr/bin/env python
"""Launch the batch-1 weight kernels at V4-Flash shapes a few times each, for Nsight Compute.

    ncu --clock-control none --kernel-name regex:"moe_|gemv" \\
        --section SpeedOfLight --section WarpStateStats python scripts/ncu_kernels.py

The first matching launch is a routed gate+up that makes the downs' h input (not printed); then each kernel runs
`--reps` times on its own weights copy / expert ids (eager, so ncu sees one launch per call);
ncu serialises and times each launch with flushed caches, so these are the kernels alone — no PDL
overlap, no neighbours. The names printed before each group let the ncu report be read in order.
The weights are in the layouts the library runs by default: the routed experts in fp4t (moe=fp4_topk:
ds4.quant.tile_fp4_mma of the fp4p words), the dense FP8 projections in fp8t (linear=gemv_cuda: tile_fp8_mma).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4 import kernels  # noqa: E402
from ds4.quant import pack_fp4_mma, tile_fp4_mma, tile_fp8_mma  # noqa: E402
from scripts.bench_kernels import DEV, rand_fp4, rand_fp8  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    kernels.require("ncu_kernels")  # one line, not a traceback, where the extension cannot run
    g = torch.Generator(device=DEV).manual_seed(0)
    E, dim, inter, k = 256, 4096, 2048, 6
    x = torch.randn(1, dim, device=DEV).to(torch.bfloat16)
    w1, s1 = rand_fp4((E,), inter, dim, g)
    w3, s3 = rand_fp4((E,), inter, dim, g)
    w2, s2 = rand_fp4((E,), dim, inter, g)
    w1, w3, w2 = (tile_fp4_mma(pack_fp4_mma(w)) for w in (w1, w3, w2))
    rw = torch.rand(1, k, device=DEV) + 0.1
    cases = []
    for r in range(args.reps):
        ids = torch.randperm(E, device=DEV, generator=g)[:k].view(1, k)
        cases.append(("moe fp4 gate+up", lambda ids=ids: kernels.moe_gate_up(x, ids, rw, w1, s1, w3, s3, "fp4t", 0, E,
                                                                              10.0)))
    h = kernels.moe_gate_up(x, torch.arange(k, device=DEV).view(1, k), rw, w1, s1, w3, s3, "fp4t", 0, E, 10.0)
    for r in range(args.reps):
        ids = torch.randperm(E, device=DEV, generator=g)[:k].view(1, k)
        cases.append(("moe fp4 down", lambda ids=ids: kernels.moe_down(h, ids, k, w2, s2, "fp4t", 0, E, None, True)))
    for name, o, i in (("fp8t wq_b 32768x1024", 32768, 1024), ("fp8t wo_b 4096x8192", 4096, 8192)):
        ws = [(tile_fp8_mma(w), s) for w, s in (rand_fp8(o, i, g) for _ in range(args.reps))]
        xi = torch.randn(1, i, device=DEV).to(torch.bfloat16)
        for w, s in ws:
            cases.append((name, lambda w=w, s=s, xi=xi: kernels.gemv(xi, w, s, "fp8t")))
    torch.cuda.synchronize()
    for name, fn in cases:
        print(name, flush=True)
        fn()
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
