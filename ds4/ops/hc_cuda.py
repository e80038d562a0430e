"""hc=fused_cuda: mHC pre / post / head (spec §4) as CUDA kernels of the ds4_attn extension.

pre:  2 launches (RMS + the (2+hc)*hc x hc*D fp32 matvec split over ~128 blocks per token into
      partials; a finishing kernel doing sigmoids, Sinkhorn in ds4.ops.hc_torch.sinkhorn's exact op
      order, and the weighted sum of the streams; given the block's norm weight, one block per token
      that also RMS-normalises the collapsed stream — still 2 launches).
head: the same 2 launches without post/comb/Sinkhorn.  post: 1 elementwise launch.
post_pre (a block's post followed by the next site's pre): 2 launches; the first forms the post's
      elements inside the pre's matvec and writes them (no separate post launch).
post_pre_route (post_pre before the MoE): the router fold (default; DS4_HC_ROUTER=0 turns it off): the finishing
      launch also returns the router's logits, so the router's BF16 GEMV launch leaves the step (moe route() then
      runs only its top-k tail). H200, session 25: 115.1 / 115.1 against 117.7 / 117.4 us per layer without it
      (experiments/decode_session25_h200.md); session 14 had measured it slower (133.9 against 131.2), before
      the router's own GEMV and the hc finish were reworked.
fold_pre(proj=) (the projection fold; opt-in, DS4_HC_QKV=1): at the attention site the finishing launch of a fold
      also forms x . W^T for the attention's merged FP8 wq_a + wkv (every block forms the normalised x and 12 of the
      1536 rows), so the wq_a + wkv GEMV launch leaves the step (the attention takes the rows as qkv_a). H200, session
      27, three runs (experiments/decode_session27_h200.md): 115.8 / 115.6, 114.9 / 114.4, 115.6 / 115.5 against
      115.6 / 115.4, 114.9 / 114.9, 115.1 / 115.4 us per layer without it: no gain. The run's profile charges the
      finish about 3 us more and wq_b about 3 us more: the finish's 128 blocks hold every SM, so wq_b's blocks no
      longer start their weight loads during it as they did during the wq_a + wkv GEMV.
defer_sinkhorn (the Sinkhorn ride; default at both sites of a decode step, DS4_SINKHORN_RIDE=attn keeps it at the
      attention sites only, =0 turns it off, read per call): every finish above writes the Sinkhorn's input logits
      into comb (iters = 0) and a later launch of the step finishes comb in place (ds4.ops.base.SinkhornRide): the
      attention core's combine launch before its PDL wait, the router's top-k launch in a warp of its own. In the
      finish the Sinkhorn's ~40 dependent steps outlast the weighted sum and norm, and the next launch waits for
      all of it (a build with 1 iteration instead of 20 ran 1.0-1.3 us per layer faster, H200, session 29); comb
      is read only at the site's end. Session 29's form, a launch of its own on a side stream, measured slower
      (experiments/TRIED.md).
fold / fold_pre (the hc fold; default, DS4_HC_FOLD=0 turns it off): a decode row's post + the next site's
      first launch done by the epilogue of the kernel that produces the block output (wo_b's tensor-core
      GEMV, the MoE down kernel: ds4.kernels.gemv_fold / moe_down(fold=)), so the site is its finishing
      launch alone (ds4_attn.hc_fold_finish over one partial per 16-row tile). H200, session 14: 127.6
      against 130.7 us per layer without it (experiments/decode_session14_h200.md).
Same arguments, outputs and dtypes as TorchHC. Inputs other than bf16/fp32 or hc > 8 streams go to
TorchHC (chosen by dtype/shape only, never by values) — part of this implementation.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from ds4 import kernels_attn
from ds4.model.norm import rms_norm
from ds4.ops.base import HcFold, QWeight, sinkhorn_iters
from ds4.ops.hc_torch import TorchHC

_ACT = (torch.bfloat16, torch.float32)
ROUTER_FOLD_ROWS = 8  # decode sizes: the fold's launch has E / 2 blocks per row
FOLD_MIX = {1: 3, 2: 8, 4: 24}  # (2 + n) * n mixes of n streams


def _ok(h: Tensor) -> bool:
    return h.is_cuda and h.dtype in _ACT and h.dim() == 3 and 1 <= h.shape[-2] <= 8


def _router_fold_on() -> bool:
    """The router fold is on unless DS4_HC_ROUTER=0 (read per call, for the ablation: bench token nohcr)."""
    return os.environ.get("DS4_HC_ROUTER", "1") != "0"


def _router_fold_ok(x: Tensor, res: Tensor, norm: Tensor | None, gate: Tensor) -> bool:
    """The router fold's kernel takes this call: decode rows (<= ROUTER_FOLD_ROWS), bf16 streams of 1, 2 or 4
    and D % 8 == 0 (D <= 8192), the block norm, a bf16 gate [E, D] (shapes and dtypes only)."""
    n, d = res.shape[-2], res.shape[-1]
    return (_ok(res) and res.dtype == torch.bfloat16 and x.dtype in _ACT and res.shape[0] <= ROUTER_FOLD_ROWS
            and n in (1, 2, 4) and d % 8 == 0 and d <= 8192 and norm is not None and norm.is_cuda
            and gate.is_cuda and gate.dtype == torch.bfloat16 and gate.dim() == 2 and gate.shape[1] == d)


def _proj_fold_on() -> bool:
    """The projection fold is on with DS4_HC_QKV=1 only (read per call, for the ablation: bench token hcq). Its kernel
    reads the stored fp8 rows, so it applies with DS4_FP8_TILE=0 (linear=gemv_cuda lays them out as fp8t by default;
    Attention.fold_proj then offers none)."""
    return os.environ.get("DS4_HC_QKV", "0") == "1"


def _proj_fold_ok(h: Tensor, norm: Tensor | None, proj: QWeight) -> bool:
    """The projection fold's kernel takes this finish: bf16 streams of 1, 2 or 4 with D a multiple of 128 (at most
    4096), the block norm, an FP8 weight [O, D] with its [ceil(O/128), D/128] scales (shapes and dtypes only)."""
    n, d = h.shape[-2], h.shape[-1]
    return (_ok(h) and h.dtype == torch.bfloat16 and h.shape[0] <= ROUTER_FOLD_ROWS and n in (1, 2, 4)
            and d % 128 == 0 and d <= 4096 and norm is not None and norm.is_cuda and proj.fmt == "fp8"
            and proj.weight.is_cuda and proj.weight.dim() == 2 and proj.weight.shape[1] == d
            and proj.scale is not None and tuple(proj.scale.shape) == (-(-proj.weight.shape[0] // 128), d // 128))


def _norm_fuses(norm: Tensor | None, d: int) -> bool:
    """The finishing kernel can apply the block norm (the generic one holds a row in shared memory)."""
    return norm is None or d * 4 <= 48 * 1024


RIDE_ENV = "DS4_SINKHORN_RIDE"


def _iters(h: Tensor, iters: int, defer: bool) -> int:
    """The finish's iters: 0 when its Sinkhorn is deferred (comb then holds the logits)."""
    if defer and not (_ok(h) and h.shape[-2] in (1, 2, 4)):
        raise ValueError("hc.defer_sinkhorn: only for the CUDA finishes of 1, 2 or 4 streams (ask defers_sinkhorn)")
    return 0 if defer else sinkhorn_iters(iters)


