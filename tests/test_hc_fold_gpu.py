"""GPU tests of the hc fold (hc=fused_cuda's default; DS4_HC_FOLD=0 turns it off): wo_b's tensor-core GEMV and the MoE down kernel forming the
next mHC site's streams and partials in their epilogues (ds4.kernels.gemv_fold, moe_down(fold=)), finished by
ds4_attn.hc_fold_finish — against the unfolded launches (the same y bit for bit; the streams and the finish's x,
post, comb as hc_post_pre forms them, at most a rounding apart; the partials against an fp64 matvec), at V4-Flash
and odd shapes, 1 / 2 / 4 streams, with every tensor-core stream shape (register depths, the shared-memory
stream whose cp.async groups share the block with the fold's), outputs poisoned before the launch
(marker gpu; skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch
from gpu_common import BF16, DEV, gen, poison, randn, rel, require_extension

pytestmark = pytest.mark.gpu
kernels = require_extension("ds4.kernels")  # skips this module without CUDA
kernels_attn = require_extension("ds4.kernels_attn")

from ds4.ops.base import HcFold  # noqa: E402
from ds4.quant import tile_fp8_mma  # noqa: E402
from test_kernels_gpu import make_experts, rand_fp4_weight, rand_fp8_weight, rand_x, seed_of  # noqa: E402

STREAMS = {"default": {}, "depth2": {"DS4_MMA_DEPTH": "2"}, "depth8": {"DS4_MMA_DEPTH": "8"},
           "smem": {"DS4_MMA_LOAD": "smem"}}


def _site(n, D, g):
    """The streams a block's output updates, their post / comb, the next site's weights and norm, an empty fold."""
    mix = (2 + n) * n
    res = randn(1, n, D, g=g, dtype=BF16, scale=2.0)
    post = torch.rand(1, n, device=DEV, generator=g) * 2
    comb = torch.rand(1, n, n, device=DEV, generator=g)
    fn = randn(mix, n * D, g=g) * (4.0 / (n * D) ** 0.5)
    scale, base = 1.0 + 0.1 * randn(3, g=g), randn(mix, g=g) * 0.5
    norm = (1 + 0.1 * randn(D, g=g)).to(BF16)
    nan = float("nan")  # what a kernel does not write stays NaN
    fold = HcFold(res, post, comb, fn, torch.full_like(res, nan), torch.full((1, mix + 1, D // 16), nan, device=DEV))
    return fold, scale, base, norm


def _check_fold(y, fold, scale, base, norm):
    """fold (formed with the block output y) against hc_post_pre on y, and the finish against hc_post_pre's."""
    n, D = fold.res.shape[1], fold.res.shape[2]
    rh, rxn, rpn, rcn = kernels_attn.hc_post_pre(y, fold.res, fold.post, fold.comb, fold.fn, scale, base, 20, 1e-6,
                                                 1e-6, norm)
    assert torch.isfinite(fold.out.float()).all() and torch.isfinite(fold.part).all(), "unwritten fold outputs"
    assert rel(fold.out, rh) <= 1e-3, rel(fold.out, rh)  # hc_post_elem's arithmetic, at most a rounding apart
    # the partials: the next site's matvec and sum of squares of the written streams, one split per 16-row tile
    v = fold.out.double().flatten()
    want, got = fold.fn.double() @ v, fold.part[0].double().sum(-1)
    assert torch.allclose(got[:-1], want, rtol=1e-4, atol=1e-4 * want.abs().max().item()), (got[:-1] - want).abs().max()
    assert rel(got[-1:], (v * v).sum().view(1)) <= 1e-5
    x, post, comb, logits = kernels_attn.hc_fold_finish(fold.out, fold.part, scale, base, 20, 1e-6, 1e-6, norm)
    assert logits is None and x.shape == (1, D) and post.shape == (1, n) and comb.shape == (1, n, n)
    assert rel(post, rpn) <= 1e-5 and rel(comb, rcn) <= 1e-5 and rel(x, rxn) <= 1e-2, (rel(post, rpn),
                                                                                       rel(comb, rcn), rel(x, rxn))


@pytest.mark.parametrize("stream", list(STREAMS))
@pytest.mark.parametrize("fmt,D,K,n", [("fp8", 4096, 8192, 4), ("fp8", 256, 2048, 2), ("fp4", 1024, 512, 1),
                                       ("fp8", 4096, 2048, 4), ("fp4", 4096, 8192, 4), ("fp8t", 4096, 8192, 4)])
