"""GPU tests of the ds4_attn kernels (hc / attn / indexer = fused_cuda) against the torch references
(marker gpu; skipped without CUDA). Fresh random inputs per check, V4-Flash shapes (H=64, D=512,
window 128 + 512 selected keys, HCA with many entries, rows at different positions) and odd shapes,
outputs poisoned before the launch (the caching allocator hands the kernels NaN-filled memory),
relative L2 error <= 1e-2 for bf16 outputs; an end-to-end greedy check on the `small` preset.
Imports no hydra / omegaconf / wandb."""
from __future__ import annotations

import pytest
import torch
from gpu_common import BF16, DEV, TOL, gen, poison, randn, rel, require_extension

pytestmark = pytest.mark.gpu
kernels_attn = require_extension("ds4.kernels_attn")  # skips this module without CUDA
require_extension("ds4.kernels")  # the router fold's routing check and the e2e rows use it too

from ds4.ops.attn_torch import TorchAttention, TorchIndexer  # noqa: E402
from ds4.ops.hc_torch import TorchHC  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False   # fp32 references in true fp32
torch.backends.cudnn.allow_tf32 = False


# ------------------------------------------------------------------------------------------------ mHC
def hc_weights(n, d, g, head=False):
    mix = n if head else (2 + n) * n
    fn = randn(mix, n * d, g=g) * (0.5 / (n * d) ** 0.5) * 8
    base = randn(mix, g=g) * 0.5
    scale = 1.0 + 0.1 * randn(1 if head else 3, g=g)
    return fn, scale, base


# N > 64 (a prompt): the partials by cuBLAS in one split, in slices of 4096 tokens (attn_bindings.cpp HC_GEMM_ROWS)
@pytest.mark.parametrize("N,n,D,dtype", [(1, 4, 4096, BF16), (3, 4, 4096, BF16), (8, 4, 4096, BF16),
                                         (2, 4, 1024, torch.float32), (5, 3, 136, BF16), (300, 4, 1024, BF16),
                                         (1, 2, 64, torch.float32), (2, 8, 520, BF16), (64, 4, 4096, BF16),
                                         (65, 4, 4096, BF16), (5000, 2, 520, torch.float32)])
def test_hc_pre_post_head(N, n, D, dtype):
    g = gen(N * 1000 + n * 10 + D)
    ref = TorchHC()
    h = randn(N, n, D, g=g, dtype=dtype, scale=2.0)
    fn, scale, base = hc_weights(n, D, g)
    poison()
    x, post, comb = kernels_attn.hc_pre(h, fn, scale, base, 20, 1e-6, 1e-6)
    rx, rpost, rcomb = ref.pre(h, fn, scale, base, 20, 1e-6, 1e-6)
    assert x.dtype == rx.dtype and post.dtype == rpost.dtype == torch.float32 and comb.shape == rcomb.shape
    for t in (x, post, comb):
        assert torch.isfinite(t).all(), "unwritten (NaN-poisoned) outputs"
    assert rel(x, rx) <= (TOL if dtype == BF16 else 1e-5)
    assert rel(post, rpost) <= 1e-5 and rel(comb, rcomb) <= 1e-5, (rel(post, rpost), rel(comb, rcomb))
    # post: block output in the activation dtype, residual streams
    xo = randn(N, D, g=g, dtype=dtype)
    poison()
    out = kernels_attn.hc_post(xo, h, post, comb)
    rout = ref.post(xo, h, post, comb)
    assert out.dtype == rout.dtype and torch.isfinite(out).all()
    assert rel(out, rout) <= (TOL if dtype == BF16 else 1e-5)
    # head
    fnh, sch, bh = hc_weights(n, D, g, head=True)
    poison()
    y = kernels_attn.hc_head(h, fnh, sch, bh, 1e-6, 1e-6)
    ry = ref.head(h, fnh, sch, bh, 1e-6, 1e-6)
    assert y.dtype == ry.dtype and torch.isfinite(y).all()
    assert rel(y, ry) <= (TOL if dtype == BF16 else 1e-5)
    # head with the final norm in the same launch (fp32 and bf16 weights), against head then rms_norm
    for nw in ((1 + 0.1 * randn(D, g=g)), (1 + 0.1 * randn(D, g=g)).to(BF16)):
        poison()
        yn = kernels_attn.hc_head(h, fnh, sch, bh, 1e-6, 1e-6, nw)
        ryn = ref.head(h, fnh, sch, bh, 1e-6, 1e-6, nw)
        assert yn.dtype == ryn.dtype == dtype and torch.isfinite(yn).all()
        assert rel(yn, ryn) <= (TOL if dtype == BF16 else 1e-5)


