"""GPU tests of DS4_BULK_STAGE (opt-in, sm_90+; csrc/bulk_stage.cuh): the one-token tensor-core GEMVs (g), MoE downs
(d) and MoE gate+ups (u) staging their activations by bulk copies on the TMA unit — and the downs the shared expert's
output they add — give the bits of their threads' register staging, for every stream shape, grouped rows, the hc
fold, the shared expert and routed slots none of which are local; outputs poisoned before each launch (marker gpu;
skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch
from gpu_common import BF16, DEV, gen, poison, require_extension, seed_of

pytestmark = pytest.mark.gpu
kernels = require_extension("ds4.kernels")  # skips this module without CUDA

from ds4.ops.base import HcFold  # noqa: E402
from ds4.quant import tile_fp8_mma  # noqa: E402
from test_hc_fold_gpu import _site  # noqa: E402
from test_kernels_gpu import ONE_TOKEN_IDS, make_experts, rand_fp4_weight, rand_fp8_weight, rand_x  # noqa: E402

HOPPER = torch.cuda.get_device_capability()[0] >= 9
STREAMS = {"depth2": {"DS4_MMA_DEPTH": "2"}, "depth8": {"DS4_MMA_DEPTH": "8"}, "smem": {"DS4_MMA_LOAD": "smem"}}


def _both(monkeypatch, site, run):
    """run() with the register staging, then with DS4_BULK_STAGE=site: (theirs, bulk's)."""
    monkeypatch.delenv("DS4_BULK_STAGE", raising=False)
    assert not kernels.bulk_stage_site(site[0])
    poison()
    ref = run()
    monkeypatch.setenv("DS4_BULK_STAGE", site)
    assert kernels.bulk_stage_site(site[0]) == HOPPER  # sm_80: the register staging, whatever the variable says
    poison()
    return ref, run()


def _stream(monkeypatch, stream):
    monkeypatch.delenv("DS4_MMA_DEPTH", raising=False)
    monkeypatch.delenv("DS4_MMA_LOAD", raising=False)
    for k, v in STREAMS[stream].items():
        monkeypatch.setenv(k, v)


def test_bulk_stage_names_its_sites(monkeypatch):
    """The letters name the kinds; "all" names every one; other text none of them."""
    for value, want in (("d", "d"), ("gu", "gu"), ("all", "gdu"), ("x", "")):
        monkeypatch.setenv("DS4_BULK_STAGE", value)
        assert [kernels.bulk_stage_site(s) for s in "gdu"] == [HOPPER and s in want for s in "gdu"], value


@pytest.mark.parametrize("stream", list(STREAMS))
@pytest.mark.parametrize("fmt,o,i,groups", [("fp8", 1000, 2048, 1), ("fp8t", 4096, 8192, 1), ("fp4", 333, 4224, 1),
                                            ("fp8", 1024, 512, 4)])
def test_gemv_bulk_stage_is_bit_exact(fmt, o, i, groups, stream, monkeypatch):
    """groups: wo_a's form, a block's tiles reading the rows of x its groups take (one copy of them)."""
    _stream(monkeypatch, stream)
    g = gen(seed_of("bulk_gemv", fmt, o, i, groups, stream))
    w, s = (rand_fp4_weight if fmt == "fp4" else rand_fp8_weight)(o, i, g)
    if fmt == "fp8t":
        w = tile_fp8_mma(w)
    x = rand_x(1, groups * i, g)
    ref, got = _both(monkeypatch, "g", lambda: kernels.gemv(x, w, s, fmt, groups=groups, kernel="mma"))
    assert torch.isfinite(ref.float()).all() and torch.equal(got, ref)


def test_gemv_fold_bulk_stage_is_bit_exact(monkeypatch):
    """wo_b's form: fp8t with the hc fold in its epilogue (the fold's own cp.async copies beside the bulk copy)."""
    _stream(monkeypatch, "depth8")
    g = gen(seed_of("bulk_gemv_fold"))
    w, s = rand_fp8_weight(4096, 8192, g)
    w = tile_fp8_mma(w)
    x = rand_x(1, 8192, g)
    site = _site(4, 4096, g)[0]

    def run():
        fold = HcFold(site.res, site.post, site.comb, site.fn, torch.full_like(site.out, 7.0),
                      torch.full_like(site.part, 7.0))
        return kernels.gemv_fold(x, w, s, "fp8t", fold), fold

    (y0, f0), (y1, f1) = _both(monkeypatch, "g", run)
    assert torch.equal(y1, y0) and torch.equal(f1.out, f0.out) and torch.equal(f1.part, f0.part)


@pytest.mark.parametrize("stream", list(STREAMS))
@pytest.mark.parametrize("case", list(ONE_TOKEN_IDS))
@pytest.mark.parametrize("fmt", ["fp4t", "fp8"])
def test_moe_bulk_stage_is_bit_exact(fmt, case, stream, monkeypatch):
    """The routed gate+up and down (fp4t: V4's layout; fp8: the shared expert's format), the down with no add, a
    bf16 add (the finished shared expert's output) and an fp32 add, bf16 and fp32 out; h's local rows compared (the
    others are not written); none_local: no slot of the block is local."""
    _stream(monkeypatch, stream)
    dim, inter = 4096, 2048
    g = gen(seed_of("bulk_moe", fmt, case, stream))
    (w1, s1, w3, s3, w2, s2), _ = make_experts(16, dim, inter, g, fmt)
    ids = torch.tensor([ONE_TOKEN_IDS[case]], device=DEV)
    weights = torch.rand(1, 6, device=DEV, generator=g) + 0.1
    x = rand_x(1, dim, g)
    adds = (None, rand_x(1, dim, g), rand_x(1, dim, g).float())
    h = kernels.moe_gate_up(x, ids, weights, w1, s1, w3, s3, fmt, 32, 16, 10.0, kernel="mma")
    loc = ((ids >= 32) & (ids < 48)).flatten()

    def gate_up():
        return kernels.moe_gate_up(x, ids, weights, w1, s1, w3, s3, fmt, 32, 16, 10.0, kernel="mma")[loc]

    ref, got = _both(monkeypatch, "u", gate_up)
    assert torch.equal(got, ref)
    for add in adds:
        for out_f32 in (False, True):
            def down():
                return kernels.moe_down(h, ids, 6, w2, s2, fmt, 32, 16, add, out_f32, kernel="mma")

            ref, got = _both(monkeypatch, "d", down)
            assert torch.isfinite(ref.float()).all() and torch.equal(got, ref), (add is None, out_f32)


def test_shared_expert_bulk_stage_is_bit_exact(monkeypatch):
    """One expert without routing (ids None: the shared expert, whose gate+up loads weights before its PDL wait and
    only then issues x's copy), fp8t as the library lays it."""
    _stream(monkeypatch, "depth8")
    dim, inter = 4096, 2048
    g = gen(seed_of("bulk_shared"))
    (w1, s1, w3, s3, w2, s2), _ = make_experts(1, dim, inter, g, "fp8")
    w1, w3, w2 = (tile_fp8_mma(w[0]) for w in (w1, w3, w2))
    s1, s3, s2 = s1[0], s3[0], s2[0]
    x, add = rand_x(1, dim, g), rand_x(1, dim, g)

    def run():
        hh = kernels.moe_gate_up(x, None, None, w1, s1, w3, s3, "fp8t", 0, 1, 10.0, kernel="mma")
        return hh, kernels.moe_down(hh, None, 1, w2, s2, "fp8t", 0, 1, add, False, kernel="mma")

    (h0, y0), (h1, y1) = _both(monkeypatch, "all", run)
    assert torch.isfinite(y0.float()).all() and torch.equal(h1, h0) and torch.equal(y1, y0)


@pytest.mark.parametrize("add_dtype", [BF16, torch.float32])
def test_moe_down_fold_bulk_stage_is_bit_exact(add_dtype, monkeypatch):
    """The routed down as the decode step runs it: fp4t at depth 2 with the hc fold, its add copied beside h."""
    _stream(monkeypatch, "depth2")
    dim, inter = 4096, 2048
    g = gen(seed_of("bulk_down_fold", str(add_dtype)))
    (w1, s1, w3, s3, w2, s2), _ = make_experts(16, dim, inter, g, "fp4t")
    ids = torch.tensor([ONE_TOKEN_IDS["distinct"]], device=DEV)
    weights = torch.rand(1, 6, device=DEV, generator=g) + 0.1
    x, add = rand_x(1, dim, g), rand_x(1, dim, g).to(add_dtype)
    h = kernels.moe_gate_up(x, ids, weights, w1, s1, w3, s3, "fp4t", 32, 16, 10.0)
    site = _site(4, dim, g)[0]

    def run():
        fold = HcFold(site.res, site.post, site.comb, site.fn, torch.full_like(site.out, 7.0),
                      torch.full_like(site.part, 7.0))
        return kernels.moe_down(h, ids, 6, w2, s2, "fp4t", 32, 16, add, False, kernel="mma", fold=fold), fold

    (y0, f0), (y1, f1) = _both(monkeypatch, "d", run)
    assert torch.equal(y1, y0) and torch.equal(f1.out, f0.out) and torch.equal(f1.part, f0.part)
