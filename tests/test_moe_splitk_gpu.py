"""GPU tests of the routed experts' split-K pair (ds4.kernels.moe_splitk_up / moe_splitk_down, csrc/moe_splitk.cu;
moe=fp4_topk's DS4_MOE_SPLITK=1) against the separate gate+up and down launches (the same block output up to fp32
summation order) and an fp32 reference: V4-Flash's shapes and shapes whose blocks take an odd number of pairs (a
32-value chunk of inter shared by two blocks, a block's pairs crossing experts), repeated, boundary, non-local and no
local expert ids, w2 in fp4t and in the chunk-major fp4k (ds4.quant.chunk_fp4_splitk: the same bits), the down's
epilogues (no add, bf16 and fp32 adds, bf16 / fp32 out, the hc fold), graph replays, and the MoE op taking it where
asked (marker gpu; skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch
from gpu_common import BF16, DEV, TOL, gen, poison, rel, require_extension, seed_of

pytestmark = pytest.mark.gpu
kernels = require_extension("ds4.kernels")  # skips this module without CUDA

from ds4.quant import chunk_fp4_splitk  # noqa: E402
from test_hc_fold_gpu import _check_fold, _site  # noqa: E402
from test_kernels_gpu import ONE_TOKEN_IDS, _launched, _moe_weights, make_experts, rand_x, ref_routed  # noqa: E402

# (dim, inter, topk): V4-Flash's; a small one; pair counts that leave blocks an odd number of pairs on a 132-SM GPU
# at 3 blocks per SM (960 pairs -> 3 per block, 1920 -> 5), so chunks straddle blocks and blocks straddle experts
SHAPES = [(4096, 2048, 6), (512, 256, 6), (1024, 2560, 6), (512, 3840, 8)]


def _ids(case, topk, g):
    if topk == len(ONE_TOKEN_IDS[case]):
        return torch.tensor([ONE_TOKEN_IDS[case]], device=DEV)
    return torch.randint(26, 54, (1, topk), device=DEV, generator=g)  # mixes local (32..47) and non-local ids


def _setup(shape, case, seed):
    dim, inter, topk = shape
    g = gen(seed)
    (w1, s1, w3, s3, w2, s2), deq = make_experts(16, dim, inter, g, "fp4t")
    ids = _ids(case, topk, g)
    weights = torch.rand(1, topk, device=DEV, generator=g) + 0.1
    return rand_x(1, dim, g), ids, weights, (w1, s1, w3, s3, w2, s2), deq, g


def _separate(x, ids, weights, w, add=None, out_f32=True, fold=None):
    w1, s1, w3, s3, w2, s2 = w
    h = kernels.moe_gate_up(x, ids, weights, w1, s1, w3, s3, "fp4t", 32, 16, 10.0)
    return kernels.moe_down(h, ids, ids.shape[1], w2, s2, "fp4t", 32, 16, add, out_f32, fold=fold)


def _splitk(x, ids, weights, w, add=None, out_f32=True, fold=None, layout="fp4t"):
    """The pair; layout "fp4k": its first launch reads w2 / s2 in the chunk-major layout (chunk_fp4_splitk)."""
    w1, s1, w3, s3, w2, s2 = w
    u2, v2 = chunk_fp4_splitk(w2, s2) if layout == "fp4k" else (w2, s2)
    parts = kernels.moe_splitk_up(x, ids, weights, w1, s1, w3, s3, u2, v2, "fp4t", 32, 16, 10.0, w2_layout=layout)
    assert parts.dtype == torch.float32 and parts.shape == (kernels.moe_splitk_rows("fp4t", ids.shape[1], x.shape[1],
                                                                                   w1.shape[-2]), x.shape[1])
    return kernels.moe_splitk_down(parts, ids, w2, s2, "fp4t", 32, 16, add, out_f32, fold)


@pytest.mark.parametrize("layout", ["fp4t", "fp4k"])
@pytest.mark.parametrize("case", list(ONE_TOKEN_IDS))
@pytest.mark.parametrize("shape", SHAPES)
def test_splitk_matches_the_separate_launches(shape, case, layout):
    x, ids, weights, w, (d1, d3, d2), g = _setup(shape, case, seed_of("splitk", shape, case))
    assert kernels.moe_splitk_rows("fp4t", shape[2], shape[0], shape[1]) >= 1
    ref = ref_routed(x, weights, ids, d1, d3, d2, 32, 10.0)
    want = _separate(x, ids, weights, w)
    poison()
    y = _splitk(x, ids, weights, w, layout=layout)
    assert y.dtype == torch.float32 and y.shape == (1, shape[0]) and torch.isfinite(y).all()
    if ref.norm() == 0:  # no local expert: every partial row is zeros
        assert y.abs().max() == 0 and want.abs().max() == 0
        return
    # the same products summed in another fp32 order
    assert torch.allclose(y, want, rtol=1e-4, atol=1e-5 * want.abs().max().item()), (y - want).abs().max()
    assert rel(y, ref) <= TOL, rel(y, ref)
    assert torch.equal(_splitk(x, ids, weights, w, layout=layout), y)  # deterministic (no atomics: a fixed order)
    if layout == "fp4k":  # the same products in the same order as from fp4t: the same bits
        assert torch.equal(_splitk(x, ids, weights, w), y)
        return
    # the down's epilogues: a bf16 add (the finished shared expert) and an fp32 one, bf16 and fp32 out
    for add in (rand_x(1, shape[0], g), rand_x(1, shape[0], g).float()):
        for out_f32 in (False, True):
            poison()
            got = _splitk(x, ids, weights, w, add, out_f32)
            exp = _separate(x, ids, weights, w, add, out_f32)
            assert got.dtype == exp.dtype and torch.isfinite(got.float()).all()
            assert rel(got, exp) <= 2e-3, (add.dtype, out_f32, rel(got, exp))
            if add.dtype == BF16:  # bf16(fp32 sum + add): the sum not rounded first
                assert torch.equal(got, (y + add.float()).to(got.dtype)), out_f32


@pytest.mark.parametrize("shape,n", [((4096, 2048, 6), 4), ((512, 256, 6), 1), ((1024, 2560, 6), 2)])
def test_splitk_fold(shape, n):
    """The hc fold formed by the reduction's epilogue from its block output, as the down kernel's fold forms it."""
    x, ids, weights, w, _, g = _setup(shape, "distinct", seed_of("splitk_fold", shape, n))
    add = rand_x(1, shape[0], g)
    fold, scale, base, norm = _site(n, shape[0], g)
    poison()
    y = _splitk(x, ids, weights, w, add, False, fold)
    assert torch.equal(y, _splitk(x, ids, weights, w, add, False))  # the fold does not change the block output
    _check_fold(y, fold, scale, base, norm)


def test_splitk_graph_replays():
    """Captured once, replayed 30 times with new ids, route weights and x: each replay equals an eager pair."""
    shape = (4096, 2048, 6)
    x, ids, weights, w, _, g = _setup(shape, "distinct", 11)
    add = rand_x(1, shape[0], g)
    run = lambda: _splitk(x, ids, weights, w, add, False)  # noqa: E731
    run()  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = run()
    for step in range(30):
        ids.copy_(torch.randint(28, 52, (1, 6), device=DEV, generator=g))
        weights.copy_(torch.rand(1, 6, device=DEV, generator=g) + 0.1)
        x.copy_(rand_x(1, shape[0], g))
        graph.replay()
        assert torch.equal(y, run()), step


def test_splitk_refuses_what_it_cannot_serve():
    """Layouts and shapes the pair does not take are refused, with the reason."""
    x, ids, weights, (w1, s1, w3, s3, w2, s2), _, _ = _setup((512, 256, 6), "distinct", 5)
    assert kernels.moe_splitk_rows("fp4p", 6, 512, 256) == -1
    assert kernels.moe_splitk_rows("fp4t", 6, 480, 256) == -1  # dim not whole groups of 4 tiles
    assert kernels.moe_splitk_rows("fp4t", 33, 512, 256) == -1  # more slots than a block's tables hold
    with pytest.raises(RuntimeError, match="kernel splitk"):
        kernels.moe_splitk_up(torch.cat([x, x]), ids.repeat(2, 1), weights.repeat(2, 1), w1, s1, w3, s3, w2, s2,
                              "fp4t", 32, 16, 10.0)
    with pytest.raises(RuntimeError, match="kernel splitk"):  # partial rows of another count
        kernels.moe_splitk_down(torch.zeros(3, 512, device=DEV), ids, w2, s2, "fp4t", 32, 16)
    with pytest.raises(RuntimeError, match="kernel splitk"):  # w2 of another shape than w1's experts
        kernels.moe_splitk_up(x, ids, weights, w1, s1, w3, s3, w2[:8], s2[:8], "fp4t", 32, 16, 10.0)


@pytest.mark.parametrize("with_shared", [False, True], ids=["routed", "routed_and_shared"])
def test_moe_op_takes_the_pair_where_asked(with_shared, monkeypatch):
    """moe=fp4_topk's one-token routed launches under DS4_MOE_SPLITK=1: the split-K kernels run (none of the
    separate gate+up / down), and the block output is the separate launches' to fp32 summation order; unset, the
    separate launches run."""
    from ds4.ops.moe_cuda import Fp4TopkMoE
    for name in ("DS4_MOE_FFN", "DS4_ROUTE_IN_MOE", "DS4_FP4_TILE", "DS4_FP4_PACK"):
        monkeypatch.delenv(name, raising=False)
    g = gen(seed_of("splitk_op", with_shared))
    mw, _ = _moe_weights(g)
    moe = Fp4TopkMoE()
    laid = moe.prepare(mw)
    assert laid.w1.fmt == "fp4t" and laid.w2.fmt == "fp4t"
    x = rand_x(1, 512, g)
    ids = torch.tensor([ONE_TOKEN_IDS["boundary_and_nonlocal"]], device=DEV)
    w = torch.rand(1, 6, device=DEV, generator=g) + 0.1

    def run():
        return moe.routed(x, w, ids, laid, shared=moe.shared_up(x, laid) if with_shared else None)

    out = {}
    for on in ("0", "1"):
        monkeypatch.setenv("DS4_MOE_SPLITK", on)
        poison()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out[on] = run()
            torch.cuda.synchronize()
        split = bool(_launched(prof, "moe_splitk_kernel")) and bool(_launched(prof, "moe_splitk_reduce_kernel"))
        # the routed down: fmt 4 (fp4t; the shared expert's down, where it runs on the tensor cores, is fp8 / fp8t)
        routed_down = any(t.startswith("4,") for t in _launched(prof, "moe_down_mma_kernel"))
        assert (split, routed_down) == (on == "1", on == "0"), on
    assert out["1"].dtype == out["0"].dtype and torch.isfinite(out["1"].float()).all()
    assert rel(out["1"], out["0"]) <= 2e-3, rel(out["1"], out["0"])
