"""Prefill's dense weights under the CUDA implementations (linear=gemv_cuda, moe=fp4_topk).

A prompt longer than the decode kernels take multiplies by dense BF16 weights (cuBLAS). The torch dequantisation
(QWeight.dequant) is the reference's and stays the seed's phase-1 path; here the CUDA kernel (ds4.kernels.dequant,
csrc/dequant.cu) forms the same values in one launch (the torch path: 82 torch ops a matrix in the tiled layouts,
experiments/decode_session46_h200.md; the kernel: experiments/decode_session48_h200.md). Chosen by format and shape
only; DS4_DEQUANT_KERNEL=0 in the environment (read per call: the measurement's A/B) takes QWeight.dequant everywhere.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from ds4 import kernels
from ds4.ops.base import QWeight

_DTYPES = (torch.bfloat16, torch.float32)


def takes(w: QWeight, dtype: torch.dtype) -> bool:
    """Whether the kernel forms w's dense matrix (CUDA, contiguous, a stored layout and shape it takes)."""
    return (w.weight.is_cuda and dtype in _DTYPES and os.environ.get("DS4_DEQUANT_KERNEL") != "0"
            and w.scale is not None and w.weight.is_contiguous() and w.scale.is_contiguous()
            and kernels.dequant_ok(w.fmt, w.out_features, w.in_features))  # (the formats it takes too)


def dense(w: QWeight, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """w's values as a dense [..., O, I] tensor of dtype: the CUDA kernel where it takes w, else QWeight.dequant
    (BF16 weights, other dtypes, CPU). out (the kernel's path only) receives them when given."""
    if takes(w, dtype):
        return kernels.dequant(w.weight, w.scale, w.fmt, dtype, out=out)
    d = w.dequant(dtype)
    return d if out is None else out.copy_(d)
