"""Stage profiler: named regions timed with CUDA events (or the host clock on CPU).

Disabled (the default) it costs one attribute check per region: `region()` returns a shared
no-op context. Enabled on CUDA it records an event pair per region and reads them only in
`summary()`, so profiling adds no host synchronisation inside a step (the events themselves
do add a little GPU time, which is why headline TPOT is measured with profiling off).
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

_NULL = contextlib.nullcontext()

# Names used by the model; listed so reports keep a stable order.
STAGES = ("embed", "hc.pre", "attn.q", "attn.kv", "attn.compress", "attn.indexer", "attn.sparse", "attn.out",
          "moe.shared_up", "moe.gate", "moe.routed", "moe.shared", "moe.ffn", "hc.post", "head", "comm.attn", "comm.moe",
          "comm.head")


class Profiler:
    def __init__(self, enabled: bool = False, device: torch.device | str = "cpu"):
        self.enabled = enabled
        self.cuda = torch.device(device).type == "cuda"
        self._events: dict[str, list] = defaultdict(list)
        self._host: dict[str, list[float]] = defaultdict(list)
        self._phase = ""

    def region(self, name: str | None):
        """A timed region; none for name None (a communication site at one rank: dist.SingleProcess.stage)."""
        if not self.enabled or name is None:
            return _NULL
        name = self._phase + name
        return self._cuda_region(name) if self.cuda else self._host_region(name)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Regions opened inside are recorded as `name:region` (Transformer.prefill: a prompt's calls apart from
        the decode steps', whose regions keep their plain names)."""
        outer, self._phase = self._phase, f"{name}:"
        try:
            yield
        finally:
            self._phase = outer

    __call__ = region

    @contextlib.contextmanager
    def _cuda_region(self, name: str):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            self._events[name].append((start, end))

    @contextlib.contextmanager
    def _host_region(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._host[name].append(time.perf_counter() - t0)

    def reset(self) -> None:
        self._events.clear()
        self._host.clear()

    def summary(self) -> list[dict]:
        """Rows {stage, calls, total_ms, mean_us}: the decode rows (plain names), then each phase's (`prefill:...`),
        each in STAGES order then alphabetical."""
        if self.cuda and self._events:
            torch.cuda.synchronize()
        times: dict[str, list[float]] = {}
        for name, pairs in self._events.items():
            times[name] = [s.elapsed_time(e) / 1e3 for s, e in pairs]
        for name, ts in self._host.items():
            times[name] = list(ts)
        def key(n: str):
            ph, _, s = n.rpartition(":")
            return ph, STAGES.index(s) if s in STAGES else len(STAGES), s
        order = sorted(times, key=key)
        return [{"stage": n, "calls": len(times[n]), "total_ms": 1e3 * sum(times[n]),
                 "mean_us": 1e6 * sum(times[n]) / max(1, len(times[n]))} for n in order]

    def format(self) -> str:
        rows = self.summary()
        if not rows:
            return "(profiling off: run with profile=true)"
        lines = [f"{'stage':<24}{'calls':>8}{'total ms':>12}{'mean us':>12}"]
        for r in rows:
            lines.append(f"{r['stage']:<24}{r['calls']:>8}{r['total_ms']:>12.3f}{r['mean_us']:>12.1f}")
        return "\n".join(lines)


NULL_PROFILER = Profiler(False)
