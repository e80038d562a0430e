"""Helpers shared by the GPU test modules (each imports them after its own CUDA skip)."""
from __future__ import annotations

import importlib
import zlib

import pytest
import torch

DEV = torch.device("cuda")
TOL = 1e-2            # relative L2 error allowed for bf16 kernel outputs
BF16 = torch.bfloat16


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of a against the reference b (in float64)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def seed_of(*parts) -> int:
    """A seed from a test's parameters, the same in every process (str hashes are salted per process)."""
    return zlib.crc32(repr(parts).encode()) % 10_000


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def randn(*shape, g: torch.Generator, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEV, generator=g) * scale).to(dtype)


def cuda_kernels(fn):
    """(fn(), the names of the GPU activities it launched, in order) through torch.profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def rand_qweight(fmt: str, o: int, i: int, g: torch.Generator):
    """A random CUDA ds4.ops.base.QWeight [o, i]: fp8 (E4M3 bytes without NaN, the stored layout), fp8t (the same laid
    out for the tensor cores) or fp4 (E2M1 pairs), E8M0 scales 2^-11 .. 2^-4."""
    from ds4.ops.base import QWeight
    if fmt in ("fp8", "fp8t"):
        wb = torch.randint(0, 256, (o, i), device=DEV, dtype=torch.uint8, generator=g)
        w = torch.where((wb & 0x7F) == 0x7F, wb - 1, wb).view(torch.float8_e4m3fn)
        s = torch.randint(116, 124, (-(-o // 128), -(-i // 128)), device=DEV, dtype=torch.uint8, generator=g)
    else:
        w = torch.randint(-128, 128, (o, i // 2), device=DEV, dtype=torch.int8, generator=g)
        s = torch.randint(116, 124, (o, i // 32), device=DEV, dtype=torch.uint8, generator=g)
    qw = QWeight("fp8" if fmt == "fp8t" else fmt, w, s.view(torch.float8_e8m0fnu))
    if fmt == "fp8t":
        from ds4.ops.linear_cuda import lay_fp8
        return lay_fp8(qw, "1", "rand_qweight", "w")
    return qw


def ll_sum_expected(parts: list[torch.Tensor], round_bf16: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """comm=ll's all-reduce arithmetic in torch: partials (rounded to bf16 first with round_bf16) summed in fp32
    in rank order, the sum rounded to bf16 with round_bf16, cast to out_dtype."""
    acc = torch.zeros_like(parts[0], dtype=torch.float32)
    for p in parts:
        p = p.float()
        acc = acc + (p.to(torch.bfloat16).float() if round_bf16 else p)
    if round_bf16:
        acc = acc.to(torch.bfloat16).float()
    return acc.to(out_dtype)


def poison() -> None:
    """Fill a large cached block with NaN and free it, so the next outputs come from NaN memory."""
    t = torch.full((64 << 20,), float("nan"), device=DEV)
    del t


def require_extension(module: str):
    """Skip the calling test module without CUDA; fail it when CUDA is there but the extension in
    `module` (ds4.kernels or ds4.kernels_attn) cannot build or load. Returns the module."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA", allow_module_level=True)
    mod = importlib.import_module(module)
    why = mod.unavailable_reason()
    if why is not None:
        pytest.fail(f"CUDA is available but the {module} extension is not: {why}", pytrace=False)
    return mod
