"""linear=gemv_cuda: FP8 / MXFP4 GEMV kernels reading the stored bytes and E8M0 scales.

Decode (<= PREFILL_TOKENS tokens): one launch of the CUDA GEMV (fp32 accumulation, BF16 out); with an hc
fold (one row; hc=fused_cuda's default, DS4_HC_FOLD=0 turns it off, ds4.ops.hc_cuda) the tensor-core GEMV
whose epilogue also forms the next mHC site's streams and partials (ds4.kernels.gemv_fold).
Prefill (more tokens) and BF16 weights: dequantise + torch matmul (cuBLAS) — part of this
implementation, chosen by shape only, never by tensor values.
qat (act_quant=True): the activation is FP8-simulated per 128 channels (ds4.quant.act_quant_sim,
extra torch ops) before the same kernel, as the reference does.
prefetch: while a decode graph is captured and DS4_L2_PREFETCH names sites (opt-in: measured slower), a
side-stream L2 prefetch of weights a later GEMV reads (ds4.ops.prefetch: the sites and the figures).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ds4 import kernels
from ds4.ops import prefetch as l2
from ds4.ops.base import HcFold, QWeight

PREFILL_TOKENS = 16


class GemvCudaLinear:
    name = "gemv_cuda"

    def __call__(self, x: Tensor, w: QWeight, act_quant: bool = False, fold: HcFold | None = None) -> Tensor:
        if act_quant and w.fmt in ("fp8", "fp4"):
            from ds4.quant import act_quant_sim
            x = act_quant_sim(x, 128)
        lead, n_in = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, n_in)
        if fold is not None and self._folds(x2, w, fold):  # the hc fold in the tensor-core GEMV's epilogue
            fold.fused = True
            y = kernels.gemv_fold(x2.to(torch.bfloat16).contiguous(), w.weight, w.scale, w.fmt, fold)
            return y.view(*lead, w.out_features).to(x.dtype)
        if w.fmt == "bf16" or x2.shape[0] > PREFILL_TOKENS or x2.shape[0] == 0:
            return F.linear(x, w.dequant(x.dtype))
        y = kernels.gemv(x2.to(torch.bfloat16).contiguous(), w.weight, w.scale, w.fmt)
        return y.view(*lead, w.out_features).to(x.dtype)

    @staticmethod
    def _folds(x2: Tensor, w: QWeight, fold: HcFold) -> bool:
        """One bf16 row onto the fold's D = out_features, a weight gemv_fold takes (shapes only)."""
        return (x2.is_cuda and x2.shape[0] == 1 and w.fmt in ("fp8", "fp4") and fold.out.shape[-1] == w.out_features
                and kernels.hc_fold_ok("gemv", w.fmt, w.out_features, w.in_features, 1, fold.out.shape[-2]))

    def grouped(self, x: Tensor, w: QWeight, groups: int) -> Tensor:
        """Block-diagonal projection (wo_a): x [N, G, I], w [G*R, I] -> [N, G, R], one launch."""
        n = x.shape[0]
        if w.fmt == "bf16" or n > PREFILL_TOKENS or n == 0:
            wd = w.dequant(x.dtype).view(groups, -1, x.shape[-1])
            return torch.einsum("ngi,gri->ngr", x, wd)
        y = kernels.gemv(x.reshape(n, -1).to(torch.bfloat16).contiguous(), w.weight, w.scale, w.fmt, groups=groups)
        return y.view(n, groups, -1).to(x.dtype)

    def prefetch(self, site: str, ws: Sequence[QWeight], x: Tensor) -> bool:
        """L2 prefetch of ws (weights and scales) at `site`, on a side stream forked now (ds4.ops.prefetch;
        joined at the end of the step). Returns whether it was issued."""
        return l2.issue(site, [t for w in ws for t in (w.weight, w.scale) if t is not None], x)
