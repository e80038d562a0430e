"""The projection fold's plumbing on the CPU (hc.fold_pre(proj=) -> Block.forward -> attend -> Attention._qkv_a): rows
handed over by an hc implementation are what the attention uses (the same outputs as it computing them itself), the
attention offers its merged wq_a + wkv only where the CUDA GEMV would do the projection (linear=gemv_cuda, FP8, no
activation quantization), the reference never forms them, and the CUDA fold is on with DS4_HC_QKV=1 only."""
from __future__ import annotations

import dataclasses

import torch

from ds4.ops.hc_cuda import FusedCudaHC, _proj_fold_on
from ds4.ops.hc_torch import TorchHC
from test_hc_fold import _folding_ops


def _gemv_named(linear):
    """The reference linear under gemv_cuda's name: the attention then offers its projection to the hc finish."""
    class Named(type(linear)):
        name = "gemv_cuda"
    return Named()


def test_rows_from_hc_are_what_the_attention_uses():
    """A model whose hc finish hands each attention x . wqkv_a^T (as the CUDA projection fold forms it) decodes
    exactly as the reference; every decode step's attention sites after the first block's took the handed rows."""
    from ds4.model.args import tiny
    from ds4.registry import torch_reference_ops
    from ds4.weights.synthetic import random_weights
    from tiny_decode import decode_logits

    made: list[str] = []
    ref_ops = torch_reference_ops()
    fold_ops = _folding_ops(ref_ops, made, started=False)
    lin = _gemv_named(fold_ops.linear)

    class ProjHC(type(fold_ops.hc)):
        def fold_pre(self, fold, scale, base, iters, hc_eps, norm_eps, norm, gate=None, proj=None):
            h, x, post, comb, y = super().fold_pre(fold, scale, base, iters, hc_eps, norm_eps, norm, gate, proj)
            assert y is None  # the reference forms neither logits nor rows
            if proj is None:
                return h, x, post, comb, None
            made.append("proj")
            return h, x, post, comb, lin(x, proj)

    class RecordingLinear(type(lin)):
        def __call__(self, x, w, act_quant=False, fold=None):
            made.append(f"linear{w.out_features}")
            return super().__call__(x, w, act_quant, fold)

    a = tiny()
    w = random_weights(a, seed=9, include_mtp=False)
    prompt = [(7 * i + 3) % a.vocab_size for i in range(9)]
    steps = [5, 1, 8]
    ref, _ = decode_logits(a, w, ref_ops, prompt, steps, 64)
    ops = dataclasses.replace(fold_ops, hc=ProjHC(), linear=RecordingLinear())
    got, model = decode_logits(a, w, ops, prompt, steps, 64, made.clear)
    assert torch.equal(ref, got)
    qkv_rows = a.q_lora_rank + a.head_dim
    assert model.layers[0].attn.wqkv_a.out_features == qkv_rows
    per_step = made[: len(made) // len(steps)]
    assert made == per_step * len(steps)
    # the first block's site has no fold before it (its GEMV runs); every later block's rows came from the hc finish
    assert per_step.count("proj") == a.n_layers - 1
    assert per_step.count(f"linear{qkv_rows}") == 1


def test_attention_offers_its_projection_only_to_gemv_cuda_fp8_without_act_quant():
    from ds4.model.args import tiny
    from ds4.model.transformer import Transformer
    from ds4.registry import torch_reference_ops
    from ds4.weights.synthetic import random_weights

    ref_ops = torch_reference_ops()
    a = tiny()
    m = Transformer(a, dataclasses.replace(ref_ops, linear=_gemv_named(ref_ops.linear)), "plain", torch.float32)
    m.load_weights(random_weights(a, seed=2, include_mtp=False))
    attn = m.layers[1].attn
    assert attn.fold_proj() is attn.wqkv_a and attn.wqkv_a.fmt == "fp8"
    attn.qat = True  # the reference's activation quantization before the GEMM: the hc finish does not simulate it
    assert attn.fold_proj() is None
    attn.qat = False
    attn.ops = dataclasses.replace(attn.ops, linear=ref_ops.linear)  # linear=dequant keeps its own projections
    assert attn.fold_proj() is None


def test_projection_fold_switch_and_cpu_fallback(monkeypatch):
    """Off by default (measured no faster, session 27), on with DS4_HC_QKV=1 only; off the GPU the CUDA hc never
    takes the projection (its fold_pre needs a kernel-formed fold, which CPU tensors never get), and the reference
    returns no rows."""
    monkeypatch.delenv("DS4_HC_QKV", raising=False)
    assert not _proj_fold_on()
    monkeypatch.setenv("DS4_HC_QKV", "1")
    assert _proj_fold_on()
    monkeypatch.setenv("DS4_HC_QKV", "0")
    assert not _proj_fold_on()
    n, d = 4, 128
    res = torch.randn(1, n, d).to(torch.bfloat16)
    assert FusedCudaHC().fold(res, torch.rand(1, n), torch.rand(1, n, n), torch.randn((2 + n) * n, n * d)) is None
    from ds4.ops.base import HcFold
    fold = HcFold(res, torch.rand(1, n), torch.rand(1, n, n), torch.randn((2 + n) * n, n * d), res.clone(),
                  torch.zeros(1, (2 + n) * n + 1, d // 16))
    from ds4.ops.base import QWeight
    proj = QWeight("fp8", torch.zeros(256, d).to(torch.float8_e4m3fn), torch.ones(2, 1).to(torch.float8_e8m0fnu))
    out = TorchHC().fold_pre(fold, torch.ones(3), torch.zeros((2 + n) * n), 20, 1e-6, 1e-6, torch.ones(d), proj=proj)
    assert len(out) == 5 and out[4] is None
