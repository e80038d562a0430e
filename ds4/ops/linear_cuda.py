"""linear=gemv_cuda: FP8 / MXFP4 GEMV kernels reading the stored bytes and E8M0 scales.

Decode (<= PREFILL_TOKENS tokens): one launch of the CUDA GEMV (fp32 accumulation, BF16 out); with an hc
fold (one row; hc=fused_cuda's default, DS4_HC_FOLD=0 turns it off, ds4.ops.hc_cuda) the tensor-core GEMV
whose epilogue also forms the next mHC site's streams and partials (ds4.kernels.gemv_fold).
BF16 dense weights (weight_dtype=bf16, or a checkpoint's BF16 projections) at decode: the same GEMV launch in its BF16
form (fp32 accumulation; with bf16 activations only, so that a float32 run keeps the reference's fp32 product).
Prefill (more tokens) and what the launch does not take: dequantise (FP8 on the device in one launch,
ds4.ops.dequant_cuda) + torch matmul (cuBLAS) — part of this implementation, chosen by shape and dtype only, never by
tensor values.
qat (act_quant=True): the activation is FP8-simulated per 128 channels, as the reference does, with the torch twin's
bits: inside the one-row tensor-core GEMV's activation staging where it takes it (DS4_ACT_QUANT=staged, the default
since session 71), else one launch of the act_quant_sim kernel before the GEMV (ds4.ops.qat_cuda).
Layout: `prepare` (at load, and when a loaded model is configured with this implementation) places the dense FP8
projections' bytes in the tensor-core GEMV's fragment order, each word's bits permuted for a cheaper decode (fmt
"fp8t", ds4.quant.tile_fp8_mma; experiments/decode_session45_h200.md), where the shapes allow, so that every warp
load of the one-token GEMV reads 512 contiguous bytes instead of 128-byte runs
of 8 rows (a read-only probe of the two patterns: 3867 against 3585 GB/s on an H200,
experiments/decode_session6_h200.md; the decode step: 105.9 / 105.5 against 107.3 / 107.1 us per layer,
experiments/decode_session41_h200.md). DS4_FP8_TILE=0 keeps (or restores) the stored layout; =1 requires fp8t and
fails at load where a weight cannot be laid out. The FMA GEMV (several tokens, short rows) finds its chunks in
either layout, and so does prefill's dequantisation kernel.
prefetch: while a decode graph is captured and DS4_L2_PREFETCH names sites (opt-in: measured slower), a
side-stream L2 prefetch of weights a later GEMV reads (ds4.ops.prefetch: the sites and the figures).
"""
from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ds4 import kernels
from ds4.ops import prefetch as l2
from ds4.ops.base import HcFold, QWeight
from ds4.ops.dequant_cuda import dense
from ds4.ops.qat_cuda import act_quant_sim
from ds4.ops.qat_cuda import staged as qat_staged
from ds4.quant import fp8t_ok, tile_fp8_mma, untile_fp8_mma

PREFILL_TOKENS = 16


def fp8_tile_mode(knob: str = "DS4_FP8_TILE") -> str:
    """DS4_FP8_TILE (or another knob of the same values): "0" (the stored fp8 layout), "1" (fp8t required) or "auto"
    (fp8t where the shapes allow; the default where it is unset or empty)."""
    v = os.environ.get(knob) or "auto"
    if v not in ("auto", "0", "1"):
        raise ValueError(f"{knob} must be 0, 1 or unset (auto), got {v!r}")
    return v


def lay_fp8(w: QWeight, mode: str, knob: str, who: str) -> QWeight:
    """w in the layout `mode` asks for ("0": fp8, "1": fp8t required, "auto": fp8t where the shape allows) if it is a
    CUDA FP8 weight, else w itself; a re-laid weight is a new tensor (see GemvCudaLinear.prepare). knob and who name
    the setting and the weight in the error of a "1" that cannot be served."""
    if w.fmt not in ("fp8", "fp8t") or not w.weight.is_cuda:
        return w
    can = w.weight.dim() == 2 and w.weight.is_contiguous() and fp8t_ok(*w.weight.shape)
    if mode == "1" and not can:
        raise ValueError(f"{knob}=1: {who} {tuple(w.weight.shape)} out as fp8t (it needs whole 16-row tiles and "
                         f"rows of a multiple of 128 values, contiguous); {knob}=auto keeps such weights in fp8")
    tile = can and mode != "0"
    if w.fmt == ("fp8t" if tile else "fp8"):
        return w
    return QWeight("fp8t" if tile else "fp8", (tile_fp8_mma if tile else untile_fp8_mma)(w.weight), w.scale)


