"""Side-stream branches of a captured decode step.

While a CUDA graph is being captured, an implementation may run work that is independent of the
main chain on a side stream: the fork (side waits for main) and the join (main waits for side)
become two graph edges, and the branch's kernels overlap the main chain's (their ramps and tails
fill each other's idle bandwidth; a chain of small kernels leaves the critical path). Eager steps keep
everything in line: there a fork and join would only add host work to a host-bound step. Used by
moe=fp4_topk (the shared expert) and attn=fused_cuda (compressor steps, window write, indexer).

Branches live at the same time use different slots (one stream each). Tensors a branch reads stay
referenced until it is joined (the callers hold them), so no allocation on the main stream can reuse
their memory while the branch still reads it.
"""
from __future__ import annotations

import contextlib
import os

import torch

_SIDE: dict[tuple[int, int, int], torch.cuda.Stream] = {}


def side_priority() -> int:
    """The side streams' priority: DS4_SIDE_PRIORITY=high (read when a stream is asked for) gives them a
    higher one than the main stream's (-1; CUDA clamps to the device's range), so their kernels' blocks are
    placed before the main chain's waiting ones (torch instantiates captured graphs with per-node
    priorities, taken from the capturing streams); else the default, the main stream's (0)."""
    return -1 if os.environ.get("DS4_SIDE_PRIORITY") == "high" else 0


def side_stream(device: torch.device, slot: int = 0) -> torch.cuda.Stream:
    """The process's side stream `slot` of `device` (created at the eager warm-up steps, before any capture)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    prio = side_priority()
    if (idx, slot, prio) not in _SIDE:
        _SIDE[idx, slot, prio] = torch.cuda.Stream(device, priority=prio)
    return _SIDE[idx, slot, prio]


def fork(device: torch.device, env: str, slot: int = 0, site: str | None = None) -> torch.cuda.Stream | None:
    """Side stream `slot`, made to wait for everything issued so far on the current stream, while a graph is
    captured and the environment variable `env` is not "0" (the ablation); else None (stay in line).
    site: the caller's name for this fork where the branch's first launch is a ds4 kernel that waits (PDL) before it
    reads anything the main stream wrote. Where DS4_PFORK names the site, the branch then depends on the main stream's
    last kernels by programmatic edges (ds4.kernels.fork_programmatic): its first kernel launches once they have let
    their successors launch, beside the main stream's next kernel, instead of after they end."""
    if device.type != "cuda":
        return None
    side = side_stream(device, slot)
    if not torch.cuda.is_current_stream_capturing() or os.environ.get(env) == "0":
        return None
    main = torch.cuda.current_stream(device)
    side.wait_stream(main)
    if site is not None and site in programmatic_fork_sites():
        from ds4 import kernels
        if kernels.unavailable_reason() is None and kernels.fork_programmatic(main, side):
            global _pforks
            _pforks += 1
    return side


# shared: the shared expert's branch (moe=fp4_topk's shared_up), whose gate+up loads its first weight rounds before its
# PDL wait; the default since session 76 (two H100s: 1-2.3 us per layer faster, experiments/session76.md). Session 74
# forked the compressors' branches so (experiments/s74/programmatic_fork.diff): no gain.
PFORK_SITES = ("shared",)
PFORK_DEFAULT = "shared"


def programmatic_fork_sites() -> set[str]:
    """The fork sites DS4_PFORK names (comma list; read per call; unset: PFORK_DEFAULT; "" or "none": none, every
    fork a full edge, the form before session 76)."""
    v = os.environ.get("DS4_PFORK", PFORK_DEFAULT)
    return set() if v == "none" else _named_sites("DS4_PFORK", v, PFORK_SITES, "fork", "")


def _named_sites(env: str, v: str, known: tuple[str, ...], what: str, also: str) -> set[str]:
    """The sites of env's comma list v; an unknown name raises (a misspelt site would time the plain edges under the
    option's name). also: the list's other accepted words, for the message."""
    sites = {t for t in v.split(",") if t}
    if sites - set(known):
        raise ValueError(f"{env}={v!r}: unknown {what} site(s) {', '.join(sorted(sites - set(known)))}; "
                         f"the sites are {', '.join(known)}{also}")
    return sites


_pforks = 0  # programmatic forks made so far in this process


def programmatic_fork_count() -> int:
    """How many branch forks were made by programmatic edges in this process so far."""
    return _pforks


def programmatic_sites() -> set[str]:
    """The join sites DS4_PJOIN names (comma list; "all": every one; read per call): there a captured branch joins
    by programmatic edges (Branch.join). Opt-in: on an H200 the routed down joined so (one join per layer) measured
    115.4 / 115.5 against 115.1 / 115.4 us per layer (session 27, experiments/decode_session27_h200.md): no gain."""
    v = os.environ.get("DS4_PJOIN", "")
    return set(PJOIN_SITES) if v == "all" else _named_sites("DS4_PJOIN", v, PJOIN_SITES, "join", " or all")


# moe: the routed MoE down kernel after the shared expert's branch (moe=fp4_topk); attn: the attention core's chunk
# kernel after the window write's, the compressors' and the indexer's branches (attn=fused_cuda's decode_join_site)
PJOIN_SITES = ("moe", "attn")
_pjoins = 0  # programmatic joins made so far in this process (scripts/bench_decode.py reports them per variant)


def programmatic_joins() -> int:
    """How many branch joins were made by programmatic edges in this process so far."""
    return _pjoins


class Branch:
    """A branch of a step: `with branch:` issues on its side stream (in line when it has none); `join()`
    makes the current stream wait for it. Branch(None, device) is the in-line branch."""

    def __init__(self, side: torch.cuda.Stream | None, device: torch.device):
        self.side, self.device = side, device
        self._ctx = None

    def __enter__(self) -> "Branch":
        self._ctx = torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)
        self._ctx = None

    def join(self, site: str | None = None) -> None:
        """site: the caller's next launch on the current stream is a ds4 kernel that waits (PDL) for its
        predecessors before it reads the branch's outputs. Where DS4_PJOIN names the site, the branch then joins by
        programmatic edges (ds4.kernels.join_programmatic: that kernel may launch before the branch drains); else,
        or where that cannot be done, by an event."""
        if self.side is None:
            return
        main = torch.cuda.current_stream(self.device)
        if site is not None and site in programmatic_sites():
            from ds4 import kernels
            if kernels.unavailable_reason() is None and kernels.join_programmatic(self.side, main):
                global _pjoins
                _pjoins += 1
                return
        main.wait_stream(self.side)
