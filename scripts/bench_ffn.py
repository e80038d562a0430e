#!/usr/bin/env python
"""The one-launch MoE FFN (ds4.kernels.moe_ffn) alone at V4-Flash shapes: its time against the four launches it
replaces (in line), per plan variant, and where its blocks spend the launch (the phase probe, DS4_FFN_PROBE=1).

    python scripts/bench_ffn.py [--plans auto,reg,1,3] [--out f.json]

A plan variant sets DS4_FFN_SHARED_PPB (N: the shared expert's gate+up tile pairs per block; auto: the byte-balanced
split) or DS4_FFN_SH_DOWN=reg (reg: the shared expert's down on the register stream, not the shared-memory one);
auto and reg also run with the shared expert's h row given (its gate+up launched first, DS4_MOE_FFN=2's form).
Timing as scripts/bench_kernels.py (CUDA-graph replay over rotating expert sets; bytes as KERNEL_NOTES §1).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import copy_bandwidth, nbytes, rand_fp4, rand_fp8, time_fn  # noqa: E402

from ds4 import kernels  # noqa: E402
from ds4.ops.base import QWeight  # noqa: E402
from ds4.quant import pack_fp4_mma, tile_fp4_mma  # noqa: E402

DEV = torch.device("cuda")


def probe_stats(blocks: int) -> dict:
    """Phase times (us) of the last probed launch: t0 PDL wait's end, t1 phase 1's end, t2 barrier exit, t3 end."""
    p = torch.ops.ds4.moe_ffn_probe(blocks).double() / 1e3
    t0 = p[:, 0].min()
    p = p - t0
    ph1 = (p[:, 1] - p[:, 0]).tolist()
    done = p[:, 3] > -t0 / 2  # blocks that had phase-2 tiles (the others never wrote their end: 0 - t0)
    ends, ph2 = p[done, 3], (p[done, 3] - p[done, 2]).tolist()
    q = lambda v, f: sorted(v)[int(f * (len(v) - 1))]  # noqa: E731
    return {"start_spread": float(p[:, 0].max()), "phase1_min": q(ph1, 0), "phase1_med": q(ph1, 0.5),
            "phase1_max": q(ph1, 1.0), "last_arrival": float(p[:, 1].max()), "barrier_exit": float(p[:, 2].max()),
            "end": float(ends.max()), "phase2_med": statistics.median(ph2),
            "phase1_by_block": [round(v, 2) for v in ph1]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plans", default="auto,reg")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    kernels.require("bench_ffn")
    g = torch.Generator(device=DEV).manual_seed(0)
    bw = copy_bandwidth()
    E, dim, inter, k = 256, 4096, 2048, 6
    routed = []
    for o, i in ((inter, dim), (inter, dim), (dim, inter)):
        w, s = rand_fp4((E,), o, i, g)
        routed.append(QWeight("fp4t", tile_fp4_mma(pack_fp4_mma(w)), s))
    shared = [tuple(QWeight("fp8", *rand_fp8(o, i, g)) for o, i in ((inter, dim), (inter, dim), (dim, inter)))
              for _ in range(16)]
    x = torch.randn(1, dim, device=DEV).to(torch.bfloat16)
    idsets = [torch.randperm(E, device=DEV, generator=g)[:k].view(1, k) for _ in range(16)]
    rw = torch.rand(1, k, device=DEV) + 0.1
    w1, w3, w2 = routed
    per_expert = nbytes(w1.weight, w1.scale, w3.weight, w3.scale, w2.weight, w2.scale) // E
    bts = k * per_expert + nbytes(*[t for q in shared[0] for t in (q.weight, q.scale)]) + dim * 4

    def four(ids, sq):
        sh_h = kernels.moe_gate_up(x, None, None, sq[0].weight, sq[0].scale, sq[1].weight, sq[1].scale, "fp8", 0, 1,
                                   10.0)
        sh = kernels.moe_down(sh_h, None, 1, sq[2].weight, sq[2].scale, "fp8", 0, 1, None, False)
        h = kernels.moe_gate_up(x, ids, rw, w1.weight, w1.scale, w3.weight, w3.scale, "fp4t", 0, E, 10.0)
        return kernels.moe_down(h, ids, k, w2.weight, w2.scale, "fp4t", 0, E, sh, False)

    def one(ids, sq):
        return kernels.moe_ffn(x, ids, rw, *routed, *sq, 0, 10.0)

    def given(ids, sq):  # DS4_MOE_FFN=2's launches, in line: the shared gate+up, then the one launch with its h
        sh_h = kernels.moe_gate_up(x, None, None, sq[0].weight, sq[0].scale, sq[1].weight, sq[1].scale, "fp8", 0, 1,
                                   10.0)
        return kernels.moe_ffn(x, ids, rw, *routed, *sq, 0, 10.0, None, sh_h)

    rows = []

    def record(name, fns, probe=False):
        us, eager = time_fn(fns, a.calls, a.reps)
        row = {"variant": name, "us": us, "us_eager": eager, "bytes": bts, "GB_s": bts / us / 1e3,
               "pct_copy": 100 * bts / us / 1e3 / bw}
        if probe:
            os.environ["DS4_FFN_PROBE"] = "1"
            for _ in range(3):
                fns[0]()
            torch.cuda.synchronize()
            row["probe"] = probe_stats(2 * torch.cuda.get_device_properties(DEV).multi_processor_count)
            os.environ.pop("DS4_FFN_PROBE")
        rows.append(row)
        pr = row.get("probe")
        extra = "" if pr is None else (
            f" | phase1 med {pr['phase1_med']:.1f} max {pr['phase1_max']:.1f}, last arrival {pr['last_arrival']:.1f}, "
            f"barrier exit {pr['barrier_exit']:.1f}, phase2 med {pr['phase2_med']:.1f}, end {pr['end']:.1f} us")
        print(f"{name:<34} {us:7.2f} us {row['GB_s']:6.0f} GB/s {row['pct_copy']:5.1f}%{extra}", flush=True)

    pairs = list(zip(idsets, shared))
    print(f"GPU {torch.cuda.get_device_name()} | copy bandwidth {bw:.0f} GB/s | {bts / 1e6:.1f} MB per FFN")
    record("4 launches (in line)", [(lambda i=i, s=s: four(i, s)) for i, s in pairs])
    for plan in a.plans.split(","):
        os.environ.pop("DS4_FFN_SHARED_PPB", None)
        os.environ.pop("DS4_FFN_SH_DOWN", None)
        if plan == "reg":  # the shared expert's down on the register stream
            os.environ["DS4_FFN_SH_DOWN"] = "reg"
        elif plan != "auto":
            os.environ["DS4_FFN_SHARED_PPB"] = plan
        record(f"moe_ffn {plan}", [(lambda i=i, s=s: one(i, s)) for i, s in pairs], probe=True)
        if plan in ("auto", "reg"):
            record(f"shared gate+up, moe_ffn {plan} (h given)", [(lambda i=i, s=s: given(i, s)) for i, s in pairs],
                   probe=True)
    os.environ.pop("DS4_FFN_SHARED_PPB", None)
    os.environ.pop("DS4_FFN_SH_DOWN", None)
    if a.out:
        Path(a.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "copy_GB_s": bw, "rows": rows},
                                          indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
