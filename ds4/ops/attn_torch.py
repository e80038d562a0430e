"""Reference attention core and indexer scoring (spec §5.5, §5.7), plain PyTorch."""
from __future__ import annotations

import torch
from torch import Tensor


class TorchAttention:
    name = "torch"

    def sparse(self, q: Tensor, kv: Tensor, valid: Tensor, sel_kv: Tensor | None, sel_valid: Tensor | None,
               sink: Tensor, scale: float) -> Tensor:
        """One softmax over shared keys and per-query selected keys, with the attention sink.

        q [B, S, H, D]; kv [B, K, D] keys (= values) shared by the S queries of a row, valid
        [B, S, K]; sel_kv [B, S, P, D] per-query keys (CSA top-k entries), sel_valid [B, S, P];
        sink [H] enters only the denominator. Scores in fp32, probabilities rounded to the
        activation dtype before P.V (as the reference kernel does). Returns [B, S, H, D]."""
        qf = q.float()
        s = torch.einsum("bshd,bkd->bshk", qf, kv.float()) * scale
        s = s.masked_fill(~valid.unsqueeze(2), float("-inf"))
        parts = [s]
        if sel_kv is not None:
            s2 = torch.einsum("bshd,bspd->bshp", qf, sel_kv.float()) * scale
            parts.append(s2.masked_fill(~sel_valid.unsqueeze(2), float("-inf")))
        sink_col = sink.float().view(1, 1, -1, 1).expand(*s.shape[:3], 1)
        logits = torch.cat(parts + [sink_col], -1)
        p = logits.softmax(-1)[..., :-1].to(q.dtype).float()
        k1 = kv.shape[1]
        out = torch.einsum("bshk,bkd->bshd", p[..., :k1], kv.float())
        if sel_kv is not None:
            out = out + torch.einsum("bshp,bspd->bshd", p[..., k1:], sel_kv.float())
        return out.to(q.dtype)


class TorchIndexer:
    name = "torch"

    def scores(self, q: Tensor, w: Tensor, keys: Tensor, bf16: bool = False) -> Tensor:
        """q [B, S, H, d], w [B, S, H] fp32, keys [B, T, d] -> [B, S, T] = sum_h w * ReLU(q . k).

        `bf16` reproduces the reference's BF16 einsum/ReLU/weighted sum (qat mode); otherwise fp32."""
        if bf16:
            s = torch.einsum("bshd,btd->bsht", q.bfloat16(), keys.bfloat16()).relu()
            return (s * w.bfloat16().unsqueeze(-1)).sum(2)
        s = torch.einsum("bshd,btd->bsht", q.float(), keys.float()).relu()
        return (s * w.unsqueeze(-1)).sum(2)