class GemvCudaLinear:
    name = "gemv_cuda"

    def __call__(self, x: Tensor, w: QWeight, act_quant: bool = False, fold: HcFold | None = None) -> Tensor:
        # qat: the FP8 simulation in the GEMV's staging where it can (DS4_ACT_QUANT=staged), else a launch before it
        staged = False
        if act_quant and w.fmt != "bf16":  # every FP8 / FP4 layout (spec §2)
            staged = qat_staged(x, w.fmt, w.out_features, w.in_features)
            if not staged:
                x = act_quant_sim(x, 128)
        lead, n_in = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, n_in)
        if fold is not None and self._folds(x2, w, fold):  # the hc fold in the tensor-core GEMV's epilogue
            fold.fused = True
            y = kernels.gemv_fold(x2.to(torch.bfloat16).contiguous(), w.weight, w.scale, w.fmt, fold, act_quant=staged)
            return y.view(*lead, w.out_features).to(x.dtype)
        if not self._launches(x2, w):
            return F.linear(x, dense(w, x.dtype))  # (staged needs one bf16 row on a CUDA GEMV: never here)
        y = kernels.gemv(x2.to(torch.bfloat16).contiguous(), w.weight, w.scale, w.fmt, act_quant=staged)
        return y.view(*lead, w.out_features).to(x.dtype)

    @staticmethod
    def _launches(x2: Tensor, w: QWeight, groups: int = 1) -> bool:
        """Whether the GEMV launch takes these rows (shapes and dtypes only): 1..PREFILL_TOKENS rows whose I values
        fit the launch's shared-memory staging (kernels.gemv_max_tokens: attn=fused_cuda_wo_bf16's merged BF16
        wo_b.wo_a, I = 32768, does not and takes the matmul, as it did before the BF16 form existed); a BF16 weight
        only bf16 [O, I] with bf16 activations, I a multiple of 8 and, grouped, whole 16-row warps' shares per group
        (the launch's BF16 form)."""
        if not 1 <= x2.shape[0] <= PREFILL_TOKENS or kernels.gemv_max_tokens(w.fmt, w.in_features) < 1:
            return False
        if w.fmt != "bf16":
            return True
        return (x2.dtype == torch.bfloat16 and w.weight.dtype == torch.bfloat16 and w.weight.dim() == 2
                and w.weight.is_contiguous() and w.in_features % 8 == 0
                and (groups == 1 or (w.out_features // groups) % 16 == 0))

    @staticmethod
    def _folds(x2: Tensor, w: QWeight, fold: HcFold) -> bool:
        """One bf16 row onto the fold's D = out_features, a weight gemv_fold takes (shapes only)."""
        return (x2.is_cuda and x2.shape[0] == 1 and w.fmt in ("fp8", "fp8t", "fp4")
                and fold.out.shape[-1] == w.out_features
                and kernels.hc_fold_ok("gemv", w.fmt, w.out_features, w.in_features, 1, fold.out.shape[-2]))

    @staticmethod
    def prepare(w: QWeight, name: str = "weight") -> QWeight:
        """At load: a CUDA FP8 weight in the layout DS4_FP8_TILE asks for (fp8 <-> fp8t, so one loaded model can be
        configured either way); anything else as it is. A re-laid weight is a new tensor, never w's bytes changed in
        place: the loader hands the model the caller's tensors without a copy (Transformer.load_weights), and they
        must keep their meaning; the caller replaces its buffer (one weight's bytes in flight at a time). Row views
        of a merged weight (whole 16-row tiles of it) are re-made by the caller in the returned format."""
        return lay_fp8(w, fp8_tile_mode(), "DS4_FP8_TILE", f"linear=gemv_cuda cannot lay {name}")

    def grouped(self, x: Tensor, w: QWeight, groups: int) -> Tensor:
        """Block-diagonal projection (wo_a): x [N, G, I], w [G*R, I] -> [N, G, R], one launch."""
        n = x.shape[0]
        if not self._launches(x.reshape(n, -1), w, groups):
            wd = dense(w, x.dtype).view(groups, -1, x.shape[-1])
            return torch.einsum("ngi,gri->ngr", x, wd)
        y = kernels.gemv(x.reshape(n, -1).to(torch.bfloat16).contiguous(), w.weight, w.scale, w.fmt, groups=groups)
        return y.view(n, groups, -1).to(x.dtype)

    def prefetch(self, site: str, ws: Sequence[QWeight], x: Tensor) -> bool:
        """L2 prefetch of ws (weights and scales) at `site`, on a side stream forked now (ds4.ops.prefetch;
        joined at the end of the step). Returns whether it was issued."""
        return l2.issue(site, [t for w in ws for t in (w.weight, w.scale) if t is not None], x)
