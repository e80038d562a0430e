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
    """FusedCudaHC.defers_sinkhorn: never off the GPU; DS4_SINKHORN_RIDE=0 off, =attn the attention sites only, =topk
    both (the FFN site's in the router's launch: moe=fp4_topk's choice). An
    explicit defer_sinkhorn it cannot honour fails instead of returning a finished comb."""
    from ds4.ops import hc_cuda

    impl = hc_cuda.FusedCudaHC()
    h = torch.randn(1, 4, 64)
    assert not impl.defers_sinkhorn(h, "attn")
    monkeypatch.setattr(hc_cuda, "_ok", lambda t: True)  # as if h were CUDA streams
    for mode, want in ((None, (True, True)), ("1", (True, True)), ("topk", (True, True)), ("attn", (True, False)),
                       ("0", (False, False))):
        if mode is None:
            monkeypatch.delenv(hc_cuda.RIDE_ENV, raising=False)
        else:
            monkeypatch.setenv(hc_cuda.RIDE_ENV, mode)
        assert (impl.defers_sinkhorn(h, "attn"), impl.defers_sinkhorn(h, "ffn")) == want, mode
    assert not impl.defers_sinkhorn(torch.randn(1, 3, 64), "attn")  # the ride's kernels take 1, 2 or 4 streams
    monkeypatch.undo()
    with pytest.raises(ValueError, match="defer_sinkhorn"):
        impl.pre(h, torch.randn(24, 256), torch.ones(3), torch.zeros(24), 20, 1e-6, 1e-6, defer_sinkhorn=True)


def _fp4_topk_calls(monkeypatch, impl_cls=None):
    """A moe=fp4_topk implementation on the CPU whose kernels are fakes recording which launch got the ride, its
    weights (shapes only) and a ride whose own launch is recorded too."""
    from ds4 import kernels
    from ds4.ops import moe_cuda
    from ds4.ops.base import MoEWeights, QWeight, SinkhornRide

    calls: list[tuple[str, object]] = []

    def router(x, gate, bias, tid, tok, topk, route_scale, logits=None, ride=None):
        calls.append(("router", ride))
        return torch.ones(x.shape[0], topk), torch.zeros(x.shape[0], topk, dtype=torch.int64)

    def gate_up(x, ids, w, *args, ride=None, **kw):
        calls.append(("gate_up", ride))
        return torch.zeros(x.shape[0] * ids.shape[1], 8, dtype=torch.bfloat16)

    def down(h, ids, topk, *args, **kw):
        return torch.zeros(h.shape[0] // topk, 4)

    monkeypatch.setattr(kernels, "router", router)
    monkeypatch.setattr(kernels, "moe_gate_up", gate_up)
    monkeypatch.setattr(kernels, "moe_down", down)

    class Ride(SinkhornRide):
        def run(self):
            calls.append(("own launch", self))

    q = QWeight("fp4", torch.zeros(2, 8, 2, dtype=torch.int8), torch.zeros(2, 8, 1))
    mw = MoEWeights(gate=torch.zeros(2, 4, dtype=torch.bfloat16), bias=torch.zeros(2), tid2eid=None, w1=q, w2=q, w3=q,
                    shared_w1=q, shared_w2=q, shared_w3=q, n_experts=2, expert_offset=0, topk=2, route_scale=1.0,
                    swiglu_limit=10.0)
    impl = (impl_cls or moe_cuda.Fp4TopkMoE)()
    return impl, mw, calls, lambda: Ride(torch.zeros(1, 4, 4), 20, 1e-6)


@pytest.mark.parametrize("mode,carrier", [(None, "gate_up"), ("1", "gate_up"), ("topk", "router")])
def test_fp4_topk_leaves_the_ride_to_its_routed_gate_up(monkeypatch, mode, carrier):
    """moe=fp4_topk: route() leaves its ride to the routed gate+up launch of the routed() call after it (the default)
    or gives it to the router's launch (DS4_SINKHORN_RIDE=topk); either way exactly one launch takes it."""
    from ds4.ops.base import RIDE_ENV
    if mode is None:
        monkeypatch.delenv(RIDE_ENV, raising=False)
    else:
        monkeypatch.setenv(RIDE_ENV, mode)
    monkeypatch.delenv("DS4_MOE_FFN", raising=False)
    impl, mw, calls, make_ride = _fp4_topk_calls(monkeypatch)
    x, ride = torch.randn(1, 4), make_ride()
    w, ids = impl.route(x, torch.zeros(1, dtype=torch.int64), mw, ride=ride)
    impl.routed(x, w, ids, mw)
    assert [who for who, r in calls if r is ride] == [carrier] and len(calls) == 2
    calls.clear()
    w, ids = impl.route(x, torch.zeros(1, dtype=torch.int64), mw)  # no ride: none taken, none pending
    impl.routed(x, w, ids, mw)
    assert all(r is None for _, r in calls)


def test_fp4_topk_ride_without_one_gate_up_launch(monkeypatch):
    """Where routed() has no single gate+up launch for the ride (a prompt-sized call), it finishes the ride as a launch
    of its own first; a second route() before routed() took the ride fails; bf16_cache (whose routed() reads the ids
    on the host) and the one-launch FFN leave it to the router."""
    from ds4.ops.base import RIDE_ENV
    from ds4.ops.moe_cuda import PREFILL_TOKENS, Bf16CacheMoE
    monkeypatch.delenv(RIDE_ENV, raising=False)
    monkeypatch.delenv("DS4_MOE_FFN", raising=False)
    impl, mw, calls, make_ride = _fp4_topk_calls(monkeypatch)
    n = PREFILL_TOKENS + 1
    x, ride = torch.randn(n, 4), make_ride()
    w, ids = impl.route(x, torch.zeros(n, dtype=torch.int64), mw, ride=ride)
    impl.routed(x, w, ids, mw)
    assert calls[:2] == [("router", None), ("own launch", ride)] and all(r is None for _, r in calls[2:])
    impl.route(x[:1], torch.zeros(1, dtype=torch.int64), mw, ride=make_ride())
    with pytest.raises(RuntimeError, match="route\\(\\) again"):
        impl.route(x[:1], torch.zeros(1, dtype=torch.int64), mw, ride=make_ride())
    for cls, env in ((Bf16CacheMoE, None), (None, "1")):
        if env is not None:
            monkeypatch.setenv("DS4_MOE_FFN", env)
        impl, mw, calls, make_ride = _fp4_topk_calls(monkeypatch, cls)
        ride = make_ride()
        impl.route(x[:1], torch.zeros(1, dtype=torch.int64), mw, ride=ride)
        assert calls == [("router", ride)] and impl._ride is None
