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


def fork(device: torch.device, env: str, slot: int = 0) -> torch.cuda.Stream | None:
    """Side stream `slot`, made to wait for everything issued so far on the current stream, while a graph is
    captured and the environment variable `env` is not "0" (the ablation); else None (stay in line)."""
    if device.type != "cuda":
        return None
    side = side_stream(device, slot)
    if not torch.cuda.is_current_stream_capturing() or os.environ.get(env) == "0":
        return None
    side.wait_stream(torch.cuda.current_stream(device))
    return side


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

    def join(self) -> None:
        if self.side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.side)
