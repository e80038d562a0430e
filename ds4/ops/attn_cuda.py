"""attn=fused_cuda (alias fused) and indexer=fused_cuda: CUDA kernels of the ds4_attn extension.

FusedCudaAttention.sparse — decode (S = 1 query per row, any B): MQA flash-decoding. Each block
loads 32 key rows once (window/HCA keys, then the row's selected keys) and serves all H heads with
BF16 tensor-core MMAs; online-softmax partials per chunk; a combine kernel adds the sink to the
denominator only. Probabilities are rounded to bf16 before P.V like the reference. Needs bf16 q / kv
/ sel_kv and D % 64 == 0. Prefill (S > 1), other dtypes or shapes call TorchAttention.sparse: that
dispatch (by shape/dtype only, never by values) is part of this implementation.

FusedCudaIndexer.scores — decode (B*S <= 16 query rows): keys split over blocks of 64 (the whole GPU
works on a long cache), all heads per block on BF16 tensor cores, ReLU-weighted head sum fused.
bf16=True reproduces the reference's BF16 einsum/ReLU/product. Prefill-sized calls, fp32 q / keys
and index dims not a multiple of 16 call TorchIndexer.scores (part of this implementation). Top-k
stays torch.topk on the device (no host sync).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ds4 import kernels_attn
from ds4.ops.attn_torch import TorchAttention, TorchIndexer

BF16 = torch.bfloat16
INDEXER_MAX_ROWS = 16


class FusedCudaAttention:
    name = "fused_cuda"

    def __init__(self):
        self._ref = TorchAttention()

    def sparse(self, q: Tensor, kv: Tensor, valid: Tensor, sel_kv: Tensor | None, sel_valid: Tensor | None,
               sink: Tensor, scale: float) -> Tensor:
        use = (q.is_cuda and q.shape[1] == 1 and q.dtype == BF16 and kv.dtype == BF16
               and (sel_kv is None or sel_kv.dtype == BF16) and q.shape[-1] % 64 == 0)
        if not use:
            return self._ref.sparse(q, kv, valid, sel_kv, sel_valid, sink, scale)
        return kernels_attn.sparse_attn(q, kv, valid, sel_kv, sel_valid, sink, scale)


class FusedCudaIndexer:
    name = "fused_cuda"

    def __init__(self):
        self._ref = TorchIndexer()

    def scores(self, q: Tensor, w: Tensor, keys: Tensor, bf16: bool = False) -> Tensor:
        use = (q.is_cuda and q.dtype == BF16 and keys.dtype == BF16 and q.shape[-1] % 16 == 0
               and q.shape[0] * q.shape[1] <= INDEXER_MAX_ROWS)
        if not use:
            return self._ref.scores(q, w, keys, bf16)
        return kernels_attn.indexer_scores(q, w, keys, bf16)
