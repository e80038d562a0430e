"""L2 prefetch of the weights a captured decode step streams next.

A batch-1 decode step alternates bandwidth-bound GEMVs with latency-bound chains of small kernels
(mHC, router, attention core) during which HBM is mostly idle. While a decode graph is captured, a
prefetch site forks a side stream at the start of such a chain and launches ds4.kernels.l2_prefetch
there (it only issues requests and writes nothing; it lasts about as long as the transfer); the GEMV
after the chain then finds its weights in L2.

Measured slower, so off by default (an ablation; H200, 1 GPU, 4 -> 12 layers, caches for 8192 positions,
experiments/decode_session13_h200.md, run 3): 131.0 us per layer without prefetch, 135.2 with q,
135.7 with o, 132.1 with d, 139.9 with q and o, 141.0 with q, o and d. The GEMVs it feeds did not get
faster in the step's profile; presumably its traffic slows the kernels running beside it.

The sites (DS4_L2_PREFETCH, read per call: unset or "0" = none, "1" = DEFAULT_SITES, "all", or a comma
list):

  q   the query up-projection (wq_b, with the indexer's rows when merged), forked at the block's start:
      runs beside the block's first mHC and the merged wq_a + wkv GEMV;
  o   the grouped wo_a, forked after wq_b: beside the indexer and the attention core;
  b   wo_b, right after wo_a's prefetch on the same branch (not in DEFAULT_SITES: with wo_a it is
      67 MB for a ~50 MB L2);
  d   the routed experts' down projections (w2 and scales of the ids the router chose, read on the
      device), forked after the router: beside the routed gate+up.

Eager steps and prefill never prefetch (a fork there only adds host work). The branches share one side
stream (slot PREFETCH_SLOT): their kernels are small and in order there. They are joined once, at the
end of the step (join_pending, from Transformer.decode), not after the GEMV each feeds: a join there makes
the next main-stream kernel depend on two nodes, which likely costs it its programmatic (PDL) launch
(session 13, run 2, joins after each GEMV: 151.2 against 130.3 us per layer without prefetch).
"""
from __future__ import annotations

import os
from typing import Sequence

from torch import Tensor

from ds4.ops import side_stream

ENV = "DS4_L2_PREFETCH"
SITES = ("q", "o", "b", "d")
DEFAULT_SITES = ("q", "o", "d")  # what "1" turns on
PREFETCH_SLOT = 4  # the attention branches use side-stream slots 0-3 (ds4.ops.attn_torch.BRANCHES)
MAX_ROWS = 8  # decode-sized inputs only (the GEMV kernels' decode sizes)


def sites() -> frozenset[str]:
    """The enabled prefetch sites (DS4_L2_PREFETCH, read per call; none unless it names some)."""
    v = os.environ.get(ENV, "").strip()
    if v in ("", "0"):
        return frozenset()
    if v == "1":
        return frozenset(DEFAULT_SITES)
    if v == "all":
        return frozenset(SITES)
    chosen = frozenset(p.strip() for p in v.split(",") if p.strip())
    unknown = sorted(chosen - set(SITES))
    if unknown:
        raise ValueError(f"{ENV}={v!r}: unknown site(s) {unknown}; sites are {list(SITES)} (or 0, 1, all)")
    return chosen


_PENDING: list[tuple[side_stream.Branch, tuple]] = []  # forked, not yet joined: (branch, tensors it reads)


def issue(site: str, tensors: Sequence[Tensor], x: Tensor, ids: Tensor | None = None, id_offset: int = 0) -> bool:
    """Prefetch `tensors` (whole; or with ids the experts ids - id_offset of tensors stacked by local expert)
    on the prefetch side stream, forked from the current stream, while a decode graph (x: <= MAX_ROWS rows)
    is captured and `site` is enabled; the branch is joined by join_pending. Returns whether it was issued."""
    if site not in SITES:
        raise ValueError(f"unknown prefetch site {site!r} (one of {list(SITES)})")
    if not (x.is_cuda and x.shape[0] <= MAX_ROWS and tensors and site in sites()):
        return False
    # None outside a capture; called in the eager warm-up steps too, so the side stream exists before one
    side = side_stream.fork(x.device, ENV, PREFETCH_SLOT)
    if side is None:
        return False
    from ds4 import kernels
    with side_stream.Branch(side, x.device) as branch:
        kernels.l2_prefetch(list(tensors), ids, id_offset)
    _PENDING.append((branch, (*tensors, ids)))  # ids may be an activation: kept alive until the join
    return True


def discard_pending() -> None:
    """Forget the branches of a step that did not finish (a failed capture's; the next job's step must not join
    them, and they hold that job's weights): called where a step starts, where the list is otherwise empty."""
    _PENDING.clear()


def join_pending() -> int:
    """Join every prefetch branch issued since the last call into the current stream (the end of a decode
    step); returns how many there were."""
    n = len(_PENDING)
    while _PENDING:
        branch, _ = _PENDING.pop(0)
        branch.join()
    return n
