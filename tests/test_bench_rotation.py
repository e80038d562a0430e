"""The kernel micro-benchmarks' L2 rotation on CPU (torch.cuda stood in for): every input set is in the timed graph,
and the sets together exceed the L2, so no call finds its inputs in L2 from the previous replay."""
from __future__ import annotations

import contextlib

import pytest
from cuda_standins import fake_cuda
from script_loader import load_script


def _fake_cuda(mp, captured: list):
    """A capture runs its body eagerly with `captured` collecting the sets the calls read; the rest are no-ops and
    an event times 1 ms per replay (the figure is then 1000 / calls us)."""
    @contextlib.contextmanager
    def graph(g, **k):
        captured.append([])
        yield

    fake_cuda(mp, graph=graph)


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
