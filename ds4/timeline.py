"""Where a replayed decode step's wall time goes, from its kernel trace.

Per-kernel totals (scripts/profile_step.py) add up to more than the step when PDL and side-stream
branches overlap kernels, and to less when the GPU idles between launches; neither says which kernels
the step actually waits on. Stream ids do not say it either: a replayed CUDA graph's kernels run on
streams the driver picks (session 13's trace had the step's chain spread over several of them).

`critical_path` reads the chain off the times alone, walking back from the kernel that ends last. Without
PDL a kernel starts only after everything it depends on has ended, so its predecessor is the kernel that
ended last before it started (strict=True). With PDL a kernel may start before its predecessor ends; its
predecessor is then the kernel that ended last among those that started before it and ended no later than
it (strict=False): its stream predecessor, which PDL let it overlap, or the branch it joined — or a side
kernel that merely ended later, which this rule cannot tell apart (session 13's run 4: in a no-PDL trace
read with it, the routed gate+up's predecessor came out as the shared expert's down kernel running beside
it). Each kernel on the path is charged its end minus its predecessor's end: its own time on the chain
plus any idle gap before it. The charges add up to the path's span, which is the step's span when the path
reaches the step's first kernel.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable, Iterable


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


def critical_path(kernels: Iterable[Kernel], strict: bool = False,
                  slack: float = 0.5) -> list[tuple[Kernel, float, float]]:
    """The chain the step waits on, first to last, as (kernel, charge, gap): charge = its end minus its
    predecessor's end (the first kernel: its duration); gap = its start minus its predecessor's end when
    positive (idle before it on the chain), else 0. strict: a trace without PDL (a predecessor ended before
    its successor started, within `slack` us of timestamp jitter). See the module docstring."""
    ks = sorted(kernels, key=lambda k: (k.end, k.start))
    if not ks:
        return []

    def precedes(j: Kernel, k: Kernel) -> bool:
        if strict:
            return j.end <= k.start + slack and j.start < k.start
        return j.start < k.start and j.end <= k.end

    path = [ks[-1]]
    while True:
        k = path[-1]
        before = [j for j in ks if j is not k and precedes(j, k)]
        if not before:
            break
        path.append(max(before, key=lambda j: (j.end, j.start)))
    path.reverse()
    out = [(path[0], path[0].end - path[0].start, 0.0)]
    for prev, k in zip(path, path[1:]):
        out.append((k, k.end - prev.end, max(0.0, k.start - prev.end)))
    return out


def path_parts(path: list[tuple[Kernel, float, float]],
               label: Callable[[str], str] = lambda n: n) -> dict[str, tuple[float, int]]:
    """label -> (us charged on the critical path, kernels on it), largest first."""
    out: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for k, charge, _ in path:
        out[label(k.name)][0] += charge
        out[label(k.name)][1] += 1
    return {n: (v[0], v[1]) for n, v in sorted(out.items(), key=lambda kv: -kv[1][0])}


def one_step(kernels: list[Kernel], per_step: int, which: int = -1) -> list[Kernel]:
    """The kernels of one replay out of consecutive replays of `per_step` kernels each (by start order; the kernels
    are sorted by start first, as kernels_from_trace returns them)."""
    return replays(kernels, per_step)[which]


def replays(kernels: list[Kernel], per_step: int, alike: bool = False) -> list[list[Kernel]]:
    """Every replay's kernels, in order, out of consecutive replays of `per_step` kernels each (by start order).
    alike: the kernels are replays of one graph, which launch the same kernels every time; a split whose replays
    differ in their kernel names (replays of different lengths whose total happens to divide, e.g. a graph per
    compressor phase) raises ValueError instead of cutting replays at the wrong places."""
    n = len(kernels) // per_step if per_step > 0 else 0
    if n == 0 or len(kernels) % per_step:
        raise ValueError(f"{len(kernels)} kernels are not whole replays of {per_step}")
    ordered = sorted(kernels, key=lambda k: (k.start, k.end))
    out = [ordered[i * per_step:(i + 1) * per_step] for i in range(n)]
    if alike:
        first = collections.Counter(k.name for k in out[0])
        for i, ks in enumerate(out[1:], 1):
            if collections.Counter(k.name for k in ks) != first:
                raise ValueError(f"replay {i} of {n} (by start order, {per_step} kernels each) launches other "
                                 f"kernels than replay 0: the replays are not alike")
    return out


def mean_parts(paths: list[list[tuple[Kernel, float, float]]],
               label: Callable[[str], str] = lambda n: n) -> dict[str, tuple[float, float, float]]:
    """label -> (mean us charged per replay, its sample standard deviation, mean kernels on the path per replay)
    over several replays' critical paths, largest first. A label missing from a replay's path counts 0 there.
    One replay's path moves by a µs or two per kernel (session 65, 12 layers on an H200: the span's sd over 12
    replays 4-8 µs, the MoE downs' summed charge 2-3 µs), so a difference of about a µs per layer needs several."""
    per = [path_parts(p, label) for p in paths]
    names = {n for parts in per for n in parts}
    out = {}
    for n in names:
        mean, sd = mean_sd([parts.get(n, (0.0, 0))[0] for parts in per])
        out[n] = (mean, sd, sum(parts.get(n, (0.0, 0))[1] for parts in per) / len(per))
    return dict(sorted(out.items(), key=lambda kv: -kv[1][0]))


def mean_sd(xs: list[float]) -> tuple[float, float]:
    """The mean and the sample standard deviation (0 for one value)."""
    m = sum(xs) / len(xs)
    return m, ((sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0)
