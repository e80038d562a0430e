"""Next-token selection on the device: greedy, temperature, top-k, top-p, seeded. No host sync."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"invalid sampling settings {self}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: Tensor, s: Sampling, generator: torch.Generator | None = None) -> Tensor:
    """logits [B, V] fp32 -> token ids [B] int64."""
    if s.greedy:
        return logits.argmax(-1)
    logits = logits.float() / s.temperature
    if s.top_k:
        kth = logits.topk(min(s.top_k, logits.shape[-1]), -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if s.top_p < 1:
        sp, si = probs.sort(-1, descending=True)
        drop = sp.cumsum(-1) - sp > s.top_p          # keep the smallest prefix whose mass reaches top_p
        probs = probs.scatter(-1, si, sp.masked_fill(drop, 0))
    # Gumbel-max in its exponential form (as the official generate.py): argmax(p / E), E ~ Exp(1).
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / noise).argmax(-1)
