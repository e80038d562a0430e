"""Where one batch-1 decode step's time goes, kernel by kernel (one GPU, CUDA-graph replay).

    python scripts/profile_step.py --layers 4 --variant kernels+fused [--replays 20] [--out f.json]
    python scripts/profile_step.py --layers 12 --variant kernels+fused+cap8192 --timeline --timeline-replays 12
    torchrun --nproc-per-node 2 scripts/profile_step.py --layers 8 --variant kernels+fused+symm --timeline

Under torchrun every rank replays and profiles its own step (the collectives inside the graph need both);
rank 0 prints and writes. Variant tokens for tp > 1: symm (comm=symm_mem), ll (comm=ll), bf16
(reduce=bf16), shtp (the shared expert sliced over the ranks, parallel.shared_expert=tp; without it whole on
every rank, replicate); the routed experts are laid out as parallel.experts=tp (the default). capN sizes the
caches for N positions, and qat selects numerics=qat, as in bench_decode.py.

The captured step is replayed under torch.profiler (CUPTI sees every kernel inside the graph):
per kernel name, the GPU time per step and per layer, and the step's wall time, whose difference
to the summed kernel time is the launch gaps between kernels. Variant tokens as in
bench_decode.py (kernels, fused, wobf16).

--timeline also reads one replayed step's critical path off the kernel times (ds4.timeline: each kernel's
predecessor is the one that ended last before it, whatever stream the graph put it on): with PDL and the
side-stream branches on (the product's step), which kernels the wall time waits on rather than what each
kernel costs alone. --timeline-replays N reads N replays' paths and prints each kernel's charge and each
layer's attention / FFN side as mean +- sd over them.

PDL and the side-stream branches overlap kernels inside the graph, so a kernel's time then includes
its neighbours' contention (and the wall time is below the summed kernel time). For each kernel's
own time run with DS4_PDL=0 DS4_COMPRESS_OVERLAP=0 DS4_ATTN_OVERLAP=0 DS4_SHARED_OVERLAP=0.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
import time

import torch

from ds4 import dist as ddist
from ds4.model.args import preset
from ds4.model.transformer import Transformer
from ds4.registry import build_ops
from ds4.runtime.generate import Generator
from ds4.timeline import critical_path, kernels_from_trace, mean_parts, mean_sd, path_parts
from ds4.timeline import replays as split_replays
from ds4.weights.synthetic import random_weights

from attn_side import sides  # per-layer attention / FFN sides of a critical path
from bench_decode import (_number_token, attention_options, impls_of,  # the decode benchmark's variant tokens
                          numerics_of, tp_comm)

# the variant tokens this script applies (through bench_decode's impls_of / numerics_of / attention_options / tp_comm);
# bench_decode.py's others set DS4_* variables that this script does not: set those in the shell
APPLIED_TOKENS = frozenset({"kernels", "fused", "wobf16", "dp4a", "qat", "graph", "ll", "symm", "bf16", "shtp", "noidxm",
                            "hwin", "noqskip"})

# a readable label per kernel: template arguments and namespaces dropped, an anonymous one too (without it
# csrc/moe_dp4a.cu's kernel was labelled "ds4" and torch's at::native::(anonymous namespace):: kernels "native",
# as in session 65's profiles)
_LABEL = re.compile(r"^(?:void )?(?:(?:\w+|\(anonymous namespace\))::)*(\w+)")


def label(name: str) -> str:
    m = _LABEL.match(name)
    return (m.group(1) if m else name)[:48]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="v4_flash")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--variant", default="kernels+fused")
    ap.add_argument("--context", type=int, default=64, help="prompt tokens before the profiled steps")
    ap.add_argument("--long-context", type=int, default=0,
                    help="also time steps at this position: the state is allocated for it and the row's position "
                         "set there after the prompt (cache contents are the prompt's and zeros: the work per "
                         "step - indexer over every entry, top-k, HCA over all entries - is that of the context)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--timeline", action="store_true",
                    help="also print one replay's critical path (ds4.timeline), and with --long-context one there too")
    ap.add_argument("--timeline-replays", type=int, default=1,
                    help="with --timeline: also read the critical path of this many replays and print each kernel's "
                         "charge and each layer's attention / FFN side as mean +- sd over them (one replay's path "
                         "varies by a us or two per kernel; a difference of about a us per layer needs several)")
    ap.add_argument("--phases", type=int, default=0,
                    help="also time this many single replays (CUDA events) and print the mean step by position mod 4 "
                         "(the compressors' deferred projections run at positions 3 mod 4) and the replay of the "
                         "timeline at such a position too")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.timeline_replays < 1:
        ap.error(f"--timeline-replays {a.timeline_replays}: at least 1")
    ignored = sorted(t for t in a.variant.split("+")
                     if t not in APPLIED_TOKENS and not (t[:3] == "cap" and t[3:].isdigit()))
    if ignored:
        ap.error(f"--variant {a.variant}: {', '.join(ignored)} would be ignored here (this script applies "
                 f"{', '.join(sorted(APPLIED_TOKENS))} and capN; set the other switches' DS4_* variables in the shell)")
    from ds4 import kernels
    kernels.require("profile_step")
    e = ddist.init("cuda", int(os.environ.get("WORLD_SIZE", 1)))
    if e.rank:  # every rank runs and profiles the same step; rank 0 reports
        sys.stdout = open(os.devnull, "w")
        a.out = None
    dev = torch.device("cuda", e.local_rank)
    toks = set(a.variant.split("+"))
    comm = None
    if e.world > 1:
        comm = tp_comm(toks, dev)
    args = preset(a.model)
    args = args.with_layers(a.layers) if a.layers < args.n_layers else args
    model = Transformer(args, build_ops(impls_of(toks), dev), numerics_of(toks), torch.bfloat16, dev, e.rank,
                        e.world, comm=comm)
    model.load_weights(random_weights(args, seed=0, device=dev, rank=e.rank, world=e.world, include_mtp=False,
                                      experts="tp", shared="tp" if "shtp" in toks else "replicate"))
    cap = max(a.context, a.long_context) + 3 * a.replays + 64
    if a.timeline:  # the timelines' own replays: max(3, N) for the step's, with --phases 3 more and up to 3 to reach a
        # position 3 mod 4 (without them, --timeline-replays N past ~58 overran the caches after the profile had run)
        cap += 2 * max(3, a.timeline_replays) + 6
    attention_options(model, toks)
    cap += a.phases
    gen = Generator(model, 1, max(cap, _number_token(toks, "cap", 0)), runtime="cuda_graph")
    prompt = [(13 * i + 7) % args.vocab_size for i in range(a.context)]
    gen.generate([prompt], 4, stop_at_eos=False)            # prefill, capture, a few steps
    graph = gen.graph_step(1, "argmax")
    tok = torch.tensor([1], device=dev)

    def step(t):  # one replay at the row's position (the Generator counts it: the graph of the step's phase)
        return gen.replay(graph, t)

    def wall_per_step() -> float:
        """Mean wall time of `replays` graph replays (after 3 warm-up replays), in us."""
        nonlocal tok
        for _ in range(3):
            tok = step(tok)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.replays):
            tok = step(tok)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / a.replays * 1e6

    wall_us = wall_per_step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(a.replays):
            tok = step(tok)
        torch.cuda.synchronize()
    per = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.key_averages():  # kernel rows: device time, no host time of their own
        dt = getattr(ev, "self_device_time_total", None)
        dt = dt if dt is not None else getattr(ev, "self_cuda_time_total", 0.0)
        if dt > 0 and ev.cpu_time_total == 0:
            k = label(ev.key)
            per[k][0] += dt
            per[k][1] += ev.count
    timeline = step_timeline(step, tok, a.layers, mean_over=a.timeline_replays) if a.timeline else None
    phase_us = due_timeline = None
    if a.phases:
        phase_us = per_phase(step, tok, gen, a.phases)
        print("step wall by position mod 4 (us): " + ", ".join(f"{k}: {v:.1f}" for k, v in sorted(phase_us.items())))
        if a.timeline:  # the last replay of step_timeline at a position 3 mod 4
            while (gen.host_pos[0] + 2) % 4 != 3:
                tok = step(tok)
            print("the critical path of a step at a position 3 mod 4:")
            due_timeline = step_timeline(step, tok, a.layers)
    def at_long_context(entries: str):
        """(wall us, critical path or None) of a step at position a.long_context; entries names the cache's."""
        gen.state.pos[0] = a.long_context
        gen.host_pos[0] = a.long_context
        wall = wall_per_step()
        path = None
        if a.timeline:  # where the long context's extra time sits on the critical path
            print(f"the critical path of a step at position ~{gen.host_pos[0]} ({entries} cache entries):")
            path = step_timeline(step, tok, a.layers)
        return wall, path

    long_us = long_timeline = None
    long_random = {}
    if a.long_context:
        long_us, long_timeline = at_long_context("zero")
        # The entries past the prompt are zeros, so every index score there ties (a top-k's worst case, not a
        # real context's): the same position again with the compressed caches (attention's and the indexer's)
        # filled with random values
        torch.manual_seed(0)
        for st in gen.state.layers:
            for name in ("ckv", "ikv"):
                if name in st:
                    st[name].normal_()
        r_wall, r_path = at_long_context("random")
        long_random = {"wall_us": r_wall, "timeline": r_path}
    rows = sorted(((k, v[0] / a.replays, v[1] / a.replays) for k, v in per.items()), key=lambda r: -r[1])
    busy = sum(r[1] for r in rows)
    launches = sum(r[2] for r in rows)
    print(f"\n{torch.cuda.get_device_name(dev)}: {a.model} n_layers={a.layers} {a.variant}, context {a.context}"
          + (f", tp={e.world} (rank 0)" if e.world > 1 else ""))
    print(f"step wall {wall_us:.1f} us, kernel time {busy:.1f} us, {launches:.0f} kernels per step "
          f"({launches / a.layers:.1f} per layer), gaps {wall_us - busy:.1f} us")
    if long_us is not None:
        print(f"step wall at position {a.long_context}: {long_us:.1f} us ({100 * (long_us / wall_us - 1):+.1f}% vs "
              f"position ~{a.context})")
        r_us = long_random["wall_us"]
        print(f"step wall at position {a.long_context}, random cache entries: {r_us:.1f} us "
              f"({100 * (r_us / wall_us - 1):+.1f}% vs position ~{a.context})")
    print(f"{'kernel':<50}{'us/step':>9}{'us/layer':>10}{'calls':>7}{'us/call':>9}")
    for k, us, n in rows:
        print(f"{k:<50}{us:>9.1f}{us / a.layers:>10.1f}{n:>7.0f}{us / max(n, 1):>9.2f}")
    if a.out:
        json.dump({"gpu": torch.cuda.get_device_name(dev), "layers": a.layers, "variant": a.variant,
                   "context": a.context, "wall_us": wall_us, "kernel_us": busy, "kernels": launches,
                   "long_context": a.long_context, "long_context_wall_us": long_us, "world": e.world,
                   "rows": [{"kernel": k, "us_per_step": us, "calls_per_step": n} for k, us, n in rows],
                   "timeline": timeline, "phase_us": phase_us, "timeline_pos3": due_timeline,
                   "timeline_long_context": long_timeline, "long_context_random": long_random},
                  open(a.out, "w"), indent=1)
    if e.world > 1:
        torch.distributed.destroy_process_group()


