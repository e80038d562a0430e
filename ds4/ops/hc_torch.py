"""Reference manifold-constrained hyper-connections (spec §4), fp32 throughout."""
from __future__ import annotations

import torch
from torch import Tensor

from ds4.model.norm import rms_norm
from ds4.ops.base import HcFold, QWeight


def sinkhorn(logits: Tensor, iters: int, eps: float) -> Tensor:
    """[..., n, n] -> approximately doubly stochastic, in the reference's exact op order:
    row softmax + eps, column normalise, then (iters-1) x (row, column) normalisations."""
    c = logits.softmax(-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def _mixes(h: Tensor, fn: Tensor, norm_eps: float) -> Tensor:
    """h [N, hc, D] -> (fn . vec(h)) * rsqrt(mean(vec(h)^2) + eps)  [N, mix] fp32."""
    v = h.flatten(-2).float()
    r = torch.rsqrt(v.square().mean(-1, keepdim=True) + norm_eps)
    return (v @ fn.float().t()) * r


class TorchHC:
    name = "torch"

    def pre(self, h: Tensor, fn: Tensor, scale: Tensor, base: Tensor, iters: int, hc_eps: float,
            norm_eps: float, norm: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """h [N, hc, D] -> x [N, D] (h.dtype), post [N, hc] f32, comb [N, hc, hc] f32.
        `norm` (the block's attn_norm / ffn_norm weight): x is returned RMS-normed with it."""
        n = h.shape[-2]
        m = _mixes(h, fn, norm_eps)
        base, scale = base.float(), scale.float()
        pre = torch.sigmoid(m[:, :n] * scale[0] + base[:n]) + hc_eps
        post = 2 * torch.sigmoid(m[:, n:2 * n] * scale[1] + base[n:2 * n])
        comb = (m[:, 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n))
        comb = sinkhorn(comb, iters, hc_eps)
        x = (pre.unsqueeze(-1) * h.float()).sum(-2).to(h.dtype)
        return (x if norm is None else rms_norm(x, norm, norm_eps)), post, comb

    def post(self, x: Tensor, res: Tensor, post: Tensor, comb: Tensor) -> Tensor:
        """out[k] = post[k] * x + sum_j comb[j, k] * res[j]  (comb used transposed): [N, hc, D]."""
        out = post.unsqueeze(-1) * x.float().unsqueeze(-2) + torch.einsum("njk,njd->nkd", comb, res.float())
        return out.to(res.dtype)

    def post_pre(self, x: Tensor, res: Tensor, post: Tensor, comb: Tensor, fn: Tensor, scale: Tensor, base: Tensor,
                 iters: int, hc_eps: float, norm_eps: float,
                 norm: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """post(x, res, post, comb) -> h, then pre(h, fn, ...): (h, x_next, post_next, comb_next). One
        block's output step followed by the next site's input step (fused by the CUDA implementation)."""
        h = self.post(x, res, post, comb)
        return (h, *self.pre(h, fn, scale, base, iters, hc_eps, norm_eps, norm))

    def post_pre_route(self, x: Tensor, res: Tensor, post: Tensor, comb: Tensor, fn: Tensor, scale: Tensor,
                       base: Tensor, iters: int, hc_eps: float, norm_eps: float, norm: Tensor,
                       gate: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
        """post_pre before the MoE, which may also return the router's logits (fp32 x_next . gate^T) when an
        implementation forms them in the same launches (the CUDA router fold); None: the router computes
        them. The reference never does."""
        return (*self.post_pre(x, res, post, comb, fn, scale, base, iters, hc_eps, norm_eps, norm), None)

    def fold(self, res: Tensor, post: Tensor, comb: Tensor, fn: Tensor) -> HcFold | None:
        """The hc fold's request for the kernel that produces the block output (ds4.ops.hc_cuda); the reference
        never folds."""
        return None

    def fold_pre(self, fold: HcFold, scale: Tensor, base: Tensor, iters: int, hc_eps: float, norm_eps: float,
                 norm: Tensor, gate: Tensor | None = None,
                 proj: QWeight | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
        """The next site's pre once a kernel folded the post (fold.fused): (h, x, post, comb, None) from the
        streams fold.out (the partials are the CUDA finish's shortcut to the same matvec). The reference never
        forms the router's logits (gate) or the projection (proj) here: the caller computes them itself."""
        return (fold.out, *self.pre(fold.out, fold.fn, scale, base, iters, hc_eps, norm_eps, norm), None)

    def head(self, h: Tensor, fn: Tensor, scale: Tensor, base: Tensor, hc_eps: float, norm_eps: float,
             norm: Tensor | None = None) -> Tensor:
        """Final collapse (spec §4.4): h [N, hc, D] -> [N, D]; with `norm` the final RMSNorm after it."""
        m = _mixes(h, fn, norm_eps)
        pre = torch.sigmoid(m * scale.float() + base.float()) + hc_eps
        y = (pre.unsqueeze(-1) * h.float()).sum(-2).to(h.dtype)
        return y if norm is None else rms_norm(y, norm, norm_eps)
