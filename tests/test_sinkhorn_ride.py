"""The Sinkhorn ride's plumbing on the CPU (Block.forward -> attn.decode(ride=) / MoE.forward -> moe.route(ride=)):
where the hc implementation defers a finish's Sinkhorn, the ride reaches a launch of the same site before comb is
read, and decode steps come out exactly as without it; prefill never defers."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ds4.ops.hc_torch import TorchHC


def _deferring_ops(rides: list[str]):
    """Reference ops whose hc defers every decode finish's Sinkhorn: comb comes back NaN (any read before the ride
    poisons the logits) and the attention / MoE put the finished comb back in place when they take the ride."""
    from ds4.registry import torch_reference_ops

    ref = torch_reference_ops()
    finished: dict[int, torch.Tensor] = {}  # comb's storage -> its Sinkhorn, kept aside until a ride runs

    def deferred(comb: torch.Tensor, defer: bool) -> torch.Tensor:
        if not defer:
            return comb
        finished[comb.data_ptr()] = comb.clone()
        return comb.fill_(float("nan"))

    def finish(ride, who: str) -> None:
        rides.append(who)
        ride.comb.copy_(finished.pop(ride.comb.data_ptr()))

    class DeferringHC(TorchHC):
        def defers_sinkhorn(self, h, site):
            return True

        def pre(self, *args, defer_sinkhorn=False):
            x, post, comb = super().pre(*args)
            return x, post, deferred(comb, defer_sinkhorn)

        def post_pre(self, *args, defer_sinkhorn=False):
            h, x, post, comb = super().post_pre(*args)
            return h, x, post, deferred(comb, defer_sinkhorn)

        def post_pre_route(self, *args, defer_sinkhorn=False):
            h, x, post, comb, logits = super().post_pre_route(*args)
            return h, x, post, deferred(comb, defer_sinkhorn), logits

    class RidingAttn(type(ref.attn)):
        rides_sinkhorn = True

        def decode(self, *args, ride=None):
            if ride is not None:
                finish(ride, "attn")
            return super().decode(*args)

    class RidingMoE(type(ref.moe)):
        rides_sinkhorn = True

        def route(self, x, token_ids, mw, logits=None, ride=None):
            if ride is not None:
                finish(ride, "moe")
            return super().route(x, token_ids, mw, logits)

    return ref, dataclasses.replace(ref, hc=DeferringHC(), attn=RidingAttn(), moe=RidingMoE())


def test_every_decode_site_rides_and_decodes_as_the_reference():
    from ds4.model.args import tiny
    from ds4.weights.synthetic import random_weights
    from tiny_decode import decode_logits

    rides: list[str] = []
    ref_ops, ops = _deferring_ops(rides)
    a = tiny()
    w = random_weights(a, seed=8, include_mtp=False)
    prompt = [(5 * i + 1) % a.vocab_size for i in range(10)]
    steps = [3, 11, 7]
    ref, _ = decode_logits(a, w, ref_ops, prompt, steps, 64)
    got, _ = decode_logits(a, w, ops, prompt, steps, 64, rides.clear)  # prefill deferred nothing: cleared, unread
    assert torch.equal(ref, got)
    assert rides == ["attn", "moe"] * (len(steps) * a.n_layers)


def test_prefill_never_defers():
    from ds4.model.args import tiny
    from ds4.model.transformer import Transformer
    from ds4.runtime.generate import Generator
    from ds4.weights.synthetic import random_weights

    rides: list[str] = []
    _, ops = _deferring_ops(rides)
    a = tiny()
    m = Transformer(a, ops, "plain", torch.float32)
    m.load_weights(random_weights(a, seed=8, include_mtp=False))
    logits = Generator(m, 1, 16).prefill([[1, 2, 3, 4]])
    assert rides == [] and torch.isfinite(logits).all()


def test_fused_cuda_hc_defers_only_cuda_streams_and_as_the_switch_says(monkeypatch):
    """FusedCudaHC.defers_sinkhorn: never off the GPU; DS4_SINKHORN_RIDE=0 off, =attn the attention sites only. An
    explicit defer_sinkhorn it cannot honour fails instead of returning a finished comb."""
    from ds4.ops import hc_cuda

    impl = hc_cuda.FusedCudaHC()
    h = torch.randn(1, 4, 64)
    assert not impl.defers_sinkhorn(h, "attn")
    monkeypatch.setattr(hc_cuda, "_ok", lambda t: True)  # as if h were CUDA streams
    for mode, want in ((None, (True, True)), ("1", (True, True)), ("attn", (True, False)), ("0", (False, False))):
        if mode is None:
            monkeypatch.delenv(hc_cuda.RIDE_ENV, raising=False)
        else:
            monkeypatch.setenv(hc_cuda.RIDE_ENV, mode)
        assert (impl.defers_sinkhorn(h, "attn"), impl.defers_sinkhorn(h, "ffn")) == want, mode
    assert not impl.defers_sinkhorn(torch.randn(1, 3, 64), "attn")  # the ride's kernels take 1, 2 or 4 streams
    monkeypatch.undo()
    with pytest.raises(ValueError, match="defer_sinkhorn"):
        impl.pre(h, torch.randn(24, 256), torch.ones(3), torch.zeros(24), 20, 1e-6, 1e-6, defer_sinkhorn=True)