@pytest.mark.parametrize("N,n,D,dtype,with_norm", [(1, 4, 4096, BF16, True), (3, 4, 4096, BF16, False),
                                                   (2, 4, 1024, torch.float32, True), (5, 3, 136, BF16, True),
                                                   (2, 8, 520, BF16, False), (1, 2, 64, torch.float32, False),
                                                   (200, 4, 4096, BF16, True), (70, 2, 64, torch.float32, False)])
def test_hc_post_pre(N, n, D, dtype, with_norm):
    """A block's post fused into the next site's pre (2 launches) against TorchHC's post then pre."""
    g = gen(N * 7000 + n * 10 + D)
    res = randn(N, n, D, g=g, dtype=dtype, scale=2.0)
    x = randn(N, D, g=g, dtype=dtype)
    post = torch.rand(N, n, device=DEV, generator=g) * 2
    comb = torch.rand(N, n, n, device=DEV, generator=g)
    fn, scale, base = hc_weights(n, D, g)
    norm = (1 + 0.1 * randn(D, g=g)) if with_norm else None
    poison()
    h, xn, pn, cn = kernels_attn.hc_post_pre(x, res, post, comb, fn, scale, base, 20, 1e-6, 1e-6, norm)
    rh, rxn, rpn, rcn = TorchHC().post_pre(x, res, post, comb, fn, scale, base, 20, 1e-6, 1e-6, norm)
    for a, b in ((h, rh), (xn, rxn), (pn, rpn), (cn, rcn)):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.isfinite(a).all(), "unwritten outputs"
    tol = TOL if dtype == BF16 else 1e-5
    assert rel(h, rh) <= tol and rel(xn, rxn) <= tol, (rel(h, rh), rel(xn, rxn))
    assert rel(pn, rpn) <= 1e-5 and rel(cn, rcn) <= 1e-5, (rel(pn, rpn), rel(cn, rcn))
    # the new streams are what hc_post writes (the same arithmetic; at most a rounding apart)
    assert rel(h, kernels_attn.hc_post(x, res, post, comb)) <= (1e-3 if dtype == BF16 else 1e-6)


def test_zero_sinkhorn_iters_are_the_references():
    """hc_sinkhorn_iters = 0 (ModelArgs takes it; the reference's loop runs iters - 1 times, so it computes what 1
    does): the finish and the deferred finish + its ride against TorchHC. The finish used to read 0 as "deferred"
    and leave the logits in comb."""
    from ds4.ops.base import SinkhornRide
    from ds4.ops.hc_cuda import FusedCudaHC
    g = gen(4242)
    h = randn(3, 4, 1024, g=g, dtype=BF16, scale=2.0)
    fn, scale, base = hc_weights(4, 1024, g)
    rx, rpost, rcomb = TorchHC().pre(h, fn, scale, base, 0, 1e-6, 1e-6)
    poison()
    x, post, comb = FusedCudaHC().pre(h, fn, scale, base, 0, 1e-6, 1e-6)
    assert rel(x, rx) <= TOL and rel(post, rpost) <= 1e-5 and rel(comb, rcomb) <= 1e-5, rel(comb, rcomb)
    poison()
    _, _, comb = FusedCudaHC().pre(h, fn, scale, base, 0, 1e-6, 1e-6, defer_sinkhorn=True)
    SinkhornRide(comb, 0, 1e-6).run()
    assert rel(comb, rcomb) <= 1e-5, rel(comb, rcomb)