class FusedCudaHC:
    name = "fused_cuda"

    def __init__(self):
        self._ref = TorchHC()

    def defers_sinkhorn(self, h: Tensor, site: str) -> bool:
        """Whether a finish over the streams h [N, n, D] at `site` ("attn" / "ffn") may leave its Sinkhorn to a later
        launch (defer_sinkhorn=True; the caller then hands a SinkhornRide to that launch): CUDA streams of 1, 2 or 4,
        unless DS4_SINKHORN_RIDE (read per call) is 0, or "attn" at an FFN site."""
        mode = os.environ.get(RIDE_ENV, "1")
        return _ok(h) and h.shape[-2] in (1, 2, 4) and mode != "0" and (site == "attn" or mode != "attn")

    def pre(self, h: Tensor, fn: Tensor, scale: Tensor, base: Tensor, iters: int, hc_eps: float,
            norm_eps: float, norm: Tensor | None = None,
            defer_sinkhorn: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        # defer_sinkhorn: comb comes back holding the Sinkhorn's logits (module docstring)
        iters = _iters(h, iters, defer_sinkhorn)
        if not _ok(h):
            return self._ref.pre(h, fn, scale, base, iters, hc_eps, norm_eps, norm)
        if not _norm_fuses(norm, h.shape[-1]):
            x, post, comb = kernels_attn.hc_pre(h, fn, scale, base, iters, hc_eps, norm_eps)
            return rms_norm(x, norm, norm_eps), post, comb
        return kernels_attn.hc_pre(h, fn, scale, base, iters, hc_eps, norm_eps, norm)

    def post(self, x: Tensor, res: Tensor, post: Tensor, comb: Tensor) -> Tensor:
        if not (_ok(res) and x.dtype in _ACT):
            return self._ref.post(x, res, post, comb)
        return kernels_attn.hc_post(x, res, post, comb)

    def post_pre(self, x: Tensor, res: Tensor, post: Tensor, comb: Tensor, fn: Tensor, scale: Tensor, base: Tensor,
                 iters: int, hc_eps: float, norm_eps: float, norm: Tensor | None = None,
                 defer_sinkhorn: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if not (_ok(res) and x.dtype in _ACT and _norm_fuses(norm, res.shape[-1])):
            h = self.post(x, res, post, comb)
            return (h, *self.pre(h, fn, scale, base, iters, hc_eps, norm_eps, norm, defer_sinkhorn))
        return kernels_attn.hc_post_pre(x, res, post, comb, fn, scale, base, _iters(res, iters, defer_sinkhorn),
                                        hc_eps, norm_eps, norm)

    def post_pre_route(self, x: Tensor, res: Tensor, post: Tensor, comb: Tensor, fn: Tensor, scale: Tensor,
                       base: Tensor, iters: int, hc_eps: float, norm_eps: float, norm: Tensor,
                       gate: Tensor,
                       defer_sinkhorn: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
        # the router fold (default; DS4_HC_ROUTER=0 turns it off, read per call): decode rows with the V4 layout —
        # the finishing launch also computes the router's logits (every block forms the normalised x and the
        # logits of two gate rows), so the router's BF16 GEMV leaves the step; otherwise post_pre and None
        if not (_router_fold_on() and _router_fold_ok(x, res, norm, gate)):
            return (*self.post_pre(x, res, post, comb, fn, scale, base, iters, hc_eps, norm_eps, norm,
                                   defer_sinkhorn), None)
        it = _iters(res, iters, defer_sinkhorn)
        return kernels_attn.hc_post_pre_router(x, res, post, comb, fn, scale, base, it, hc_eps, norm_eps, norm, gate)

    def fold(self, res: Tensor, post: Tensor, comb: Tensor, fn: Tensor) -> HcFold | None:
        # On by default (DS4_HC_FOLD=0 turns it off, read per call): one decode row of bf16 streams (1, 2 or 4 of
        # them, D % 16 == 0) with fp32 post / comb / fn. The request's buffers are allocated here; the producing
        # kernel fills them if it can (then fold.fused), else the caller runs post_pre as usual.
        if os.environ.get("DS4_HC_FOLD", "1") == "0":
            return None
        n, d = res.shape[-2], res.shape[-1]
        if not (_ok(res) and res.dtype == torch.bfloat16 and res.shape[0] == 1 and n in (1, 2, 4) and d % 16 == 0
                and fn.dtype == torch.float32 and fn.shape == (FOLD_MIX[n], n * d)):
            return None
        mix = FOLD_MIX[n]
        return HcFold(res.contiguous(), post.float().contiguous(), comb.float().contiguous(), fn.contiguous(),
                      torch.empty_like(res), res.new_empty((1, mix + 1, d // 16), dtype=torch.float32))

    def fold_pre(self, fold: HcFold, scale: Tensor, base: Tensor, iters: int, hc_eps: float, norm_eps: float,
                 norm: Tensor, gate: Tensor | None = None, proj: QWeight | None = None,
                 defer_sinkhorn: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
        # the finishing launch on the fold's streams and partials; with a gate (and the router fold on) the router
        # fold's finish (the logits too), as post_pre_route; with proj (and the projection fold opted in) the
        # projection fold's finish, whose last output is x . proj^T (bf16); else that output is None
        if not fold.fused:
            raise RuntimeError("hc.fold_pre: the fold was not formed by a kernel (fold.fused is False)")
        iters = _iters(fold.out, iters, defer_sinkhorn)
        if proj is not None and gate is None and _proj_fold_on() and _proj_fold_ok(fold.out, norm, proj):
            x, post, comb, y = kernels_attn.hc_fold_finish_proj(fold.out, fold.part, scale, base, iters, hc_eps,
                                                                norm_eps, norm, proj.weight, proj.scale)
            return fold.out, x, post, comb, y
        route = gate is not None and _router_fold_on() and _router_fold_ok(fold.out[0], fold.out, norm, gate)
        x, post, comb, logits = kernels_attn.hc_fold_finish(fold.out, fold.part, scale, base, iters, hc_eps,
                                                            norm_eps, norm, gate if route else None)
        return fold.out, x, post, comb, logits

    def head(self, h: Tensor, fn: Tensor, scale: Tensor, base: Tensor, hc_eps: float, norm_eps: float,
             norm: Tensor | None = None) -> Tensor:
        # with the final norm: one block per token forms the collapse and normalises it (the head's torch
        # rms_norm ops, one launch each, leave the step)
        if not _ok(h):
            return self._ref.head(h, fn, scale, base, hc_eps, norm_eps, norm)
        if not _norm_fuses(norm, h.shape[-1]):
            return rms_norm(kernels_attn.hc_head(h, fn, scale, base, hc_eps, norm_eps), norm, norm_eps)
        return kernels_attn.hc_head(h, fn, scale, base, hc_eps, norm_eps, norm)
