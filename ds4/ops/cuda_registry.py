"""Registry entries of the CUDA implementations (imported by ds4.registry when present)."""
from __future__ import annotations

from ds4.registry import Entry, Setup

# (the limits the implementations' modules hold; not imported from them: that would load the CUDA wrappers)
GEMV_MAX_TOKENS = 16      # ds4.ops.linear_cuda.PREFILL_TOKENS
BF16_CACHE_MAX_TOKENS = 8  # ds4.ops.moe_cuda.PREFILL_TOKENS


def _gemv_caveats(s: Setup) -> list[str]:
    out = []
    if s.weight_dtype == "bf16":
        out.append("BF16 dense weights: torch matmuls, as linear=dequant")
    if s.max_batch > GEMV_MAX_TOKENS:
        out.append(f"decode batch {s.max_batch} > {GEMV_MAX_TOKENS}: dequantise + torch matmul per step")
    return out


def _bf16_cache_caveats(_s: Setup) -> list[str]:
    return [f"calls over {BF16_CACHE_MAX_TOKENS} tokens (prompts): the torch reference's experts (moe=dequant)"]


def entries(check):
    """check(device) -> None or the reason the compiled extension cannot run there."""
    return [
        (Entry("linear", "gemv_cuda", "ds4.ops.linear_cuda:GemvCudaLinear", check, 10,
               "CUDA FP8/MXFP4 GEMV on stored bytes + E8M0 scales, 1-16 tokens (prefill: dequant + matmul)",
               caveats=_gemv_caveats), ()),
        (Entry("moe", "fp4_topk", "ds4.ops.moe_cuda:Fp4TopkMoE", check, 10,
               "CUDA router + all top-k MXFP4 experts in two launches (ids on the device) + fused FP8 shared expert"), ()),
        (Entry("moe", "bf16_cache", "ds4.ops.moe_cuda:Bf16CacheMoE", check, 5,
               "seed phase 5: LRU cache of dequantised BF16 hot experts (host sync per layer) + BF16/FP4 kernels; "
               "calls over 8 tokens take the torch reference's experts", caveats=_bf16_cache_caveats), ()),
    ]
