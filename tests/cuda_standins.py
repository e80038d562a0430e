"""torch.cuda stood in for on CPU, for tests of code that drives streams, graphs and events: streams and synchronize
do nothing, a graph's capture runs its body eagerly and its replay does nothing, an event times 1 ms."""
from __future__ import annotations

import contextlib

import torch


class Stream:
    def wait_stream(self, s):
        pass


class Graph:
    made = 0

    def __init__(self):
        Graph.made += 1
        self.id = (0, Graph.made)

    def pool(self):
        return self.id

    def replay(self):
        pass


class Event:
    def __init__(self, enable_timing=False):
        pass

    def record(self):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 1.0  # ms


def fake_cuda(mp, **override) -> None:
    """torch.cuda's stream / graph / event / memory calls replaced through the monkeypatch `mp`; `override` replaces
    some of the stand-ins (e.g. graph=a capture context, memory_snapshot=...)."""
    fakes = {"Stream": lambda *a, **k: Stream(), "stream": lambda s: contextlib.nullcontext(),
             "current_stream": lambda *a: Stream(), "synchronize": lambda *a: None, "CUDAGraph": Graph,
             "graph": lambda g, **k: contextlib.nullcontext(), "Event": Event,
             "memory_snapshot": lambda *a, **k: [], "current_device": lambda: 0}
    for name, value in {**fakes, **override}.items():
        mp.setattr(torch.cuda, name, value, raising=False)
