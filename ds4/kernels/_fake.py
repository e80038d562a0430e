"""Fake (meta) implementations of torch.ops.ds4.* for torch.compile / FakeTensor tracing.
Imported by ds4.kernels.load() once the library has registered the op schemas."""
from __future__ import annotations

import torch
from torch.library import register_fake

from ds4.kernels.ops import KERNEL_SPLITK


@register_fake("ds4::gemv")
def _gemv(x, w, scale, fmt, groups=1, kernel=0, out_f32=False, act_quant=False):
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32 if out_f32 else torch.bfloat16)


@register_fake("ds4::gemv_deferred")
def _gemv_deferred(x, ring, w, pos):
    return x.new_empty((ring.shape[0], w.shape[0]), dtype=torch.float32)


@register_fake("ds4::gemv_rmsnorm")
def _gemv_rmsnorm(x, w, scale, fmt, norm_weight, eps, skip_pos=None, skip_ratio=1, skip_k=0, skip_rows=0,
                  act_quant=False):
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.bfloat16)


@register_fake("ds4::moe_gate_up")
def _gate_up(x, ids, route_w, w1, s1, w3, s3, ptrs, fmt, expert_offset, n_local, limit, kernel=0, route_logits=None,
             route_bias=None, tid2eid=None, token_ids=None, route_scale=1.0, act_quant=False, w2=None, s2=None):
    k = 1 if ids is None else ids.shape[1]
    if kernel in KERNEL_SPLITK.values():  # the split-K pair's partial rows (their count: the device's resident wave)
        rows = torch.ops.ds4.moe_splitk_rows(fmt, k, x.shape[1], w1.shape[-2])
        return x.new_empty((rows, x.shape[1]), dtype=torch.float32)
    return x.new_empty((x.shape[0] * k, w1.shape[-2]), dtype=torch.bfloat16)


@register_fake("ds4::gemv_fold")
def _gemv_fold(x, w, scale, fmt, res, post, comb, fn, out, part, act_quant=False):
    return x.new_empty((1, w.shape[0]), dtype=torch.bfloat16)


@register_fake("ds4::moe_down")
def _down(h, ids, topk, w2, s2, ptrs, fmt, expert_offset, n_local, add, out_f32, kernel=0, route_logits=None,
          route_bias=None, tid2eid=None, token_ids=None, route_scale=1.0, fold_res=None, fold_post=None,
          fold_comb=None, fold_fn=None, fold_out=None, fold_part=None, act_quant=False):
    n = 1 if kernel in KERNEL_SPLITK.values() else h.shape[0] // topk  # (splitk: h holds the partial rows of one token)
    return h.new_empty((n, w2.shape[-2]), dtype=torch.float32 if out_f32 else torch.bfloat16)


@register_fake("ds4::moe_ffn")
def _moe_ffn(x, ids, route_w, w1, s1, w3, s3, w2, s2, expert_offset, limit, sw1, ss1, sw3, ss3, sw2, ss2,
             fold_res=None, fold_post=None, fold_comb=None, fold_fn=None, fold_out=None, fold_part=None, shared_h=None):
    return x.new_empty((1, x.shape[1]), dtype=torch.bfloat16)


@register_fake("ds4::router")
def _router(x, gate, bias, tid2eid, token_ids, topk, route_scale, logits=None, comb=None, iters=0, hc_eps=0.0):
    n = x.shape[0]
    return x.new_empty((n, topk), dtype=torch.float32), x.new_empty((n, topk), dtype=torch.int64)


@register_fake("ds4::argmax")
def _argmax(x):
    return x.new_empty((x.shape[0],), dtype=torch.int64)


@register_fake("ds4::act_quant_sim")
def _act_quant_sim(x, block):
    return torch.empty_like(x)


@register_fake("ds4::dequant")
def _dequant(w, scale, fmt, out):
    return None


@register_fake("ds4::all_reduce_ll")
def _all_reduce_ll(x, peers, counters, rank, cap, round_bf16, out_f32):
    return x.new_empty(x.shape, dtype=torch.float32 if out_f32 else torch.bfloat16)


@register_fake("ds4::all_reduce_ll_fold")
def _all_reduce_ll_fold(x, peers, counters, rank, cap, round_bf16, res, post, comb, fn, out, part):
    return x.new_empty(x.shape, dtype=torch.bfloat16)


@register_fake("ds4::l2_prefetch")
def _l2_prefetch(t0, t1, t2, t3, ids, id_offset):
    return None
