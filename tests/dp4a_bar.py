"""The exactness bar of the dp4a gate+up (tests/test_moe_dp4a_gpu.py), importable without CUDA: the GPU test holds
the kernel to it, and experiments/s67/dp4a_exactness_emulation.py holds a CPU emulation of the kernel to the same."""
from __future__ import annotations

import torch


def codes16(x: torch.Tensor) -> torch.Tensor:
    """x [1, dim] bf16 as the dp4a kernel quantizes it (csrc/moe_dp4a.cu q16_of, blocks above 2^-64): per 32 values
    q = rint(v * fl(32767 / amax)) and scale fl(amax / 32767), float32 quotients and products (IEEE: the build uses no
    fast math); returned as float64 q x scale."""
    xb = x.float().view(-1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(32767.0, device=x.device) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv).clamp(-32767, 32767)
    return (q.double() * (amax / 32767.0).double()).view(1, -1)


def f32_slack(xq: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """A bound on what float32 adds to a row's dot product in the kernel: its per-block integer sums are exact, and a
    lane's fmaf chain plus the 32-lane shuffle tree round at most 9 times, each within 2^-24 of the running sum of
    |block terms|; 16 roundings' worth of that sum (session 67: the bar without it failed one element by 1.37 steps
    where the row's blocks cancel)."""
    nb = xq.shape[-1] // 32
    blocks = (xq.view(1, nb, 32) * d.double().view(-1, nb, 32)).sum(-1)  # [inter, nb]
    return 16 * 2.0 ** -24 * blocks.abs().sum(-1)


def h_slack(gg: torch.Tensor, uu: torch.Tensor, xq: torch.Tensor, d1: torch.Tensor, d3: torch.Tensor,
            want: torch.Tensor) -> torch.Tensor:
    """float32's share of |h - bf16(want)| beyond one bf16 step: the sums' slack (f32_slack) carried through the
    SwiGLU's derivatives in g and u, and 8 roundings of h for the SwiGLU itself. gg, uu: the float64 gate / up rows."""
    sg = torch.sigmoid(gg)
    return ((sg * (1 + gg * (1 - sg)) * uu).abs() * f32_slack(xq, d1) + (gg * sg).abs() * f32_slack(xq, d3)
            + 8 * 2.0 ** -24 * want.abs())
