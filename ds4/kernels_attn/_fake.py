"""Fake (meta) implementations of torch.ops.ds4_attn.* for FakeTensor tracing / torch.compile.
Imported by ds4.kernels_attn.load() once the library has registered the op schemas."""
from __future__ import annotations

import torch
from torch.library import register_fake


@register_fake("ds4_attn::hc_pre")
def _hc_pre(h, fn, scale, base, iters, hc_eps, norm_eps, norm=None):
    n_tok, n, d = h.shape
    return (h.new_empty((n_tok, d)), h.new_empty((n_tok, n), dtype=torch.float32),
            h.new_empty((n_tok, n, n), dtype=torch.float32))


@register_fake("ds4_attn::hc_head")
def _hc_head(h, fn, scale, base, hc_eps, norm_eps, norm=None):
    return h.new_empty((h.shape[0], h.shape[2]))


@register_fake("ds4_attn::hc_sinkhorn")
def _hc_sinkhorn(comb, iters, hc_eps):
    return None


@register_fake("ds4_attn::hc_post")
def _hc_post(x, res, post, comb):
    return torch.empty_like(res)


@register_fake("ds4_attn::hc_post_pre")
def _hc_post_pre(x, res, post, comb, fn, scale, base, iters, hc_eps, norm_eps, norm=None):
    n_tok, n, d = res.shape
    return (torch.empty_like(res), res.new_empty((n_tok, d)), res.new_empty((n_tok, n), dtype=torch.float32),
            res.new_empty((n_tok, n, n), dtype=torch.float32))


@register_fake("ds4_attn::hc_post_pre_router")
def _hc_post_pre_router(x, res, post, comb, fn, scale, base, iters, hc_eps, norm_eps, norm, gate):
    n_tok, n, d = res.shape
    return (torch.empty_like(res), res.new_empty((n_tok, d)), res.new_empty((n_tok, n), dtype=torch.float32),
            res.new_empty((n_tok, n, n), dtype=torch.float32), res.new_empty((n_tok, gate.shape[0]), dtype=torch.float32))


@register_fake("ds4_attn::hc_fold_finish")
def _hc_fold_finish(h, part, scale, base, iters, hc_eps, norm_eps, norm=None, gate=None):
    n_tok, n, d = h.shape
    e = 0 if gate is None else gate.shape[0]
    return (h.new_empty((n_tok, d)), h.new_empty((n_tok, n), dtype=torch.float32),
            h.new_empty((n_tok, n, n), dtype=torch.float32), h.new_empty((n_tok, e), dtype=torch.float32))


@register_fake("ds4_attn::hc_fold_finish_proj")
def _hc_fold_finish_proj(h, part, scale, base, iters, hc_eps, norm_eps, norm, w, ws):
    n_tok, n, d = h.shape
    return (h.new_empty((n_tok, d)), h.new_empty((n_tok, n), dtype=torch.float32),
            h.new_empty((n_tok, n, n), dtype=torch.float32), h.new_empty((n_tok, w.shape[0])))


@register_fake("ds4_attn::sparse_attn")
def _sparse_attn(q, kv, valid, sel_kv, sel_valid, sink, scale):
    return torch.empty_like(q)


@register_fake("ds4_attn::indexer_scores")
def _indexer_scores(q, w, keys, bf16, pos=None, ratio=1, w_scale=1.0, rope_freqs=None, q_fp4=False):
    b, s = q.shape[:2]
    return q.new_empty((b, s, keys.shape[1]), dtype=torch.bfloat16 if bf16 else torch.float32)


@register_fake("ds4_attn::indexer_select")
def _indexer_select(q, w, keys, k, bf16, pos, ratio=1, w_scale=1.0, rope_freqs=None, q_fp4=False):
    return q.new_empty((q.shape[0], k), dtype=torch.long)


@register_fake("ds4_attn::sparse_decode")
def _sparse_decode(q, win, pos, ext, ext_idx, ratio, sink, scale, freqs, q_norm_eps=None, comb=None, iters=0,
                   hc_eps=0.0):
    return torch.empty_like(q)


@register_fake("ds4_attn::topk")
def _topk(scores, k, pos=None, ratio=1):
    return scores.new_empty((scores.shape[0], k), dtype=torch.long)


@register_fake("ds4_attn::rms_norm")
def _rms_norm(x, weight, eps):
    return torch.empty_like(x)


@register_fake("ds4_attn::head_rope")
def _head_rope(x, pos, freqs, norm, eps):
    return torch.empty_like(x)


@register_fake("ds4_attn::kv_store")
def _kv_store(win, kv, weight, pos, freqs, eps, fp8_nope):
    return None


@register_fake("ds4_attn::compress_step")
def _compress_step(kvz, ape, norm, pos, freqs, skv, ssc, cache, m, overlap, eps, fp8_nope, tokens=1, fp4=False):
    return None


@register_fake("ds4_attn::hadamard_fp4")
def _hadamard_fp4(x):
    return torch.empty_like(x)
