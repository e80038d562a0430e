#!/usr/bin/env python
"""Where a captured decode step leaves the eager one: tiny, batch 1, every fused kernel, the same tokens fed to
both runtimes (the eager step's greedy token), and after every step each decode-state tensor compared bit for
bit. Prints the first step at which any tensor (or the logits) differs, and which ones.

    python scripts/diag_graph_state.py --defer 4 --steps 400

A diagnostic of graph-vs-eager mismatches (tests/test_gpu_e2e.py asserts only that the tokens agree)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ds4.model.args import tiny  # noqa: E402
from ds4.model.transformer import Transformer  # noqa: E402
from ds4.registry import Impls, build_ops  # noqa: E402
from ds4.runtime.generate import Generator  # noqa: E402
from ds4.weights.synthetic import random_weights  # noqa: E402

FUSED = dict(linear="gemv_cuda", moe="fp4_topk", attn="fused_cuda", indexer="fused_cuda", hc="fused_cuda")


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    """How two unequal tensors differ: max |a - b| over finite pairs, NaN / inf mismatches, changed elements."""
    fa, fb = a.float(), b.float()
    ne = ~((fa == fb) | (fa.isnan() & fb.isnan()))
    fin = fa.isfinite() & fb.isfinite()
    d = (fa - fb).abs()[fin & ne]
    where = ne.nonzero()[:3].tolist()
    return (f"{int(ne.sum())} of {ne.numel()} differ, max finite |d| {d.max().item() if d.numel() else 0:.3g}, "
            f"first at {where}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--defer", type=int, default=4)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=3)
    o = p.parse_args()
    from ds4 import kernels
    kernels.require("diag_graph_state")  # one line, not a traceback, where the fused kernels cannot run
    dev = torch.device("cuda")
    args = tiny()
    w = random_weights(args, seed=o.seed, device=dev, include_mtp=False)
    gens = []
    for runtime in ("eager", "cuda_graph"):
        m = Transformer(args, build_ops(Impls(**FUSED), dev), "plain", torch.bfloat16, dev)
        m.load_weights(w)
        for blk in m.layers:
            blk.attn.defer_compress = o.defer
        gens.append(Generator(m, 1, o.steps + 64, runtime=runtime))
    eager, graph = gens
    step = graph.graph_step(1, "logits")
    prompt = [5, 6, 7, 8, 9, 10, 11]
    with torch.inference_mode():
        la, lb = eager.prefill([prompt]), graph.prefill([prompt])
        tok = la.argmax(-1)
        for i in range(o.steps):
            la = eager.decode(tok)
            lb = graph.replay(step, tok).clone()
            bad = [] if torch.equal(la, lb) else [("logits", _diff(la, lb))]
            for li, (sa, sb) in enumerate(zip(eager.state.layers, graph.state.layers)):
                for k in sa:
                    if not torch.equal(sa[k], sb[k]):
                        bad.append((f"layer {li} {k}", _diff(sa[k], sb[k])))
            if bad:
                print(f"defer={o.defer}: step {i} (position {len(prompt) + i}) differs:")
                for name, how in bad:
                    print(f"  {name}: {how}")
                return 1
            tok = la.argmax(-1)
    print(f"defer={o.defer}: {o.steps} steps, every state tensor and the logits equal")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
