"""Lightning indexer of CSA layers (spec §5.5): picks the top-k compressed entries per query.

scores[t, s] = sum_h w[t, h] * ReLU(qI[t, h] . K[s]),  w = weights_proj(x) * (d^-0.5 * H^-0.5)
`qat` adds the reference's Hadamard rotation + FP4 simulation of q and keys and BF16 scores.
"""
from __future__ import annotations

from typing import Mapping

from torch import Tensor

from ds4.model.args import ModelArgs
from ds4.model.compressor import Compressor
from ds4.model.weights_module import WeightsModule, weight_format
from ds4.ops.base import QWeight


class Indexer(WeightsModule):
    def __init__(self, args: ModelArgs, layer: int, ops, qat: bool):
        super().__init__()
        self.args, self.ops, self.qat = args, ops, qat
        self.m = args.ratio(layer)
        self.compressor = Compressor(args, self.m, args.index_head_dim, overlap=True, for_indexer=True)

    def load(self, t: Mapping[str, Tensor], prefix: str, wq_b: QWeight | None = None) -> None:
        """wq_b: this indexer's wq_b as a row view of the attention's merged wq_bi (held there), or None."""
        if wq_b is None:
            wq_b = self.take_linear("wq_b", t, f"{prefix}.wq_b", weight_format(t[f"{prefix}.wq_b.weight"]))
        self.wq_b = wq_b
        self.weights_proj = self.take("weights_proj", t, f"{prefix}.weights_proj.weight")
        self.compressor.load(t, f"{prefix}.compressor")
        self.n_heads = self.weights_proj.shape[0]  # all index heads: replicated under tensor parallelism

    def query(self, qr: Tensor, x: Tensor, positions: Tensor, freqs: Tensor) -> tuple[Tensor, Tensor]:
        """qr [..., q_lora], x [..., dim], positions [...] -> qI [..., H, d], head weights [..., H] fp32."""
        return self.query_heads(qr, positions, freqs), self.head_weights(x)

    def query_heads(self, qr: Tensor, positions: Tensor, freqs: Tensor) -> Tensor:
        """qr [..., q_lora] (q_norm'ed latent), positions [...] -> qI [..., H, d] (rotated; qat: Hadamard + FP4)."""
        q = self.ops.linear(qr, self.wq_b, act_quant=self.qat).unflatten(-1, (self.n_heads, self.args.index_head_dim))
        q = self.ops.indexer.rope(q, positions, freqs)
        if self.qat:
            q = self.ops.indexer.hadamard_fp4(q)  # fp4_act_quant_sim(hadamard(q), 32)
        return q

    def decode_query(self, qa: Tensor, q_norm: Tensor, eps: float, positions: Tensor,
                     freqs: Tensor) -> tuple[Tensor, Tensor | None]:
        """The decode query from the attention's wq_a latent qa [B, q_lora] -> (qI [B, H, d], rope_freqs):
        q_norm + wq_b as attn.q_up (one launch where its fused GEMV applies) with the RoPE (and under qat the
        Hadamard + FP4 after it) left to scores() (rope_freqs = freqs)."""
        q = self.ops.attn.q_up(qa, q_norm, eps, self.wq_b, self.ops.linear, self.qat)
        return q.unflatten(-1, (self.n_heads, self.args.index_head_dim)), freqs

    def head_weights(self, x: Tensor) -> Tensor:
        """x [..., dim] -> per-head weights [..., H] = bf16(weights_proj(x)) (for bf16 x); scores() applies
        their scale d^-0.5 * H^-0.5 in fp32."""
        return self.ops.indexer.head_weights(x.flatten(0, -2), self.weights_proj).unflatten(0, x.shape[:-1])

    def scores(self, q: Tensor, w: Tensor, keys: Tensor, pos: Tensor | None = None, ratio: int = 1,
               rope_freqs: Tensor | None = None) -> Tensor:
        """q [B, S, H, d], head weights w [B, S, H] (head_weights), keys [B, T, d] -> [B, S, T] (summed over
        all index heads) = sum_h fp32(w) * d^-0.5 * H^-0.5 * ReLU(q . k).
        With decode positions pos [B] (S = 1), entries t >= (pos+1)//ratio (not visible yet) score -inf;
        rope_freqs (decode_query's): q is taken before its RoPE at pos (and under qat before the Hadamard + FP4
        that follow it)."""
        a = self.args
        return self.ops.indexer.scores(q, w, keys, bf16=self.qat, pos=pos, ratio=ratio,
                                       w_scale=a.index_head_dim ** -0.5 * a.index_n_heads ** -0.5,
                                       rope_freqs=rope_freqs, q_fp4=self.qat and rope_freqs is not None)

    def select_decode(self, q: Tensor, w: Tensor, keys: Tensor, k: int, pos: Tensor, ratio: int,
                      rope_freqs: Tensor | None = None) -> Tensor:
        """Decode: q [B, 1, H, d], w [B, 1, H], keys [B, T, d] at positions pos [B] -> indices [B, k] of the top-k
        scores (scores() then topk(), as one implementation op: a row whose visible entries all fit in k needs
        no scores)."""
        a = self.args
        return self.ops.indexer.select(q, w, keys, k, pos, ratio, bf16=self.qat,
                                       w_scale=a.index_head_dim ** -0.5 * a.index_n_heads ** -0.5,
                                       rope_freqs=rope_freqs, q_fp4=self.qat and rope_freqs is not None)

    def select(self, scores: Tensor, visible: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Top-k of the visible entries: scores [B, S, T], visible [B, S, T] bool -> (idx [B, S, k]
        clamped to valid range, valid [B, S, k])."""
        scores = scores.float().masked_fill(~visible, float("-inf"))
        idx = scores.topk(k, dim=-1).indices
        valid = visible.gather(-1, idx)
        return idx, valid
