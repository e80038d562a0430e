"""Collectives the model calls. `SingleProcess` is the world-size-1 identity; the
tensor-parallel implementation (torch.distributed) plugs in behind the same two methods."""
from __future__ import annotations

from torch import Tensor


class SingleProcess:
    rank, world = 0, 1

    def all_reduce(self, x: Tensor, site: str) -> Tensor:
        """Sum partial results over ranks (site: 'attn', 'moe', 'indexer' for profiling/precision)."""
        return x

    def gather_vocab(self, logits: Tensor) -> Tensor:
        """Concatenate vocab-parallel logits [..., V/W] over ranks -> [..., V]."""
        return logits
