"""Registry entries of the ds4_attn CUDA implementations (imported by ds4.registry when present).

They use their own availability check (the ds4_attn extension); the attention entries also need the
GEMV/MoE extension (the compressor projection)."""
from __future__ import annotations

import torch

from ds4.registry import Entry, Setup


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


BF16 = (torch.bfloat16,)


# (the limits are read from ds4.ops.attn_cuda when an entry is resolved: its factory imports the module right after)
def _attn_caveats(s: Setup) -> list[str]:
    from ds4.ops.attn_cuda import GEMV_MAX_ROWS
    out = []
    if s.max_batch > 1 and s.index_len:
        out.append(f"decode batch {s.max_batch} > 1: q_norm apart from the merged wq_b GEMV, and the index query's "
                   "skipped rows zeroed by torch ops after it")
    if s.max_batch > GEMV_MAX_ROWS:
        out.append(f"decode batch {s.max_batch} > {GEMV_MAX_ROWS}: the compressors' projection by torch matmuls")
    return out


def _indexer_caveats(s: Setup) -> list[str]:
    from ds4.ops.attn_cuda import GEMV_MAX_ROWS, INDEXER_MAX_ROWS
    if s.max_batch > INDEXER_MAX_ROWS:
        return [f"decode batch {s.max_batch} > {INDEXER_MAX_ROWS}: the torch reference's scores and head weights"]
    out = []
    if s.max_batch > GEMV_MAX_ROWS:
        out.append(f"decode batch {s.max_batch} > {GEMV_MAX_ROWS}: the head weights by torch matmuls")
    from ds4 import kernels_attn  # (its check passed: the extension loads)
    if s.index_len > kernels_attn.ONE_BLOCK_TOPK_LEN and not kernels_attn.topk_ok(s.max_batch, s.index_len):
        out.append(f"decode batch {s.max_batch} over {s.index_len} indexer entries a row: the top-k by torch.topk "
                   "(the wide top-k's blocks do not fit on this GPU at once, or DS4_TOPK_WIDE=0)")
    return out


def entries(_shared_check=None):
    return [
        (Entry("attn", "fused_cuda", "ds4.ops.attn_cuda:FusedCudaAttention", check_attn, 10,
               "CUDA decode attention side: q norm/RoPE, window KV write, compressor step, position-masked MQA "
               "flash-decoding (keys loaded once for all heads, BF16 MMA, top-k gather, sink and output "
               "de-rotation in the combine); prefill-sized calls use the torch twins", dtypes=BF16,
               caveats=_attn_caveats, ds4_ext=True), ("fused",)),
        (Entry("attn", "fused_cuda_wo_bf16", "ds4.ops.attn_cuda:MergedWoAttention", check_attn, 5,
               "fused_cuda with the seed's phase-6 output projection: wo_b.wo_a precomputed in BF16 (reads 4x "
               "the bytes; an ablation option, never chosen by auto over fused_cuda)", dtypes=BF16,
               caveats=_attn_caveats, ds4_ext=True), ()),
        # (check_attn: its head weights run on the ds4 extension's BF16 GEMV too)
        (Entry("indexer", "fused_cuda", "ds4.ops.attn_cuda:FusedCudaIndexer", check_attn, 10,
               "CUDA indexer: q RoPE, position-masked scores over the whole GPU (keys split over blocks, BF16 "
               "MMA, fused ReLU-weighted head sum), radix-select top-k; prefill uses the torch reference",
               dtypes=BF16, caveats=_indexer_caveats, ds4_ext=True), ()),
        (Entry("hc", "fused_cuda", "ds4.ops.hc_cuda:FusedCudaHC", check, 10,
               "CUDA mHC: split fp32 matvec + finishing kernel (Sinkhorn, weighted sum, block RMSNorm), fused "
               "post", dtypes=(torch.bfloat16, torch.float32)), ()),
    ]
