"""CPU-side checks of the ds4_attn options (attn/indexer/hc = fused_cuda): registered with the right
priority and alias, an explicit choice without CUDA fails clearly through ds4.registry.build_ops,
`auto` falls back and says so, the objects construct without compiling anything (the nvcc compile
of csrc/attn/*.cu is in test_kernels_cpu.py)."""
from __future__ import annotations


import pytest
import torch

from ds4 import registry
from ds4.registry import ImplUnavailable

NO_CUDA = not torch.cuda.is_available()
FUSED = [("attn", "fused_cuda"), ("attn", "fused"), ("indexer", "fused_cuda"), ("hc", "fused_cuda")]


def test_registered_with_priority_and_alias():
    for comp in ("attn", "indexer", "hc"):
        e = registry.entry(comp, "fused_cuda")
        assert e.priority == 10 and e.priority > registry.entry(comp, "torch").priority
    assert registry.aliases("attn").get("fused") == "fused_cuda"
    assert registry.entry("attn", "fused").name == "fused_cuda"


@pytest.mark.parametrize("component,name", FUSED)
def test_explicit_choice_on_cpu_device_fails_clearly(component, name):
    with pytest.raises(ImplUnavailable, match=rf"{component}={name} cannot run here: needs a CUDA device"):
        registry.build_ops(registry.Impls(**{component: name}), "cpu")


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
@pytest.mark.parametrize("component,name", FUSED)
def test_explicit_choice_without_cuda_fails_clearly(component, name):
    with pytest.raises(ImplUnavailable, match=rf"{component}={name} cannot run here: CUDA is not available"):
        registry.build_ops(registry.Impls(**{component: name}), "cuda")


@pytest.mark.parametrize("component", ["attn", "indexer", "hc"])
def test_auto_falls_back_and_says_so(component):
    e, note = registry.resolve(component, "auto", torch.device("cpu"))
    assert e.name == "torch"
    assert "fused_cuda: needs a CUDA device" in note


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_unavailable_reason_without_cuda():
    from ds4 import kernels_attn
    why = kernels_attn.unavailable_reason()
    assert why is not None and ("CPU-only" in why or "CUDA is not available" in why)


def test_objects_construct_without_extension():
    from ds4.ops.attn_cuda import FusedCudaAttention, FusedCudaIndexer
    from ds4.ops.hc_cuda import FusedCudaHC
    assert FusedCudaAttention().name == FusedCudaIndexer().name == FusedCudaHC().name == "fused_cuda"


def test_cpu_tensors_go_to_the_reference():
    """Documented dispatch: non-CUDA / non-bf16 / prefill inputs use the torch twin (same results)."""
    from ds4.ops.attn_cuda import FusedCudaAttention, FusedCudaIndexer
    from ds4.ops.attn_torch import TorchAttention, TorchIndexer
    from ds4.ops.hc_cuda import FusedCudaHC
    from ds4.ops.hc_torch import TorchHC
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(2, 3, 4, 64, generator=g), torch.randn(2, 10, 64, generator=g)
    valid = torch.rand(2, 3, 10, generator=g) > 0.3
    sink = torch.randn(4, generator=g)
    a = FusedCudaAttention().sparse(q, kv, valid, None, None, sink, 0.125)
    assert torch.equal(a, TorchAttention().sparse(q, kv, valid, None, None, sink, 0.125))
    qi, w, keys = torch.randn(1, 2, 4, 32, generator=g), torch.rand(1, 2, 4, generator=g), torch.randn(1, 9, 32, generator=g)
    assert torch.equal(FusedCudaIndexer().scores(qi, w, keys), TorchIndexer().scores(qi, w, keys))
    h = torch.randn(3, 4, 16, generator=g)
    fn, sc, base = torch.randn(24, 64, generator=g) * 0.1, torch.ones(3), torch.zeros(24)
    for x, y in zip(FusedCudaHC().pre(h, fn, sc, base, 20, 1e-6, 1e-6), TorchHC().pre(h, fn, sc, base, 20, 1e-6, 1e-6)):
        assert torch.equal(x, y)

