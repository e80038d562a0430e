"""numerics=qat's FP8 activation simulation for the CUDA implementations (linear=gemv_cuda, moe=fp4_topk /
bf16_cache): ds4.quant.act_quant_sim's bits inside the one-token tensor-core kernels' activation staging where they
take it (below), else in one launch of ds4.kernels.act_quant_sim where that kernel takes the input, instead of the
torch twin's dozen launches before every FP8 / FP4 GEMV of a qat decode step (with them qat decoded 3.6 times slower
than plain on an H200: 372 against 104 us per layer, experiments/decode_session52_h200.md). Inputs the kernel does not
take (CPU, other dtypes, a last dim the block does not divide) run the torch twin, chosen by shape and dtype only.
DS4_ACT_QUANT (read per call; any other value is an error): unset or "staged" (the default since session 71: where a
one-token tensor-core GEMV or MoE kernel takes it at the plain launch's own depth, `staged` /
ds4.kernels.act_quant_staged_ok / moe_act_quant_ok, the simulation happens inside that kernel's activation staging,
act_quant=True, with no launch of its own, and with the launch path's bits (but for the merged decode query's row skip,
ds4.ops.attn_cuda's q_up: within TOL where it applies); elsewhere the one launch), "kernel" (the one
launch before every FP8 / FP4 GEMV, the ablation), or "torch" (the twin everywhere, the ablation). The staging drops
qat's step from 104 to 72 kernels. In session 56 it decoded no faster than the launch on an H200 (120.4 / 120.4
against 120.1 us per layer), when each thread loaded and simulated one vector at a time; since session 71 the loads go
four at a time before the simulation, and the simulation multiplies by the scale's exact reciprocal: 133.0-133.3
against the launch's 138.2-140.2 us per layer on an H100 (plain 121.6-122.2; experiments/session71.md).
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from ds4.quant import act_quant_sim as act_quant_sim_torch


def kernel_takes(x: Tensor, block: int) -> bool:
    """Whether ds4.kernels.act_quant_sim takes x: CUDA bf16 with a last dim that block (64 or 128) divides."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and block in (64, 128) and x.dim() >= 1 and x.numel() > 0
            and x.shape[-1] % block == 0)


ACT_QUANT_MODES = ("kernel", "torch", "staged")


def mode() -> str:
    """DS4_ACT_QUANT's value ("staged" where unset or empty); any other value than ACT_QUANT_MODES' is an error, not
    the default in silence (a misspelt "kernal" would otherwise measure the staging under the launch's name)."""
    m = os.environ.get("DS4_ACT_QUANT") or "staged"
    if m not in ACT_QUANT_MODES:
        raise ValueError(f"DS4_ACT_QUANT={m!r}: expected one of {', '.join(ACT_QUANT_MODES)} (or unset: staged)")
    return m


def staging_on() -> bool:
    """DS4_ACT_QUANT=staged (the default): the simulation goes into the one-token tensor-core kernels' staging where
    they take it."""
    return mode() == "staged"


def staged(x: Tensor, fmt: str, rows: int, cols: int) -> bool:
    """Whether a GEMV of x by an [rows, cols] weight of `fmt` takes act_quant=True into its kernel's staging: one CUDA
    bf16 row, DS4_ACT_QUANT=staged (the default), and ds4.kernels.act_quant_staged_ok (shapes only). (The MoE
    kernels ask ds4.kernels.moe_act_quant_ok: ds4.ops.moe_cuda.)"""
    if not staging_on():
        return False
    if not (x.is_cuda and x.dtype == torch.bfloat16 and x.numel() == x.shape[-1] == cols):
        return False
    from ds4 import kernels
    return kernels.act_quant_staged_ok(fmt, rows, cols)


def act_quant_sim(x: Tensor, block: int = 128) -> Tensor:
    """e4m3(x / s) s per row and block of `block` values (ds4.quant.act_quant_sim, the same bits)."""
    if mode() != "torch" and kernel_takes(x, block):
        from ds4 import kernels
        return kernels.act_quant_sim(x.contiguous(), block)
    return act_quant_sim_torch(x, block)