def per_phase(step, tok, gen, n: int) -> dict[int, float]:
    """Mean device time of single replays by the replayed token's position mod 4 (n replays, CUDA events)."""
    times = collections.defaultdict(list)
    for _ in range(n):
        p = gen.host_pos[0]
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        tok = step(tok)
        t1.record()
        t1.synchronize()
        times[p % 4].append(t0.elapsed_time(t1) * 1e3)
    return {k: sum(v) / len(v) for k, v in times.items()}


def step_timeline(step, tok, layers: int, replays: int = 3, mean_over: int = 1) -> dict | None:
    """Replays the step max(replays, mean_over) times under the profiler and reads the last replay's critical path
    (ds4.timeline); prints it and returns it (None, with the reason printed, when the trace cannot be split). With
    mean_over > 1 also the last mean_over replays' paths: per kernel the charge's mean and sd, per layer the sides'
    (scripts/attn_side.py), printed and returned under "over_replays"."""
    replays = max(replays, mean_over)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            tok = step(tok)
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            kernels = kernels_from_trace(json.load(f))
    finally:
        os.unlink(path)
    try:
        steps = split_replays(kernels, len(kernels) // replays, alike=True)  # (replays of one graph)
    except ValueError as e:  # a diagnostic: say why and go on with the rest of the profile
        print(f"timeline skipped: {e}")
        return None
    pdl = os.environ.get("DS4_PDL", "1") != "0"  # without PDL a kernel starts after its predecessor ended
    ks = steps[-1]
    span = max(k.end for k in ks) - min(k.start for k in ks)
    cpath = critical_path(ks, strict=not pdl)
    parts = path_parts(cpath, label)
    streams = len({k.stream for k in ks})
    print(f"\ntimeline of one replay: span {span:.1f} us, {len(ks)} kernels on {streams} streams; "
          f"critical path ({'PDL: overlapping' if pdl else 'no PDL: strict'} predecessors) {len(cpath)} kernels, "
          f"{sum(c for _, c, _ in cpath):.1f} us")
    print(f"{'on the critical path (charge: end - predecessor end)':<58}{'us/step':>9}{'us/layer':>10}{'share':>8}{'n':>5}")
    for who, (us, n) in parts.items():
        print(f"{who:<58}{us:>9.1f}{us / layers:>10.1f}{100 * us / span:>7.1f}%{n:>5}")
    t0 = min(k.start for k in ks)
    print("\nthe critical path in order (gap: idle before it on the path)")
    print(f"{'kernel':<50}{'end us':>10}{'charge':>9}{'gap':>8}")
    for k, charge, gap in cpath:
        print(f"{label(k.name):<50}{k.end - t0:>10.1f}{charge:>9.2f}{gap:>8.2f}")
    out = {"span_us": span, "kernels": len(ks), "streams": streams, "strict": not pdl,
           "parts": {n: {"us": us, "n": c} for n, (us, c) in parts.items()},
           "path": path_rows(cpath, t0),
           # every kernel of the replay: (label, stream, start us, end us), to read what the path's charges hide
           "all": [(label(k.name), k.stream, round(k.start - t0, 2), round(k.end - t0, 2))
                   for k in sorted(ks, key=lambda k: k.start)]}
    if mean_over > 1:
        out["over_replays"] = over_replays(steps[-mean_over:], layers, pdl)
    return out


def path_rows(cpath, t0: float) -> list[dict]:
    """A critical path as the JSON's rows (times from the replay's first kernel start t0), as attn_side.sides reads."""
    return [{"kernel": label(k.name), "end_us": k.end - t0, "charge_us": c, "gap_us": g} for k, c, g in cpath]


def over_replays(steps, layers: int, pdl: bool) -> dict:
    """Each replay's critical path; per kernel its charge and per layer its attention / FFN side, as mean and sd over
    the replays (printed, and returned for the JSON)."""
    paths, spans, per_layer = [], [], []
    for ks in steps:
        cpath = critical_path(ks, strict=not pdl)
        t0 = min(k.start for k in ks)
        span = max(k.end for k in ks) - t0
        paths.append(cpath)
        spans.append(span)
        try:
            per_layer.append(sides({"path": path_rows(cpath, t0), "span_us": span}, layers))
        except ValueError:  # a path that misses an hc site: its sides would pair the wrong sites
            per_layer.append([])
    parts = mean_parts(paths, label)
    span_m, span_sd = mean_sd(spans)
    print(f"\nover {len(steps)} replays: span {span_m:.1f} +- {span_sd:.1f} us")
    print(f"{'on the critical path, mean +- sd over the replays':<50}{'us/step':>9}{'sd':>7}{'us/layer':>10}{'n':>6}")
    for who, (m, sd, n) in parts.items():
        print(f"{who:<50}{m:>9.1f}{sd:>7.1f}{m / layers:>10.1f}{n:>6.1f}")
    layer_rows = []
    if all(per_layer):  # (sides(path, layers): every replay's `layers` pairs, or [] where its path lost an hc site)
        print(f"{'layer':<8}{'attention side us':>20}{'FFN side us':>16}")
        for i in range(len(per_layer[0])):
            am, asd = mean_sd([p[i][0] for p in per_layer])
            fm, fsd = mean_sd([p[i][1] for p in per_layer])
            layer_rows.append({"attention_us": am, "attention_sd": asd, "ffn_us": fm, "ffn_sd": fsd})
            print(f"{i:<8}{am:>12.1f} +- {asd:<4.1f}{fm:>9.1f} +- {fsd:<4.1f}")
    else:  # (a path that misses an hc site in some replay: the sides do not line up)
        print("per-layer sides skipped: the replays' paths do not split into the same layers")
    return {"replays": len(steps), "span_us": span_m, "span_sd": span_sd,
            "parts": {n: {"us": m, "sd": sd, "n": c} for n, (m, sd, c) in parts.items()}, "layers": layer_rows}


if __name__ == "__main__":
    main()
