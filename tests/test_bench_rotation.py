"""The kernel micro-benchmarks' L2 rotation on CPU (torch.cuda stood in for): every input set is in the timed graph,
and the sets together exceed the L2, so no call finds its inputs in L2 from the previous replay."""
from __future__ import annotations

import contextlib

import pytest
import torch
from script_loader import load_script


class _Event:
    def __init__(self, enable_timing=False):
        pass

    def record(self):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 1.0  # ms per replay: the figure is then 1000 / calls us


class _Stream:
    def wait_stream(self, s):
        pass


class _Graph:
    def replay(self):
        pass


def _fake_cuda(mp, captured: list):
    """A capture runs its body eagerly with `captured` collecting the sets the calls read; the rest are no-ops."""
    @contextlib.contextmanager
    def graph(g, **k):
        captured.append([])
        yield

    for name, value in {"Stream": lambda *a, **k: _Stream(), "stream": lambda s: contextlib.nullcontext(),
                        "current_stream": lambda *a: _Stream(), "synchronize": lambda *a: None,
                        "CUDAGraph": _Graph, "graph": graph, "Event": _Event}.items():
        mp.setattr(torch.cuda, name, value, raising=False)


def test_bench_attn_graph_holds_every_set(monkeypatch):
    bench = load_script("bench_attn")
    captured: list = []
    _fake_cuda(monkeypatch, captured)
    sets = [(i,) for i in range(64)]  # more sets than the default 20 calls per graph
    us, mode = bench.time_graph(lambda i: captured[-1].append(i) if captured else None, sets)
    assert mode == "graph"
    assert sorted(set(captured[0])) == list(range(64))  # the old graph held sets 0..19 only
    assert us == pytest.approx(1e3 / len(captured[0]))


@pytest.mark.parametrize("nbytes", [69_632, 73_808, 303_104, 549_120, 787_328, 1_613_904, 4_276_480, 68_174_080])
def test_bench_attn_sets_exceed_l2(nbytes):
    """Row sizes of bench_attn (top-k 64K, hc.post, hc.head, indexer 8K, CSA attention, hc.pre, indexer 64K / 1M):
    the rotation reads more than L2_ROTATE_BYTES (the old caps of 16 / 64 sets kept the small rows inside the L2)."""
    bench = load_script("bench_attn")
    assert bench.n_sets(nbytes) * nbytes > bench.L2_ROTATE_BYTES >= 3 * (50 << 20)


def test_bench_kernels_graph_holds_every_set(monkeypatch):
    bench = load_script("bench_kernels")
    captured: list = []
    _fake_cuda(monkeypatch, captured)
    fns = [(lambda i=i: captured[-1].append(i) if captured else None) for i in range(64)]
    us, eager = bench.time_fn(fns, calls=30, reps=5)  # --calls 30, as session 18 ran it
    assert sorted(set(captured[0])) == list(range(64))
    assert us == pytest.approx(1e3 / 64) and eager == pytest.approx(1e3 / 64)
