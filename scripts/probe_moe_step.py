"""The routed experts' one-token kernels block by block, inside a replayed decode step and alone (needs the ds4
extension built with the step probe, csrc/moe_mma.cu's -DDS4_MOE_PROBE, into a folder of its own):

    DS4_NVCC_FLAGS=-DDS4_MOE_PROBE DS4_ATTN_NVCC_FLAGS= DS4_EXT_BUILD_DIR=$PWD/.ext_build_probe \\
      DS4_ATTN_EXT_BUILD_DIR=$PWD/.ext_build/attn python scripts/probe_moe_step.py --layers 8 [--replays 6] \\
      [--out f.json]

(DS4_ATTN_NVCC_FLAGS= keeps the attention extension's flags the library build's, which DS4_NVCC_FLAGS would otherwise
set too, so the shared attention build is not compiled again.)

Each block of the routed gate+up and down launches writes %globaltimer at its marks (csrc/moe_mma.cu): gate+up
0 start, 1 after the PDL wait, 2 first weight rounds issued, 5 end; down 0 start, 1 first weight rounds issued (before
the PDL wait), 2 after the wait, 3 h staged (its stream starts), 4 its stream done, 8 its rows stored, 9 (with the hc
fold, in the step) the fold's copies landed, 5 end (after the fold's epilogue). A block files its marks under its
launch (its exit ticket / grid size), so one replay gives every layer's pair. "Alone" is the same pair of launches
(fp4t, random weights and ids, no fold, fp32 out) in eager stream order, nothing beside them.

Printed per case, in us from the gate+up's last block end (t = 0): the down's blocks' start / wait return / stream
start / end (first, median, last), each block's phases (the mean over the blocks), the gate+up's span, and the SM
clock over the blocks' lives (clock64 / globaltimer). Why: the routed down runs 17-19 us for 25 MB in the step (H100,
session 76), 13.4 us per launch back to back alone (session 63).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4 import kernels  # noqa: E402
from ds4.model.args import preset  # noqa: E402
from ds4.model.transformer import Transformer  # noqa: E402
from ds4.quant import pack_fp4_mma, tile_fp4_mma  # noqa: E402
from ds4.registry import build_ops  # noqa: E402
from ds4.runtime.generate import Generator  # noqa: E402
from ds4.weights.synthetic import random_weights  # noqa: E402

GU, DN = 0, 1
PROBE_SLOTS = 16  # launches of each kind recorded per replay (csrc/ds4_launch.h MOE_PROBE_SLOTS)


def read(clear: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The probe's records [2, 16, 1024, 10] (kind, launch % 16, block, mark) and tickets [2] (torch.ops.ds4
    .moe_step_probe), zeroed after the copy."""
    rec, tickets = torch.ops.ds4.moe_step_probe(clear)
    return rec, tickets


def _q(v: list[float]) -> tuple[float, float, float]:
    return (min(v), statistics.median(v), max(v)) if v else (float("nan"),) * 3


