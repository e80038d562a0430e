"""Next-token selection on the device: greedy, temperature, top-k, top-p, seeded. No host sync."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ds4 import kernels


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off
    seed: int = 0

    def __post_init__(self):
        bad = [f"{k} {v} ({rule})" for k, v, ok, rule in (
            ("temperature", self.temperature, self.temperature >= 0, "0 = greedy, else > 0"),
            ("top_k", self.top_k, self.top_k >= 0, "0 = off, else >= 1"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1], 1 = off")) if not ok]
        if bad:
            raise ValueError("invalid sampling settings: " + "; ".join(bad))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def argmax(x: Tensor, chunk: int = 128, kernel: bool = False) -> Tensor:
    """x [..., V] -> int64 [...]: index of the first maximal value, as torch.argmax(-1).

    kernel (the run's implementations use the ds4 extension: registry.Ops.ds4_ext) and x an fp32 [B <= 64, V]
    CUDA tensor: the extension's one-launch argmax kernel (the same index, NaN counting as the largest as in
    torch). Otherwise in two reductions (within chunks of `chunk` values, then over the chunks' maxima): torch
    reduces one [1, V] row in one block, 36.7 us for V = 129280 on H200. The run says which: a job of a sweep
    times the same argmax whether or not an earlier job of its process loaded the extension."""
    if (kernel and x.is_cuda and x.dtype == torch.float32 and x.dim() == 2
            and 1 <= x.shape[0] <= kernels.ARGMAX_MAX_ROWS and x.shape[-1] >= 1):
        return kernels.argmax(x.contiguous())
    v = x.shape[-1]
    if v % chunk or v < 4 * chunk:
        return x.argmax(-1)
    xc = x.unflatten(-1, (v // chunk, chunk))                      # [..., C, chunk]
    i = xc.argmax(-1, keepdim=True)                                # [..., C, 1] first max in each chunk
    c = xc.gather(-1, i).squeeze(-1).argmax(-1, keepdim=True)      # [..., 1] first chunk holding the max
    return (c * chunk + i.squeeze(-1).gather(-1, c)).squeeze(-1)


def sample(logits: Tensor, s: Sampling, generator: torch.Generator | None = None, kernel: bool = False) -> Tensor:
    """logits [B, V] fp32 -> token ids [B] int64 (kernel: greedy takes the extension's argmax, see argmax)."""
    if s.greedy:
        return argmax(logits, kernel=kernel)
    logits = logits.float()
    # the max subtracted first: a tiny temperature then sends the others to -inf, not every logit to inf (NaN)
    logits = (logits - logits.amax(-1, keepdim=True)) / s.temperature
    if s.top_k:
        kth = logits.topk(min(s.top_k, logits.shape[-1]), -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if s.top_p < 1:
        sp, si = probs.sort(-1, descending=True)
        drop = sp.cumsum(-1) - sp >= s.top_p         # keep the smallest prefix whose mass reaches top_p
        probs = probs.scatter(-1, si, sp.masked_fill(drop, 0))
    # Gumbel-max in its exponential form (as the official generate.py): argmax(p / E), E ~ Exp(1).
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / noise).argmax(-1)