def test_gemv_fold(fmt, D, K, n, stream, monkeypatch):
    """fp8t (linear=gemv_cuda's default layout of wo_b): its register stream at every depth (a depth-0 request takes
    depth 2's)."""
    for k, v in STREAMS[stream].items():
        monkeypatch.setenv(k, v)
    g = gen(seed_of(fmt, D, K, n, stream))
    w, s = (rand_fp4_weight if fmt == "fp4" else rand_fp8_weight)(D, K, g)
    if fmt == "fp8t":
        w = tile_fp8_mma(w)
    x = rand_x(1, K, g)
    fold, scale, base, norm = _site(n, D, g)
    assert kernels.hc_fold_ok("gemv", fmt, D, K, 1, n)
    poison()
    y = kernels.gemv_fold(x, w, s, fmt, fold)
    assert torch.equal(y, kernels.gemv(x, w, s, fmt, kernel="mma"))  # the same tensor-core kernel, the same bits
    _check_fold(y, fold, scale, base, norm)


@pytest.mark.parametrize("stream", list(STREAMS))
@pytest.mark.parametrize("fmt,dims,n", [("fp4t", (4096, 2048), 4), ("fp4t", (512, 256), 2), ("fp4p", (4096, 2048), 4),
                                        ("fp4", (512, 256), 2), ("fp8", (4096, 2048), 1)])
def test_moe_down_fold(fmt, dims, n, stream, monkeypatch):
    """The routed down of one token with the finished shared expert's bf16 output added (the block output), in
    every expert layout the down kernel reads (fp4t: moe=fp4_topk's default)."""
    for k, v in STREAMS[stream].items():
        monkeypatch.setenv(k, v)
    dim, inter = dims
    g = gen(seed_of(fmt, dims, n, stream))
    (w1, s1, w3, s3, w2, s2), _ = make_experts(16, dim, inter, g, fmt)
    ids = torch.tensor([[33, 40, 47, 32, 35, 44]], device=DEV)
    weights = torch.rand(1, 6, device=DEV, generator=g) + 0.1
    x, add = rand_x(1, dim, g), rand_x(1, dim, g)
    h = kernels.moe_gate_up(x, ids, weights, w1, s1, w3, s3, fmt, 32, 16, 10.0)
    fold, scale, base, norm = _site(n, dim, g)
    assert kernels.hc_fold_ok("moe_down", fmt, dim, inter, 6, n)
    poison()
    y = kernels.moe_down(h, ids, 6, w2, s2, fmt, 32, 16, add, False, fold=fold)
    assert torch.equal(y, kernels.moe_down(h, ids, 6, w2, s2, fmt, 32, 16, add, False, kernel="mma"))
    _check_fold(y, fold, scale, base, norm)


def test_fold_finish_with_the_router():
    """hc_fold_finish with a gate: the router fold's finish on the fold's partials (x, post, comb as without it;
    logits = x . gate^T)."""
    g = gen(4242)
    D, K, n, E = 4096, 8192, 4, 256
    w, s = rand_fp8_weight(D, K, g)
    fold, scale, base, norm = _site(n, D, g)
    kernels.gemv_fold(rand_x(1, K, g), w, s, "fp8", fold)
    gate = randn(E, D, g=g, dtype=BF16, scale=D ** -0.5)
    x0, p0, c0, _ = kernels_attn.hc_fold_finish(fold.out, fold.part, scale, base, 20, 1e-6, 1e-6, norm)
    x, p, c, lg = kernels_attn.hc_fold_finish(fold.out, fold.part, scale, base, 20, 1e-6, 1e-6, norm, gate)
    assert rel(x, x0) <= 1e-3 and rel(p, p0) <= 1e-6 and rel(c, c0) <= 1e-6
    assert lg.shape == (1, E) and torch.allclose(lg, x.float() @ gate.float().t(), rtol=1e-4, atol=1e-4)


def test_fold_rejections():
    """What the fold cannot serve is refused before a launch (the Python side asks hc_fold_ok first)."""
    g = gen(17)
    assert not kernels.hc_fold_ok("gemv", "fp8", 4096, 8192, 1, 3)   # 3 streams
    assert not kernels.hc_fold_ok("gemv", "fp8", 4104, 8192, 1, 4)   # rows not a multiple of 16
    assert not kernels.hc_fold_ok("gemv", "bf16", 4096, 4096, 1, 4)  # BF16 rows: no tensor-core GEMV
    w, s = rand_fp8_weight(4096, 8192, g)
    fold, *_ = _site(4, 2048, g)  # the fold's D != the GEMV's rows
    with pytest.raises(ValueError, match="no fold"):
        kernels.gemv_fold(rand_x(1, 8192, g), w, s, "fp8", fold)