def test_prompt_past_the_grid_rows():
    """A prompt of more tokens than one launch's grid rows (65535: the hc finish and head_rope refuse more) runs the
    kernels in chunks: hc_pre, hc_post_pre and head_rope against the torch references."""
    from ds4.ops.attn_torch import TorchAttention
    g = gen(70000)
    N, n, D = 70000, 4, 64
    h = randn(N, n, D, g=g, dtype=BF16)
    fn, scale, base = hc_weights(n, D, g)
    ref = TorchHC()
    for got, want in zip(kernels_attn.hc_pre(h, fn, scale, base, 20, 1e-6, 1e-6),
                         ref.pre(h, fn, scale, base, 20, 1e-6, 1e-6)):
        assert torch.isfinite(got).all() and rel(got, want) <= TOL
    xo, post, comb = randn(N, D, g=g, dtype=BF16), randn(N, n, g=g).sigmoid(), randn(N, n, n, g=g).sigmoid()
    for got, want in zip(kernels_attn.hc_post_pre(xo, h, post, comb, fn, scale, base, 20, 1e-6, 1e-6),
                         (ref.post(xo, h, post, comb), *ref.pre(ref.post(xo, h, post, comb), fn, scale, base, 20, 1e-6,
                                                               1e-6))):
        assert torch.isfinite(got).all() and rel(got, want) <= TOL
    q, pos, freqs = randn(N, 2, 64, g=g, dtype=BF16), torch.arange(N, device=DEV), randn(16, g=g).abs() * 0.1
    got = kernels_attn.head_rope(q, pos, freqs, True, 1e-6)
    assert rel(got, TorchAttention().head_rope(q, pos, freqs, True, 1e-6)) <= TOL


@pytest.mark.parametrize("N,n,D,E", [(1, 4, 4096, 256), (3, 4, 4096, 256), (2, 2, 1024, 7), (1, 1, 136, 64),
                                     (8, 4, 512, 33)])
