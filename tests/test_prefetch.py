"""ds4.ops.prefetch outside a CUDA-graph capture (never forks, never loads the extension), its site switch,
and the decode step asking for every site once per layer (joined once at the end of the step)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ds4.ops import prefetch
from ds4.ops.base import QWeight
from ds4.ops.linear_cuda import GemvCudaLinear
from ds4.ops.linear_torch import DequantLinear


@pytest.mark.parametrize("value,expected", [
    (None, set()), ("1", set(prefetch.DEFAULT_SITES)), ("0", set()),
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
def test_outside_a_capture_no_site_issues_anything(monkeypatch, linear):
    monkeypatch.setenv(prefetch.ENV, "all")
    w = QWeight("bf16", torch.zeros(8, 4))
    x = torch.zeros(1, 4)
    for site in prefetch.SITES:
        assert linear.prefetch(site, [w], x) is False
    assert prefetch.issue("d", [torch.zeros(2, 8)], x, torch.zeros(1, 2, dtype=torch.long)) is False
    assert prefetch.join_pending() == 0


def test_decode_issues_every_site_once_per_layer():
    """A recording linear: each decode step asks every layer for q (its query up-projection), o (wo_a) and b
    (wo_b) once, in that order, and the logits are those of the plain reference."""
    from ds4.model.args import tiny
    from ds4.registry import torch_reference_ops
    from ds4.weights.synthetic import random_weights
    from tiny_decode import decode_logits

    log = []

    class RecordingLinear(DequantLinear):
        def prefetch(self, site, ws, x):
            log.append((site, tuple(id(w) for w in ws)))
            return False

    a = tiny().replace(index_topk=16)
    w = random_weights(a, seed=5, include_mtp=False)
    ref_ops = torch_reference_ops()
    prompt = [(5 * i + 1) % a.vocab_size for i in range(20)]
    ref, _ = decode_logits(a, w, ref_ops, prompt, [3, 8, 1], 256)
    got, m = decode_logits(a, w, dataclasses.replace(ref_ops, linear=RecordingLinear()), prompt, [3, 8, 1], 256,
                           log.clear)
    assert torch.equal(ref, got)
    want = []
    for blk in m.layers:
        at = blk.attn
        want += [("q", (id(at.wq_bi if at.wq_bi is not None else at.wq_b),)), ("o", (id(at.wo_a),)),
                 ("b", (id(at.wo_b),))]
    assert log == want * 3
