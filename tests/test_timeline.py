"""The step-timeline attribution (ds4.timeline) on hand-made traces."""
from __future__ import annotations

import pytest

from ds4.timeline import IDLE, Kernel, attribute, chain, kernels_from_trace, main_stream, one_step


def _trace():
    # main stream 7: A, then B launched early (PDL) while A finishes, then C after a wait on the side
    # branch, then D after an idle gap; side stream 9: S
    return [Kernel("A", 7, 0, 10), Kernel("B", 7, 8, 20), Kernel("S", 9, 12, 28), Kernel("C", 7, 25, 30),
            Kernel("D", 7, 35, 40)]


def test_attribute_splits_the_span_by_who_holds_each_instant():
    got = attribute(_trace())
    assert got == {"A": 10, "B": 10, "side: S": 5, "C": 5, IDLE: 5, "D": 5}
    assert sum(got.values()) == 40  # the span, first start to last end
    assert main_stream(_trace()) == 7


def test_attribute_with_a_given_main_stream_and_labels():
    got = attribute(_trace(), main=9, label=str.lower)
    # stream 9 is the chain now: S holds [12, 28); the rest goes to the other stream's kernels
    assert got == {"side: a": 10, "side: b": 2, "s": 16, "side: c": 2, IDLE: 5, "side: d": 5}


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
    with pytest.raises(ValueError, match="no kernels"):
        main_stream(kernels_from_trace([]))


def test_one_step_takes_whole_replays():
    ks = [Kernel(f"k{i}", 7, i, i + 0.5) for i in range(6)]
    assert one_step(ks, 2) == ks[4:]
    assert one_step(ks, 2, 0) == ks[:2]
    with pytest.raises(ValueError, match="whole replays"):
        one_step(ks, 4)
    with pytest.raises(ValueError, match="whole replays"):
        one_step([], 0)  # a trace without kernels


def test_chain_lists_the_main_stream_with_its_gaps():
    assert chain(_trace()) == [("A", 0, 10, 0.0), ("B", 8, 12, -2), ("C", 25, 5, 5), ("D", 35, 5, 5)]
    assert chain(_trace(), main=9) == [("S", 12, 16, 0.0)]
    assert chain([]) == []
