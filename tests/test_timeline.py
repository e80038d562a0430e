"""The step's critical path (ds4.timeline) on hand-made traces."""
from __future__ import annotations

import pytest

from ds4.timeline import Kernel, critical_path, kernels_from_trace, mean_parts, mean_sd, one_step, path_parts, replays


def _trace():
    # A, then B launched early (PDL) while A finishes, a side kernel S beside B, C after the join of S, then
    # D after an idle gap; E: a short side kernel that ends inside C (not on the path). Streams are
    # deliberately mixed up: a replayed graph's stream ids say nothing.
    return [Kernel("A", 7, 0, 10), Kernel("B", 3, 8, 20), Kernel("S", 9, 12, 28), Kernel("E", 7, 22, 26),
            Kernel("C", 9, 25, 30), Kernel("D", 1, 35, 40)]


def test_critical_path_follows_the_latest_finished_predecessor():
    path = critical_path(_trace())
    assert [(k.name, charge, gap) for k, charge, gap in path] == [
        ("A", 10, 0.0), ("B", 10, 0.0), ("S", 8, 0.0), ("C", 2, 0.0), ("D", 10, 5)]
    assert sum(c for _, c, _ in path) == 40  # the span: the path reaches the first kernel
    assert critical_path([]) == []


def test_strict_predecessors_ended_before_the_kernel_started():
    # without PDL: R (the router) ends before G (gate+up) starts; X (a side kernel) starts earlier and ends
    # after G started: the overlapping rule takes X, the strict one R
    ks = [Kernel("H", 0, 0, 5), Kernel("X", 1, 4, 20), Kernel("R", 0, 6, 10), Kernel("G", 0, 10.3, 30)]
    assert [k.name for k, _, _ in critical_path(ks)] == ["H", "X", "G"]
    strict = critical_path(ks, strict=True)
    assert [k.name for k, _, _ in strict] == ["H", "R", "G"]
    assert [x for _, c, g in strict for x in (c, g)] == pytest.approx([5, 0, 5, 1, 20, 0.3])  # gap: G start - R end


def test_path_parts_sum_charges_per_label():
    ks = [Kernel("gemv<1>", 0, 0, 4), Kernel("hc", 0, 3, 6), Kernel("gemv<2>", 0, 5, 9)]
    parts = path_parts(critical_path(ks), label=lambda n: n.split("<")[0])
    assert parts == {"gemv": (7, 2), "hc": (2, 1)}
    assert list(parts) == ["gemv", "hc"]  # largest first


def test_kernels_from_a_chrome_trace():
    events = [
        {"ph": "X", "cat": "kernel", "name": "k1", "ts": 5.0, "dur": 2.0, "args": {"stream": 7}},
        {"ph": "X", "cat": "Kernel", "name": "k0", "ts": 1.0, "dur": 1.5, "tid": "stream 9"},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0.0, "dur": 9.0},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 3.0},
    ]
    ks = kernels_from_trace({"traceEvents": events})
    assert ks == [Kernel("k0", 9, 1.0, 2.5), Kernel("k1", 7, 5.0, 7.0)]
    assert kernels_from_trace(events) == ks
    assert kernels_from_trace([]) == []


def test_one_step_takes_whole_replays():
    ks = [Kernel(f"k{i}", 7, i, i + 0.5) for i in range(6)]
    assert one_step(ks, 2) == ks[4:]
    assert one_step(ks, 2, 0) == ks[:2]
    with pytest.raises(ValueError, match="whole replays"):
        one_step(ks, 4)
    with pytest.raises(ValueError, match="whole replays"):
        one_step([], 0)  # a trace without kernels


def test_ties_slack_and_a_path_short_of_the_first_kernel():
    # identical timestamps: neither of two kernels starting together precedes the other; the later one joins
    ks = [Kernel("A", 0, 0, 10), Kernel("A2", 1, 0, 10), Kernel("B", 0, 10, 20)]
    path = critical_path(ks)
    assert [k.name for k, _, _ in path][1:] == ["B"] and sum(c for _, c, _ in path) == 20
    # strict: a kernel ending within `slack` after the next one started still precedes it (timestamp jitter)
    ks = [Kernel("A", 0, 0, 10.4), Kernel("B", 0, 10, 20)]
    assert [k.name for k, _, _ in critical_path(ks, strict=True)] == ["A", "B"]
    assert [k.name for k, _, _ in critical_path(ks, strict=True, slack=0.3)] == ["B"]
    # strict: a side kernel S that started first and ended after A started precedes nothing: the path starts at A,
    # its charges 19 of the 20 us span (the overlapping rule reaches S: there the charges are the span)
    ks = [Kernel("S", 1, 0, 1.8), Kernel("A", 0, 1, 10), Kernel("B", 0, 10.2, 20)]
    strict = critical_path(ks, strict=True)
    assert [k.name for k, _, _ in strict] == ["A", "B"] and sum(c for _, c, _ in strict) == 19
    assert [k.name for k, _, _ in critical_path(ks)] == ["S", "A", "B"]


def test_replays_split_every_replay_in_order():
    ks = [Kernel(f"k{i}", 7, i, i + 0.5) for i in range(6)]
    assert replays(ks, 2) == [ks[:2], ks[2:4], ks[4:]]
    with pytest.raises(ValueError, match="whole replays"):
        replays(ks, 4)


def test_mean_parts_over_replays():
    """Per label: the mean charge over the replays' paths, its sample sd, the mean count; a label absent from one
    replay's path counts 0 there (here the side kernel S joins the path in one replay only)."""
    a = [Kernel("A", 1, 0, 10), Kernel("B", 1, 10, 20)]          # A 10, B 10
    b = [Kernel("A", 1, 0, 12), Kernel("B", 1, 12, 20)]          # A 12, B 8
    c = [Kernel("A", 1, 0, 8), Kernel("S", 2, 1, 14), Kernel("B", 1, 14, 22)]  # A 8, S 6, B 8
    got = mean_parts([critical_path(ks) for ks in (a, b, c)])
    assert list(got) == ["A", "B", "S"]  # largest mean first
    assert got["A"][0] == pytest.approx(10.0) and got["A"][1] == pytest.approx(2.0) and got["A"][2] == 1.0
    assert got["B"][0] == pytest.approx(26 / 3) and got["B"][1] == pytest.approx(mean_sd([10.0, 8.0, 8.0])[1])
    assert got["S"][0] == pytest.approx(2.0) and got["S"][2] == pytest.approx(1 / 3)
    assert mean_sd([5.0]) == (5.0, 0.0)
    assert mean_sd([1.0, 3.0]) == (2.0, pytest.approx(2 ** 0.5))
