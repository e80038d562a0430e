#!/usr/bin/env python
"""Micro-benchmark of the ds4 CUDA kernels at V4-Flash shapes, batch 1 (one GPU).

    python scripts/bench_kernels.py --out experiments/kernels.json

Copy bandwidth is measured first in the same process (a 2 GiB device-to-device copy, bytes read +
written). Each kernel is timed by CUDA-graph replay: one graph holds `--calls` launches (or one per input set
where there are more sets) over rotating input sets (weights copies / expert ids, so the working set is several
times the 50 MiB L2), the graph is replayed `--reps` times, each replay timed with CUDA events;
µs = median replay / launches. Graph replay removes host launch overhead but keeps the GPU's own inter-kernel
gaps. An eager column (events around the same launches, plain) is printed too. bytes = weights + scales + activations in
and out; GB/s = bytes / µs; %copy = GB/s / copy bandwidth.
--l2-hot times the dense FP8 rows on one weight set instead (a weight that fits stays in L2 between the calls: what
an L2 prefetch could buy them; experiments/decode_session49_h200.md); --dense-only stops after the dense rows.
Untagged rows run the default ("auto", see csrc/ds4_launch.h); rows tagged [fma] / [mma wN dM] force the
FMA / tensor-core kernels, N = DS4_MMA_W (the widest run of 16-B chunks a lane reads per row), M =
DS4_MMA_DEPTH (16-B chunks per lane and row in flight; fewer buy more resident warps; d0 = the
shared-memory stream, DS4_MMA_LOAD=smem), from --mma. The routed-MoE rows named "moe fp4" run the experts
in the fp4t layout moe=fp4_topk uses by default (ds4.quant.tile_fp4_mma: fp4p words in the tensor-core
kernels' fragment order, run width 2 whatever DS4_MMA_W says), "moe fp4p" rows in the fp4p word layout
(ds4.quant.pack_fp4_mma, DS4_FP4_TILE=0) and "[stored layout]" rows in the checkpoint's; "[dp4a ...]" rows run
moe=fp4_dp4a's integer-pipe gate+up (csrc/moe_dp4a.cu) on the stored w1 / w3, its routed row the fp4t down after it.
The dense FP8 and shared expert rows named "fp8t" run the weights in the layout linear=gemv_cuda and moe=fp4_topk give
them by default (ds4.quant.tile_fp8_mma: the same fragment order, run width 2), the "fp8" rows in the stored one
(DS4_FP8_TILE=0; the dense [fma] / [mma] rows too).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4 import kernels  # noqa: E402
from ds4.ops.base import QWeight  # noqa: E402
from ds4.quant import chunk_fp4_splitk, pack_fp4_mma, tile_fp4_mma, tile_fp8_mma  # noqa: E402
from ds4.tasks.common import source_commit  # noqa: E402

DEV = torch.device("cuda")
L2_ROTATE_BYTES = 400 << 20


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 20) -> float:
    a = torch.empty(nbytes // 4, device=DEV, dtype=torch.float32).normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    times.sort()
    t = times[len(times) // 2]
    del a, b
    return 2 * nbytes / t / 1e9  # GB/s


def time_fn(fns, calls: int, reps: int) -> tuple[float, float]:
    """fns: list of zero-arg callables (rotating inputs). Returns (graph µs/call, eager µs/call). The graph holds
    every callable at least once (max(calls, len(fns)) launches): fewer would leave the rotation's later input sets
    out and re-read the first ones from L2 on every replay."""
    calls = max(calls, len(fns))
    seq = [fns[i % len(fns)] for i in range(calls)]
    for f in fns:  # warm-up (and any lazy init) outside capture
        f()
    torch.cuda.synchronize()
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for f in seq[:3]:
            f()
    torch.cuda.current_stream().wait_stream(st)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in seq:
            f()
    graph.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3 / calls)
    ts.sort()
    eager = []
    for _ in range(max(3, reps // 3)):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for f in seq:
            f()
        e.record()
        e.synchronize()
        eager.append(s.elapsed_time(e) * 1e3 / calls)
    eager.sort()
    del graph
    return ts[len(ts) // 2], eager[len(eager) // 2]


def rand_fp8(o, i, g):
    b = torch.randint(0, 256, (o, i), device=DEV, dtype=torch.uint8, generator=g)
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b).view(torch.float8_e4m3fn)
    s = torch.randint(116, 124, (-(-o // 128), -(-i // 128)), device=DEV, dtype=torch.uint8, generator=g)
    return b, s.view(torch.float8_e8m0fnu)


def rand_fp4(lead, o, i, g):
    w = torch.randint(-128, 128, (*lead, o, i // 2), device=DEV, dtype=torch.int8, generator=g)
    s = torch.randint(116, 124, (*lead, o, i // 32), device=DEV, dtype=torch.uint8, generator=g)
    return w, s.view(torch.float8_e8m0fnu)


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--calls", type=int, default=50,
                    help="launches per graph (at least one per rotating input set); us = replay time / launches")
    ap.add_argument("--reps", type=int, default=30, help="timed graph replays (the median is reported)")
    ap.add_argument("--tokens", type=int, default=1, help="activation rows per launch (batch)")
    ap.add_argument("--quick", action="store_true", help="skip the [mma] / [fma] comparison rows")
    ap.add_argument("--dense-only", action="store_true", help="only the dense FP8 GEMV rows")
    ap.add_argument("--l2-hot", action="store_true",
                    help="the dense GEMV rows on one weight set, no rotation: where it fits, the weight stays in L2 "
                         "between calls (what a GEMV gains from an L2 prefetch; ds4.ops.prefetch)")
    ap.add_argument("--moe-bound", action="store_true",
                    help="only the routed MoE rows (the library's defaults), the split-K pair's (csrc/moe_splitk.cu; "
                         "w2 in fp4t and in the chunk-major fp4k) and its bound: the gate+up alone at 1.5x V4's "
                         "inter, whose w1 + w3 are the pair's weight bytes")
    ap.add_argument("--mma", default="w2d8",
                    help="[mma wNdM] rows: comma-separated DS4_MMA_W (N) / DS4_MMA_DEPTH (M) pairs, e.g. w2d8,w2d4; "
                         "M = 0: the shared-memory stream (DS4_MMA_LOAD=smem)")
    args = ap.parse_args()
    kernels.require("bench_kernels")
    n = args.tokens
    g = torch.Generator(device=DEV).manual_seed(0)
    bw = copy_bandwidth()
    rows = []

    def record(name, bts, fns, target_us=None):
        us, eager = time_fn(fns, args.calls, args.reps)
        gbs = bts / us / 1e3
        rows.append({"kernel": name, "tokens": n, "us": us, "us_eager": eager, "bytes": bts, "GB_s": gbs,
                     "pct_copy": 100 * gbs / bw, "target_us": target_us,
                     "meets_75pct": gbs >= 0.75 * bw})
        print(f"  {name:<34} {us:8.2f} us  {gbs:7.0f} GB/s  {100 * gbs / bw:5.1f}%", flush=True)

    def finish() -> int:  # the table, and the JSON record
        print()
        hdr = f"{'kernel':<36}{'tok':>4}{'us(graph)':>11}{'us(eager)':>11}{'bytes':>13}{'GB/s':>8}{'%copy':>7}{'target':>8}"
        print(hdr)
        print("-" * len(hdr))
        for r in rows:
            tgt = f"{r['target_us']:.1f}" if r["target_us"] else "-"
            print(f"{r['kernel']:<36}{r['tokens']:>4}{r['us']:>11.2f}{r['us_eager']:>11.2f}{r['bytes']:>13,}"
                  f"{r['GB_s']:>8.0f}{r['pct_copy']:>7.1f}{tgt:>8}")
        print(f"copy bandwidth {bw:.0f} GB/s (2 GiB D2D, read+write) on {torch.cuda.get_device_name()}")
        if args.out:
            commit = source_commit() or "?"
            meta = {"gpu": torch.cuda.get_device_name(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
                    "commit": commit, "torch": torch.__version__, "cuda": torch.version.cuda,
                    "copy_GB_s": bw, "command": " ".join(sys.argv), "timing": "CUDA-graph replay median / calls",
                    "rows": rows}
            Path(args.out).write_text(json.dumps(meta, indent=1))
        return 0

    def gemv_case(name, o, i, groups=1, kernel="auto", target=None, fmt="fp8"):
        one = rand_fp8(o, i, g)
        bts = nbytes(*one) + n * i * groups * 2 + n * o * 2
        sets = 1 if args.l2_hot else max(2, min(64, math.ceil(L2_ROTATE_BYTES / bts)))
        ws = [one] + [rand_fp8(o, i, g) for _ in range(sets - 1)]
        if fmt == "fp8t":
            ws = [(tile_fp8_mma(w), s) for w, s in ws]
        x = torch.randn(n, i * groups, device=DEV).to(torch.bfloat16)
        fns = [(lambda w=w, s=s: kernels.gemv(x, w, s, fmt, groups=groups, kernel=kernel)) for w, s in ws]
        record(name, bts, fns, target)
        del ws

    print(f"GPU {torch.cuda.get_device_name()} | copy bandwidth {bw:.0f} GB/s | tokens {n}", flush=True)
    compare = not args.quick and n == 1 and not args.moe_bound
    shapes = [tuple(int(v) for v in t.strip().lstrip("w").split("d")) for t in args.mma.split(",") if t.strip()]

    def variants():
        """(kernel, row tag) pairs; sets DS4_MMA_W / DS4_MMA_DEPTH (read at each launch, so at graph capture)
        per [mma] row and removes them for the untagged row (the library's defaults)."""
        for v in ("DS4_MMA_W", "DS4_MMA_DEPTH", "DS4_MMA_LOAD"):
            os.environ.pop(v, None)
        yield "auto", ""
        if not compare:
            return
        yield "fma", " [fma]"
        for w, d in shapes:
            os.environ["DS4_MMA_W"], os.environ["DS4_MMA_DEPTH"] = str(w), str(max(d, 2))
            os.environ["DS4_MMA_LOAD"] = "smem" if d == 0 else "reg"
            yield "mma", f" [mma w{w} d{d}]"
        for v in ("DS4_MMA_W", "DS4_MMA_DEPTH", "DS4_MMA_LOAD"):
            os.environ.pop(v, None)

    if not args.moe_bound:  # (the dense and FP4 GEMV rows)
        # FP8 dense projections (V4-Flash): linear=gemv_cuda's default fp8t layout, then the stored one
        gemv_case("fp8t wq_a+wkv 1536x4096", 1536, 4096, fmt="fp8t")
        gemv_case("fp8t wq_b 32768x1024", 32768, 1024, target=10.5, fmt="fp8t")
        gemv_case("fp8t wo_a 8x(1024x4096) grouped", 8192, 4096, groups=8, fmt="fp8t")
        gemv_case("fp8t wo_b 4096x8192", 4096, 8192, fmt="fp8t")
        for kern, tag in variants():
            gemv_case("fp8 wq_a+wkv 1536x4096" + tag, 1536, 4096, kernel=kern)
            gemv_case("fp8 wq_b 32768x1024" + tag, 32768, 1024, kernel=kern, target=10.5)
            gemv_case("fp8 wo_a 8x(1024x4096) grouped" + tag, 8192, 4096, groups=8, kernel=kern)
            gemv_case("fp8 wo_b 4096x8192" + tag, 4096, 8192, kernel=kern)
            gemv_case("fp8 idx_wq_b 8192x1024" + tag, 8192, 1024, kernel=kern)
        if args.dense_only:
            return finish()

        # one MXFP4 GEMV (one expert's w1)
        one = rand_fp4((), 2048, 4096, g)
        bts = nbytes(*one) + n * 4096 * 2 + n * 2048 * 2
        ws = [one] + [rand_fp4((), 2048, 4096, g) for _ in range(max(1, math.ceil(L2_ROTATE_BYTES / bts)) - 1)][:63]
        x = torch.randn(n, 4096, device=DEV).to(torch.bfloat16)
        for kern, tag in variants():
            record("fp4 gemv 2048x4096" + tag, bts,
                   [(lambda w=w, s=s, kern=kern: kernels.gemv(x, w, s, "fp4", kernel=kern)) for w, s in ws])
        del ws

    # routed MoE: 256 stacked FP4 experts, top-6, rotating distinct ids
    E, dim, inter, k = 256, 4096, 2048, 6
    w1, s1 = rand_fp4((E,), inter, dim, g)
    w3, s3 = rand_fp4((E,), inter, dim, g)
    w2, s2 = rand_fp4((E,), dim, inter, g)
    per_expert = (nbytes(w1, s1, w3, s3, w2, s2)) // E
    x = torch.randn(n, dim, device=DEV).to(torch.bfloat16)
    idsets = [torch.stack([torch.randperm(E, device=DEV, generator=g)[:k] for _ in range(n)]) for _ in range(16)]
    rw = torch.rand(n, k, device=DEV) + 0.1
    distinct = [len(set(i.flatten().tolist())) for i in idsets]
    avg_exp = sum(distinct) / len(distinct)
    h_bytes = n * k * inter * 2
    b_gu = int(avg_exp * per_expert * 2 / 3) + n * dim * 2 + h_bytes
    b_dn = int(avg_exp * per_expert / 3) + h_bytes + n * dim * 4
    hs = [kernels.moe_gate_up(x, ids, rw, w1, s1, w3, s3, "fp4", 0, E, 10.0) for ids in idsets]
    p1, p3, p2 = (pack_fp4_mma(w) for w in (w1, w3, w2))  # the fp4p layout (DS4_FP4_TILE=0)

    def moe_rows(fmt, a1, a3, a2, kern, tag):
        def routed(ids):
            h = kernels.moe_gate_up(x, ids, rw, a1, s1, a3, s3, fmt, 0, E, 10.0, kernel=kern)
            return kernels.moe_down(h, ids, k, a2, s2, fmt, 0, E, None, True, kernel=kern)
        name = "moe fp4" if fmt == "fp4t" else f"moe {fmt}"
        record(f"{name} gate+up (6 experts)" + tag, b_gu,
               [(lambda ids=ids: kernels.moe_gate_up(x, ids, rw, a1, s1, a3, s3, fmt, 0, E, 10.0, kernel=kern))
                for ids in idsets])
        record(f"{name} down (6 experts)" + tag, b_dn,
               [(lambda ids=ids, h=h: kernels.moe_down(h, ids, k, a2, s2, fmt, 0, E, None, True, kernel=kern))
                for ids, h in zip(idsets, hs)])
        record(f"{name} routed top-6 (2 launches)" + tag, b_gu + b_dn - 2 * h_bytes,
               [(lambda ids=ids: routed(ids)) for ids in idsets], target_us=25.0)
    t1, t3, t2 = (tile_fp4_mma(w) for w in (p1, p3, p2))  # the fp4t layout moe=fp4_topk runs on by default
    for kern, tag in variants():
        moe_rows("fp4t", t1, t3, t2, kern, tag)
    if args.moe_bound:
        # The split-K pair (csrc/moe_splitk.cu, DS4_MOE_SPLITK's launches): each gate+up block also multiplies its own
        # slice of h by the matching columns of w2, and a second launch sums the partial rows, so no block stages h
        # after a launch boundary (session 82: 3.3-4.0 us of the down's block life in the step).
        def splitk(ids):
            parts = kernels.moe_splitk_up(x, ids, rw, t1, s1, t3, s3, t2, s2, "fp4t", 0, E, 10.0)
            return kernels.moe_splitk_down(parts, ids, t2, s2, "fp4t", 0, E, None, True)
        record("moe fp4 routed top-6 split-K (2 launches)", b_gu + b_dn - 2 * h_bytes,
               [(lambda ids=ids: splitk(ids)) for ids in idsets], target_us=25.0)
        # the same with w2 in the chunk-major fp4k layout (each block's columns of w2 one run; an experiment)
        k2, ks2 = chunk_fp4_splitk(t2, s2)

        def splitk_k(ids):
            parts = kernels.moe_splitk_up(x, ids, rw, t1, s1, t3, s3, k2, ks2, "fp4t", 0, E, 10.0, w2_layout="fp4k")
            return kernels.moe_splitk_down(parts, ids, t2, s2, "fp4t", 0, E, None, True)
        record("moe fp4 routed top-6 split-K, w2 fp4k (2 launches)", b_gu + b_dn - 2 * h_bytes,
               [(lambda ids=ids: splitk_k(ids)) for ids in idsets], target_us=25.0)
        del k2, ks2
        # Its bound: the gate+up alone at 1.5x the inter streams the pair's weight bytes (w1 + w3 at V4's inter, and
        # w2) in one launch; against the pair's rows above it bounds what the fusion could gain, before its
        # reduction's cost.
        wide = 3 * inter // 2
        u1, v1 = rand_fp4((E,), wide, dim, g)
        u3, v3 = rand_fp4((E,), wide, dim, g)
        u1, u3 = (tile_fp4_mma(pack_fp4_mma(w)) for w in (u1, u3))
        b_wide = int(avg_exp * nbytes(u1, v1, u3, v3) / E) + n * dim * 2 + n * k * wide * 2
        record(f"moe fp4 gate+up at inter {wide}", b_wide,
               [(lambda ids=ids: kernels.moe_gate_up(x, ids, rw, u1, v1, u3, v3, "fp4t", 0, E, 10.0))
                for ids in idsets])
        return finish()
    if n == 1 and kernels.dp4a_ok("fp4", n, dim):  # moe=fp4_dp4a: w1 / w3 stored, the integer-pipe gate+up
        def dp4a_gu(ids):
            return kernels.moe_gate_up(x, ids, rw, w1, s1, w3, s3, "fp4", 0, E, 10.0, kernel="dp4a")
        record("moe fp4 gate+up (6 experts) [dp4a, stored layout]", b_gu,
               [(lambda ids=ids: dp4a_gu(ids)) for ids in idsets])
        record("moe fp4 routed top-6 (2 launches) [dp4a gate+up, fp4t down]", b_gu + b_dn - 2 * h_bytes,
               [(lambda ids=ids: kernels.moe_down(dp4a_gu(ids), ids, k, t2, s2, "fp4t", 0, E, None, True))
                for ids in idsets], target_us=25.0)

    def shared_set():
        a1, b1 = rand_fp8(inter, dim, g)
        a3, b3 = rand_fp8(inter, dim, g)
        a2, b2 = rand_fp8(dim, inter, g)
        return a1, b1, a3, b3, a2, b2

    def shared_h(p, kern="auto", fmt="fp8"):  # the shared expert's gate+up launch
        return kernels.moe_gate_up(x, None, None, p[0], p[1], p[2], p[3], fmt, 0, 1, 10.0, kernel=kern)

    def shared_down(p, h, kern="auto", fmt="fp8"):  # ... and its down launch
        return kernels.moe_down(h, None, 1, p[4], p[5], fmt, 0, 1, None, False, kernel=kern)

    def shared(p, kern, fmt="fp8"):
        return shared_down(p, shared_h(p, kern, fmt), kern, fmt)

    if n == 1:  # the whole FFN (routed top-6 + the shared expert): the step's four launches, in line, against one
        ssets = [shared_set() for _ in range(16)]
        routed_q = tuple(QWeight("fp4t", w, s) for w, s in ((t1, s1), (t3, s3), (t2, s2)))

        def ffn4(ids, p):
            sh = shared(p, "auto")
            h = kernels.moe_gate_up(x, ids, rw, t1, s1, t3, s3, "fp4t", 0, E, 10.0)
            return kernels.moe_down(h, ids, k, t2, s2, "fp4t", 0, E, sh, False)

        def ffn1(ids, p):
            sq = tuple(QWeight("fp8", p[i], p[i + 1]) for i in (0, 2, 4))
            return kernels.moe_ffn(x, ids, rw, *routed_q, *sq, 0, 10.0)
        b_ffn = b_gu + b_dn - 2 * h_bytes + nbytes(*ssets[0])
        record("ffn routed+shared (4 launches)", b_ffn, [(lambda i=i, p=p: ffn4(i, p)) for i, p in zip(idsets, ssets)])
        record("ffn routed+shared (moe_ffn, 1)", b_ffn, [(lambda i=i, p=p: ffn1(i, p)) for i, p in zip(idsets, ssets)],
               target_us=b_ffn / (0.75 * bw) / 1e3)
        del ssets
    del t1, t3, t2
    for kern, tag in variants():
        moe_rows("fp4p", p1, p3, p2, kern, tag)
    moe_rows("fp4", w1, w3, w2, "auto", " [stored layout]")  # before the word permutation (DS4_FP4_PACK=0)
    del p1, p3, p2
    del hs

    # shared expert FP8 (2 launches), rotating weight copies: in moe=fp4_topk's default fp8t layout
    # (ds4.quant.tile_fp8_mma, as the dense projections), then in the stored one
    sets = [shared_set() for _ in range(16)]
    bts = nbytes(*sets[0]) + n * dim * 2 * 2
    tsets = [tuple(tile_fp8_mma(t) if i % 2 == 0 else t for i, t in enumerate(p)) for p in sets]
    for fmt, ps in (("fp8t", tsets), ("fp8", sets)):
        for kern, tag in variants():
            record(f"shared expert {fmt} (2 launches)" + tag, bts,
                   [(lambda p=p, kern=kern, fmt=fmt: shared(p, kern, fmt)) for p in ps], target_us=8.0)
        # its two launches alone (the gate+up's bytes as one dense GEMV below: 4096 x 4096, 256 row tiles, where the
        # gate+up pairs its gate and up tiles: 128 blocks at V4's inter)
        record(f"shared gate+up {fmt} (1 launch)", nbytes(*ps[0][:4]) + n * dim * 2 + n * inter * 2,
               [(lambda p=p, fmt=fmt: shared_h(p, "auto", fmt)) for p in ps])
        record(f"shared down {fmt} (1 launch)", nbytes(*ps[0][4:]) + n * inter * 2 + n * dim * 2,
               [(lambda p=p, h=shared_h(p, "auto", fmt), fmt=fmt: shared_down(p, h, "auto", fmt)) for p in ps])
    del sets, tsets
    gemv_case("fp8 gemv 4096x4096 (shared w1+w3 bytes)", 2 * inter, dim)

    # router (learned): bf16 gate GEMV + top-k kernel
    gates = [(torch.randn(E, dim, device=DEV) * 0.05).to(torch.bfloat16) for _ in range(64)]
    bias = torch.randn(E, device=DEV) * 0.1
    record("router gate+topk (2 launches)", nbytes(gates[0]) + n * dim * 2 + n * k * 12,
           [(lambda gt=gt: kernels.router(x, gt, bias, None, None, k, 1.5)) for gt in gates])

    return finish()


if __name__ == "__main__":
    raise SystemExit(main())
