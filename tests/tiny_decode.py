"""A CPU helper for tests that compare decode steps of the fp32 `tiny` model under two sets of implementations."""
from __future__ import annotations

from typing import Callable

import torch

from ds4.model.transformer import Transformer
from ds4.runtime.generate import Generator


def decode_logits(args, weights, ops, prompt: list[int], tokens: list[int], max_seq_len: int,
                  after_prefill: Callable[[], None] = lambda: None) -> tuple[torch.Tensor, Transformer]:
    """Prefill `prompt` into a fresh fp32 model with `ops`, call `after_prefill`, decode `tokens` one by one:
    -> (the decode steps' logits stacked [len(tokens), vocab], the model)."""
    m = Transformer(args, ops, "plain", torch.float32)
    m.load_weights(weights)
    g = Generator(m, 1, max_seq_len)
    g.prefill([prompt])
    after_prefill()
    return torch.stack([g.decode(torch.tensor([t]))[0] for t in tokens]), m
