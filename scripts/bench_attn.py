#!/usr/bin/env python
"""Micro-benchmark of the ds4_attn kernels (hc / attn / indexer = fused_cuda) at V4-Flash decode shapes.

For each op: µs per call (median over trials of a CUDA graph replaying one call per input set, or `reps`
calls where there are fewer sets), the fewest bytes it must move (inputs once, outputs once), GB/s, and % of
the device-to-device copy bandwidth measured in this process; the torch reference timed the same way. The sets
together exceed the L2 several times, so every call reads its inputs from DRAM: as a decode step reads its
layer's hc weights, KV rows and indexer keys; its activations and the top-k's scores, written just before,
may still be in L2 there (for those inputs these figures are the cold bound). Prints a table; --out writes JSON.

Until 2026-12 each graph held 20 calls over the first 20 sets (of at most 64; 16 for the indexer and top-k
rows), and the references 5 calls over 4 sets: the hc rows, attention CSA 1 row / HCA 64K / SWA, indexer 8K and
the one-row top-k rows ran on 1-33 MiB of inputs, L2-resident (50 MiB L2); CSA 4 rows, indexer 64K and top-k 1M
4 rows on 60-65 MiB. Figures recorded before (experiments/attn_kernels_h200.md, decode_session44_h200.md,
decode_session45_h200.md, the README's top-k row) compare with each other, not with these.

    python scripts/bench_attn.py [--out bench.json] [--quick] [--only topk]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEV = torch.device("cuda")
BF16 = torch.bfloat16
L2_ROTATE_BYTES = 160 << 20


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    del a, b
    return 2 * n / statistics.median(ts) / 1e9


def time_graph(fn, sets, reps=20, trials=7) -> tuple[float, str]:
    """µs per call: a CUDA graph of max(reps, len(sets)) calls rotating over the input sets (every set in it: a
    graph shorter than the rotation would re-read its first sets from L2); eager fallback."""
    calls = max(reps, len(sets))
    for s in sets[:3]:
        fn(*s)
    torch.cuda.synchronize()
    mode = "graph"
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for s in sets[:2]:
                fn(*s)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(*sets[i % len(sets)])
        run = graph.replay
    except Exception as e:  # noqa: BLE001
        mode = f"eager ({type(e).__name__})"
        torch.cuda.synchronize()

        def run():
            for i in range(calls):
                fn(*sets[i % len(sets)])
    run()
    torch.cuda.synchronize()
    ts = []
    for _ in range(trials):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        run()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / calls)
    return statistics.median(ts), mode


def n_sets(nbytes: int) -> int:
    """Input sets of nbytes each that together exceed L2_ROTATE_BYTES (over 3x the L2). No cap on the count: a cap
    left the small ops' rotation inside the L2."""
    return max(2, L2_ROTATE_BYTES // max(1, nbytes) + 1)


def g():
    return torch.Generator(device=DEV).manual_seed(0)


def cases(quick: bool):
    from ds4 import kernels_attn as K
    from ds4.ops.attn_torch import TorchAttention, TorchIndexer
    from ds4.ops.hc_torch import TorchHC
    ref_hc, ref_at, ref_ix = TorchHC(), TorchAttention(), TorchIndexer()
    gg = g()
    out = []

    # mHC pre / head / post at dim 4096, hc 4 (per call site; 2 pre + 2 post per layer)
    for N in (1, 4):
        n, D, mix = 4, 4096, 24
        nbytes = mix * n * D * 4 + N * n * D * 2 + N * D * 2 + N * (n + n * n) * 4
        k = n_sets(nbytes)
        sets = [(torch.randn(N, n, D, device=DEV, generator=gg).to(BF16),
                 torch.randn(mix, n * D, device=DEV, generator=gg) * 0.004, 1 + 0.1 * torch.randn(3, device=DEV),
                 torch.randn(mix, device=DEV) * 0.5) for _ in range(k)]
        out.append((f"hc.pre N={N}", nbytes, lambda h, f, s, b: K.hc_pre(h, f, s, b, 20, 1e-6, 1e-6),
                    lambda h, f, s, b: ref_hc.pre(h, f, s, b, 20, 1e-6, 1e-6), sets))
        nbytes = N * n * D * 2 * 2 + N * D * 2 + N * (n + n * n) * 4
        sets = [(torch.randn(N, D, device=DEV).to(BF16), torch.randn(N, n, D, device=DEV, generator=gg).to(BF16),
                 torch.rand(N, n, device=DEV), torch.rand(N, n, n, device=DEV)) for _ in range(n_sets(nbytes))]
        out.append((f"hc.post N={N}", nbytes, K.hc_post, ref_hc.post, sets))
    n, D = 4, 4096
    nbytes = n * n * D * 4 + n * D * 2 + D * 2
    sets = [(torch.randn(1, n, D, device=DEV).to(BF16), torch.randn(n, n * D, device=DEV) * 0.004,
             torch.ones(1, device=DEV), torch.zeros(n, device=DEV)) for _ in range(n_sets(nbytes))]
    out.append(("hc.head N=1", nbytes, lambda h, f, s, b: K.hc_head(h, f, s, b, 1e-6, 1e-6),
                lambda h, f, s, b: ref_hc.head(h, f, s, b, 1e-6, 1e-6), sets))

    # sparse attention: CSA (128 window + 512 selected), HCA at 64K / 1M context, SWA; H=64, D=512
    H, D = 64, 512
    attn_cfgs = [("attn CSA B=1", 1, 128, 512), ("attn CSA B=4", 4, 128, 512), ("attn HCA 64K B=1", 1, 128 + 512, 0),
                 ("attn HCA 1M B=1", 1, 128 + 8192, 0), ("attn SWA B=1", 1, 128, 0)]
    if quick:
        attn_cfgs = attn_cfgs[:2]
    for name, B, Kn, P in attn_cfgs:
        nbytes = B * (H * D * 2 * 2 + (Kn + P) * (D * 2 + 1)) + H * 4
        sets = []
        for _ in range(n_sets(nbytes)):
            q = torch.randn(B, 1, H, D, device=DEV, generator=gg).to(BF16)
            kv = torch.randn(B, Kn, D, device=DEV, generator=gg).to(BF16)
            valid = torch.ones(B, 1, Kn, dtype=torch.bool, device=DEV)
            sel = torch.randn(B, 1, P, D, device=DEV, generator=gg).to(BF16) if P else None
            sv = torch.ones(B, 1, P, dtype=torch.bool, device=DEV) if P else None
            sets.append((q, kv, valid, sel, sv, torch.randn(H, device=DEV)))
        out.append((name, nbytes, lambda *a: K.sparse_attn(*a, 512 ** -0.5),
                    lambda *a: ref_at.sparse(*a, 512 ** -0.5), sets))

    # indexer scores: H=64, d=128, T = context/4
    ix_cfgs = [("indexer 8K ctx B=1", 1, 2048), ("indexer 64K ctx B=1", 1, 16384), ("indexer 64K ctx B=4", 4, 16384),
               ("indexer 1M ctx B=1", 1, 262144)]
    if quick:
        ix_cfgs = ix_cfgs[:2]
    for name, B, T in ix_cfgs:
        nbytes = B * (64 * 128 * 2 + 64 * 4 + T * 128 * 2 + T * 4)
        sets = [(torch.randn(B, 1, 64, 128, device=DEV, generator=gg).to(BF16),
                 torch.rand(B, 1, 64, device=DEV) * 0.01,
                 torch.randn(B, T, 128, device=DEV, generator=gg).to(BF16)) for _ in range(n_sets(nbytes))]
        out.append((name, nbytes, lambda q, w, k: K.indexer_scores(q, w, k, False),
                    lambda q, w, k: ref_ix.scores(q, w, k, False), sets))

    # the indexer's top-512 over T = context / 4 scores (one block per row up to 32768 entries, then the wide form)
    tk_cfgs = [("topk 64K ctx B=1", 1, 16384), ("topk 128K ctx B=1", 1, 32768), ("topk 256K ctx B=1", 1, 65536),
               ("topk 1M ctx B=1", 1, 262144), ("topk 1M ctx B=4", 4, 262144)]
    if quick:
        tk_cfgs = tk_cfgs[:1] + tk_cfgs[3:4]
    for name, B, T in tk_cfgs:
        nbytes = B * (T * 4 + 512 * 8)
        sets = [(torch.randn(B, T, device=DEV, generator=gg),) for _ in range(n_sets(nbytes))]
        out.append((name, nbytes, lambda s: K.topk(s, 512), lambda s: ref_ix.topk(s, 512), sets))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-ref", action="store_true", help="skip timing the torch references")
    ap.add_argument("--only", default=None, help="time only the ops whose name contains this text, e.g. 'topk'")
    args = ap.parse_args()
    from ds4 import kernels
    kernels.require("bench_attn")
    from ds4 import kernels_attn
    t0 = time.time()
    why = kernels_attn.unavailable_reason()
    if why:
        print("ds4_attn extension unavailable:", why)
        return 1
    build_s = time.time() - t0
    torch.backends.cuda.matmul.allow_tf32 = False
    bw = copy_bandwidth()
    rows = []
    for name, nbytes, fn, ref, sets in cases(args.quick):
        if args.only and args.only not in name:
            continue
        us, mode = time_graph(fn, sets)
        ref_us = None
        if not args.no_ref:
            try:
                ref_us, _ = time_graph(ref, sets, reps=5, trials=3)
            except Exception as e:  # noqa: BLE001
                print(f"  ({name}: reference timing failed: {type(e).__name__})")
        gbs = nbytes / (us * 1e-6) / 1e9
        rows.append(dict(op=name, us=us, bytes=nbytes, gbps=gbs, pct_copy=100 * gbs / bw, ref_us=ref_us, mode=mode,
                         sets=len(sets)))
        del sets
        torch.cuda.empty_cache()
    dev = torch.cuda.get_device_name()
    print(f"\n{dev}, torch {torch.__version__}, copy bandwidth {bw:.0f} GB/s (read+write), load/build {build_s:.1f} s")
    print(f"{'op':<22}{'us':>9}{'bytes':>12}{'GB/s':>9}{'%copy':>7}{'ref us':>10}{'speedup':>9}")
    for r in rows:
        ref = f"{r['ref_us']:.1f}" if r["ref_us"] else "-"
        sp = f"{r['ref_us'] / r['us']:.1f}x" if r["ref_us"] else "-"
        print(f"{r['op']:<22}{r['us']:>9.2f}{r['bytes']:>12,}{r['gbps']:>9.0f}{r['pct_copy']:>7.1f}{ref:>10}{sp:>9}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=dev, torch=torch.__version__, copy_gbps=bw, rows=rows,
                                                  date=time.strftime("%Y-%m-%d %H:%M:%S")), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
