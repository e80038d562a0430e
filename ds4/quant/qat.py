"""Numerics simulations of the official reference kernels (spec §11, §14.1, §5.5).

All functions here are [hot]: pure tensor ops, no host synchronisation, no Python branching
on tensor values (only on shapes), usable inside decode steps / CUDA graphs.
"""

from __future__ import annotations

import struct

import torch
import torch.nn.functional as F
from torch import Tensor

from .formats import E2M1_MAX, E4M3_MAX, fp4_e2m1_decode, fp4_e2m1_encode

__all__ = ["act_quant", "act_quant_sim", "fp4_act_quant_sim", "hadamard"]


def _f32(v: float) -> float:
    """The float32 rounding of v, as a Python float (exact as a double)."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


_INV_E4M3 = _f32(1.0 / E4M3_MAX)   # fp32(1/448), as the reference kernels use
_INV_E2M1 = _f32(1.0 / E2M1_MAX)   # fp32(1/6)
_FP8_AMAX_FLOOR = 1e-4
_FP4_AMAX_FLOOR = E2M1_MAX * 2.0 ** -126


def _blocks(x: Tensor, block: int) -> tuple[Tensor, int]:
    """x [..., K] -> float32 [..., nb, block] (zero padded) and K."""
    K = x.shape[-1]
    nb = -(-K // block)
    xf = x.to(torch.float32)
    if nb * block != K:
        xf = F.pad(xf, (0, nb * block - K))
    return xf.reshape(*x.shape[:-1], nb, block), K


def _pow2_ceil_scale(amax: Tensor, inv_qmax: float) -> Tensor:
    """s = 2^ceil(log2(amax * fp32(inv_qmax))) with the reference's bit trick (float32).

    p = amax * inv (an fp32 product); ceil(log2 p) = exponent field - 127, +1 if the mantissa
    is non-zero (for fp32 subnormal p this yields -126). s is built from bits.
    """
    p = amax * inv_qmax  # float32 tensor * exact-fp32 scalar -> RNE fp32 product
    bits = p.view(torch.int32)
    e = (bits >> 23) & 0xFF
    m = bits & 0x7FFFFF
    k_biased = e + (m != 0).to(torch.int32)  # = ceil(log2 p) + 127
    return (k_biased << 23).view(torch.float32)


def act_quant(x: Tensor, block: int = 128) -> tuple[Tensor, Tensor]:
    """[hot] Reference ``act_quant`` (per row, per block of ``block`` along the last dim).

    amax = max(|x|, 1e-4); s = 2^ceil(log2(amax * fp32(1/448))); q = e4m3(clamp(x/s, ±448))
    with round-to-nearest-even. Returns (q float8_e4m3fn [..., K], s float32 [..., ceil(K/block)]).
    A partial last block is zero padded for its amax.
    """
    xb, K = _blocks(x, block)
    amax = xb.abs().amax(dim=-1).clamp(min=_FP8_AMAX_FLOOR)
    s = _pow2_ceil_scale(amax, _INV_E4M3)
    q = (xb / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(*x.shape[:-1], -1)[..., :K]
    return q, s


def act_quant_sim(x: Tensor, block: int = 128) -> Tensor:
    """[hot] FP8 quant-dequant simulation: e4m3(x/s) * s in x's dtype (act_quant's inplace mode;
    block 64 on KV nope dims, block 128 before FP8/FP4 GEMMs)."""
    xb, K = _blocks(x, block)
    amax = xb.abs().amax(dim=-1).clamp(min=_FP8_AMAX_FLOOR)
    s = _pow2_ceil_scale(amax, _INV_E4M3)[..., None]
    q = (xb / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    y = (q * s).reshape(*x.shape[:-1], -1)[..., :K]
    return y.to(x.dtype)


def fp4_act_quant_sim(x: Tensor, block: int = 32) -> Tensor:
    """[hot] FP4 quant-dequant simulation (reference ``fp4_act_quant`` inplace mode).

    amax = max(|x|, 6*2^-126); s = 2^ceil(log2(amax * fp32(1/6))); q = e2m1(clamp(x/s, ±6))
    rounded like ``fp4_e2m1_encode`` (nearest, ties to even); returns q*s in x's dtype.
    """
    xb, K = _blocks(x, block)
    amax = xb.abs().amax(dim=-1).clamp(min=_FP4_AMAX_FLOOR)
    s = _pow2_ceil_scale(amax, _INV_E2M1)[..., None]
    q = fp4_e2m1_decode(fp4_e2m1_encode((xb / s).clamp(-E2M1_MAX, E2M1_MAX)))
    y = (q * s).reshape(*x.shape[:-1], -1)[..., :K]
    return y.to(x.dtype)


def hadamard(x: Tensor) -> Tensor:
    """[hot] x @ H_n * n^-0.5 along the last dim (n a power of two), H_n the Sylvester
    Hadamard matrix (scipy.linalg.hadamard ordering). Fast Walsh-Hadamard butterfly
    (log2 n stages) in float32, scale applied at the end, result cast back to x.dtype."""
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard: last dim must be a power of two, got {n}")
    y = x.to(torch.float32).reshape(-1, n)
    rows = y.shape[0]
    h = 1
    while h < n:
        y = y.view(rows, n // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    y = y.reshape(x.shape) * (n ** -0.5)  # same scalar as hadamard_transform(x, n ** -0.5)
    return y.to(x.dtype)
