"""Registry entries of the CUDA implementations (imported by ds4.registry when present)."""
from __future__ import annotations

from ds4.registry import Entry


def entries(check):
    """check(device) -> None or the reason the compiled extension cannot run there."""
    return [
        (Entry("linear", "gemv_cuda", "ds4.ops.linear_cuda:GemvCudaLinear", check, 10,
               "CUDA FP8/MXFP4 GEMV on stored bytes + E8M0 scales, 1-16 tokens (prefill: dequant + matmul)"), ()),
        (Entry("moe", "fp4_topk", "ds4.ops.moe_cuda:Fp4TopkMoE", check, 10,
               "CUDA router + all top-k MXFP4 experts in two launches (ids on the device) + fused FP8 shared expert"), ()),
        (Entry("moe", "bf16_cache", "ds4.ops.moe_cuda:Bf16CacheMoE", check, 5,
               "seed phase 5: LRU cache of dequantised BF16 hot experts (host sync per layer) + BF16/FP4 kernels"), ()),
    ]
