"""The router fold's plumbing (hc.post_pre_route -> MoE.forward -> moe.route(logits=)) on the CPU: the reference
never folds, the CUDA implementation falls back off the GPU, and logits handed over by an hc implementation
are what the router uses (same outputs as the router computing them itself)."""
from __future__ import annotations

import dataclasses

import torch

from ds4.ops.hc_cuda import FusedCudaHC
from ds4.ops.hc_torch import TorchHC


def _site(n=4, d=64, g=None):
    g = g or torch.Generator().manual_seed(3)
    res = torch.randn(2, n, d, generator=g)
    x = torch.randn(2, d, generator=g)
    post, comb = torch.rand(2, n, generator=g) * 2, torch.rand(2, n, n, generator=g)
    mix = (2 + n) * n
    fn = torch.randn(mix, n * d, generator=g) * 0.05
    base, scale = torch.randn(mix, generator=g) * 0.5, 1 + 0.1 * torch.randn(3, generator=g)
    norm = 1 + 0.1 * torch.randn(d, generator=g)
    gate = torch.randn(16, d, generator=g).to(torch.bfloat16)
    return x, res, post, comb, fn, scale, base, 20, 1e-6, 1e-6, norm, gate


def test_reference_and_cpu_fallback_return_post_pre_and_no_logits(monkeypatch):
    monkeypatch.setenv("DS4_HC_ROUTER", "1")
    args = _site()
    want = TorchHC().post_pre(*args[:-1])
    for impl in (TorchHC(), FusedCudaHC()):
        got = impl.post_pre_route(*args)
        assert len(got) == 5 and got[4] is None
        assert all(torch.equal(a, b) for a, b in zip(got[:4], want))


def test_logits_from_hc_are_what_the_router_uses():
    """A model whose hc hands the router its logits (x . gate^T, as the CUDA fold forms them) decodes exactly
    as the reference, and every MoE call of a decode step routed from the handed logits."""
    from ds4.model.args import tiny
    from ds4.registry import torch_reference_ops
    from ds4.weights.synthetic import random_weights
    from tiny_decode import decode_logits

    handed = []

    class LogitsHC(TorchHC):
        def post_pre_route(self, *args):
            h, x, post, comb, _ = super().post_pre_route(*args)
            return h, x, post, comb, x.float() @ args[-1].float().t()

    ref_ops = torch_reference_ops()

    class RecordingMoE(type(ref_ops.moe)):
        def route(self, x, token_ids, mw, logits=None):
            handed.append(logits is not None)
            return super().route(x, token_ids, mw, logits)

    a = tiny()
    w = random_weights(a, seed=6, include_mtp=False)
    prompt = [(3 * i + 2) % a.vocab_size for i in range(12)]
    ref, _ = decode_logits(a, w, ref_ops, prompt, [4, 9, 1], 64)
    got, _ = decode_logits(a, w, dataclasses.replace(ref_ops, hc=LogitsHC(), moe=RecordingMoE()), prompt, [4, 9, 1],
                           64, handed.clear)
    assert torch.equal(ref, got)
    assert handed == [True] * (3 * a.n_layers)


def test_router_fold_is_on_by_default_and_off_with_zero(monkeypatch):
    """The CUDA hc's router fold is the default (H200, session 25: 115.1 against 117.4-117.7 us per layer);
    DS4_HC_ROUTER=0 turns it off, any other value keeps it."""
    from ds4.ops.hc_cuda import _router_fold_on
    monkeypatch.delenv("DS4_HC_ROUTER", raising=False)
    assert _router_fold_on()
    monkeypatch.setenv("DS4_HC_ROUTER", "0")
    assert not _router_fold_on()
    monkeypatch.setenv("DS4_HC_ROUTER", "1")
    assert _router_fold_on()