def summary(gu: torch.Tensor, dn: torch.Tensor) -> dict:
    """One layer's figures from its gate+up and down records ([1024, 10] each), in us relative to the gate+up's last
    block end; {} where either launch left no complete block."""
    gu = gu[gu[:, 5] > 0].double()  # the blocks that reached their end mark (gate+up's idle blocks write zeros)
    dn = dn[dn[:, 0] > 0].double()
    if len(gu) == 0 or len(dn) == 0 or (dn[:, 5] == 0).any():
        return {}
    t0 = gu[:, 5].max()
    us = lambda t: [float(x) for x in ((t - t0) / 1e3).tolist()]  # noqa: E731
    ghz = lambda r: statistics.median(((r[:, 7] - r[:, 6]) / (r[:, 5] - r[:, 0])).tolist())  # noqa: E731
    # a phase's mean over the blocks: %globaltimer ticks every 256 ns on the H100s of sessions 77-78, so a median of
    # differences is a multiple of 0.256 us, where the mean of many blocks' (their phases random against the
    # ticks) resolves finer
    d = lambda a, b: statistics.fmean(((dn[:, b] - dn[:, a]) / 1e3).tolist())  # noqa: E731
    folded, nan = bool((dn[:, 9] > 0).all()), float("nan")
    return {
        "gu_blocks": len(gu), "dn_blocks": len(dn),
        "gu_start": _q(us(gu[:, 0])), "gu_waited": _q(us(gu[:, 1])), "gu_end": _q(us(gu[:, 5])),
        "dn_start": _q(us(dn[:, 0])), "dn_waited": _q(us(dn[:, 2])), "dn_run": _q(us(dn[:, 3])),
        "dn_ran": _q(us(dn[:, 4])), "dn_end": _q(us(dn[:, 5])),
        "dn_prefetch": d(0, 1), "dn_wait": d(1, 2), "dn_stage": d(2, 3), "dn_stream": d(3, 4), "dn_epilogue": d(4, 5),
        # the epilogue's parts: rows stored; with the fold (mark 9 set), its copies' wait and the fold's pass
        "dn_store": d(4, 8), "dn_fold_wait": d(8, 9) if folded else nan, "dn_fold": d(9, 5) if folded else nan,
        "dn_life": d(0, 5), "gu_ghz": ghz(gu), "dn_ghz": ghz(dn),
    }