def test_hc_post_pre_router_fold(N, n, D, E):
    """The router fold (hc_post_pre_router): the same streams, x, post and comb as hc_post_pre (the x of every
    block is formed as the unfolded kernel forms it: at most a rounding apart), and logits = the stored bf16
    x . gate^T in fp32, for gate row counts that do not fill the last block; the router's top-k tail on those
    logits picks the experts the torch route picks on them."""
    g = gen(N * 9000 + n * 10 + D + E)
    res = randn(N, n, D, g=g, dtype=BF16, scale=2.0)
    x = randn(N, D, g=g, dtype=BF16)
    post = torch.rand(N, n, device=DEV, generator=g) * 2
    comb = torch.rand(N, n, n, device=DEV, generator=g)
    fn, scale, base = hc_weights(n, D, g)
    norm = (1 + 0.1 * randn(D, g=g)).to(BF16)
    gate = randn(E, D, g=g, dtype=BF16, scale=D ** -0.5)
    poison()
    h, xn, pn, cn, lg = kernels_attn.hc_post_pre_router(x, res, post, comb, fn, scale, base, 20, 1e-6, 1e-6, norm,
                                                         gate)
    rh, rxn, rpn, rcn = kernels_attn.hc_post_pre(x, res, post, comb, fn, scale, base, 20, 1e-6, 1e-6, norm)
    assert lg.shape == (N, E) and lg.dtype == torch.float32 and torch.isfinite(lg).all(), "unwritten logits"
    assert torch.equal(h, rh)  # the same partials launch
    assert rel(pn, rpn) <= 1e-6 and rel(cn, rcn) <= 1e-6 and rel(xn, rxn) <= 1e-3, (rel(pn, rpn), rel(cn, rcn),
                                                                                   rel(xn, rxn))
    want = xn.float() @ gate.float().t()
    assert torch.allclose(lg, want, rtol=1e-4, atol=1e-4), (lg - want).abs().max()
    if E >= 6:
        from ds4 import kernels
        from ds4.ops.base import MoEWeights
        from ds4.ops.moe_torch import route
        bias = torch.randn(E, device=DEV, generator=g) * 0.01
        w, ids = kernels.router(xn, gate, bias, None, None, 6, 1.5, logits=lg)
        mw = MoEWeights(gate=gate, bias=bias, tid2eid=None, w1=None, w2=None, w3=None, shared_w1=None,
                        shared_w2=None, shared_w3=None, n_experts=E, expert_offset=0, topk=6, route_scale=1.5,
                        swiglu_limit=10.0)
        rw, rids = route(xn, None, mw, lg)
        assert torch.equal(ids, rids) and torch.allclose(w, rw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("N,n,D,O", [(1, 4, 4096, 1536), (3, 4, 4096, 1536), (2, 2, 1024, 100), (1, 1, 256, 130),
                                     (8, 4, 512, 12)])
def test_hc_fold_finish_proj(N, n, D, O):
    """The projection fold (hc_fold_finish_proj): the same x, post and comb as hc_fold_finish on the same streams and
    partials (bit for bit: the same arithmetic), and y = the stored bf16 x . W^T for an FP8 weight (every E4M3 code
    but NaN, subnormals included; E8M0 scales) against fp64, for row counts that fill neither the last block of 12
    rows nor the last 128-row scale block."""
    from ds4.ops.base import QWeight
    g = gen(N * 11000 + n * 10 + D + O)
    h = randn(N, n, D, g=g, dtype=BF16, scale=2.0)
    fn, scale, base = hc_weights(n, D, g)
    hv = h.float().flatten(1)  # the partials as the fold forms them (here one split): the matvec, the sum of squares
    part = torch.cat([hv @ fn.t(), (hv * hv).sum(-1, keepdim=True)], -1).unsqueeze(-1).contiguous()
    norm = (1 + 0.1 * randn(D, g=g)).to(BF16)
    b = torch.randint(0, 256, (O, D), device=DEV, dtype=torch.uint8, generator=g)
    w = torch.where((b & 0x7F) == 0x7F, b - 1, b).view(torch.float8_e4m3fn)
    ws = torch.randint(116, 124, (-(-O // 128), D // 128), device=DEV, dtype=torch.uint8,
                       generator=g).view(torch.float8_e8m0fnu)
    poison()
    x, post, comb, y = kernels_attn.hc_fold_finish_proj(h, part, scale, base, 20, 1e-6, 1e-6, norm, w, ws)
    rx, rpost, rcomb, _ = kernels_attn.hc_fold_finish(h, part, scale, base, 20, 1e-6, 1e-6, norm)
    assert torch.equal(x, rx) and torch.equal(post, rpost) and torch.equal(comb, rcomb)
    assert y.shape == (N, O) and y.dtype == BF16 and torch.isfinite(y).all(), "unwritten rows"
    want = x.double() @ QWeight("fp8", w, ws).dequant(torch.float32).double().t()
    assert rel(y, want) <= 4e-3, rel(y, want)  # the bf16 rounding of an fp32 sum


@pytest.mark.parametrize("N,n,D", [(1, 4, 4096), (3, 4, 4096), (2, 2, 1024), (1, 1, 256), (40, 4, 512)])
def test_hc_sinkhorn_after_a_deferring_finish_is_the_finish_sinkhorn(N, n, D):
    """Every finish with iters = 0 leaves the Sinkhorn's input logits in comb and hc_sinkhorn finishes it in place
    (the ride's launch of its own; the rides run the same device code): the same comb bit for bit as the finish
    with iters, and the same x, post (and logits, y) as that finish; iters = 0 is refused where nothing can
    follow (3 streams)."""
    g = gen(N * 13000 + n * 10 + D)
    h = randn(N, n, D, g=g, dtype=BF16, scale=2.0)
    fn, scale, base = hc_weights(n, D, g)
    hv = h.float().flatten(1)
    part = torch.cat([hv @ fn.t(), (hv * hv).sum(-1, keepdim=True)], -1).unsqueeze(-1).contiguous()
    norm = (1 + 0.1 * randn(D, g=g)).to(BF16)
    gate = randn(9, D, g=g, dtype=BF16, scale=D ** -0.5)
    x0 = randn(N, D, g=g, dtype=BF16)
    post0, comb0 = torch.rand(N, n, device=DEV, generator=g) * 2, torch.rand(N, n, n, device=DEV, generator=g)
    w = torch.randint(0, 120, (130, D), device=DEV, dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    ws = torch.randint(116, 124, (2, D // 128), device=DEV, dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    finishes = {
        "hc_pre": lambda it: kernels_attn.hc_pre(h, fn, scale, base, it, 1e-6, 1e-6),
        "hc_pre+norm": lambda it: kernels_attn.hc_pre(h, fn, scale, base, it, 1e-6, 1e-6, norm),
        "hc_post_pre": lambda it: kernels_attn.hc_post_pre(x0, h, post0, comb0, fn, scale, base, it, 1e-6, 1e-6,
                                                           norm),
        "hc_post_pre_router": lambda it: kernels_attn.hc_post_pre_router(x0, h, post0, comb0, fn, scale, base, it,
                                                                         1e-6, 1e-6, norm, gate),
        "hc_fold_finish": lambda it: kernels_attn.hc_fold_finish(h, part, scale, base, it, 1e-6, 1e-6, norm)[:3],
        "hc_fold_finish+gate": lambda it: kernels_attn.hc_fold_finish(h, part, scale, base, it, 1e-6, 1e-6, norm,
                                                                      gate),
        "hc_fold_finish_proj": lambda it: kernels_attn.hc_fold_finish_proj(h, part, scale, base, it, 1e-6, 1e-6,
                                                                           norm, w, ws),
    }
    comb_at = {"hc_post_pre": 3, "hc_post_pre_router": 3}
    for name, finish in finishes.items():
        if name == "hc_fold_finish_proj" and D % 128:
            continue
        poison()
        want = finish(20)
        poison()
        got = finish(0)
        c = comb_at.get(name, 2)
        raw = got[c].clone()
        kernels_attn.hc_sinkhorn(got[c], 20, 1e-6)
        assert not torch.equal(raw, got[c]), name  # the finish left the logits: hc_sinkhorn changed them
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), (name, i)
    with pytest.raises(RuntimeError, match="iters"):
        kernels_attn.hc_pre(randn(1, 3, 136, g=g, dtype=BF16), *hc_weights(3, 136, g), 0, 1e-6, 1e-6)


def test_a_message_with_a_number_raises():
    """A refusal whose message holds a number raises a RuntimeError (on the lent H200 such a message formed by the
    ostream of c10::str segfaulted the process, session 48; csrc/check_text.h)."""
    x = torch.zeros(2, 64, device=DEV, dtype=BF16)
    with pytest.raises(RuntimeError, match="tensor of 64 values"):
        torch.ops.ds4_attn.rms_norm(x, torch.ones(63, device=DEV), 1e-6)


def test_hc_sinkhorn_refuses_what_it_cannot_finish():
    with pytest.raises(RuntimeError, match="n = 1, 2 or 4"):
        kernels_attn.hc_sinkhorn(torch.rand(1, 3, 3, device=DEV), 20, 1e-6)
    with pytest.raises(RuntimeError, match="iters"):
        kernels_attn.hc_sinkhorn(torch.rand(1, 4, 4, device=DEV), 0, 1e-6)


def test_hc_post_mixed_dtypes():
    g = gen(77)
    res = randn(3, 4, 4096, g=g, dtype=BF16)
    x = randn(3, 4096, g=g)  # fp32 block output
    post, comb = torch.rand(3, 4, device=DEV, generator=g) * 2, torch.rand(3, 4, 4, device=DEV, generator=g)
    out = kernels_attn.hc_post(x, res, post, comb)
    assert out.dtype == BF16 and rel(out, TorchHC().post(x, res, post, comb)) <= TOL


# ------------------------------------------------------------------------------------------ attention
def attn_case(B, H, D, K, P, g, pos=None, p_valid=0.8, S=1, window=None):
    """Random decode inputs; window-style validity from per-row positions when `window` is given."""
    q = randn(B, S, H, D, g=g, dtype=BF16)
    q = q / q.float().pow(2).mean(-1, keepdim=True).sqrt().to(BF16)   # unit-RMS heads like the model
    kv = randn(B, K, D, g=g, dtype=BF16, scale=1.0)
    if window is not None:
        ar = torch.arange(K, device=DEV)
        lim = pos.view(B, 1) if pos is not None else torch.full((B, 1), K, device=DEV)
        valid = (ar.view(1, K) < window) & (ar.view(1, K) <= lim)
        extra = (ar.view(1, K) >= window) & (ar.view(1, K) - window < (lim + 1) // 128)
        valid = (valid | extra).unsqueeze(1).expand(B, S, K).contiguous()
    else:
        valid = torch.rand(B, S, K, device=DEV, generator=g) < p_valid
    sel = sel_valid = None
    if P:
        sel = randn(B, S, P, D, g=g, dtype=BF16)
        sel_valid = torch.rand(B, S, P, device=DEV, generator=g) < p_valid
    sink = randn(H, g=g)
    return q, kv, valid, sel, sel_valid, sink


def check_attn(q, kv, valid, sel, sel_valid, sink, scale, tol=TOL):
    poison()
    out = kernels_attn.sparse_attn(q, kv, valid, sel, sel_valid, sink, scale)
    ref = TorchAttention().sparse(q, kv, valid, sel, sel_valid, sink, scale)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) outputs"
    err = rel(out, ref)
    assert err <= tol, err
    return err


@pytest.mark.parametrize("B", [1, 2, 4])
def test_sparse_v4_csa(B):
    g = gen(10 + B)
    pos = torch.tensor([5, 127, 3000, 64000][:B], device=DEV)
    q, kv, valid, sel, sv, sink = attn_case(B, 64, 512, 128, 512, g, pos=pos, window=128)
    check_attn(q, kv, valid, sel, sv, sink, 512 ** -0.5)


@pytest.mark.parametrize("B", [1, 3])
def test_sparse_v4_hca_many_entries(B):
    g = gen(20 + B)
    n_entries = 2048                             # 256K context worth of HCA entries
    pos = torch.tensor([200_000, 1000, 130][:B], device=DEV)
    q, kv, valid, _, _, sink = attn_case(B, 64, 512, 128 + n_entries, 0, g, pos=pos, window=128)
    check_attn(q, kv, valid, None, None, sink, 512 ** -0.5)


def test_sparse_v4_swa_and_large_scores():
    g = gen(30)
    q, kv, valid, _, _, sink = attn_case(2, 64, 512, 128, 0, g, pos=torch.tensor([0, 90], device=DEV), window=128)
    check_attn(q, kv, valid, None, None, sink, 512 ** -0.5)
    q, kv, valid, sel, sv, sink = attn_case(1, 64, 512, 128, 512, g)
    check_attn(q, kv * 8, valid, sel * 8, sv, sink, 512 ** -0.5)          # peaked softmax


@pytest.mark.parametrize("B,H,D,K,P", [(1, 16, 256, 128, 64), (2, 16, 256, 151, 0), (3, 20, 128, 7, 3),
                                       (1, 5, 64, 1, 0), (2, 64, 512, 33, 31), (1, 72, 192, 100, 40),
                                       (8, 64, 512, 128, 512)])
def test_sparse_odd_shapes(B, H, D, K, P):
    g = gen(B * 7 + H + D + K + P)
    q, kv, valid, sel, sv, sink = attn_case(B, H, D, K, P, g)
    check_attn(q, kv, valid, sel, sv, sink, D ** -0.5)


@pytest.mark.parametrize("cap", ["1", "3"])
@pytest.mark.parametrize("B,H,D,K,P", [(1, 16, 256, 128, 64), (3, 20, 128, 7, 3), (2, 64, 512, 33, 31),
                                       (1, 72, 192, 100, 40), (2, 64, 512, 128, 512), (1, 64, 512, 2176, 0)])
def test_sparse_blocks_merge_several_chunks(monkeypatch, cap, B, H, D, K, P):
    """DS4_SPARSE_MAX_SPLITS caps the splits, so each block takes several 32-key chunks and merges them (running max;
    in registers at D = 512, through its own partial-output slot at other D), the first chunk all masked so a later
    one starts the block's rows: against the torch twin."""
    monkeypatch.setenv("DS4_SPARSE_MAX_SPLITS", cap)
    g = gen(B * 11 + H + D + K + P + int(cap))
    q, kv, valid, sel, sv, sink = attn_case(B, H, D, K, P, g, p_valid=0.5)
    if K > 32:
        valid[..., :32] = False
    check_attn(q, kv, valid, sel, sv, sink, D ** -0.5)


def test_sparse_all_masked_row_gives_zero_and_sink_only():
    g = gen(40)
    q, kv, valid, sel, sv, sink = attn_case(2, 64, 512, 128, 64, g)
    valid[0] = False
    sv[0] = False
    out = kernels_attn.sparse_attn(q, kv, valid, sel, sv, sink, 512 ** -0.5)
    assert torch.isfinite(out).all() and out[0].abs().max().item() == 0.0
    ref = TorchAttention().sparse(q, kv, valid, sel, sv, sink, 512 ** -0.5)
    assert rel(out[1], ref[1]) <= TOL


def test_sparse_multi_query_rows_and_strided_kv():
    """The kernel itself handles S > 1 (per-query masks and selections) and kv views of a larger state."""
    g = gen(41)
    q, _, valid, sel, sv, sink = attn_case(2, 16, 256, 130, 20, g, S=3)
    big = randn(4, 200, 256, g=g, dtype=BF16)
    kv = big[:2, 10:140]                                                  # strided view
    check_attn(q, kv, valid, sel, sv, sink, 256 ** -0.5)


def test_fused_attention_class_decode_and_prefill(monkeypatch):
    from ds4.ops.attn_cuda import FusedCudaAttention
    g = gen(42)
    a = FusedCudaAttention()
    q, kv, valid, sel, sv, sink = attn_case(2, 64, 512, 128, 512, g)
    out = a.sparse(q, kv, valid, sel, sv, sink, 512 ** -0.5)
    assert rel(out, TorchAttention().sparse(q, kv, valid, sel, sv, sink, 512 ** -0.5)) <= TOL
    q, kv, valid, sel, sv, sink = attn_case(1, 16, 256, 40, 8, g, S=5)    # a prompt's queries: the kernel too
    ref = TorchAttention().sparse(q, kv, valid, sel, sv, sink, 0.0625)
    assert rel(a.sparse(q, kv, valid, sel, sv, sink, 0.0625), ref) <= TOL
    monkeypatch.setenv("DS4_PREFILL_ATTN", "torch")  # the A/B knob: the reference there
    assert torch.equal(a.sparse(q, kv, valid, sel, sv, sink, 0.0625), ref)


@pytest.mark.parametrize("S,K,P", [(256, 383, 512), (256, 300, 0), (40, 130, 20)])
def test_sparse_prompt_rows_cap_their_splits(S, K, P):
    """A prompt chunk's rows (S > 1; V4's 256-query chunk with its 383 window keys and 512 selected entries, or HCA
    entries): the splits are capped at 1024 (row, split) pairs, so each block merges several 32-key chunks; against
    the torch twin, with causal-window masks."""
    g = gen(S + K + P)
    q, kv, valid, sel, sv, sink = attn_case(1, 64, 512, K, P, g, S=S, p_valid=0.7)
    valid &= torch.arange(K, device=DEV).view(1, 1, K) <= (torch.arange(S, device=DEV).view(1, S, 1) + K - S)
    check_attn(q, kv, valid, sel, sv, sink, 512 ** -0.5)


# -------------------------------------------------------------------------------------------- indexer
@pytest.mark.parametrize("B,H,d,T", [(1, 64, 128, 16384 + 37), (4, 64, 128, 2048), (2, 16, 128, 1000),
                                     (3, 20, 64, 5), (1, 64, 128, 1), (1, 8, 32, 300),
                                     (1, 64, 128, 70000 + 5), (16, 64, 128, 4096)])  # blocks looping over chunks
@pytest.mark.parametrize("bf16", [False, True])
def test_indexer_scores(B, H, d, T, bf16):
    g = gen(B * 13 + H + d + T + bf16)
    q = randn(B, 1, H, d, g=g, dtype=BF16)
    w = randn(B, 1, H, g=g) * (d ** -0.5 * H ** -0.5)
    keys = randn(B, T, d, g=g, dtype=BF16)
    poison()
    out = kernels_attn.indexer_scores(q, w, keys, bf16)
    ref = TorchIndexer().scores(q, w, keys, bf16)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) outputs"
    assert rel(out, ref) <= (TOL if bf16 else 1e-4), rel(out, ref)


def test_indexer_strided_keys_and_topk_agreement():
    g = gen(50)
    state = randn(4, 4096, 128, g=g, dtype=BF16)
    keys = state[:2]                                                      # rows of a preallocated state
    q = randn(2, 1, 64, 128, g=g, dtype=BF16)
    w = torch.rand(2, 1, 64, device=DEV, generator=g) * 0.01
    out = kernels_attn.indexer_scores(q, w, keys, False)
    ref = TorchIndexer().scores(q, w, keys, False)
    assert rel(out, ref) <= 1e-4
    a, b = out.topk(512, -1).indices, ref.topk(512, -1).indices
    overlap = sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a.flatten(0, 1), b.flatten(0, 1)))
    assert overlap / a.numel() >= 0.99


# ------------------------------------------------------------------------------------------- registry
def test_build_ops_on_cuda():
    from ds4 import registry
    ops = registry.build_ops(registry.Impls(attn="fused", indexer="fused_cuda", hc="fused_cuda"), "cuda")
    assert ops.chosen["attn"] == ops.chosen["indexer"] == ops.chosen["hc"] == "fused_cuda"
    e, note = registry.resolve("attn", "auto", DEV)
    assert e.name == "fused_cuda"


# ---------------------------------------------------------------------------------------- end to end
_REF_TOKENS: dict = {}


@pytest.fixture(scope="module")
def small_weights():
    from ds4.model.args import small
    from ds4.weights.synthetic import random_weights
    return random_weights(small(), seed=0, device="cuda", include_mtp=False)


def _model(weights, **impls):
    from ds4 import registry
    from ds4.model.args import small
    from ds4.model.transformer import Transformer
    m = Transformer(small(), registry.build_ops(registry.Impls(**impls), "cuda"), "plain", BF16, "cuda")
    m.load_weights(weights)
    return m


@pytest.mark.parametrize("impls", [dict(attn="fused_cuda", indexer="fused_cuda", hc="fused_cuda"),
                                   dict(attn="fused"), dict(indexer="fused_cuda"), dict(hc="fused_cuda")],
                         ids=["all", "attn", "indexer", "hc"])
def test_end_to_end_greedy_small(small_weights, impls):
    """Reference greedy tokens (2 rows, prompts of 37 and 300 tokens -> HCA emissions, CSA top-k over
    more entries than index_topk), then the fused model decodes teacher-forced on the same tokens:
    >= 99% of its greedy choices on confident steps (>= 90% overall) over 128 steps per row."""
    steps, lens = 128, (37, 300)
    g = torch.Generator(device="cpu").manual_seed(3)
    prompts = [torch.randint(0, 32768, (n,), generator=g).to(DEV) for n in lens]

    def run(m, forced=None):
        st = m.alloc_state(len(lens), max(lens) + steps + 8)
        last = torch.stack([m.prefill(p, st, r) for r, p in enumerate(prompts)])
        toks, logits = [], [last]
        nxt = last.argmax(-1)
        for i in range(steps):
            toks.append(nxt)
            feed = nxt if forced is None else forced[i]
            logits.append(m.decode(feed, st))
            nxt = logits[-1].argmax(-1)
        return torch.stack(toks), torch.stack(logits[:-1])

    if "ref" not in _REF_TOKENS:
        _REF_TOKENS["ref"] = run(_model(small_weights))
    ref_toks, ref_logits = _REF_TOKENS["ref"]
    got, _ = run(_model(small_weights, **impls), forced=ref_toks)
    # Synthetic weights give flat distributions: BF16 rounding in another order flips near-ties,
    # so the strict bar is on steps where the reference's top-2 gap exceeds 2 (BENCHMARKING.md;
    # at 1.0 one confident step in ~80 still flipped through an MoE routing near-tie).
    top2 = ref_logits.float().topk(2, -1).values
    gap = top2[..., 0] - top2[..., 1]
    conf = gap > 2.0
    agree = (got == ref_toks).float().mean().item()
    agree_conf = (got == ref_toks)[conf].float().mean().item()
    print(f"e2e {impls}: agreement {agree:.4f} overall, {agree_conf:.4f} on {int(conf.sum())} confident steps; "
          f"largest reference gaps at misses {sorted(gap[got != ref_toks].tolist())[-5:]}")
    assert int(conf.sum()) >= 16 and agree_conf >= 0.99 and agree >= 0.9, (agree, agree_conf)
