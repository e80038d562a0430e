"""Interleaved partial RoPE on the last `rope_head_dim` dims, with YaRN on compressed layers (spec §5.3)."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ds4.model.args import ModelArgs


def _correction_dim(rotations: float, dim: int, base: float, max_seq_len: int) -> float:
    return dim * math.log(max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))


def inv_freq(args: ModelArgs, layer: int, device=None) -> Tensor:
    """Per-pair frequencies f_i [rope_head_dim/2] fp32 for layer `layer`.

    Pure sliding-window layers use rope_theta without YaRN; layers with a compressor use
    compress_rope_theta with YaRN for every rotation in the layer. No mscale anywhere."""
    dim = args.rope_head_dim
    compressed = args.ratio(layer) != 0
    base = args.compress_rope_theta if compressed else args.rope_theta
    f = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    if compressed and args.rope_factor != 1.0:
        low = max(math.floor(_correction_dim(args.beta_fast, dim, base, args.original_seq_len)), 0)
        high = min(math.ceil(_correction_dim(args.beta_slow, dim, base, args.original_seq_len)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        f = f / args.rope_factor * ramp + f * (1 - ramp)
    return f


def rotations(freqs: Tensor, positions: Tensor) -> Tensor:
    """positions [...] (int, device tensor) -> rotations exp(i * pos * f) [..., rope_head_dim/2]
    complex64, angles in fp32 (the reference's torch.polar)."""
    ang = positions.to(torch.float32).unsqueeze(-1) * freqs
    return torch.polar(torch.ones_like(ang), ang)


def apply_rope(x: Tensor, cis: Tensor, inverse: bool = False) -> Tensor:
    """Rotate the last 2*cis.shape[-1] dims of x as interleaved pairs (x[2i] + i x[2i+1]).

    cis broadcasts against x[..., :R/2] (insert head dims at the caller). One complex multiply
    in fp32, result written back in x.dtype; `inverse` applies the conjugate (de-rotation)."""
    r = 2 * cis.shape[-1]
    rope = torch.view_as_complex(x[..., -r:].float().unflatten(-1, (-1, 2)).contiguous())
    out = torch.view_as_real(rope * (cis.conj() if inverse else cis)).flatten(-2)
    return torch.cat((x[..., :-r], out.to(x.dtype)), dim=-1)


def rope_heads(x: Tensor, positions: Tensor, freqs: Tensor, inverse: bool = False) -> Tensor:
    """x [N, H, D] with one position per row (positions [N]) -> every head rotated at its row's
    position (queries, indexer queries; `inverse` de-rotates attention outputs)."""
    return apply_rope(x, rotations(freqs, positions).unsqueeze(-2), inverse=inverse)
