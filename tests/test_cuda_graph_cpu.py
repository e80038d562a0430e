"""CudaGraphStep's capture bookkeeping on CPU: the torch.cuda calls it makes are stood in for (streams and synchronize
no-ops, a 'capture' runs its body eagerly, which the restore must undo as it undoes the warm-up)."""
from __future__ import annotations

import contextlib

import pytest
import torch
from cuda_standins import Graph, fake_cuda

from ds4.model.args import tiny
from ds4.model.transformer import Transformer
from ds4.registry import torch_reference_ops
from ds4.runtime import cuda_graph
from ds4.runtime.cuda_graph import CudaGraphStep, pool_bytes
from ds4.runtime.generate import Generator
from ds4.weights.synthetic import random_weights


class _Replaying(Graph):
    """A stand-in graph that replays: the capture ran the step's body eagerly (as above); replay runs it again into
    the output the capture returned, as a replay rewrites its static output buffers."""
    capturing = None

    def __init__(self):
        super().__init__()
        self.generators = []

    def register_generator_state(self, gen):
        self.generators.append(gen)

    def replay(self):
        self.out.copy_(self.body())


@contextlib.contextmanager
def _capturing(g, **k):
    _Replaying.capturing = g
    try:
        yield
    finally:
        _Replaying.capturing = None


def _replaying_steps(mp):
    """CudaGraphStep on CPU with graphs that replay (the device check waived; the body each capture ran is kept)."""
    _fake_cuda(mp, graph=_Replaying, capture=_capturing)
    mp.setattr(cuda_graph, "_check_device", lambda model: None)
    body = CudaGraphStep._step

    def recording(self, phase):
        out, g = body(self, phase), _Replaying.capturing
        if g is not None:
            g.body, g.out = (lambda: body(self, phase)), out
        return out
    mp.setattr(CudaGraphStep, "_step", recording)


def _fake_cuda(mp, segments=(), graph=Graph, capture=lambda g, **k: contextlib.nullcontext()):
    fake_cuda(mp, CUDAGraph=graph, graph=capture, memory_snapshot=lambda *a, **k: list(segments))


def _capture(model, state, batch):
    step = object.__new__(CudaGraphStep)  # (__init__ refuses a CPU model; _capture is what is tested)
    step.model, step.state, step.batch, step.mode = model, state, batch, "logits"
    step.sampling = step.gen = None
    step.tok = torch.zeros(batch, dtype=torch.long)
    step.full = model.compress_ratios
    step.phases = [step.full]
    step._capture(2)
    return step


def test_capture_warms_up_inside_the_caches_and_restores_the_state(monkeypatch):
    """A Generator whose row 0 stands at max_seq_len - 1 (a generate run to the limit) captures a step of another
    batch or mode (teacher_forced_logits' (1, 'logits'), a generate at batch 2): the warm-up steps must not run at
    max_seq_len and past (the torch compressor step writes cache[pos // m], out of bounds there), and every state
    tensor and position is as it was afterwards."""
    _fake_cuda(monkeypatch)
    a = tiny()  # ratios 4 and 16; 64 positions: 16 and 4 compressed entries
    m = Transformer(a, torch_reference_ops(), "plain", torch.float32)
    m.load_weights(random_weights(a, seed=0, include_mtp=False))
    g = Generator(m, 2, 64)
    assert g.generate([[1, 2, 3]], 100, stop_at_eos=False).truncated
    assert g.host_pos[0] == g.state.pos[0].item() == 63
    before = [{k: v.clone() for k, v in st.items()} for st in g.state.layers]
    seen, decode = [], m.decode
    monkeypatch.setattr(m, "decode", lambda ids, st, *x, **k: (seen.append(st.pos[: ids.shape[0]].tolist()),
                                                                decode(ids, st, *x, **k))[1])
    _capture(m, g.state, 1)
    assert max(p for ps in seen for p in ps) < 64, seen
    assert all(torch.equal(v, before[i][k]) for i, st in enumerate(g.state.layers) for k, v in st.items())
    g.check_positions()


def test_pool_bytes_are_the_graphs_pool_segments(monkeypatch):
    segs = [{"device": 0, "segment_pool_id": (0, 7), "total_size": 2 << 20},
            {"device": 0, "segment_pool_id": (0, 7), "total_size": 20 << 20},
            {"device": 0, "segment_pool_id": (0, 0), "total_size": 1 << 30},   # the default pool
            {"device": 1, "segment_pool_id": (0, 7), "total_size": 4 << 20},   # another device
            {"device": 0, "segment_pool_id": (0, 8), "total_size": 8 << 20}]   # another graph's
    _fake_cuda(monkeypatch, segs)
    g = Graph()
    g.id = (0, 7)
    assert pool_bytes(g, torch.device("cuda", 0)) == 22 << 20
    assert pool_bytes(g, torch.device("cuda")) == 22 << 20


