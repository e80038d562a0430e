"""Where a replayed decode step's wall time goes, from its kernel trace.

Per-kernel totals (scripts/profile_step.py) add up to more than the step when PDL and side-stream
branches overlap kernels, and to less when the GPU idles between launches; neither says which kernels
the step actually waits on. `attribute` splits the step's span instant by instant: to the main-stream
kernel running then (with PDL the next kernel starts while the previous one finishes: the earlier
started of them keeps the instant), else to a side-stream kernel running then ("side: name"), else to
"idle". The parts add up to the span, so a table of them reads as the step's critical timeline.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable, Iterable

IDLE = "idle"


@dataclass(frozen=True)
class Kernel:
    name: str
    stream: int
    start: float  # us
    end: float


def kernels_from_trace(trace: dict | list) -> list[Kernel]:
    """The kernels of a Chrome trace (torch.profiler's export_chrome_trace JSON, or its event list),
    sorted by start. Kernel events are complete events ("ph": "X") of category "kernel"; the stream is
    args["stream"] (else the event's tid)."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    out = []
    for e in events:
        if e.get("ph") != "X" or str(e.get("cat", "")).lower() != "kernel":
            continue
        stream = e.get("args", {}).get("stream", e.get("tid", 0))
        try:
            stream = int(stream)
        except (TypeError, ValueError):  # e.g. "stream 7"
            digits = "".join(ch for ch in str(stream) if ch.isdigit())
            stream = int(digits) if digits else -1
        start = float(e["ts"])
        out.append(Kernel(str(e.get("name", "?")), stream, start, start + float(e.get("dur", 0.0))))
    return sorted(out, key=lambda k: (k.start, k.end))


def main_stream(kernels: Iterable[Kernel]) -> int:
    """The stream with the most kernels (a decode step's main chain; its branches run fewer)."""
    counts = collections.Counter(k.stream for k in kernels)
    if not counts:
        raise ValueError("no kernels in the trace")
    return counts.most_common(1)[0][0]


def attribute(kernels: list[Kernel], main: int | None = None,
              label: Callable[[str], str] = lambda n: n) -> dict[str, float]:
    """label -> us of the span [first start, last end] the label holds (see the module docstring).
    The values sum to the span."""
    if not kernels:
        return {}
    main = main_stream(kernels) if main is None else main
    cuts = sorted({t for k in kernels for t in (k.start, k.end)})
    ordered = sorted(kernels, key=lambda k: (k.start, k.end))
    out: dict[str, float] = collections.defaultdict(float)
    for t0, t1 in zip(cuts, cuts[1:]):
        running = [k for k in ordered if k.start <= t0 and k.end >= t1]
        on_main = [k for k in running if k.stream == main]
        if on_main:
            who = label(on_main[0].name)
        elif running:
            who = "side: " + label(running[0].name)
        else:
            who = IDLE
        out[who] += t1 - t0
    return dict(out)


def chain(kernels: list[Kernel], main: int | None = None) -> list[tuple[str, float, float, float]]:
    """The main stream's kernels in start order as (name, start - the first kernel's start, duration, gap):
    gap = start - the previous main-stream kernel's end (negative where PDL launched it early)."""
    if not kernels:
        return []
    main = main_stream(kernels) if main is None else main
    t0 = min(k.start for k in kernels)
    out, prev_end = [], None
    for k in sorted((k for k in kernels if k.stream == main), key=lambda k: (k.start, k.end)):
        out.append((k.name, k.start - t0, k.end - k.start, 0.0 if prev_end is None else k.start - prev_end))
        prev_end = k.end
    return out


def one_step(kernels: list[Kernel], per_step: int, which: int = -1) -> list[Kernel]:
    """The kernels of one replay out of consecutive replays of `per_step` kernels each (by start order)."""
    n = len(kernels) // per_step if per_step > 0 else 0
    if n == 0 or len(kernels) % per_step:
        raise ValueError(f"{len(kernels)} kernels are not whole replays of {per_step}")
    i = which % n
    return kernels[i * per_step:(i + 1) * per_step]