def layers_of(rec: torch.Tensor, tickets: torch.Tensor, grids: tuple[int, int]) -> list[dict]:
    """Each recorded launch pair (launch i of the gate+up with launch i of the down) summarised, in launch order."""
    n = min(int(tickets[GU]) // grids[GU], int(tickets[DN]) // grids[DN], rec.shape[1])
    return [summary(rec[GU][i], rec[DN][i]) for i in range(n)]


def show(name: str, s: dict) -> None:
    if not s:
        print(f"{name}: no complete record")
        return
    f = lambda t: "/".join(f"{x:7.2f}" for x in t)  # noqa: E731
    print(f"{name}: gate+up {s['gu_blocks']} blocks, down {s['dn_blocks']} (us from the gate+up's last end; "
          f"first/median/last)")
    print(f"  gate+up  start {f(s['gu_start'])}  waited {f(s['gu_waited'])}  end {f(s['gu_end'])}  "
          f"SM {s['gu_ghz']:.2f} GHz")
    print(f"  down     start {f(s['dn_start'])}  waited {f(s['dn_waited'])}  stream {f(s['dn_run'])}")
    print(f"           streamed {f(s['dn_ran'])}  end {f(s['dn_end'])}  SM {s['dn_ghz']:.2f} GHz")
    print(f"  down block (mean us): prefetch {s['dn_prefetch']:.2f}  wait {s['dn_wait']:.2f}  "
          f"stage {s['dn_stage']:.2f}  stream {s['dn_stream']:.2f}  epilogue {s['dn_epilogue']:.2f}  "
          f"life {s['dn_life']:.2f}")
    print(f"  down epilogue (mean us): rows stored {s['dn_store']:.2f}  fold's copies waited "
          f"{s['dn_fold_wait']:.2f}  fold {s['dn_fold']:.2f}")


def in_step(layers: int, replays: int, dev: torch.device) -> list[list[dict]]:
    """Per replay, every layer's routed pair (the step's launches in layer order: one routed gate+up and down per
    layer, so a kind's grid is its tickets / layers)."""
    from bench_decode import impls_of, numerics_of  # the decode benchmark's variant tokens
    toks = {"kernels", "fused"}
    args = preset("v4_flash")
    args = args.with_layers(layers) if layers < args.n_layers else args
    model = Transformer(args, build_ops(impls_of(toks), dev), numerics_of(toks), torch.bfloat16, dev, 0, 1)
    model.load_weights(random_weights(args, seed=0, device=dev, include_mtp=False))
    gen = Generator(model, 1, 8192, runtime="cuda_graph")  # cap8192, as the benchmark's variants
    gen.generate([[(13 * i + 7) % args.vocab_size for i in range(64)]], 4, stop_at_eos=False)
    graph = gen.graph_step(1, "argmax")
    tok = torch.tensor([1], device=dev)
    for _ in range(3):
        tok = gen.replay(graph, tok)
    out = []
    for i in range(replays):
        torch.cuda.synchronize()
        read(True)
        tok = gen.replay(graph, tok)
        torch.cuda.synchronize()
        rec, tickets = read(True)
        if any(int(t) % args.n_layers for t in tickets):
            raise RuntimeError(f"tickets {tickets.tolist()} are not whole grids of {args.n_layers} launches each")
        grids = (int(tickets[GU]) // args.n_layers, int(tickets[DN]) // args.n_layers)
        per_layer = layers_of(rec, tickets, grids)
        for li, s in enumerate(per_layer):
            show(f"step replay {i} layer {li}", s)
        out.append(per_layer)
    return out


def alone(reps: int, dev: torch.device) -> list[dict]:
    """The routed pair alone (fp4t, random weights and ids; no fold, fp32 out), one launch each per repetition."""
    g = torch.Generator(device=dev).manual_seed(0)
    E, dim, inter, k = 256, 4096, 2048, 6

    def fp4(o, i):
        w = torch.randint(-128, 128, (E, o, i // 2), device=dev, dtype=torch.int8, generator=g)
        s = torch.randint(116, 124, (E, o, i // 32), device=dev, dtype=torch.uint8, generator=g)
        return tile_fp4_mma(pack_fp4_mma(w)), s.view(torch.float8_e8m0fnu)
    (w1, s1), (w3, s3), (w2, s2) = fp4(inter, dim), fp4(inter, dim), fp4(dim, inter)
    x = torch.randn(1, dim, device=dev, generator=g).to(torch.bfloat16)
    rw = torch.rand(1, k, device=dev, generator=g) + 0.1
    out = []
    for i in range(reps + 2):
        ids = torch.randperm(E, device=dev, generator=g)[:k].view(1, k)
        torch.cuda.synchronize()
        read(True)
        h = kernels.moe_gate_up(x, ids, rw, w1, s1, w3, s3, "fp4t", 0, E, 10.0)
        kernels.moe_down(h, ids, k, w2, s2, "fp4t", 0, E, None, True)
        torch.cuda.synchronize()
        rec, tickets = read(True)
        s = layers_of(rec, tickets, (int(tickets[GU]), int(tickets[DN])))[0]
        if i >= 2:  # the first two warm the launches
            show(f"alone {i - 2}", s)
            out.append(s)
    return out


def medians(rows: list[dict]) -> dict:
    """The median of each scalar figure, and of each (first, median, last) triple's items, over rows."""
    rows = [r for r in rows if r]
    if not rows:
        return {}
    out = {}
    for key, v in rows[0].items():
        if isinstance(v, tuple | list):
            out[key] = tuple(statistics.median(r[key][j] for r in rows) for j in range(len(v)))
        else:
            out[key] = statistics.median(r[key] for r in rows)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8, help=f"2 to {PROBE_SLOTS} (the probe's launch slots)")
    ap.add_argument("--replays", type=int, default=6)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not 2 <= a.layers <= PROBE_SLOTS:  # more would overwrite the first layers' slots; the last layer is left out
        ap.error(f"--layers {a.layers}: 2 to {PROBE_SLOTS} (the probe records {PROBE_SLOTS} launches of each kind "
                 "per replay, and its summaries leave the last layer out)")
    kernels.require("probe_moe_step")
    try:
        read(True)
    except RuntimeError as e:
        print(f"probe_moe_step: {e}", file=sys.stderr)
        return 1
    dev = torch.device("cuda", 0)
    print(torch.cuda.get_device_name(dev))
    res = {"gpu": torch.cuda.get_device_name(dev), "layers": a.layers, "alone": alone(a.replays, dev),
           "step": in_step(a.layers, a.replays, dev)}
    print("\nmedians over the repetitions (alone) and over the replays' layers but the last (step: the last layer's "
          "down has no hc fold)")
    show("alone", medians(res["alone"]))
    show("step", medians([s for rep in res["step"] for s in rep[:-1]]))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