def test_eval_captures_before_its_clock_and_reports_the_graph_figures(monkeypatch):
    """task=eval under runtime=cuda_graph: the (1, 'logits') step is captured before eval_tok_s's clock starts (it was
    captured inside teacher_forced_logits, so the warm-up and capture counted as eval time), and its warm-up,
    capture and pool are reported as the other tasks report them."""
    from types import SimpleNamespace

    from ds4.tasks import eval as ev
    order = []
    step = SimpleNamespace(warmup_s=2.0, capture_s=0.5, pool_bytes=1 << 20, graphs={frozenset(): 0})

    class Gen:
        graphs = {}

        def graph_step(self, batch, mode):
            order.append(("capture", batch, mode))
            self.graphs[(batch, mode)] = step
            return step

        def teacher_forced_logits(self, prompt, cont):
            order.append(("tf",))
            return torch.zeros(len(cont), 8)

    clock = iter(range(100))
    monkeypatch.setattr(ev.time, "perf_counter", lambda: float(next(clock)))
    gen = Gen()
    spec = SimpleNamespace(runtime="cuda_graph", device=torch.device("cpu"), task_opts={"fidelity": False})
    ctx = SimpleNamespace(spec=spec, gen=lambda: gen, profiler=SimpleNamespace(enabled=False, summary=lambda: []))
    f = ev.run(ctx, ev.Plan(ids=[1, 2, 3, 4], source="x"))["figures"]
    assert order == [("capture", 1, "logits"), ("tf",)]
    assert f["graph_warmup_s"] == 2.0 and f["graph_capture_s"] == 0.5 and f["graph_pool_mib"] == 1.0


def test_a_step_at_max_seq_len_is_refused():
    """Generator.decode / replay (teacher_forced_logits' steps) refuse a row at max_seq_len before the step: past it the
    compressed caches are indexed out of bounds (an IndexError in torch on CPU once pos // m passes the last entry,
    silently up to then; unchecked in a captured step's kernels)."""
    import pytest
    a = tiny()
    m = Transformer(a, torch_reference_ops(), "plain", torch.float32)
    m.load_weights(random_weights(a, seed=0, include_mtp=False))
    g = Generator(m, 1, 30)  # 8 entries of ratio 4: positions 30 and 31 would still fit, 32 not
    with pytest.raises(ValueError, match="max_seq_len=30"):
        g.teacher_forced_logits(list(range(1, 11)), list(range(5, 30)))
    assert g.host_pos[0] == g.state.pos[0].item() == 30


def test_sampling_inside_the_graph_draws_the_eager_tokens(monkeypatch):
    """runtime=cuda_graph with temperature > 0 captures the sampler ('sample' mode): the first token is drawn eagerly
    and the rest by replays, from one generator (the step's, registered with every graph of it) seeded after the
    capture, whose warm-up draws are undone; so the tokens are eager decoding's with the same seed. A second call
    draws them again; other settings recapture the step (the seed does not)."""
    from ds4.runtime.sampling import Sampling
    _replaying_steps(monkeypatch)
    a = tiny()
    m = Transformer(a, torch_reference_ops(), "plain", torch.float32)
    m.load_weights(random_weights(a, seed=0, include_mtp=False))
    prompts = [[1, 2, 3, 4, 5], [7, 8]]

    def run(s, n, g=None):
        g = g or Generator(m, 2, 64)
        return g.generate(prompts, n, s, stop_at_eos=False).tokens

    s = Sampling(temperature=0.9, top_k=20, top_p=0.9, seed=5)
    g = Generator(m, 2, 64)
    g.runtime = "cuda_graph"  # (refused on a CPU model at construction)
    eager = run(s, 30)
    assert run(s, 30, g) == eager
    step = g.graphs[(2, "sample")]
    assert list(g.graphs) == [(2, "sample")] and step.graphs
    assert all(gr.generators == [step.gen] for gr in step.graphs.values())
    assert run(s, 30, g) == eager and g.graphs[(2, "sample")] is step
    assert run(Sampling(temperature=0.9, top_k=20, top_p=0.9, seed=6), 30, g) != eager  # the seed is not baked in
    assert g.graphs[(2, "sample")] is step
    hot = Sampling(temperature=1.3, seed=5)
    assert run(hot, 12, g) == run(hot, 12)
    new = g.graphs[(2, "sample")]
    assert new is not step and new.sampling == Sampling(temperature=1.3)
    g.check_positions()
    # the figures count the replaced capture's time and graphs too, the pool only the graph still held
    from ds4.tasks.common import graph_figures
    f = graph_figures(g)
    assert f["graph_capture_s"] == pytest.approx(step.capture_s + new.capture_s) and step.capture_s > 0
    assert f["graph_warmup_s"] == pytest.approx(step.warmup_s + new.warmup_s)
    assert f["graphs"] == len(step.graphs) + len(new.graphs) == 2 and f["graph_pool_mib"] == new.pool_bytes / 2**20


def test_graph_modes_are_checked():
    import pytest

    from ds4.runtime.sampling import Sampling
    a = tiny()
    m = Transformer(a, torch_reference_ops(), "plain", torch.float32)
    st = m.alloc_state(1, 16)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        CudaGraphStep(m, st, 1, "sample", sampling=Sampling(temperature=1.0))
    cuda_graph_check = cuda_graph._check_device
    try:
        cuda_graph._check_device = lambda model: None
        with pytest.raises(ValueError, match="graph mode must be one of"):
            CudaGraphStep(m, st, 1, "topk")
        for mode, s in (("sample", None), ("sample", Sampling()), ("argmax", Sampling(temperature=1.0))):
            with pytest.raises(ValueError, match="go together"):
                CudaGraphStep(m, st, 1, mode, sampling=s)
    finally:
        cuda_graph._check_device = cuda_graph_check
