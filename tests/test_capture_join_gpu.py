"""GPU tests of the programmatic join and fork (csrc/capture.cu). The join (ds4.kernels.join_programmatic; opt-in
DS4_PJOIN, the fork's test at the end: DS4_PFORK): inside a
CUDA-graph capture a side-stream branch ending in a ds4 kernel joins the main stream by programmatic edges, and the
next ds4 kernel on the main stream, which may then launch before the branch drains, still reads the branch's output
as written (it waits before reading): the replay equals the eager products bit for bit, with the branch's output
poisoned before the replay. Outside a capture the op declines (False) and changes nothing (marker gpu; skipped
without CUDA)."""
from __future__ import annotations

import pytest
import torch
from gpu_common import gen, require_extension

pytestmark = pytest.mark.gpu
kernels = require_extension("ds4.kernels")  # skips this module without CUDA

from test_kernels_gpu import rand_fp8_weight, rand_x  # noqa: E402


def test_programmatic_join_in_a_captured_graph(monkeypatch):
    monkeypatch.setenv("DS4_PDL", "1")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    g = gen(27)
    w, s = rand_fp8_weight(4096, 4096, g)  # 16 MB: the branch's kernel runs for microseconds
    w2, s2 = rand_fp8_weight(4096, 4096, g)
    x = rand_x(1, 4096, g)
    side = torch.cuda.Stream()
    assert not kernels.join_programmatic(side, torch.cuda.current_stream())  # not capturing: declines
    y1r = kernels.gemv(x, w, s, "fp8")
    y2r = kernels.gemv(y1r, w2, s2, "fp8")
    main = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    main.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(main):
        for _ in range(2):  # warm-up (the kernels' attributes) on the capture's streams
            side.wait_stream(main)
            with torch.cuda.stream(side):
                kernels.gemv(x, w, s, "fp8")
            main.wait_stream(side)
            kernels.gemv(y1r, w2, s2, "fp8")
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=main):
        side.wait_stream(main)
        with torch.cuda.stream(side):  # the branch: one ds4 kernel
            y1 = kernels.gemv(x, w, s, "fp8")
        joined = kernels.join_programmatic(side, main)
        y2 = kernels.gemv(y1, w2, s2, "fp8")  # the next ds4 kernel on the main stream reads the branch's output
    assert joined
    assert _replay_matches(graph, (y1, y2), (y1r, y2r))


def _replay_matches(graph, outs, refs) -> bool:
    """Poisons the graph's outputs (NaN), replays it, and compares them with the eager products bit for bit."""
    for out in outs:
        out.fill_(float("nan"))
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    return all(torch.equal(out, ref) for out, ref in zip(outs, refs, strict=True))


def test_programmatic_fork_in_a_captured_graph(monkeypatch):
    """The fork (ds4.kernels.fork_programmatic; DS4_PFORK, on by default): a branch forked from the main stream
    depends on main's last kernel by a programmatic edge, so its first kernel — the shared expert's tensor-core
    gate+up, which loads weight rounds before its PDL wait — may launch while that kernel runs; it still reads that
    kernel's output as written: the replay equals the eager products bit for bit, with both outputs poisoned before
    the replay."""
    monkeypatch.setenv("DS4_PDL", "1")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    g = gen(28)
    w, s = rand_fp8_weight(4096, 4096, g)
    w1, s1 = rand_fp8_weight(2048, 4096, g)  # V4's shared expert: gate / up rows of dim 4096
    w3, s3 = rand_fp8_weight(2048, 4096, g)
    x = rand_x(1, 4096, g)
    side = torch.cuda.Stream()
    assert not kernels.fork_programmatic(torch.cuda.current_stream(), side)  # not capturing: declines

    def gate_up(y):
        return kernels.moe_gate_up(y, None, None, w1, s1, w3, s3, "fp8", 0, 1, 10.0, kernel="mma")

    yr = kernels.gemv(x, w, s, "fp8")
    hr = gate_up(yr)
    main = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    main.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(main):
        for _ in range(2):  # warm-up (the kernels' attributes) on the capture's streams
            yw = kernels.gemv(x, w, s, "fp8")
            side.wait_stream(main)
            with torch.cuda.stream(side):
                gate_up(yw)
            main.wait_stream(side)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=main):
        y = kernels.gemv(x, w, s, "fp8")  # the main stream's last kernel: the branch reads its output
        side.wait_stream(main)
        forked = kernels.fork_programmatic(main, side)
        with torch.cuda.stream(side):  # the branch: the gate+up, which waits before it reads y
            h = gate_up(y)
        main.wait_stream(side)
    assert forked
    assert _replay_matches(graph, (y, h), (yr, hr))
