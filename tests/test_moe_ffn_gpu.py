"""GPU tests of the one-launch MoE FFN (ds4.kernels.moe_ffn, csrc/moe_ffn.cu: routed fp4t + shared fp8 experts,
gate+up and down meeting at a grid barrier, and the hc fold) against the separate launches it replaces (the same
block output up to fp32 summation order) and an fp32 reference, at V4-Flash and smaller shapes, with repeated,
boundary and non-local expert ids, outputs poisoned before the launch; repeated launches and CUDA-graph replays
(the barrier's state is reused across launches) give the same bits (marker gpu; skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch
from gpu_common import DEV, TOL, gen, poison, rel, require_extension

pytestmark = pytest.mark.gpu
kernels = require_extension("ds4.kernels")  # skips this module without CUDA

from ds4.ops.base import QWeight  # noqa: E402
from ds4.quant import dequant_fp8  # noqa: E402
from test_hc_fold_gpu import _check_fold, _site  # noqa: E402
from test_kernels_gpu import make_experts, rand_fp8_weight, rand_x, ref_routed, seed_of  # noqa: E402

IDS = {  # expert_offset 32, 16 local experts -> local global ids 32..47
    "distinct": [33, 40, 47, 32, 35, 44],
    "repeated": [40, 40, 41, 40, 43, 41],
    "boundary_and_nonlocal": [31, 32, 47, 48, 0, 63],
}


def _setup(dims, case, seed):
    dim, inter, s_inter = dims
    g = gen(seed)
    (w1, s1, w3, s3, w2, s2), deq = make_experts(16, dim, inter, g, "fp4t")
    routed = tuple(QWeight("fp4t", w, s) for w, s in ((w1, s1), (w3, s3), (w2, s2)))
    shared = (rand_fp8_weight(s_inter, dim, g), rand_fp8_weight(s_inter, dim, g), rand_fp8_weight(dim, s_inter, g))
    shared = tuple(QWeight("fp8", w, s) for w, s in shared)
    ids = torch.tensor([IDS[case]], device=DEV)
    weights = torch.rand(1, 6, device=DEV, generator=g) + 0.1
    x = rand_x(1, dim, g)
    return x, ids, weights, routed, shared, deq, g


def _separate(x, ids, weights, routed, shared):
    """The four launches moe_ffn replaces: the shared expert (bf16 out), then the routed ones with it added."""
    (w1, w3, w2), (sw1, sw3, sw2) = routed, shared
    sh_h = kernels.moe_gate_up(x, None, None, sw1.weight, sw1.scale, sw3.weight, sw3.scale, "fp8", 0, 1, 10.0)
    sh = kernels.moe_down(sh_h, None, 1, sw2.weight, sw2.scale, "fp8", 0, 1, None, False)
    h = kernels.moe_gate_up(x, ids, weights, w1.weight, w1.scale, w3.weight, w3.scale, "fp4t", 32, 16, 10.0)
    return kernels.moe_down(h, ids, 6, w2.weight, w2.scale, "fp4t", 32, 16, sh, False), sh


def _ffn(x, ids, weights, routed, shared, fold=None, shared_h=None):
    return kernels.moe_ffn(x, ids, weights, *routed, *shared, 32, 10.0, fold, shared_h)


def _shared_h(x, shared):
    """The shared expert's h row from its own gate+up launch (DS4_MOE_FFN=2's side-stream launch)."""
    sw1, sw3, _ = shared
    return kernels.moe_gate_up(x, None, None, sw1.weight, sw1.scale, sw3.weight, sw3.scale, "fp8", 0, 1, 10.0)


@pytest.mark.parametrize("case", list(IDS))
@pytest.mark.parametrize("dims", [(4096, 2048, 2048), (1024, 512, 512), (512, 256, 1024)])
def test_moe_ffn_matches_the_separate_launches(dims, case):
    x, ids, weights, routed, shared, (d1, d3, d2), _ = _setup(dims, case, seed_of(dims, case))
    assert kernels.moe_ffn_ok(6, dims[0], dims[1], dims[2])
    want, sh = _separate(x, ids, weights, routed, shared)
    poison()
    y = _ffn(x, ids, weights, routed, shared)
    assert y.dtype == torch.bfloat16 and y.shape == (1, dims[0]) and torch.isfinite(y.float()).all()
    # the same sums in another fp32 order: a bf16 rounding apart at most on a few rows
    assert rel(y, want) <= 2e-3, rel(y, want)
    # against fp32: the routed sum (non-local slots add nothing) plus the shared expert's output
    sw1, sw3, sw2 = (dequant_fp8(q.weight, q.scale) for q in shared)
    a = torch.nn.functional.silu((x.float() @ sw1.t()).clamp(max=10.0)) * (x.float() @ sw3.t()).clamp(-10, 10)
    ref = ref_routed(x, weights, ids, d1, d3, d2, 32, 10.0) + a.to(torch.bfloat16).float() @ sw2.t()
    assert rel(y, ref) <= TOL, rel(y, ref)
    # deterministic, and the grid barrier's state is left ready for the next launch
    for _ in range(3):
        assert torch.equal(_ffn(x, ids, weights, routed, shared), y)
    # the shared expert's h row given (its gate+up launched separately): phase 1 streams the routed pairs alone
    poison()
    yg = _ffn(x, ids, weights, routed, shared, shared_h=_shared_h(x, shared))
    assert torch.isfinite(yg.float()).all() and rel(yg, want) <= 2e-3, rel(yg, want)


@pytest.mark.parametrize("dims,n", [((4096, 2048, 2048), 4), ((1024, 512, 512), 2), ((512, 256, 256), 1)])
def test_moe_ffn_fold(dims, n):
    """The hc fold formed from the one-launch FFN's output, as the down kernel's fold forms it from its y."""
    x, ids, weights, routed, shared, _, g = _setup(dims, "distinct", seed_of("fold", dims, n))
    assert kernels.moe_ffn_ok(6, dims[0], dims[1], dims[2], n)
    fold, scale, base, norm = _site(n, dims[0], g)
    poison()
    y = _ffn(x, ids, weights, routed, shared, fold)
    assert torch.equal(y, _ffn(x, ids, weights, routed, shared))  # the fold does not change the block output
    _check_fold(y, fold, scale, base, norm)


@pytest.mark.parametrize("given", [False, True], ids=["shared_in_launch", "shared_h_given"])
def test_moe_ffn_graph_replays(given):
    """Captured once, replayed 50 times with new ids and x each time: each replay equals an eager launch."""
    dims = (4096, 2048, 2048)
    x, ids, weights, routed, shared, _, g = _setup(dims, "distinct", 7)

    def run():
        return _ffn(x, ids, weights, routed, shared, shared_h=_shared_h(x, shared) if given else None)
    run()  # warm-up (function attributes set outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = run()
    for step in range(50):
        ids.copy_(torch.randint(32, 48, (1, 6), device=DEV, generator=g))
        x.copy_(rand_x(1, dims[0], g))
        graph.replay()
        assert torch.equal(y, run()), step


def test_moe_ffn_refuses_what_it_cannot_serve():
    """Formats and shapes it does not take are refused before the op, with the reason."""
    x, ids, weights, routed, shared, _, _ = _setup((512, 256, 256), "distinct", 3)
    fp4p = tuple(QWeight("fp4p", q.weight, q.scale) for q in routed)
    with pytest.raises(ValueError, match="no one-launch FFN"):
        kernels.moe_ffn(x, ids, weights, *fp4p, *shared, 32, 10.0)
    with pytest.raises(ValueError, match="no one-launch FFN"):
        kernels.moe_ffn(torch.cat([x, x]), ids, weights, *routed, *shared, 32, 10.0)
    assert not kernels.moe_ffn_ok(6, 512, 192, 256)  # inter not a whole number of fp4t rounds
