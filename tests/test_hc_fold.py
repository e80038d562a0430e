"""The hc fold's plumbing on the CPU (hc.fold -> attend / MoE.forward -> the producing kernel -> hc.fold_pre, and the
fold as a block's carry into the next block): with torch stand-ins that do what the CUDA epilogues do (the post into
fold.out), a model decodes exactly as the reference, and every decode row's sites fold except the last block's FFN
(nothing follows it inside the blocks). The CUDA implementation never folds off the GPU or with DS4_HC_FOLD=0."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ds4.ops.base import HcFold
from ds4.ops.hc_cuda import FusedCudaHC
from ds4.ops.hc_torch import TorchHC


def _fill(fold: HcFold, y: torch.Tensor) -> None:
    """What a folding kernel's epilogue leaves: the post of y onto the streams (its partials are the CUDA finish's
    shortcut; TorchHC.fold_pre reads the streams)."""
    fold.out.copy_(TorchHC().post(y, fold.res, fold.post, fold.comb))
    fold.fused = True


def _folding_ops(ref_ops, made: list[str], started: bool):
    """started: the shared expert "starts" before routing (as moe=fp4_topk's shared_up for a decode row, on a captured
    step's side stream or in line) and routed() forms the block output; else (an implementation whose shared_up starts
    nothing) shared(add=) does."""
    class FoldingHC(TorchHC):
        def fold(self, res, post, comb, fn):
            if res.shape[0] != 1:  # one decode row, as the CUDA implementation
                return None
            mix = fn.shape[0]
            return HcFold(res, post, comb, fn, torch.empty_like(res), res.new_zeros(1, mix + 1, res.shape[-1] // 16))

    class FoldingLinear(type(ref_ops.linear)):
        def __call__(self, x, w, act_quant=False, fold=None):
            y = super().__call__(x, w, act_quant)
            if fold is not None:
                _fill(fold, y)
                made.append("attn")
            return y

    class FoldingMoE(type(ref_ops.moe)):
        def shared_up(self, x, mw, act_quant=False):
            return True if started and x.shape[0] == 1 else None

        def routed(self, x, weights, ids, mw, act_quant=False, shared=None, fold=None):
            if shared is None:
                return super().routed(x, weights, ids, mw, act_quant)
            return self.shared(x, mw, act_quant, add=super().routed(x, weights, ids, mw, act_quant), fold=fold)

        def shared(self, x, mw, act_quant=False, add=None, up=None, fold=None):
            y = super().shared(x, mw, act_quant, add)  # the reference's order
            if fold is not None:
                _fill(fold, y)
                made.append("ffn")
            return y

    return dataclasses.replace(ref_ops, hc=FoldingHC(), linear=FoldingLinear(), moe=FoldingMoE())


@pytest.mark.parametrize("started", [True, False])
def test_folded_decode_matches_the_reference(started):
    from ds4.model.args import tiny
    from ds4.registry import torch_reference_ops
    from ds4.weights.synthetic import random_weights
    from tiny_decode import decode_logits

    made: list[str] = []
    ref_ops = torch_reference_ops()
    a = tiny()
    w = random_weights(a, seed=8, include_mtp=False)
    prompt = [(5 * i + 1) % a.vocab_size for i in range(10)]
    steps = [3, 7, 2]
    ref, _ = decode_logits(a, w, ref_ops, prompt, steps, 64)
    got, _ = decode_logits(a, w, _folding_ops(ref_ops, made, started), prompt, steps, 64, made.clear)
    assert torch.equal(ref, got)
    # per step: every block's attention output folds; every FFN but the last block's (no next site inside the blocks)
    per_step = ["attn", "ffn"] * (a.n_layers - 1) + ["attn"]
    assert made == per_step * len(steps)


def test_cuda_hc_does_not_fold_off_the_gpu_or_when_off(monkeypatch):
    n, d = 4, 64
    res = torch.randn(1, n, d).to(torch.bfloat16)
    post, comb, fn = torch.rand(1, n), torch.rand(1, n, n), torch.randn((2 + n) * n, n * d)
    for value in (None, "1", "0"):  # default (on), on, off
        if value is None:
            monkeypatch.delenv("DS4_HC_FOLD", raising=False)
        else:
            monkeypatch.setenv("DS4_HC_FOLD", value)
        assert FusedCudaHC().fold(res, post, comb, fn) is None  # CPU tensors: nothing to fold into
    assert TorchHC().fold(res, post, comb, fn) is None          # the reference never folds


def test_cuda_hc_fold_switch(monkeypatch):
    """The switch alone (a CUDA-looking request): on unless DS4_HC_FOLD=0."""
    import ds4.ops.hc_cuda as hc_cuda
    n, d = 4, 64
    res = torch.randn(1, n, d).to(torch.bfloat16)
    post, comb, fn = torch.rand(1, n), torch.rand(1, n, n), torch.randn((2 + n) * n, n * d)
    monkeypatch.setattr(hc_cuda, "_ok", lambda h: True)  # shapes and dtypes as on the GPU; CPU tensors here
    monkeypatch.delenv("DS4_HC_FOLD", raising=False)
    f = FusedCudaHC().fold(res, post, comb, fn)
    assert f is not None and not f.fused and f.out.shape == res.shape and f.part.shape == (1, 25, d // 16)
    monkeypatch.setenv("DS4_HC_FOLD", "0")
    assert FusedCudaHC().fold(res, post, comb, fn) is None


def test_fold_pre_needs_a_formed_fold():
    n, d = 2, 32
    res = torch.randn(1, n, d).to(torch.bfloat16)
    fold = HcFold(res, torch.rand(1, n), torch.rand(1, n, n), torch.randn(8, n * d), torch.empty_like(res),
                  torch.zeros(1, 9, d // 16))
    with pytest.raises(RuntimeError, match="not formed"):
        FusedCudaHC().fold_pre(fold, torch.ones(3), torch.zeros(8), 20, 1e-6, 1e-6, torch.ones(d))


def test_the_fold_wrappers_are_exported():
    """What ds4.ops calls on the GPU (the CPU paths above never reach it)."""
    from ds4 import kernels, kernels_attn
    assert callable(kernels.gemv_fold) and callable(kernels.hc_fold_ok) and callable(kernels_attn.hc_fold_finish)
