"""ds4.ops.prefetch outside a CUDA-graph capture (never forks, never loads the extension), its site switch,
and the decode step's prefetch discipline (every site issued once per layer and joined in the same step)."""
from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from ds4.ops import prefetch
from ds4.ops.base import QWeight
from ds4.ops.linear_cuda import GemvCudaLinear
from ds4.ops.linear_torch import DequantLinear
from ds4.ops.side_stream import Branch


@pytest.mark.parametrize("value,expected", [
    (None, set(prefetch.DEFAULT_SITES)), ("1", set(prefetch.DEFAULT_SITES)), ("0", set()),
    ("all", set(prefetch.SITES)), ("q,d", {"q", "d"}), (" o , b ", {"o", "b"}),
])
def test_sites_follow_the_environment(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(prefetch.ENV, raising=False)
    else:
        monkeypatch.setenv(prefetch.ENV, value)
    assert prefetch.sites() == expected


def test_unknown_sites_fail_clearly(monkeypatch):
    monkeypatch.setenv(prefetch.ENV, "q,wo")
    with pytest.raises(ValueError, match="unknown site"):
        prefetch.sites()
    monkeypatch.delenv(prefetch.ENV)
    with pytest.raises(ValueError, match="unknown prefetch site"):
        prefetch.issue("x", [torch.zeros(4)], torch.zeros(1, 4))


@pytest.mark.parametrize("linear", [DequantLinear(), GemvCudaLinear()])
def test_outside_a_capture_every_site_is_in_line(monkeypatch, linear):
    monkeypatch.setenv(prefetch.ENV, "all")
    w = QWeight("bf16", torch.zeros(8, 4))
    x = torch.zeros(1, 4)
    for site in prefetch.SITES:
        b = linear.prefetch(site, [w], x)
        assert isinstance(b, Branch) and b.side is None
        b.join()  # a no-op
    assert prefetch.issue("d", [torch.zeros(2, 8)], x, torch.zeros(1, 2, dtype=torch.long)).side is None


def _bench_decode():
    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_decode.py"
    spec = importlib.util.spec_from_file_location("bench_decode_for_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("tokens,expected", [
    ({"kernels", "graph"}, "1"), ({"kernels", "nopf"}, "0"), ({"pfqd"}, "d,q"), ({"pfo", "pfb"}, "b,o"),
    ({"pfx"}, "1"),  # not a site: not a prefetch token
])
def test_bench_tokens_choose_the_sites(tokens, expected):
    assert _bench_decode()._prefetch_sites(tokens) == expected


class _RecordingBranch(Branch):
    def __init__(self, log, site):
        super().__init__(None, torch.device("cpu"))
        self.log, self.site, self.joined = log, site, False

    def join(self):
        self.joined = True
        self.log.append(("join", self.site))


def test_decode_issues_every_site_once_per_layer_and_joins_it():
    """A recording linear: in each decode step every layer prefetches q (its query up-projection), o (wo_a) and
    b (wo_b) once, joined before the step ends, and the logits are those of the plain reference."""
    from ds4.model.args import tiny
    from ds4.model.transformer import Transformer
    from ds4.registry import torch_reference_ops
    from ds4.runtime.generate import Generator
    from ds4.weights.synthetic import random_weights

    log, made = [], []

    class RecordingLinear(DequantLinear):
        def prefetch(self, site, ws, x):
            log.append(("issue", site, tuple(id(w) for w in ws)))
            b = _RecordingBranch(log, site)
            made.append(b)
            return b

    a = tiny().replace(index_topk=16)
    w = random_weights(a, seed=5, include_mtp=False)
    ref_ops = torch_reference_ops()
    logits = []
    for recording, ops in ((False, ref_ops), (True, dataclasses.replace(ref_ops, linear=RecordingLinear()))):
        m = Transformer(a, ops, "plain", torch.float32)
        m.load_weights(w)
        g = Generator(m, 1, 256)
        g.prefill([[(5 * i + 1) % a.vocab_size for i in range(20)]])
        log.clear()
        made.clear()
        steps = []
        for t in (3, 8, 1):
            steps.append(g.decode(torch.tensor([t]))[0])
            assert not recording or (made and all(b.joined for b in made)), [(b.site, b.joined) for b in made]
            made.clear()
        logits.append(torch.stack(steps))
    assert torch.equal(logits[0], logits[1])
    attns = [blk.attn for blk in m.layers]
    want = {"q": [(id(at.wq_bi if at.wq_bi is not None else at.wq_b),) for at in attns],
            "o": [(id(at.wo_a),) for at in attns], "b": [(id(at.wo_b),) for at in attns]}
    issued = [e for e in log if e[0] == "issue"]
    for site, per_layer in want.items():
        assert [e[2] for e in issued if e[1] == site] == per_layer * 3, site
