"""Reference attention and indexer implementations (spec §5), plain PyTorch.

TorchAttention holds every step of the attention side that an implementation may fuse: the norms
and RoPE of the query path, the window KV write, the compressor decode step, the sparse attention
core (prefill form with masks, decode form with positions) and the output de-rotation. Each method
is the plain-torch twin a CUDA implementation is tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ds4.model import compressor
from ds4.model.norm import rms_norm, unweighted_rms_norm
from ds4.model.rope import rope_heads
from ds4.ops import side_stream
from ds4.ops.base import QWeight, RowSkip
from ds4.quant import fp4_act_quant_sim, hadamard


# The decode branches an attention implementation may put on side streams: name -> (the environment
# variable that keeps it in line when "0", side-stream slot). Branches live at once have distinct slots.
BRANCHES = {"compress": ("DS4_COMPRESS_OVERLAP", 0), "icompress": ("DS4_COMPRESS_OVERLAP", 1),
            "kv": ("DS4_ATTN_OVERLAP", 2), "indexer": ("DS4_ATTN_OVERLAP", 3)}


def branch_env_slot(name: str) -> tuple[str, int]:
    if name not in BRANCHES:
        raise ValueError(f"unknown decode branch {name!r} (one of {sorted(BRANCHES)})")
    return BRANCHES[name]


def apply_row_skip(y: Tensor, skip: RowSkip | None) -> Tensor:
    """y [N, O] with columns [skip.rows:] zeroed in the rows where skip applies (decided on the device)."""
    if skip is None:
        return y
    zero = skip.applies()[:, None]  # [N, 1]: no host sync
    return torch.cat([y[:, :skip.rows], torch.where(zero, torch.zeros((), dtype=y.dtype, device=y.device),
                                                    y[:, skip.rows:])], -1)


class TorchAttention:
    name = "torch"

    # ---- query / window KV path ------------------------------------------------------------------
    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """Weighted RMSNorm in fp32, result in x.dtype (q_norm on the q-LoRA latent)."""
        return rms_norm(x, weight, eps)

    def q_up(self, qa: Tensor, weight: Tensor, eps: float, wq_b: QWeight, linear, act_quant: bool,
             skip: RowSkip | None = None) -> Tensor:
        """qa [N, q_lora] (wq_a output) -> wq_b(rms_norm(qa)) [N, H*D]: q_norm, then wq_b through `linear`.
        skip (decode): the rows where skip.applies(pos) have zeros in columns skip.rows: (see RowSkip)."""
        return apply_row_skip(linear(self.rms_norm(qa, weight, eps), wq_b, act_quant=act_quant), skip)

    def head_rope(self, x: Tensor, positions: Tensor, freqs: Tensor, norm: bool, eps: float) -> Tensor:
        """x [N, H, D] at positions [N] -> (norm: per-head unweighted RMSNorm) + RoPE of the last dims."""
        if norm:
            x = unweighted_rms_norm(x, eps)
        return rope_heads(x, positions, freqs)

    def kv_store(self, win: Tensor, kv: Tensor, weight: Tensor, pos: Tensor, freqs: Tensor, eps: float,
                 fp8_nope: bool) -> None:
        """win [B, W, D] ring buffer; kv [B, D] raw wkv output -> win[b, pos % W] = norm, RoPE, (qat) FP8 nope."""
        rows = torch.arange(kv.shape[0], device=kv.device)
        win[rows, pos % win.shape[1]] = compressor.finish_entry(kv, weight, eps, pos, freqs, "fp8" if fp8_nope else None)

    def branch(self, x: Tensor, name: str) -> side_stream.Branch:
        """Where a decode step's independent piece runs (`name`: "compress" / "icompress" — the compressor
        steps, "kv" — the window write, "indexer" — the indexer query and scores): `with branch:` around
        it, `branch.join()` before anything reads what it writes. In line here."""
        branch_env_slot(name)
        return side_stream.Branch(None, x.device)

    def compress_project(self, x: Tensor, w: Tensor) -> Tensor:
        """The compressor's merged [wkv; wgate] projection: x [N, dim] -> fp32 [N, rows] (w [rows, dim], the
        reference's fp32-held BF16 values; see ds4.model.compressor.project_f32)."""
        return compressor.project_f32(x, w)

    def compress_step(self, kvz: Tensor, ape: Tensor, norm: Tensor, pos: Tensor, freqs: Tensor, skv: Tensor,
                      ssc: Tensor, cache: Tensor, m: int, overlap: bool, eps: float, quant: str | None) -> None:
        """The compressor decode step (ds4.model.compressor.decode_step)."""
        compressor.decode_step(kvz, ape, norm, pos, freqs, skv, ssc, cache, m, overlap, eps, quant)

    def compress_deferred(self, x: Tensor, ring: Tensor, w: Tensor, ape: Tensor, norm: Tensor, pos: Tensor,
                          freqs: Tensor, skv: Tensor, ssc: Tensor, cache: Tensor, m: int, overlap: bool, eps: float,
                          quant: str | None) -> None:
        """The compressor decode step with its projection deferred to every n-th token (ring [B, n, dim];
        ds4.model.compressor.decode_step_deferred)."""
        compressor.decode_step_deferred(x, ring, w, ape, norm, pos, freqs, skv, ssc, cache, m, overlap, eps, quant)

    # ---- output projection -----------------------------------------------------------------------
    def out_proj(self, o: Tensor, wo_a: QWeight, wo_b: QWeight, groups: int, linear, act_quant: bool,
                 fold=None) -> Tensor:
        """o [N, H*D] (de-rotated heads, flattened) -> [N, dim] before the all-reduce: grouped wo_a
        (block-diagonal over the o-groups) then wo_b, both in their stored formats through `linear`
        (which may fold the next mHC step into wo_b: `fold`, LinearImpl.__call__)."""
        u = linear.grouped(o.unflatten(-1, (groups, -1)), wo_a, groups).flatten(-2)   # [N, G*R]
        return linear(u, wo_b, act_quant=act_quant, fold=fold)

    # ---- attention core --------------------------------------------------------------------------
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

    def decode(self, q: Tensor, win: Tensor, pos: Tensor, ext: Tensor | None, ext_idx: Tensor | None, ratio: int,
               sink: Tensor, scale: float, freqs: Tensor, q_norm_eps: float | None = None) -> Tensor:
        """Decode attention of one query per row at positions pos [B], output de-rotated.

        q [B, H, D] (q_norm_eps given: before head_rope(q, pos, freqs, True, q_norm_eps), applied
        here first); win [B, W, D] window ring (slot j valid iff j <= pos); ext [B, T, D] compressed
        entries (entry e visible iff e < (pos+1)//ratio): all of them (HCA, ext_idx None) or the
        ext_idx [B, k] selected ones (CSA). -> [B, H, D] with the RoPE dims rotated back by pos."""
        if q_norm_eps is not None:
            q = self.head_rope(q, pos, freqs, True, q_norm_eps)
        B, W = win.shape[:2]
        dev = q.device
        valid = torch.arange(W, device=dev).unsqueeze(0) <= pos.unsqueeze(-1)       # [B, W]
        keys, sel, sel_valid = win, None, None
        if ext is not None:
            n_vis = ((pos + 1) // ratio).unsqueeze(-1)
            if ext_idx is None:
                keys = torch.cat((win, ext), 1)
                valid = torch.cat((valid, torch.arange(ext.shape[1], device=dev).unsqueeze(0) < n_vis), 1)
            else:
                sel = ext[torch.arange(B, device=dev).unsqueeze(-1), ext_idx].unsqueeze(1)  # [B, 1, k, D]
                sel_valid = (ext_idx < n_vis).unsqueeze(1)
        o = self.sparse(q.unsqueeze(1), keys, valid.unsqueeze(1), sel, sel_valid, sink, scale)[:, 0]
        return rope_heads(o, pos, freqs, inverse=True)


class TorchIndexer:
    name = "torch"

    def rope(self, q: Tensor, positions: Tensor, freqs: Tensor) -> Tensor:
        """Indexer query q [N, H, d] at positions [N] -> RoPE of the last dims (no norm)."""
        return rope_heads(q, positions, freqs)

    def hadamard_fp4(self, q: Tensor) -> Tensor:
        """numerics=qat's indexer query simulation (the reference's Hadamard rotation, then FP4 in blocks of 32):
        q [..., d] -> the same shape and dtype."""
        return fp4_act_quant_sim(hadamard(q), 32)

    def topk(self, scores: Tensor, k: int, pos: Tensor | None = None, ratio: int = 1) -> Tensor:
        """scores [B, T] -> int64 [B, k] indices of the k largest (the selection; order irrelevant).
        pos / ratio: entries t >= (pos+1)//ratio are -inf (a hint for kernels that can skip them; which of
        the tied -inf entries fill a short selection does not matter, attention masks them)."""
        return scores.float().topk(k, dim=-1).indices

    def select(self, q: Tensor, w: Tensor, keys: Tensor, k: int, pos: Tensor, ratio: int = 1, bf16: bool = False,
               w_scale: float = 1.0, rope_freqs: Tensor | None = None, q_fp4: bool = False) -> Tensor:
        """The decode selection: q [B, 1, H, d] at positions pos [B] -> int64 [B, k], the top-k of scores()
        (arguments as there; invisible entries score -inf)."""
        sc = self.scores(q, w, keys, bf16=bf16, pos=pos, ratio=ratio, w_scale=w_scale, rope_freqs=rope_freqs,
                         q_fp4=q_fp4)
        return self.topk(sc[:, 0], k, pos, ratio)

    def head_weights(self, x: Tensor, weight: Tensor) -> Tensor:
        """x [N, dim], weights_proj [H, dim] -> [N, H] in x's dtype (bf16(x @ W^T) for bf16 x); the
        scale d^-0.5 H^-0.5 is scores()' w_scale."""
        return F.linear(x, weight.to(x.dtype))

    def scores(self, q: Tensor, w: Tensor, keys: Tensor, bf16: bool = False, pos: Tensor | None = None,
               ratio: int = 1, w_scale: float = 1.0, rope_freqs: Tensor | None = None,
               q_fp4: bool = False) -> Tensor:
        """q [B, S, H, d], head weights w [B, S, H] (any float dtype), keys [B, T, d] -> [B, S, T] =
        sum_h (fp32(w) * w_scale) * ReLU(q . k).

        `bf16` reproduces the reference's BF16 einsum/ReLU/weighted sum (qat mode); otherwise fp32.
        pos [B] (decode, S = 1): entries t >= (pos+1)//ratio are not visible yet and score -inf.
        rope_freqs (decode, with pos): q is taken before its RoPE, rope(q, pos, rope_freqs) first; q_fp4 (with
        rope_freqs, numerics=qat): and before hadamard_fp4, applied after the RoPE."""
        if q_fp4 and rope_freqs is None:
            raise ValueError("indexer scores: q_fp4 applies after the query's RoPE, so it needs rope_freqs")
        if rope_freqs is not None:
            if pos is None or q.shape[1] != 1:
                raise ValueError("indexer scores: rope_freqs needs decode positions and one query per row")
            q = self.rope(q[:, 0], pos, rope_freqs)[:, None]
            if q_fp4:
                q = self.hadamard_fp4(q)
        w = w.float() if w_scale == 1.0 else w.float() * w_scale
        if bf16:
            s = torch.einsum("bshd,btd->bsht", q.bfloat16(), keys.bfloat16()).relu()
            out = (s * w.bfloat16().unsqueeze(-1)).sum(2)
        else:
            s = torch.einsum("bshd,btd->bsht", q.float(), keys.float()).relu()
            out = (s * w.unsqueeze(-1)).sum(2)
        if pos is not None:
            t = torch.arange(keys.shape[1], device=keys.device)
            out = out.masked_fill((t >= ((pos + 1) // ratio).unsqueeze(-1)).unsqueeze(1), float("-inf"))
        return out
