"""Registry entries of the ds4_attn CUDA implementations (imported by ds4.registry when present).

They use their own availability check (the ds4_attn extension); the attention entries also need the
GEMV/MoE extension (the compressor projection)."""
from __future__ import annotations

import torch

from ds4.registry import Entry


def check(device: torch.device) -> str | None:
    """None when the ds4_attn extension can run on `device`, else the reason."""
    if device.type != "cuda":
        return f"needs a CUDA device (device is {device.type})"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    from ds4 import kernels_attn
    return kernels_attn.unavailable_reason()


def check_attn(device: torch.device) -> str | None:
    """attn=fused_cuda also runs the compressor projection on the ds4 extension's BF16 GEMV."""
    why = check(device)
    if why is None:
        from ds4 import kernels
        why = kernels.unavailable_reason()
    return why


def entries(_shared_check=None):
    return [
        (Entry("attn", "fused_cuda", "ds4.ops.attn_cuda:FusedCudaAttention", check_attn, 10,
               "CUDA decode attention side: q norm/RoPE, window KV write, compressor step, position-masked MQA "
               "flash-decoding (keys loaded once for all heads, BF16 MMA, top-k gather, sink and output "
               "de-rotation in the combine); prefill-sized calls use the torch twins"), ("fused",)),
        (Entry("attn", "fused_cuda_wo_bf16", "ds4.ops.attn_cuda:MergedWoAttention", check_attn, 5,
               "fused_cuda with the seed's phase-6 output projection: wo_b.wo_a precomputed in BF16 (reads 4x "
               "the bytes; an ablation option, never chosen by auto over fused_cuda)"), ()),
        (Entry("indexer", "fused_cuda", "ds4.ops.attn_cuda:FusedCudaIndexer", check, 10,
               "CUDA indexer: q RoPE, position-masked scores over the whole GPU (keys split over blocks, BF16 "
               "MMA, fused ReLU-weighted head sum), radix-select top-k; prefill uses the torch reference"), ()),
        (Entry("hc", "fused_cuda", "ds4.ops.hc_cuda:FusedCudaHC", check, 10,
               "CUDA mHC: split fp32 matvec + finishing kernel (Sinkhorn, weighted sum, block RMSNorm), fused "
               "post"), ()),
    ]
