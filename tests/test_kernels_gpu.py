"""GPU tests of the ds4 CUDA kernels against torch references (marker gpu; skipped without CUDA).

Fresh random stored bytes for every check (random E4M3 codes without NaN, random E2M1 nibbles,
random E8M0 scales), V4-Flash shapes and other shapes the formats allow, repeated / boundary /
non-local expert ids, outputs poisoned before the launch (the caching allocator hands the kernels
NaN-filled memory), relative L2 error <= 1e-2. Imports only ds4.kernels, ds4.ops.base, ds4.ops.prefetch
and ds4.quant."""
from __future__ import annotations

import os

import pytest
import torch
from gpu_common import DEV, TOL, gen, poison, rel, require_extension, seed_of

pytestmark = pytest.mark.gpu
kernels = require_extension("ds4.kernels")  # skips this module without CUDA

from ds4.ops import prefetch  # noqa: E402
from ds4.ops.base import MoEWeights, QWeight  # noqa: E402
from ds4.quant import dequant_fp4, dequant_fp8, fp4t_ok, pack_fp4_mma, tile_fp4_mma, tile_fp8_mma  # noqa: E402


def rand_fp8(shape, g):
    b = torch.randint(0, 256, shape, device=DEV, dtype=torch.uint8, generator=g)
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b)  # no NaN codes
    return b.view(torch.float8_e4m3fn)


def rand_scale(shape, g, lo=116, hi=124):
    return torch.randint(lo, hi, shape, device=DEV, dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)


def rand_fp8_weight(o, i, g, lead=()):
    return rand_fp8((*lead, o, i), g), rand_scale((*lead, -(-o // 128), -(-i // 128)), g)


def rand_fp4_weight(o, i, g, lead=()):
    w = torch.randint(-128, 128, (*lead, o, i // 2), device=DEV, dtype=torch.int8, generator=g)
    return w, rand_scale((*lead, o, i // 32), g)


def rand_x(n, k, g, scale=1.0):
    return (torch.randn(n, k, device=DEV, generator=g) * scale).to(torch.bfloat16)


# ------------------------------------------------------------------------------------------ GEMV

V4_FP8 = {"wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_b": (4096, 8192),
          "idx_wq_b": (8192, 1024), "shared_w1": (2048, 4096), "shared_w2": (4096, 2048)}


def _gemv_check(fmt, o, i, n, seed, kernel="auto", xscale=1.0):
    g = gen(seed)
    w, s = (rand_fp8_weight if fmt == "fp8" else rand_fp4_weight)(o, i, g)
    x = rand_x(n, i, g, xscale)
    wd = (dequant_fp8 if fmt == "fp8" else dequant_fp4)(w, s, torch.float32)
    ref = x.float() @ wd.t()
    poison()
    y = kernels.gemv(x, w, s, fmt, kernel=kernel)
    assert y.shape == (n, o) and y.dtype == torch.bfloat16
    assert torch.isfinite(y).all(), "unwritten (NaN-poisoned) outputs"
    err = rel(y, ref)
    assert err <= TOL, (fmt, o, i, n, err)


@pytest.mark.parametrize("name", list(V4_FP8))
@pytest.mark.parametrize("n", [1, 3])
def test_gemv_fp8_v4_shapes(name, n):
    o, i = V4_FP8[name]
    _gemv_check("fp8", o, i, n, seed=seed_of(name, n))


@pytest.mark.parametrize("o,i", [(200, 272), (129, 144), (16, 16), (300, 1040)])
@pytest.mark.parametrize("n", [1, 2, 5, 8, 11])
def test_gemv_fp8_odd_shapes(o, i, n):
    _gemv_check("fp8", o, i, n, seed=o * 31 + i + n)


@pytest.mark.parametrize("o,i", [(2048, 4096), (4096, 2048), (77, 96), (1, 32), (333, 4160)])
@pytest.mark.parametrize("n", [1, 4, 8, 9])
def test_gemv_fp4(o, i, n):
    _gemv_check("fp4", o, i, n, seed=o * 7 + i + n)


# one token: "auto" takes the tensor-core kernel where K allows (FP8 K % 64, FP4 K % 128); both
# kernels are checked explicitly, at row counts that are not multiples of the 16-row MMA tile, and the
# tensor-core kernel at each run width it can pick (DS4_MMA_W caps it; K decides what fits) and at each
# depth (DS4_MMA_DEPTH: chunks in flight per lane and row; U = depth / width rounds, at least 1); depth 0:
# the shared-memory stream (DS4_MMA_LOAD=smem; widths 1 and 2)
MMA_SHAPES = [("fma", 4, 8), ("mma", 1, 8), ("mma", 2, 8), ("mma", 4, 8), ("mma", 1, 4), ("mma", 2, 4), ("mma", 4, 4),
              ("mma", 1, 2), ("mma", 2, 2), ("mma", 1, 0), ("mma", 2, 0), ("mma", 4, 0)]


def set_mma_shape(monkeypatch, width, depth):
    monkeypatch.setenv("DS4_MMA_W", str(width))
    if depth == 0:
        monkeypatch.setenv("DS4_MMA_LOAD", "smem")
        monkeypatch.delenv("DS4_MMA_DEPTH", raising=False)
    else:
        monkeypatch.delenv("DS4_MMA_LOAD", raising=False)
        monkeypatch.setenv("DS4_MMA_DEPTH", str(depth))


@pytest.mark.parametrize("kernel,width,depth", MMA_SHAPES)
@pytest.mark.parametrize("fmt,o,i", [("fp8", 1000, 2048), ("fp8", 33, 64), ("fp8", 200, 320), ("fp8", 4096, 8192),
                                     ("fp8", 32768, 1024), ("fp8", 200, 384), ("fp4", 1000, 2048), ("fp4", 77, 128),
                                     ("fp4", 333, 4224), ("fp4", 2048, 4096), ("fp4", 96, 768)])
def test_gemv_kernel_variants(kernel, width, depth, fmt, o, i, monkeypatch):
    set_mma_shape(monkeypatch, width, depth)
    _gemv_check(fmt, o, i, 1, seed=o + i, kernel=kernel)


@pytest.mark.parametrize("width,depth", [(2, 8), (2, 2), (1, 8), (2, 0)])
@pytest.mark.parametrize("fmt,o,i", [("fp8", 4096, 8192), ("fp8", 200, 1024), ("fp4", 333, 4224)])
def test_gemv_prefetch_split_is_bit_exact(width, depth, fmt, o, i, monkeypatch):
    """DS4_PREFETCH=N loads only N weight rounds (stages, for the shared-memory stream) before the PDL wait and the
    rest after it, in the same order: the output is the default's bit for bit, for N = 0, 1 and more rounds than
    the stream has."""
    set_mma_shape(monkeypatch, width, depth)
    monkeypatch.delenv("DS4_PREFETCH", raising=False)
    g = gen(seed_of("prefetch", fmt, o, i, width, depth))
    w, s = (rand_fp8_weight if fmt == "fp8" else rand_fp4_weight)(o, i, g)
    x = rand_x(1, i, g)
    y = kernels.gemv(x, w, s, fmt, kernel="mma")
    assert torch.isfinite(y).all()
    for n in ("0", "1", "9"):
        monkeypatch.setenv("DS4_PREFETCH", n)
        poison()
        assert torch.equal(kernels.gemv(x, w, s, fmt, kernel="mma"), y), n


def test_gemv_mma_rejects_what_it_cannot_serve():
    g = gen(9)
    w, s = rand_fp8_weight(64, 1024, g)
    with pytest.raises(RuntimeError, match="not supported"):
        kernels.gemv(rand_x(2, 1024, g), w, s, "fp8", kernel="mma")  # two tokens
    w, s = rand_fp8_weight(64, 1040, g)
    with pytest.raises(RuntimeError, match="not supported"):
        kernels.gemv(rand_x(1, 1040, g), w, s, "fp8", kernel="mma")  # K % 64 != 0


@pytest.mark.parametrize("o,i", [(256, 4096), (1000, 2048), (7, 64)])
def test_gemv_bf16(o, i):
    """BF16 weights (the router's gate GEMV), one token."""
    g = gen(o + i)
    w = (torch.randn(o, i, device=DEV, generator=g) * 0.05).to(torch.bfloat16)
    x = rand_x(1, i, g)
    ref = x.float() @ w.float().t()
    poison()
    y = kernels.gemv(x, w, None, "bf16", out_f32=True)
    assert rel(y, ref) <= 1e-5


@pytest.mark.parametrize("kernel", ["fma", "mma"])
def test_gemv_tiny_and_large_activations(kernel):
    _gemv_check("fp8", 256, 1024, 1, seed=5, xscale=1e-6, kernel=kernel)
    _gemv_check("fp8", 256, 1024, 1, seed=6, xscale=1e4, kernel=kernel)
    _gemv_check("fp4", 256, 1024, 1, seed=7, xscale=1e-6, kernel=kernel)
    _gemv_check("fp4", 256, 1024, 1, seed=8, xscale=1e4, kernel=kernel)
    _gemv_check("fp4", 256, 1024, 2, seed=7, xscale=1e-6)


@pytest.mark.parametrize("kernel", ["fma", "mma"])
def test_gemv_only_subnormal_codes(kernel):
    """Weights made only of subnormal codes (E4M3 exponent 0; E2M1 +-0.5 and 0): both kernels must
    keep them exactly (the MMA kernel feeds them to the tensor cores as bf16 subnormals)."""
    g = gen(12)
    w8, s8 = rand_fp8_weight(256, 1024, g)
    w8 = (w8.view(torch.uint8) & 0x87).view(torch.float8_e4m3fn)
    w4, s4 = rand_fp4_weight(256, 1024, g)
    w4 = (w4.view(torch.uint8) & 0x99).view(torch.int8)  # each nibble s00m
    x = rand_x(1, 1024, g)
    for fmt, w, s in (("fp8", w8, s8), ("fp4", w4, s4)):
        ref = x.float() @ (dequant_fp8 if fmt == "fp8" else dequant_fp4)(w, s, torch.float32).t()
        assert ref.abs().max() > 0
        y = kernels.gemv(x, w, s, fmt, kernel=kernel, out_f32=True)
        assert rel(y, ref) <= 1e-5, (fmt, rel(y, ref))


def test_gemv_subnormal_and_extreme_scales():
    g = gen(11)
    w, _ = rand_fp8_weight(256, 512, g)
    w = w.view(torch.uint8).clone()
    w[:, ::3] &= 0x87  # exponent 0: E4M3 subnormals (and zeros)
    w = w.view(torch.float8_e4m3fn)
    s = rand_scale((2, 4), g, lo=80, hi=200).view(torch.uint8).clone()  # large scales (up to 2^72)
    s[0, 0] = 0  # byte 0 = 2^-127 (that block's terms underflow to 0: negligible next to the others)
    s = s.view(torch.float8_e8m0fnu)
    x = rand_x(2, 512, g)
    ref = x.float() @ dequant_fp8(w, s, torch.float32).t()
    y = kernels.gemv(x, w, s, "fp8", out_f32=True)
    assert rel(y, ref) <= 1e-5


@pytest.mark.parametrize("width", [1, 2, 4])
def test_fp4_mma_zero_scale_byte_drops_its_block(width, monkeypatch):
    """E8M0 byte 0 (2^-127) on the tensor-core FP4 path: its scale helper (e8m0_mma_scale) gives 0 there, which
    must be the same bits as 2^-127 (the block's product underflows in the FFMA for activations below 2^31). So
    the output equals, bit for bit, the output with those blocks' weights zeroed, and the fp32 reference. Zero
    bytes sit at every position of the 4-byte scale words the stream loads (on the diagonal of the first 8 rows and
    columns, and at random elsewhere)."""
    set_mma_shape(monkeypatch, width, 8)
    g = gen(seed_of("zero_scale", width))
    o, i = 256, 2048
    w, s = rand_fp4_weight(o, i, g)
    zero = torch.rand(o, i // 32, device=DEV, generator=g) < 0.1
    zero[:8, :8] |= torch.eye(8, dtype=torch.bool, device=DEV)
    s0 = s.view(torch.uint8).masked_fill(zero, 0).view(torch.float8_e8m0fnu)
    wz = w.view(o, i // 32, 16).masked_fill(zero[..., None], 0).view(o, i // 2)
    x = rand_x(1, i, g, scale=64.0)
    y = kernels.gemv(x, w, s0, "fp4", kernel="mma", out_f32=True)
    yz = kernels.gemv(x, wz, s0, "fp4", kernel="mma", out_f32=True)
    ref = x.float() @ dequant_fp4(w, s0, torch.float32).t()
    assert torch.equal(y, yz)
    assert rel(y, ref) <= 1e-5


@pytest.mark.parametrize("n,kernel", [(1, "auto"), (1, "fma"), (2, "auto"), (2, "fma"), (4, "auto")])
@pytest.mark.parametrize("groups,o,i", [(8, 8192, 4096), (3, 480, 272)])
def test_gemv_grouped_wo_a(n, kernel, groups, o, i):
    g = gen(100 + n + o)
    w, s = rand_fp8_weight(o, i, g)
    x = rand_x(n, groups * i, g)
    wd = dequant_fp8(w, s, torch.float32).view(groups, o // groups, i)
    ref = torch.einsum("ngi,gri->ngr", x.float().view(n, groups, i), wd).reshape(n, o)
    poison()
    y = kernels.gemv(x, w, s, "fp8", groups=groups, kernel=kernel)
    assert torch.isfinite(y).all()
    assert rel(y, ref) <= TOL


# tensor-core kernel: 16-row tiles split evenly over the blocks, each block stages the groups its tiles
# touch; 48 groups of 112 rows (7 tiles) at 336 tiles put group boundaries inside blocks of 2 tiles
@pytest.mark.parametrize("smem", [False, True])
@pytest.mark.parametrize("groups,o,i", [(8, 8192, 4096), (6, 576, 320), (48, 5376, 64), (4, 64, 1024)])
def test_gemv_grouped_mma(groups, o, i, smem, monkeypatch):
    set_mma_shape(monkeypatch, 2, 0 if smem else 8)
    g = gen(7 + groups + o)
    w, s = rand_fp8_weight(o, i, g)
    x = rand_x(1, groups * i, g)
    wd = dequant_fp8(w, s, torch.float32).view(groups, o // groups, i)
    ref = torch.einsum("ngi,gri->ngr", x.float().view(1, groups, i), wd).reshape(1, o)
    poison()
    y = kernels.gemv(x, w, s, "fp8", groups=groups, kernel="mma", out_f32=True)
    assert rel(y, ref) <= 1e-5


def test_linear_impl_and_grouped():
    from ds4.ops.linear_cuda import GemvCudaLinear
    lin = GemvCudaLinear()
    g = gen(3)
    w, s = rand_fp8_weight(1024, 4096, g)
    qw = QWeight("fp8", w, s)
    x = rand_x(2, 4096, g).view(1, 2, 4096)
    ref = x.float() @ dequant_fp8(w, s).t()
    assert rel(lin(x, qw), ref) <= TOL
    xg = rand_x(3, 8 * 512, g).view(3, 8, 512)
    wg, sg = rand_fp8_weight(8 * 128, 512, g)
    refg = torch.einsum("ngi,gri->ngr", xg.float(), dequant_fp8(wg, sg).view(8, 128, 512))
    assert rel(lin.grouped(xg, QWeight("fp8", wg, sg), 8), refg) <= TOL


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_linear_bf16_weights_take_the_gemv(rows):
    """BF16 dense weights (weight_dtype=bf16) at decode: linear=gemv_cuda's one GEMV launch in its BF16 form, plain
    and grouped (wo_a), within TOL of the fp32 product; float32 activations keep the reference's matmul exactly."""
    from ds4.ops.linear_cuda import GemvCudaLinear
    from ds4.ops.linear_torch import DequantLinear
    lin = GemvCudaLinear()
    g = gen(seed_of("linear_bf16", rows))
    w = (torch.randn(1024, 4096, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
    x = rand_x(rows, 4096, g)
    y = lin(x.view(1, rows, 4096), QWeight("bf16", w))
    assert rel(y.view(rows, -1), x.float() @ w.float().t()) <= TOL
    assert torch.equal(y.view(rows, -1), kernels.gemv(x, w, None, "bf16"))  # the launch, not F.linear
    wg = (torch.randn(8 * 128, 512, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
    xg = rand_x(rows, 8 * 512, g).view(rows, 8, 512)
    yg = lin.grouped(xg, QWeight("bf16", wg), 8)
    refg = torch.einsum("ngi,gri->ngr", xg.float(), wg.float().view(8, 128, 512))
    assert rel(yg, refg) <= TOL
    assert torch.equal(yg.reshape(rows, -1), kernels.gemv(xg.reshape(rows, -1), wg, None, "bf16", groups=8))
    x32 = x.float().view(1, rows, 4096)
    assert torch.equal(lin(x32, QWeight("bf16", w)), DequantLinear()(x32, QWeight("bf16", w)))


# ------------------------------------------------------------------------------------------ prefill dequantisation

def _laid_weight(fmt, lead, o, i, g):
    """A random stored weight [*lead, o, i] laid out as fmt, with every E8M0 byte (0 and 255 among them) and, for
    fp8, the NaN codes too: (QWeight in fmt, scale)."""
    if fmt in ("fp8", "fp8t"):
        w = torch.randint(0, 256, (*lead, o, i), device=DEV, dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
        s = torch.randint(0, 256, (*lead, -(-o // 128), -(-i // 128)), device=DEV, dtype=torch.uint8, generator=g)
        return QWeight(fmt, tile_fp8_mma(w) if fmt == "fp8t" else w, s.view(torch.float8_e8m0fnu))
    w = torch.randint(-128, 128, (*lead, o, i // 2), device=DEV, dtype=torch.int8, generator=g)
    s = torch.randint(0, 256, (*lead, o, i // 32), device=DEV, dtype=torch.uint8, generator=g)
    if fmt in ("fp4p", "fp4t"):
        w = pack_fp4_mma(w)
    if fmt == "fp4t":
        w = tile_fp4_mma(w)
    return QWeight(fmt, w, s.view(torch.float8_e8m0fnu))


def _same_values(a, b):
    """Bit for bit, NaN where the other has NaN (NaN payloads aside)."""
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b))
    bits = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    assert torch.equal(a[~nan].view(bits), b[~nan].view(bits))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt,lead,o,i", [
    ("fp8", (), 32768, 1024), ("fp8", (), 100, 272), ("fp8", (3,), 130, 256), ("fp8t", (), 1024, 4096),
    ("fp8t", (), 16, 128), ("fp8t", (2,), 208, 384),
    ("fp4", (), 48, 96), ("fp4p", (5,), 64, 512), ("fp4t", (4,), 2048, 4096), ("fp4t", (), 16, 256)])
@pytest.mark.parametrize("stage", ["1", "0"])
def test_dequant_matches_qweight(fmt, lead, o, i, dtype, stage, monkeypatch):
    """Prefill's device dequantisation (ds4.kernels.dequant) of every stored layout gives QWeight.dequant's values bit
    for bit (E8M0 bytes 0 and 255, E4M3 NaN codes, partial 128-blocks, stacked experts, a last warp of fewer than 32
    chunks), into poisoned memory: the staged stores (the default) and the direct ones (DS4_DEQUANT_STAGE=0)."""
    monkeypatch.setenv("DS4_DEQUANT_STAGE", stage)
    g = gen(seed_of("dequant", fmt, lead, o, i, str(dtype)))
    q = _laid_weight(fmt, lead, o, i, g)
    assert kernels.dequant_ok(fmt, o, i)
    poison()
    got = kernels.dequant(q.weight, q.scale, fmt, dtype)
    assert got.shape == (*lead, o, i) and got.dtype == dtype
    _same_values(got, q.dequant(dtype))


def test_dequant_refuses_what_it_cannot_take():
    g = gen(5)
    q = _laid_weight("fp8", (), 64, 100, g)  # rows of 100 bytes: not whole 16-byte chunks
    assert not kernels.dequant_ok("fp8", 64, 100)
    with pytest.raises(ValueError, match="not a shape it takes"):
        kernels.dequant(q.weight, q.scale, "fp8")
    from ds4.ops.dequant_cuda import dense, takes
    assert not takes(q, torch.bfloat16)
    _same_values(dense(q, torch.bfloat16), q.dequant(torch.bfloat16))  # QWeight.dequant forms it then


def test_a_message_with_a_number_raises():
    """A refusal whose message holds a number raises a RuntimeError (on the lent H200 such a message formed by the
    ostream of c10::str segfaulted the process, session 48; csrc/check_text.h)."""
    w, s = rand_fp8_weight(64, 128, gen(5))
    with pytest.raises(RuntimeError, match="x has 96 columns, expected 128"):
        torch.ops.ds4.gemv(rand_x(1, 96, gen(5)), w, s, kernels.ops.FMT["fp8"])


def test_dequant_op_checks_the_scale_shape_and_takes_strided_experts():
    """A scale of the wrong shape is refused by the wrapper and by the op itself; the op writes stacked experts into a
    strided [E, O, K] view (the w1 half of a [E, 2 O, K] buffer) and leaves the rest of that buffer as it was."""
    g = gen(6)
    q = _laid_weight("fp4t", (), 16, 256, g)
    with pytest.raises(ValueError, match="scale shape"):
        kernels.dequant(q.weight, q.scale[:8], "fp4t")
    with pytest.raises(RuntimeError, match=r"scale shape \[8, 8\], expected \[16, 8\]"):
        torch.ops.ds4.dequant(q.weight, q.scale[:8], kernels.ops.FMT["fp4t"], torch.empty(16, 256, device=DEV))
    q = _laid_weight("fp4t", (3,), 32, 256, g)
    buf = torch.full((3, 64, 256), 7.0, device=DEV, dtype=torch.bfloat16)
    kernels.dequant(q.weight, q.scale, "fp4t", out=buf[:, :32])
    _same_values(buf[:, :32], q.dequant(torch.bfloat16))
    assert (buf[:, 32:] == 7.0).all()


@pytest.mark.parametrize("fmt", ["fp8", "fp8t"])
def test_linear_prefill_uses_the_same_dense_weight(fmt):
    """linear=gemv_cuda past its GEMV sizes multiplies by the device-dequantised weight: the reference's output
    (linear=dequant, QWeight.dequant and the same torch matmul) bit for bit, plain and grouped (wo_a)."""
    from ds4.ops.linear_cuda import PREFILL_TOKENS, GemvCudaLinear
    from ds4.ops.linear_torch import DequantLinear
    g = gen(seed_of("linear_prefill", fmt))
    w, s = rand_fp8_weight(1024, 4096, g)
    q = QWeight(fmt, tile_fp8_mma(w) if fmt == "fp8t" else w, s)
    x = rand_x(3 * PREFILL_TOKENS, 4096, g).view(3, PREFILL_TOKENS, 4096)
    assert torch.equal(GemvCudaLinear()(x, q), DequantLinear()(x, q))
    xg = rand_x(40, 8 * 512, g).view(40, 8, 512)
    wg, sg = rand_fp8_weight(8 * 128, 512, g)
    qg = QWeight(fmt, tile_fp8_mma(wg) if fmt == "fp8t" else wg, sg)
    assert torch.equal(GemvCudaLinear().grouped(xg, qg, 8), DequantLinear().grouped(xg, qg, 8))


# fp8t (linear=gemv_cuda's layout of the dense FP8 projections): the same bytes in the tensor-core stream's fragment
# order, so the one-token kernel (run width 2, any depth) reads the same fragments in the same order as from the stored
# layout at run width 2, and the FMA kernels find each chunk by its address: every output equals fp8's bit for bit.
FP8T_SHAPES = [(1536, 4096), (32768, 1024), (4096, 8192), (8192, 1024), (208, 384), (16, 128)]


@pytest.mark.parametrize("o,i", FP8T_SHAPES)
@pytest.mark.parametrize("n,kernel,depth", [(1, "auto", None), (1, "mma", "8"), (1, "mma", "4"), (1, "mma", "2"),
                                            (1, "fma", None), (2, "auto", None), (3, "auto", None), (8, "auto", None)])
def test_gemv_fp8t_equals_fp8(o, i, n, kernel, depth, monkeypatch):
    monkeypatch.delenv("DS4_MMA_W", raising=False)  # fp8's default run width (2), fp8t's laid-out one
    monkeypatch.delenv("DS4_MMA_LOAD", raising=False)
    if depth is None:
        monkeypatch.delenv("DS4_MMA_DEPTH", raising=False)
    else:
        monkeypatch.setenv("DS4_MMA_DEPTH", depth)
    g = gen(seed_of("fp8t", o, i, n, kernel, depth))
    w, s = rand_fp8_weight(o, i, g)
    x = rand_x(n, i, g)
    wt = tile_fp8_mma(w)
    assert not torch.equal(wt.view(torch.uint8), w.view(torch.uint8))  # really re-laid
    poison()
    y = kernels.gemv(x, wt, s, "fp8t", kernel=kernel)
    assert torch.isfinite(y).all(), "unwritten (NaN-poisoned) outputs"
    assert torch.equal(y, kernels.gemv(x, w, s, "fp8", kernel=kernel))
    assert rel(y, x.float() @ dequant_fp8(w, s, torch.float32).t()) <= TOL


@pytest.mark.parametrize("n", [1, 2])
def test_gemv_fp8t_grouped_wo_a(n):
    """wo_a's 8 groups of 1024 rows: the groups are whole tiles of the tiled matrix."""
    g = gen(seed_of("fp8t_wo_a", n))
    w, s = rand_fp8_weight(8192, 4096, g)
    x = rand_x(n, 8 * 4096, g)
    poison()
    y = kernels.gemv(x, tile_fp8_mma(w), s, "fp8t", groups=8)
    assert torch.isfinite(y).all()
    assert torch.equal(y, kernels.gemv(x, w, s, "fp8", groups=8))


@pytest.mark.parametrize("skip", [False, True])
def test_gemv_rmsnorm_fp8t_equals_fp8(skip):
    """The merged wq_b + indexer wq_b (CSA, 32768 + 8192 rows), q_norm in the staging, with and without the index
    query's rows skipped."""
    g = gen(seed_of("fp8t_norm", skip))
    w, s = rand_fp8_weight(40960, 1024, g)
    x, nw = rand_x(1, 1024, g), (1 + 0.1 * torch.randn(1024, device=DEV, generator=g)).to(torch.bfloat16)
    sk = (torch.tensor([40], device=DEV), 4, 512, 32768) if skip else None
    assert kernels.gemv_rmsnorm_ok("fp8t", 40960, 1024)
    poison()
    y = kernels.gemv_rmsnorm(x, tile_fp8_mma(w), s, "fp8t", nw, 1e-6, sk)
    assert torch.isfinite(y).all()
    assert torch.equal(y, kernels.gemv_rmsnorm(x, w, s, "fp8", nw, 1e-6, sk))


def test_fp8t_refused_where_it_cannot_be_laid_out():
    g = gen(11)
    w, s = rand_fp8_weight(200, 272, g)  # neither whole tiles nor whole rounds
    with pytest.raises(ValueError, match="fp8t"):
        kernels.gemv(rand_x(1, 272, g), w, s, "fp8t")
    assert not kernels.gemv_rmsnorm_ok("fp8t", 200, 272)
    with pytest.raises(ValueError, match="whole 16-row tiles"):  # the MoE kernels (the shared expert) alike
        kernels.moe_gate_up(rand_x(1, 272, g), None, None, w, s, w, s, "fp8t")


@pytest.mark.parametrize("mode", ["auto", "0", "1"])
def test_linear_prepare_lays_fp8t_out(mode, monkeypatch):
    """GemvCudaLinear.prepare (at load and configure): fp8 <-> fp8t as DS4_FP8_TILE says, in a new tensor (the given
    one keeps its bytes: the loader hands the model the caller's tensors); the products equal fp8's bit for bit, and
    QWeight.dequant reads either layout."""
    from ds4.ops.linear_cuda import GemvCudaLinear
    monkeypatch.setenv("DS4_FP8_TILE", mode)
    lin = GemvCudaLinear()
    g = gen(seed_of("prepare", mode))
    w, s = rand_fp8_weight(1024, 4096, g)
    stored, x = w.clone(), rand_x(1, 4096, g)
    q = lin.prepare(QWeight("fp8", w, s), "w")
    assert q.fmt == ("fp8" if mode == "0" else "fp8t") and (q.weight is w) == (mode == "0")
    assert torch.equal(w.view(torch.uint8), stored.view(torch.uint8))
    assert torch.equal(q.dequant(), dequant_fp8(stored, s))
    assert torch.equal(lin(x, q), kernels.gemv(x, stored, s, "fp8"))
    monkeypatch.setenv("DS4_FP8_TILE", "0")  # and back (a model configured again)
    back = lin.prepare(q, "w")
    assert back.fmt == "fp8" and torch.equal(back.weight.view(torch.uint8), stored.view(torch.uint8))
    odd = QWeight("fp8", *rand_fp8_weight(200, 272, g))
    monkeypatch.setenv("DS4_FP8_TILE", mode)
    if mode == "1":
        with pytest.raises(ValueError, match="DS4_FP8_TILE=1"):
            lin.prepare(odd, "odd")
    else:
        assert lin.prepare(odd, "odd").fmt == "fp8"


# ------------------------------------------------------------------------------------------ MoE

def ref_routed(x, weights, ids, w1, w3, w2, offset, limit):
    """fp32 reference of the routed sum with the MoEImpl semantics (h cast to bf16)."""
    n, k = ids.shape
    e_local = w1.shape[0]
    y = torch.zeros(n, w2.shape[1], device=DEV)
    for t in range(n):
        for j in range(k):
            e = int(ids[t, j]) - offset
            if not 0 <= e < e_local:
                continue
            gg = x[t].float() @ w1[e].t()
            uu = x[t].float() @ w3[e].t()
            a = torch.nn.functional.silu(gg.clamp(max=limit)) * uu.clamp(-limit, limit) * weights[t, j]
            y[t] += a.to(torch.bfloat16).float() @ w2[e].t()
    return y


def make_experts(e_local, dim, inter, g, fmt="fp4"):
    """Stacked experts in `fmt` ("fp4p": random FP4 bytes, then pack_fp4_mma; "fp4t": then tile_fp4_mma) and their
    dequantised values."""
    mk = rand_fp8_weight if fmt == "fp8" else rand_fp4_weight
    w1, s1 = mk(inter, dim, g, (e_local,))
    w3, s3 = mk(inter, dim, g, (e_local,))
    w2, s2 = mk(dim, inter, g, (e_local,))
    dq = dequant_fp8 if fmt == "fp8" else dequant_fp4
    deq = tuple(dq(w, s, torch.float32) for w, s in ((w1, s1), (w3, s3), (w2, s2)))
    if fmt in ("fp4p", "fp4t"):
        w1, w3, w2 = (pack_fp4_mma(w) for w in (w1, w3, w2))
    if fmt == "fp4t":
        w1, w3, w2 = (tile_fp4_mma(w) for w in (w1, w3, w2))
    return (w1, s1, w3, s3, w2, s2), deq


MOE_CASES = {
    # name: (n, ids) with expert_offset 32, 16 local experts -> local global ids 32..47
    "one_token": (1, [[33, 40, 47, 32, 35, 44]]),
    "repeat_across_tokens": (3, [[32, 33, 34, 35, 36, 37], [37, 36, 35, 34, 33, 32], [32, 40, 41, 42, 43, 47]]),
    "boundary_and_nonlocal": (2, [[31, 32, 47, 48, 0, 63], [47, 46, 1, 2, 3, 32]]),
    "dup_in_token": (2, [[40, 40, 41, 42, 43, 44], [40, 41, 41, 41, 45, 46]]),
    "eight_tokens": (8, None),
}


@pytest.mark.parametrize("fmt", ["fp4", "fp4p", "fp4t"])
@pytest.mark.parametrize("case", list(MOE_CASES))
@pytest.mark.parametrize("dims", [(4096, 2048), (512, 256)])
def test_moe_routed_fp4(case, dims, fmt):
    dim, inter = dims
    g = gen(seed_of(case, dims, fmt))
    (w1, s1, w3, s3, w2, s2), (d1, d3, d2) = make_experts(16, dim, inter, g, fmt)
    n, ids = MOE_CASES[case]
    if ids is None:
        ids = torch.randint(26, 54, (n, 6), device=DEV, generator=g)  # mixes local / non-local
    else:
        ids = torch.tensor(ids, device=DEV)
    weights = torch.rand(n, 6, device=DEV, generator=g) + 0.1
    x = rand_x(n, dim, g)
    ref = ref_routed(x, weights, ids, d1, d3, d2, 32, 10.0)
    poison()
    h = kernels.moe_gate_up(x, ids, weights, w1, s1, w3, s3, fmt, 32, 16, 10.0)
    poison()
    y = kernels.moe_down(h, ids, 6, w2, s2, fmt, 32, 16, None, True)
    assert y.dtype == torch.float32 and y.shape == (n, dim)
    assert torch.isfinite(y).all()
    if ref.norm() == 0:
        assert y.abs().max() == 0
    else:
        assert rel(y, ref) <= TOL, rel(y, ref)
    # a bf16 add (the finished shared expert): bf16(fp32 sum + add), the sum not rounded first
    addb = rand_x(n, dim, g)
    poison()
    yb = kernels.moe_down(h, ids, 6, w2, s2, fmt, 32, 16, addb, False)
    assert yb.dtype == torch.bfloat16 and torch.equal(yb, (y + addb.float()).to(torch.bfloat16))


@pytest.mark.parametrize("kernel,n", [("fma", 1), ("fma", 3), ("fma", 8), ("mma", 1), ("auto", 1), ("auto", 5)])
@pytest.mark.parametrize("dims", [(4096, 2048), (512, 384), (512, 256)])
@pytest.mark.parametrize("layout", ["fp4p", "fp4t"])
def test_moe_fp4p_layout_bit_exact(layout, kernel, n, dims, monkeypatch):
    """The permuted-word layout decodes to the same values in the same order: the fp4p kernels give the
    fp4 kernels' h and output bit for bit (FMA kernels for 1-8 tokens, tensor-core kernels for one); so do
    the fp4t kernels (the FMA ones find the tiled chunks by address, the tensor-core ones at depth 2 here:
    fp4t's register stream against fp4's at the same depth)."""
    dim, inter = dims
    if layout == "fp4t" and not all(fp4t_ok(r, c // 2) for r, c in ((inter, dim), (dim, inter))):
        pytest.skip("384 is not a whole number of fp4t rounds")
    if layout == "fp4t":  # the register stream for both (fp4t takes depth 2 where fp4 might take the smem stream)
        monkeypatch.setenv("DS4_MMA_DEPTH", "2")
    g = gen(4242 + n + dim)
    (w1, s1, w3, s3, w2, s2), _ = make_experts(16, dim, inter, g, "fp4")
    p1, p3, p2 = (pack_fp4_mma(w) for w in (w1, w3, w2))
    if layout == "fp4t":
        p1, p3, p2 = (tile_fp4_mma(w) for w in (p1, p3, p2))
    assert not torch.equal(p1, w1)
    ids = torch.randint(26, 54, (n, 6), device=DEV, generator=g)
    weights = torch.rand(n, 6, device=DEV, generator=g) + 0.1
    x = rand_x(n, dim, g)
    h = kernels.moe_gate_up(x, ids, weights, w1, s1, w3, s3, "fp4", 32, 16, 10.0, kernel=kernel)
    poison()
    hp = kernels.moe_gate_up(x, ids, weights, p1, s1, p3, s3, layout, 32, 16, 10.0, kernel=kernel)
    loc = ((ids >= 32) & (ids < 48)).flatten()  # other slots' h rows are not written
    assert loc.any() and torch.equal(hp[loc], h[loc])
    y = kernels.moe_down(h, ids, 6, w2, s2, "fp4", 32, 16, None, True, kernel=kernel)
    poison()
    yp = kernels.moe_down(h, ids, 6, p2, s2, layout, 32, 16, None, True, kernel=kernel)
    assert torch.equal(yp, y) and torch.isfinite(y).all()


@pytest.mark.parametrize("depth", ["2", "4", "8", "smem"])
@pytest.mark.parametrize("case", ["distinct", "boundary_and_nonlocal"])
@pytest.mark.parametrize("dims", [(4096, 2048), (512, 256)])
def test_moe_fp4t_layout_bit_exact(depth, case, dims, monkeypatch):
    """The fp4t layout (fp4p words in the fragment order) feeds the tensor-core kernels the same fragments in the
    same order: one token's h and output (fp32, and bf16 with an add) equal the fp4p kernels' bit for bit, at
    every depth. The shared-memory stream's request takes depth 2's register stream for fp4t (that stream reads
    rows contiguously), so it is compared with fp4p at depth 2 (fp4p's own shared-memory stream sums in
    another order)."""
    monkeypatch.setenv("DS4_MMA_DEPTH", "2" if depth == "smem" else depth)
    dim, inter = dims
    g = gen(seed_of("fp4t", depth, case, dims))
    (p1, s1, p3, s3, p2, s2), _ = make_experts(16, dim, inter, g, "fp4p")
    t1, t3, t2 = (tile_fp4_mma(w) for w in (p1, p3, p2))
    ids = torch.tensor([ONE_TOKEN_IDS[case]], device=DEV)
    weights = torch.rand(1, 6, device=DEV, generator=g) + 0.1
    x = rand_x(1, dim, g)
    adds = (None, rand_x(1, dim, g))
    h = kernels.moe_gate_up(x, ids, weights, p1, s1, p3, s3, "fp4p", 32, 16, 10.0)
    ys = [kernels.moe_down(h, ids, 6, p2, s2, "fp4p", 32, 16, add, add is None) for add in adds]
    if depth == "smem":
        monkeypatch.setenv("DS4_MMA_LOAD", "smem")
    poison()
    ht = kernels.moe_gate_up(x, ids, weights, t1, s1, t3, s3, "fp4t", 32, 16, 10.0)
    loc = ((ids >= 32) & (ids < 48)).flatten()
    assert loc.any() and torch.equal(ht[loc], h[loc])
    for add, y in zip(adds, ys):
        poison()
        yt = kernels.moe_down(h, ids, 6, t2, s2, "fp4t", 32, 16, add, add is None)
        assert torch.isfinite(yt.float()).all() and torch.equal(yt, y)


@pytest.mark.parametrize("depth", ["2", "8", "smem"])
def test_moe_down_prefetch_split_is_bit_exact(depth, monkeypatch):
    """DS4_PREFETCH_DOWN=N: the MoE down loads N weight rounds before its PDL wait and the rest after; the same
    output bits as the default (fp4t at V4's dim, and fp4p through the shared-memory stream)."""
    monkeypatch.setenv("DS4_MMA_DEPTH", "2" if depth == "smem" else depth)
    monkeypatch.delenv("DS4_PREFETCH_DOWN", raising=False)
    if depth == "smem":
        monkeypatch.setenv("DS4_MMA_LOAD", "smem")
    else:
        monkeypatch.delenv("DS4_MMA_LOAD", raising=False)
    layout = "fp4p" if depth == "smem" else "fp4t"
    dim, inter = 4096, 2048
    g = gen(seed_of("down_prefetch", depth))
    (p1, s1, p3, s3, p2, s2), _ = make_experts(16, dim, inter, g, "fp4p")
    w2 = p2 if layout == "fp4p" else tile_fp4_mma(p2)
    ids = torch.tensor([ONE_TOKEN_IDS["boundary_and_nonlocal"]], device=DEV)
    h = rand_x(6, inter, g)
    add = rand_x(1, dim, g)
    y = kernels.moe_down(h, ids, 6, w2, s2, layout, 32, 16, add, False)
    assert torch.isfinite(y.float()).all()
    for n in ("0", "1", "9"):
        monkeypatch.setenv("DS4_PREFETCH_DOWN", n)
        poison()
        assert torch.equal(kernels.moe_down(h, ids, 6, w2, s2, layout, 32, 16, add, False), y), n


@pytest.mark.skipif("DS4_MOE_PROBE" in os.environ.get("DS4_NVCC_FLAGS", ""), reason="a probe build has the probe")
def test_moe_step_probe_says_it_needs_its_build():
    """The routed MoE kernels' step probe (scripts/probe_moe_step.py) is compiled out of the library's build: asking
    it for its records raises, naming the build that has them."""
    with pytest.raises(RuntimeError, match="DS4_MOE_PROBE"):
        torch.ops.ds4.moe_step_probe(False)


def test_spacer_diagnostic_launches_before_the_named_kernels(monkeypatch):
    """DS4_SPACER (timing only): an empty launch goes before each tensor-core GEMV (g), MoE gate+up (u) and MoE
    down (d) launch it names, and the outputs stay the same bits."""
    monkeypatch.delenv("DS4_MMA_DEPTH", raising=False)
    monkeypatch.delenv("DS4_MMA_LOAD", raising=False)
    monkeypatch.delenv("DS4_SPACER", raising=False)
    dim, inter = 4096, 2048
    g = gen(seed_of("spacer"))
    (p1, s1, p3, s3, p2, s2), _ = make_experts(16, dim, inter, g, "fp4p")
    t1, t3, t2 = (tile_fp4_mma(w) for w in (p1, p3, p2))
    ids = torch.tensor([ONE_TOKEN_IDS["distinct"]], device=DEV)
    weights = torch.rand(1, 6, device=DEV, generator=g) + 0.1
    x = rand_x(1, dim, g)
    w, s = rand_fp8_weight(1024, dim, g)

    def run():
        y = kernels.gemv(x, w, s, "fp8", kernel="mma")
        h = kernels.moe_gate_up(x, ids, weights, t1, s1, t3, s3, "fp4t", 32, 16, 10.0)
        return y, h, kernels.moe_down(h, ids, 6, t2, s2, "fp4t", 32, 16, None, True)

    ref = run()
    for letters in ("g", "u", "d", "gdu"):
        monkeypatch.setenv("DS4_SPACER", letters)
        poison()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = run()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events()]
        assert sum("spacer_kernel" in n for n in names) == len(letters), (letters, names)
        loc = ((ids >= 32) & (ids < 48)).flatten()
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1][loc], ref[1][loc]) and torch.equal(out[2], ref[2])


@pytest.mark.parametrize("routed_depth,global_depth,rounds", [(None, None, 2), ("2", None, 1), ("4", None, 2),
                                                               ("8", None, 4), (None, "8", 4), ("4", "8", 2)])
def test_routed_gate_up_depth_default_and_knob(routed_depth, global_depth, rounds, monkeypatch):
    """The routed experts' fp4t gate+up at V4's dim runs at depth 4 (2 rounds of run width 2 in flight) where the
    per-shape rule says 8; a global DS4_MMA_DEPTH applies to it too, and DS4_ROUTED_DEPTH, which takes precedence,
    sets it alone: the kernel that ran (its template arguments: format 4 = fp4t, rounds, width) says which. Its h
    agrees with depth 8's up to the fp32 summation order (the grid, and so the warps' split of the rounds, follows
    the registers), seen through h's bf16 rounding (one-ulp flips)."""
    monkeypatch.delenv("DS4_MMA_DEPTH", raising=False)
    monkeypatch.delenv("DS4_MMA_LOAD", raising=False)
    dim, inter = 4096, 2048
    g = gen(seed_of("routed_depth", routed_depth))
    (p1, s1, p3, s3, _, _), _ = make_experts(16, dim, inter, g, "fp4p")
    t1, t3 = tile_fp4_mma(p1), tile_fp4_mma(p3)
    ids = torch.tensor([ONE_TOKEN_IDS["distinct"]], device=DEV)
    weights = torch.rand(1, 6, device=DEV, generator=g) + 0.1
    x = rand_x(1, dim, g)
    monkeypatch.setenv("DS4_ROUTED_DEPTH", "8")
    h8 = kernels.moe_gate_up(x, ids, weights, t1, s1, t3, s3, "fp4t", 32, 16, 10.0)
    if routed_depth is None:
        monkeypatch.delenv("DS4_ROUTED_DEPTH")
    else:
        monkeypatch.setenv("DS4_ROUTED_DEPTH", routed_depth)
    if global_depth is not None:
        monkeypatch.setenv("DS4_MMA_DEPTH", global_depth)
    poison()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        h = kernels.moe_gate_up(x, ids, weights, t1, s1, t3, s3, "fp4t", 32, 16, 10.0)
        torch.cuda.synchronize()
    names = [e.name.replace("(int)", "") for e in prof.events() if "moe_gate_up_mma_kernel" in e.name]
    assert names and all(f"moe_gate_up_mma_kernel<4, {rounds}, 2, false>" in n for n in names), names
    loc = ((ids >= 32) & (ids < 48)).flatten()
    assert torch.isfinite(h[loc].float()).all() and rel(h[loc], h8[loc]) <= 1e-3


def _launched(prof, kernel):
    """The template arguments of the launches of `kernel` a profile recorded, e.g. "4, 2, 2, false" (the trailing
    bools: the kernel's forms, the last one AQ, numerics=qat's FP8 simulation in the staging, off here)."""
    names = [e.name.replace("(int)", "").replace("(bool)", "") for e in prof.events() if kernel + "<" in e.name]
    return sorted({n[n.index("<") + 1:n.index(">")] for n in names})


@pytest.mark.parametrize("long_rows,down,global_depth,shared", [
    (None, None, None, None), ("4", None, None, None), ("2", "4", None, None), (None, "8", None, None),
    ("4", "4", "2", None), (None, None, None, "4"), ("2", None, "8", "4")])
def test_long_row_and_down_depth_knobs(long_rows, down, global_depth, shared, monkeypatch):
    """DS4_LONG_ROW_DEPTH replaces the per-shape rule's depth 8 alone (a 4096-input FP8 GEMV and the shared expert's
    gate+up), not its depth 2 (a 1024-input GEMV) nor the routed gate+up's own rule; DS4_DOWN_DEPTH sets the MoE
    downs' depth (routed and shared); DS4_SHARED_DEPTH the shared expert's gate+up alone; a global DS4_MMA_DEPTH still
    sets the others. The kernels that ran (template arguments: format, rounds in flight, run width) say which; every
    output matches its fp32 reference."""
    for name, value in (("DS4_LONG_ROW_DEPTH", long_rows), ("DS4_DOWN_DEPTH", down), ("DS4_MMA_DEPTH", global_depth),
                        ("DS4_SHARED_DEPTH", shared)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    for name in ("DS4_MMA_LOAD", "DS4_ROUTED_DEPTH", "DS4_MMA_W"):
        monkeypatch.delenv(name, raising=False)
    rounds = lambda depth: str(int(depth) // 2)  # noqa: E731 (run width 2)
    glob = global_depth
    g = gen(seed_of("depth_knobs", long_rows, down, global_depth, shared))
    dim, inter = 4096, 2048
    # dense GEMVs: K = 4096 (rule 8) and K = 1024 (rule 2)
    for o, i, rule in ((512, 4096, "8"), (256, 1024, "2")):
        w, s = rand_fp8_weight(o, i, g)
        x = rand_x(1, i, g)
        ref = x.float() @ dequant_fp8(w, s, torch.float32).t()
        poison()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            y = kernels.gemv(x, w, s, "fp8", kernel="mma")
            torch.cuda.synchronize()
        want = glob or (long_rows if rule == "8" and long_rows else rule)
        assert _launched(prof, "gemv_mma_kernel") == [f"1, {rounds(want)}, 2, false, false, false"], (o, i)
        assert rel(y, ref) <= TOL
    # the shared expert (FP8, one slot): gate+up K = dim (rule 8), down K = inter (rule 2)
    w1, s1 = rand_fp8_weight(inter, dim, g)
    w3, s3 = rand_fp8_weight(inter, dim, g)
    w2, s2 = rand_fp8_weight(dim, inter, g)
    x = rand_x(1, dim, g)
    d1, d3, d2 = dequant_fp8(w1, s1), dequant_fp8(w3, s3), dequant_fp8(w2, s2)
    a = torch.nn.functional.silu((x.float() @ d1.t()).clamp(max=10.0)) * (x.float() @ d3.t()).clamp(-10, 10)
    poison()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        h = kernels.moe_gate_up(x, None, None, w1, s1, w3, s3, "fp8", 0, 1, 10.0, kernel="mma")
        y = kernels.moe_down(h, None, 1, w2, s2, "fp8", 0, 1, None, False, kernel="mma")
        torch.cuda.synchronize()
    assert _launched(prof, "moe_gate_up_mma_kernel") == [f"1, {rounds(shared or glob or long_rows or '8')}, 2, false"]
    assert _launched(prof, "moe_down_mma_kernel") == [f"1, {rounds(down or glob or '2')}, 2, false, false, false"]
    assert rel(y, a.to(torch.bfloat16).float() @ d2.t()) <= TOL
    # the routed experts (fp4t): gate+up by its own rule (4 where the rule says 8), down by DS4_DOWN_DEPTH
    (p1, s1, p3, s3, p2, s2), (e1, e3, e2) = make_experts(16, dim, inter, g, "fp4p")
    t1, t3, t2 = tile_fp4_mma(p1), tile_fp4_mma(p3), tile_fp4_mma(p2)
    ids = torch.tensor([ONE_TOKEN_IDS["distinct"]], device=DEV)
    weights = torch.rand(1, 6, device=DEV, generator=g) + 0.1
    poison()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        h = kernels.moe_gate_up(x, ids, weights, t1, s1, t3, s3, "fp4t", 32, 16, 10.0)
        y = kernels.moe_down(h, ids, 6, t2, s2, "fp4t", 32, 16, None, True)
        torch.cuda.synchronize()
    assert _launched(prof, "moe_gate_up_mma_kernel") == [f"4, {rounds(glob or '4')}, 2, false"]
    assert _launched(prof, "moe_down_mma_kernel") == [f"4, {rounds(down or glob or '2')}, 2, true, false, false"]
    assert rel(y, ref_routed(x, weights, ids, e1, e3, e2, 32, 10.0)) <= TOL


ONE_TOKEN_IDS = {"distinct": [33, 40, 47, 32, 35, 44], "boundary_and_nonlocal": [31, 32, 47, 48, 0, 63],
                 "dup": [40, 40, 41, 42, 43, 44], "none_local": [0, 1, 2, 3, 60, 61]}


@pytest.mark.parametrize("kernel,width,depth", MMA_SHAPES)
@pytest.mark.parametrize("case", list(ONE_TOKEN_IDS))
@pytest.mark.parametrize("fmt,dims", [("fp4", (4096, 2048)), ("fp4", (512, 384)), ("fp8", (1024, 512)),
                                      ("fp8", (768, 384)), ("fp4p", (4096, 2048)), ("fp4p", (512, 384))])
def test_moe_one_token_kernels(kernel, width, depth, case, fmt, dims, monkeypatch):
    set_mma_shape(monkeypatch, width, depth)
    dim, inter = dims
    g = gen(seed_of(case, dims, fmt))
    (w1, s1, w3, s3, w2, s2), (d1, d3, d2) = make_experts(16, dim, inter, g, fmt)
    ids = torch.tensor([ONE_TOKEN_IDS[case]], device=DEV)
    weights = torch.rand(1, 6, device=DEV, generator=g) + 0.1
    x = rand_x(1, dim, g)
    ref = ref_routed(x, weights, ids, d1, d3, d2, 32, 10.0)
    add = torch.randn(1, dim, device=DEV, generator=g)
    poison()
    h = kernels.moe_gate_up(x, ids, weights, w1, s1, w3, s3, fmt, 32, 16, 10.0, kernel=kernel)
    poison()
    y = kernels.moe_down(h, ids, 6, w2, s2, fmt, 32, 16, add, True, kernel=kernel)
    assert torch.isfinite(y).all()
    assert rel(y - add, ref) <= TOL if ref.norm() > 0 else torch.equal(y, add)
    # a bf16 add (the finished shared expert): bf16(fp32 sum + add), the sum not rounded first
    addb = add.to(torch.bfloat16)
    poison()
    yb = kernels.moe_down(h, ids, 6, w2, s2, fmt, 32, 16, addb, False, kernel=kernel)
    y0 = kernels.moe_down(h, ids, 6, w2, s2, fmt, 32, 16, None, True, kernel=kernel)
    assert yb.dtype == torch.bfloat16 and torch.equal(yb, (y0 + addb.float()).to(torch.bfloat16))


@pytest.mark.parametrize("wave", ["50", "1"])
@pytest.mark.parametrize("fmt,dims", [("fp4t", (4096, 2048)), ("fp4t", (512, 256)), ("fp4p", (4096, 2048))])
def test_routed_wave_cap(wave, fmt, dims, monkeypatch):
    """DS4_ROUTED_WAVE: the one-token routed gate+up on part of a resident wave (more tiles per block) gives the
    reference's output, and the same h as the whole wave up to the summation order of a tile's warps: h is bf16,
    so that order shows as one-ulp flips (adjacent bit patterns) in a few of its values, and nowhere more."""
    dim, inter = dims
    g = gen(seed_of("wave", wave, fmt, dims))
    (w1, s1, w3, s3, w2, s2), (d1, d3, d2) = make_experts(16, dim, inter, g, fmt)
    ids = torch.tensor([ONE_TOKEN_IDS["distinct"]], device=DEV)
    weights = torch.rand(1, 6, device=DEV, generator=g) + 0.1
    x = rand_x(1, dim, g)
    ref = ref_routed(x, weights, ids, d1, d3, d2, 32, 10.0)
    monkeypatch.setenv("DS4_ROUTED_WAVE", "100")
    h_all = kernels.moe_gate_up(x, ids, weights, w1, s1, w3, s3, fmt, 32, 16, 10.0)
    monkeypatch.setenv("DS4_ROUTED_WAVE", wave)
    poison()
    h = kernels.moe_gate_up(x, ids, weights, w1, s1, w3, s3, fmt, 32, 16, 10.0)
    poison()
    y = kernels.moe_down(h, ids, 6, w2, s2, fmt, 32, 16, None, True)
    assert torch.isfinite(y).all() and rel(y, ref) <= TOL, rel(y, ref)
    flips = (h.view(torch.int16).int() - h_all.view(torch.int16).int()).abs()  # all 6 slots are local
    assert flips.max() <= 1 and (flips > 0).float().mean() <= 0.01, (flips.max(), (flips > 0).sum())


# wave: DS4_SHARED_WAVE, the percent of a resident wave the one-token (tensor-core) shared expert launches take;
# inter 1024: V4-Flash's shared expert sliced over 2 ranks (parallel.shared_expert=tp), on the tensor cores too
@pytest.mark.parametrize("n,wave,inter", [(1, "100", 2048), (3, "100", 2048), (8, "100", 2048), (1, "40", 2048),
                                          (1, "1", 2048), (1, "100", 1024), (2, "100", 1024)])
def test_shared_expert_fp8(n, wave, inter, monkeypatch):
    monkeypatch.setenv("DS4_SHARED_WAVE", wave)
    g = gen(500 + n + inter)
    dim = 4096
    w1, s1 = rand_fp8_weight(inter, dim, g)
    w3, s3 = rand_fp8_weight(inter, dim, g)
    w2, s2 = rand_fp8_weight(dim, inter, g)
    x = rand_x(n, dim, g)
    d1, d3, d2 = dequant_fp8(w1, s1), dequant_fp8(w3, s3), dequant_fp8(w2, s2)
    a = torch.nn.functional.silu((x.float() @ d1.t()).clamp(max=10.0)) * (x.float() @ d3.t()).clamp(-10, 10)
    ref = a.to(torch.bfloat16).float() @ d2.t()
    poison()
    h = kernels.moe_gate_up(x, None, None, w1, s1, w3, s3, "fp8", 0, 1, 10.0)
    poison()
    y = kernels.moe_down(h, None, 1, w2, s2, "fp8", 0, 1, None, False)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert rel(y, ref) <= TOL
    if n == 1:  # auto takes the tensor cores for one token at both sizes: the same bits as asking for them
        hm = kernels.moe_gate_up(x, None, None, w1, s1, w3, s3, "fp8", 0, 1, 10.0, kernel="mma")
        assert torch.equal(y, kernels.moe_down(hm, None, 1, w2, s2, "fp8", 0, 1, None, False, kernel="mma"))


# fp8t for the shared expert (moe=fp4_topk's prepare, as linear=gemv_cuda's dense projections): the MoE kernels read the
# tiled bytes at the layout's run width (the one-token tensor-core kernels, every depth) or find each chunk by address
# (the FMA kernels, several tokens): the same fragments in the same order as fp8 at run width 2, so the same bits.
@pytest.mark.parametrize("n,kernel,depth", [(1, "auto", None), (1, "mma", "8"), (1, "mma", "4"), (1, "mma", "2"),
                                            (1, "fma", None), (2, "auto", None), (3, "auto", None), (8, "auto", None)])
@pytest.mark.parametrize("dim,inter", [(4096, 2048), (4096, 1024), (512, 256), (128, 128)])
def test_shared_expert_fp8t_equals_fp8(n, kernel, depth, dim, inter, monkeypatch):
    for name in ("DS4_MMA_W", "DS4_MMA_LOAD", "DS4_SHARED_DEPTH", "DS4_DOWN_DEPTH", "DS4_LONG_ROW_DEPTH"):
        monkeypatch.delenv(name, raising=False)
    if depth is None:
        monkeypatch.delenv("DS4_MMA_DEPTH", raising=False)
    else:
        monkeypatch.setenv("DS4_MMA_DEPTH", depth)
    g = gen(seed_of("shared_fp8t", n, kernel, depth, dim, inter))
    (w1, s1), (w3, s3), (w2, s2) = (rand_fp8_weight(o, i, g) for o, i in ((inter, dim), (inter, dim), (dim, inter)))
    t1, t3, t2 = (tile_fp8_mma(w) for w in (w1, w3, w2))
    assert not torch.equal(t1.view(torch.uint8), w1.view(torch.uint8))  # really re-laid
    x = rand_x(n, dim, g)
    add_b = rand_x(n, dim, g)
    add_f = torch.randn(n, dim, device=DEV, generator=g)
    poison()
    h = kernels.moe_gate_up(x, None, None, t1, s1, t3, s3, "fp8t", 0, 1, 10.0, kernel=kernel)
    assert torch.isfinite(h).all(), "unwritten (NaN-poisoned) outputs"
    assert torch.equal(h, kernels.moe_gate_up(x, None, None, w1, s1, w3, s3, "fp8", 0, 1, 10.0, kernel=kernel))
    for add, out_f32 in ((None, False), (add_b, False), (add_f, False), (add_f, True)):
        poison()
        y = kernels.moe_down(h, None, 1, t2, s2, "fp8t", 0, 1, add, out_f32, kernel=kernel)
        assert torch.isfinite(y).all()
        assert torch.equal(y, kernels.moe_down(h, None, 1, w2, s2, "fp8", 0, 1, add, out_f32, kernel=kernel))
    d1, d3, d2 = dequant_fp8(w1, s1), dequant_fp8(w3, s3), dequant_fp8(w2, s2)
    a = torch.nn.functional.silu((x.float() @ d1.t()).clamp(max=10.0)) * (x.float() @ d3.t()).clamp(-10, 10)
    y = kernels.moe_down(h, None, 1, t2, s2, "fp8t", 0, 1, None, False, kernel=kernel)
    assert rel(y, a.to(torch.bfloat16).float() @ d2.t()) <= TOL


@pytest.mark.parametrize("case", ["one_token", "boundary_and_nonlocal", "dup_in_token", "eight_tokens"])
def test_routed_fp8t_equals_fp8(case):
    """The kernels take fp8t for routed slots too (no V4 layer stores FP8 routed experts): repeated, boundary and
    non-local ids give fp8's bits."""
    n, ids = MOE_CASES[case]
    g = gen(seed_of("routed_fp8t", case))
    if ids is None:
        ids = torch.randint(32, 48, (n, 6), device=DEV, generator=g)
    else:
        ids = torch.tensor(ids, device=DEV)
    (w1, s1, w3, s3, w2, s2), _ = make_experts(16, 1024, 512, g, "fp8")
    t1, t3, t2 = (tile_fp8_mma(w) for w in (w1, w3, w2))
    weights = torch.rand(n, 6, device=DEV, generator=g) + 0.1
    x = rand_x(n, 1024, g)
    h8 = kernels.moe_gate_up(x, ids, weights, w1, s1, w3, s3, "fp8", 32, 16, 10.0)
    poison()
    h = kernels.moe_gate_up(x, ids, weights, t1, s1, t3, s3, "fp8t", 32, 16, 10.0)
    local = ((ids >= 32) & (ids < 48)).reshape(-1)  # the h rows of non-local slots are left unwritten
    assert torch.isfinite(h[local]).all() and torch.equal(h[local], h8[local])
    h[~local] = 0
    poison()
    y = kernels.moe_down(h, ids, 6, t2, s2, "fp8t", 32, 16, None, True)
    assert torch.isfinite(y).all() and torch.equal(y, kernels.moe_down(h, ids, 6, w2, s2, "fp8", 32, 16, None, True))


@pytest.mark.parametrize("env,want", [({}, "fp8t"), ({"DS4_FP8_TILE": "0"}, "fp8"), ({"DS4_SHARED_TILE": "0"}, "fp8"),
                                      ({"DS4_FP8_TILE": "0", "DS4_SHARED_TILE": "1"}, "fp8t"),
                                      ({"DS4_MOE_FFN": "1"}, "fp8"), ({"DS4_MOE_FFN": "2", "DS4_FP8_TILE": "1"}, None)])
def test_moe_prepare_lays_shared_fp8t(env, want, monkeypatch):
    """moe=fp4_topk's prepare (at load and configure) lays the shared expert out as fp8t by DS4_SHARED_TILE, else
    DS4_FP8_TILE, in new tensors (the caller's keep their bytes), fp8 under DS4_MOE_FFN (its one launch reads fp8),
    where an explicit fp8t request is refused; the shared expert's output keeps fp8's bits, one token and three."""
    from ds4.ops.moe_cuda import Fp4TopkMoE
    for name in ("DS4_FP8_TILE", "DS4_SHARED_TILE", "DS4_MOE_FFN", "DS4_FP4_TILE", "DS4_FP4_PACK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    g = gen(seed_of("moe_prepare", sorted(env.items())))
    mw, _ = _moe_weights(g)
    stored = {n: getattr(mw, n).weight.clone() for n in ("shared_w1", "shared_w2", "shared_w3")}
    moe = Fp4TopkMoE()
    if want is None:
        with pytest.raises(ValueError, match="DS4_MOE_FFN"):
            moe.prepare(mw)
        return
    out = moe.prepare(mw)
    assert out.w1.fmt == "fp4t"
    for name, w in stored.items():
        q = getattr(out, name)
        assert q.fmt == want and (q.weight is getattr(mw, name).weight) == (want == "fp8")
        assert torch.equal(getattr(mw, name).weight.view(torch.uint8), w.view(torch.uint8))
        assert torch.equal(q.dequant(), dequant_fp8(w, q.scale))
    for n in (1, 3):
        x = rand_x(n, 512, g)
        assert torch.equal(moe.shared(x, out), moe.shared(x, mw))
    monkeypatch.setenv("DS4_SHARED_TILE", "0")  # configured again: back to the stored layout
    back = moe.prepare(out)
    assert all(getattr(back, n).fmt == "fp8" and torch.equal(getattr(back, n).weight.view(torch.uint8),
                                                             w.view(torch.uint8)) for n, w in stored.items())


def _moe_weights(g, e_local=16, offset=32, dim=512, inter=256, n_experts=64, hash_layer=False):
    (w1, s1, w3, s3, w2, s2), dq = make_experts(e_local, dim, inter, g)
    sw1, ss1 = rand_fp8_weight(inter, dim, g)
    sw3, ss3 = rand_fp8_weight(inter, dim, g)
    sw2, ss2 = rand_fp8_weight(dim, inter, g)
    gate = (torch.randn(n_experts, dim, device=DEV, generator=g) * 0.05).to(torch.bfloat16)
    bias = None if hash_layer else torch.randn(n_experts, device=DEV, generator=g) * 0.1
    tid = torch.randint(0, n_experts, (1000, 6), device=DEV, generator=g, dtype=torch.int32) if hash_layer else None
    mw = MoEWeights(gate=gate, bias=bias, tid2eid=tid, w1=QWeight("fp4", w1, s1), w2=QWeight("fp4", w2, s2),
                    w3=QWeight("fp4", w3, s3), shared_w1=QWeight("fp8", sw1, ss1), shared_w2=QWeight("fp8", sw2, ss2),
                    shared_w3=QWeight("fp8", sw3, ss3), n_experts=n_experts, expert_offset=offset, topk=6,
                    route_scale=1.5, swiglu_limit=10.0)
    return mw, dq


@pytest.mark.parametrize("n,limit", [(100, None), (100, "64"), (37, "16"), (9000, None)])
def test_moe_prefill_chunks_agree_with_the_reference(n, limit, monkeypatch):
    """A prompt's MoE under moe=fp4_topk (its prepared fp4t / fp8t layouts): up to the chunk limit
    (ds4.ops.moe_cuda.chunked_tokens, DS4_MOE_CHUNKED_TOKENS) the decode kernels run chunk by chunk, beyond it the
    expert loop on device-dequantised weights (grouped_routed, and the shared expert likewise); both the routed sum
    and the shared expert agree with moe=dequant on the stored weights, and the two paths with each other."""
    from ds4.ops.moe_cuda import Fp4TopkMoE, chunked_tokens
    from ds4.ops.moe_torch import DequantMoE
    for name in ("DS4_FP8_TILE", "DS4_SHARED_TILE", "DS4_MOE_FFN", "DS4_FP4_TILE", "DS4_FP4_PACK",
                 "DS4_MOE_CHUNKED_TOKENS"):
        monkeypatch.delenv(name, raising=False)
    g = gen(seed_of("moe_prefill_chunks", n, limit))
    mw, _ = _moe_weights(g)
    x = rand_x(n, 512, g)
    w, ids = ref_route(x, torch.arange(n, device=DEV), mw)
    ids = torch.where(torch.rand(n, 6, device=DEV, generator=g) < 0.5, ids % 16 + 32, ids)  # mostly local experts
    ref = DequantMoE().routed(x, w, ids, mw)  # before prepare, which lays the routed experts out in place
    ref_sh = DequantMoE().shared(x, mw)
    moe = Fp4TopkMoE()
    laid = moe.prepare(mw)
    assert laid.w1.fmt == "fp4t" and laid.shared_w1.fmt == "fp8t"
    got = {}
    for lim in (limit, str(n)):  # the case's limit, then one that takes the whole prompt in chunks
        if lim is None:
            monkeypatch.delenv("DS4_MOE_CHUNKED_TOKENS", raising=False)
        else:
            monkeypatch.setenv("DS4_MOE_CHUNKED_TOKENS", lim)
        poison()
        y, sh = moe.routed(x, w, ids, laid), moe.shared(x, laid)
        assert torch.isfinite(y).all() and torch.isfinite(sh.float()).all()
        assert rel(y, ref) <= TOL and rel(sh.float(), ref_sh.float()) <= TOL, (lim, chunked_tokens())
        got[lim] = y
    assert rel(got[limit], got[str(n)]) <= TOL


@pytest.mark.parametrize("act_quant,grouped_mm,group_bytes", [(False, None, None), (True, None, None),
                                                               (False, "0", None), (False, None, "2000000"),
                                                               (True, "0", "2000000")])
def test_grouped_prefill_equals_the_reference_loop(act_quant, grouped_mm, group_bytes, monkeypatch):
    """grouped_routed (a long prompt's routed experts under moe=fp4_topk) on the fp4t experts: moe=dequant's expert
    loop on the stored ones, to cuBLAS's summation order (gate and up are one product there, two here), in both
    numerics modes, with non-local ids; by torch._grouped_mm or one matmul per expert (DS4_GROUPED_MM=0), all 16
    experts' weights at once or 2 at a time (DS4_PREFILL_GROUP_BYTES)."""
    from ds4.ops.moe_cuda import Fp4TopkMoE, grouped_routed
    from ds4.ops.moe_torch import DequantMoE
    for name, v in (("DS4_GROUPED_MM", grouped_mm), ("DS4_PREFILL_GROUP_BYTES", group_bytes)):
        if v is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, v)
    g = gen(seed_of("grouped_prefill", act_quant, grouped_mm, group_bytes))
    mw, _ = _moe_weights(g)
    n = 300
    x = rand_x(n, 512, g)
    w, ids = ref_route(x, torch.arange(n, device=DEV), mw)
    ref = DequantMoE().routed(x, w, ids, mw, act_quant)
    laid = Fp4TopkMoE().prepare(mw)
    assert laid.w1.fmt == "fp4t"
    poison()
    y = grouped_routed(x, w, ids, laid, act_quant)
    assert y.dtype == torch.float32 and torch.isfinite(y).all()
    assert rel(y, ref) <= TOL


@pytest.mark.parametrize("hash_layer", [False, True])
def test_prompt_routing_takes_one_fp32_gemm(hash_layer):
    """moe=fp4_topk's route() for a prompt (more tokens than the GEMV kernel takes a launch) forms the logits as the
    reference does (x.float() @ gate.float().T) and routes them with the top-k kernel: the reference's experts and
    weights (ids compared as sets per token: the kernel orders ties its own way)."""
    from ds4.ops.moe_cuda import PREFILL_TOKENS, Fp4TopkMoE
    g = gen(seed_of("prompt_routing", hash_layer))
    mw, _ = _moe_weights(g, dim=4096, n_experts=256, hash_layer=hash_layer)
    n = 40 * PREFILL_TOKENS
    x = rand_x(n, 4096, g)
    tok = torch.randint(0, 1000, (n,), device=DEV, generator=g)
    w, ids = Fp4TopkMoE().route(x, tok, mw)
    rw, rids = ref_route(x, tok, mw)
    same = (ids.sort(-1).values == rids.sort(-1).values).all(-1)
    assert same.float().mean() >= 0.99, same.float().mean()
    wk = w.gather(-1, ids.argsort(-1))[same]
    wr = rw.gather(-1, rids.argsort(-1))[same]
    assert rel(wk, wr) <= 1e-5


def ref_route(x, token_ids, mw):
    logits = x.float() @ mw.gate.float().t()
    scores = torch.nn.functional.softplus(logits).sqrt()
    if mw.tid2eid is not None:
        ids = mw.tid2eid[token_ids].long()
    else:
        ids = (scores + mw.bias.float()).topk(mw.topk, dim=-1).indices
    w = scores.gather(-1, ids)
    return w / w.sum(-1, keepdim=True) * mw.route_scale, ids


# fused (DS4_ROUTER_FUSED=1) with n <= 8 (and n * E <= 4096): the one-launch router (its last block runs
# the tail); otherwise (and n = 20 either way): the BF16 GEMV + tail kernel
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("hash_layer", [False, True])
@pytest.mark.parametrize("n", [1, 5, 20])
@pytest.mark.parametrize("dim,n_experts", [(4096, 256), (512, 64)])
def test_router(hash_layer, n, dim, n_experts, fused, monkeypatch):
    monkeypatch.setenv("DS4_ROUTER_FUSED", "1" if fused else "0")
    g = gen(900 + n + 2 * hash_layer + dim)
    mw, _ = _moe_weights(g, dim=dim, inter=256, n_experts=n_experts, hash_layer=hash_layer)
    x = rand_x(n, dim, g)
    tok = torch.randint(0, 1000, (n,), device=DEV, generator=g)
    rw, rids = ref_route(x, tok, mw)
    poison()
    w, ids = kernels.router(x, mw.gate, mw.bias, mw.tid2eid, tok if hash_layer else None, 6, 1.5)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    # same selected sets (order may differ); weights matched per expert id
    so, si = ids.sort(-1)
    ro, ri = rids.sort(-1)
    assert torch.equal(so, ro)
    assert rel(w.gather(-1, si), rw.gather(-1, ri)) <= 1e-5
    if hash_layer:
        tid64 = mw.tid2eid.long()
        w2, ids2 = kernels.router(x, mw.gate, None, tid64, tok, 6, 1.5)
        assert torch.equal(ids2, ids)
    # back-to-back launches (the fused kernel's arrival counter is reset by its last block) give the same
    for _ in range(3):
        w3, ids3 = kernels.router(x, mw.gate, mw.bias, mw.tid2eid, tok if hash_layer else None, 6, 1.5)
        assert torch.equal(ids3, ids) and torch.equal(w3, w)


# Exact ties: x and the gate on small grids, so every logit is exact in any summation order (the kernels'
# and torch's agree bit for bit) and many are equal; the bias on a grid too, so several experts share a biased
# score. Row 0 of x is zero: all its logits equal. Best first, ties to the lower expert id = a stable descending
# sort of score + bias. Through the GEMV + tail, the fused router (n * E <= 4096) and the tail from given logits.
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("n_experts,topk", [(256, 6), (64, 8), (1024, 6), (40, 16), (7, 7)])
@pytest.mark.parametrize("n", [1, 4, 20])
def test_router_topk_order_and_ties(n_experts, topk, n, fused, monkeypatch):
    monkeypatch.setenv("DS4_ROUTER_FUSED", "1" if fused else "0")
    g = gen(950 + n_experts + topk + n)
    dim = 64
    x = torch.randint(-1, 2, (n, dim), device=DEV, generator=g).to(torch.bfloat16)
    x[0] = 0
    gate = (torch.randint(-2, 3, (n_experts, dim), device=DEV, generator=g).float() * 0.25).to(torch.bfloat16)
    bias = torch.randint(-2, 3, (n_experts,), device=DEV, generator=g).float() * 0.25
    logits = x.float() @ gate.float().t()
    scores = torch.nn.functional.softplus(logits).sqrt()
    ref_ids = (scores + bias).sort(dim=-1, descending=True, stable=True).indices[:, :topk]
    ref_w = scores.gather(-1, ref_ids)
    ref_w = ref_w / ref_w.sum(-1, keepdim=True) * 1.5
    for given in (None, logits):
        poison()
        w, ids = kernels.router(x, gate, bias, None, None, topk, 1.5, logits=given)
        assert torch.equal(ids, ref_ids)  # the same experts in the same order
        assert rel(w, ref_w) <= 1e-6


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("n_experts,n,hc", [(256, 1, 4), (256, 3, 2), (16, 2, 4), (40, 1, 1)])
def test_router_takes_the_sinkhorn_along(n_experts, n, hc, fused, monkeypatch):
    """ride: the router's last launch (the top-k tail in a warp of its own, with 16 experts a block widened to two
    warps; the fused router's last block after its tail) finishes each token's mHC Sinkhorn in place: the same ids
    and weights as without it, comb as hc_sinkhorn's launch of its own makes it (the finish's bits), for learned
    and hash layers."""
    from ds4 import kernels_attn
    from ds4.ops.base import SinkhornRide
    monkeypatch.setenv("DS4_ROUTER_FUSED", "1" if fused else "0")
    g = gen(1700 + n_experts + n + hc)
    dim = 128
    x = rand_x(n, dim, g)
    gate = (torch.randn(n_experts, dim, device=DEV, generator=g) * 0.1).to(torch.bfloat16)
    bias = torch.randn(n_experts, device=DEV, generator=g) * 0.1
    tid = torch.randint(0, n_experts, (50, 6), device=DEV, generator=g)
    tok = torch.randint(0, 50, (n,), device=DEV, generator=g)
    logits = torch.randn(n, hc, hc, device=DEV, generator=g) * 2
    want = logits.clone()
    kernels_attn.hc_sinkhorn(want, 20, 1e-6)
    for table in ((bias, None, None), (None, tid, tok)):
        for given in ((None, x.float() @ gate.float().t()) if not fused else (None,)):
            plain = kernels.router(x, gate, *table, 6, 1.5, logits=given)
            comb = logits.clone()
            poison()
            got = kernels.router(x, gate, *table, 6, 1.5, logits=given, ride=SinkhornRide(comb, 20, 1e-6))
            assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])
            assert torch.equal(comb, want), (table[1] is not None, given is not None)


def test_router_refuses_a_ride_it_cannot_take():
    """One comb per token, 1, 2 or 4 streams, iters >= 1: anything else fails before a launch. iters = 0 reaches
    the binding only directly: SinkhornRide passes the model's 0 as 1 (sinkhorn_iters: the reference's meaning),
    so a ride of 0 iterations finishes comb as one of 1 does."""
    from ds4.kernels.ops import _ops
    from ds4.ops.base import SinkhornRide
    g = gen(1790)
    x = rand_x(2, 128, g)
    gate = (torch.randn(16, 128, device=DEV, generator=g) * 0.1).to(torch.bfloat16)
    bias = torch.randn(16, device=DEV, generator=g)
    for comb, iters, what in ((torch.rand(3, 4, 4, device=DEV), 20, "comb must be"),
                              (torch.rand(2, 3, 3, device=DEV), 20, "comb must be")):
        with pytest.raises(RuntimeError, match=what):
            kernels.router(x, gate, bias, None, None, 6, 1.5, ride=SinkhornRide(comb, iters, 1e-6))
    with pytest.raises(RuntimeError, match="iters"):
        _ops().router(x, gate, bias, None, None, 6, 1.5, None, torch.rand(2, 4, 4, device=DEV), 0, 1e-6)
    comb0 = torch.rand(2, 4, 4, device=DEV)
    comb1 = comb0.clone()
    kernels.router(x, gate, bias, None, None, 6, 1.5, ride=SinkhornRide(comb0, 0, 1e-6))
    kernels.router(x, gate, bias, None, None, 6, 1.5, ride=SinkhornRide(comb1, 1, 1e-6))
    assert torch.equal(comb0, comb1)


@pytest.mark.parametrize("hash_layer", [False, True])
@pytest.mark.parametrize("dim,inter,n_experts,e_local,offset", [(4096, 2048, 256, 256, 0), (512, 256, 64, 16, 32)])
def test_moe_kernels_route_from_logits(hash_layer, dim, inter, n_experts, e_local, offset):
    """One token: gate+up and down routing from the router GEMV's logits themselves (InKernelRoute) give the
    router's ids and weights (written by gate+up) and the same h and output as with the router's tensors,
    bit for bit."""
    g = gen(1300 + dim + hash_layer)
    w1, s1 = rand_fp4_weight(inter, dim, g, (e_local,))
    w3, s3 = rand_fp4_weight(inter, dim, g, (e_local,))
    w2, s2 = rand_fp4_weight(dim, inter, g, (e_local,))
    gate = (torch.randn(n_experts, dim, device=DEV, generator=g) * 0.05).to(torch.bfloat16)
    bias = None if hash_layer else torch.randn(n_experts, device=DEV, generator=g) * 0.1
    tid = torch.randint(0, n_experts, (1000, 6), device=DEV, generator=g, dtype=torch.int32) if hash_layer else None
    x = rand_x(1, dim, g)
    tok = torch.randint(0, 1000, (1,), device=DEV, generator=g)
    w, ids = kernels.router(x, gate, bias, tid, tok if hash_layer else None, 6, 1.5)
    h = kernels.moe_gate_up(x, ids, w, w1, s1, w3, s3, "fp4", offset, e_local, 10.0)
    y = kernels.moe_down(h, ids, 6, w2, s2, "fp4", offset, e_local, None, True)
    assert kernels.moe_route_ok("fp4", 6, dim, inter, n_experts)
    r = kernels.InKernelRoute(kernels.gemv(x, gate, None, "bf16", out_f32=True), bias, tid,
                              tok if hash_layer else None, 1.5)
    w_k, ids_k = torch.full_like(w, float("nan")), torch.full_like(ids, -1)
    poison()
    h_k = kernels.moe_gate_up(x, ids_k, w_k, w1, s1, w3, s3, "fp4", offset, e_local, 10.0, route=r)
    y_k = kernels.moe_down(h_k, ids_k.clone().fill_(-1), 6, w2, s2, "fp4", offset, e_local, None, True, route=r)
    assert torch.equal(ids_k, ids) and torch.equal(w_k, w)
    loc = (ids[0] >= offset) & (ids[0] < offset + e_local)  # other slots' h rows are not written
    assert torch.equal(h_k[loc], h[loc]) and torch.equal(y_k, y)
    assert loc.any() or not torch.any(y)
    with pytest.raises(RuntimeError, match="one token"):
        x2 = rand_x(2, dim, g)
        kernels.moe_gate_up(x2, ids.expand(2, -1).contiguous(), w.expand(2, -1).contiguous(), w1, s1, w3, s3, "fp4",
                            offset, e_local, 10.0, route=r)


@pytest.mark.parametrize("n", [1, 4])
def test_fp4_topk_prepare_packs_in_place(n, monkeypatch):
    """moe=fp4_topk's prepare() re-lays the routed experts as fp4p (DS4_FP4_TILE=0) or fp4t (the default) in place
    (same storage); its kernels and the dequantising reference then give what they gave on the stored layout,
    bit for bit; DS4_FP4_PACK=0 leaves the weights alone."""
    from ds4.ops.moe_cuda import Fp4TopkMoE
    from ds4.ops.moe_torch import DequantMoE
    g = gen(1300 + n)
    mw, _ = _moe_weights(g, offset=0, e_local=64, n_experts=64)
    impl = Fp4TopkMoE()
    monkeypatch.setenv("DS4_SHARED_TILE", "0")  # the routed experts' layouts alone (the shared expert's: below)
    monkeypatch.setenv("DS4_FP4_PACK", "0")
    assert impl.prepare(mw) is mw
    monkeypatch.delenv("DS4_FP4_PACK")
    monkeypatch.setenv("DS4_FP4_TILE", "0")
    x = rand_x(n, 512, g)
    w, ids = impl.route(x, torch.zeros(n, dtype=torch.int64, device=DEV), mw)
    y_nat, y_ref = impl.routed(x, w, ids, mw), DequantMoE().routed(x, w, ids, mw)
    stored = mw.w1.weight.clone()
    ptr = mw.w1.weight.data_ptr()
    mp = impl.prepare(mw)
    assert mp.w1.fmt == mp.w2.fmt == mp.w3.fmt == "fp4p" and mp.w1.weight.data_ptr() == ptr
    assert torch.equal(mp.w1.weight, pack_fp4_mma(stored))
    assert torch.equal(impl.routed(x, w, ids, mp), y_nat)
    assert torch.equal(DequantMoE().routed(x, w, ids, mp), y_ref)
    assert impl.prepare(mp) is mp  # already laid out
    # by default (DS4_FP4_TILE unset) the fp4t layout where the shapes allow (these do), in the same storage:
    # the same outputs bit for bit (one token on the tensor-core kernels, several on the FMA kernels); back to
    # fp4p with DS4_FP4_TILE=0
    monkeypatch.delenv("DS4_FP4_TILE")
    mt = impl.prepare(mp)
    assert mt.w1.fmt == mt.w2.fmt == mt.w3.fmt == "fp4t" and mt.w1.weight.data_ptr() == ptr
    assert torch.equal(mt.w1.weight, tile_fp4_mma(pack_fp4_mma(stored)))
    assert torch.equal(impl.routed(x, w, ids, mt), y_nat)
    assert torch.equal(DequantMoE().routed(x, w, ids, mt), y_ref)
    monkeypatch.setenv("DS4_FP4_TILE", "0")
    mb = impl.prepare(mt)
    assert mb.w1.fmt == "fp4p" and torch.equal(mb.w1.weight, pack_fp4_mma(stored))
    from ds4.ops.moe_cuda import Bf16CacheMoE
    monkeypatch.delenv("DS4_FP4_TILE")
    assert Bf16CacheMoE().prepare(mb) is mb  # the seed-phase cache keeps fp4p by default
    monkeypatch.setenv("DS4_FP4_TILE", "1")
    with pytest.raises(ValueError, match="DS4_FP4_TILE=1"):  # an explicit request it cannot serve: at load
        Bf16CacheMoE().prepare(mb)


@pytest.mark.parametrize("kroute", [False, True], ids=["topk_kernel", "route_in_moe"])
@pytest.mark.parametrize("n", [1, 4])
def test_fp4_topk_impl_end_to_end(n, kroute, monkeypatch):
    """Router -> gate+up -> down as launched in a step; route_in_moe: captured one-token steps route
    inside the MoE kernels (DS4_ROUTE_IN_MOE=1)."""
    from ds4.ops.moe_cuda import Fp4TopkMoE
    monkeypatch.setenv("DS4_ROUTE_IN_MOE", "1" if kroute else "0")
    g = gen(1200 + n)
    mw, (d1, d3, d2) = _moe_weights(g, offset=0, e_local=64, n_experts=64)
    impl = Fp4TopkMoE()
    x = rand_x(n, 512, g)
    tok = torch.randint(0, 1000, (n,), device=DEV, generator=g)
    w, ids = impl.route(x, tok, mw)
    rw, rids = ref_route(x, tok, mw)
    assert torch.equal(ids.sort(-1).values, rids.sort(-1).values)
    y = impl.routed(x, w, ids, mw)
    assert rel(y, ref_routed(x, w, ids, d1, d3, d2, 0, 10.0)) <= TOL
    ys = impl.shared(x, mw)
    sd1, sd3, sd2 = (q.dequant(torch.float32) for q in (mw.shared_w1, mw.shared_w3, mw.shared_w2))
    a = torch.nn.functional.silu((x.float() @ sd1.t()).clamp(max=10.0)) * (x.float() @ sd3.t()).clamp(-10, 10)
    assert ys.dtype == x.dtype and rel(ys, a.to(torch.bfloat16).float() @ sd2.t()) <= TOL
    # the block output in one step: bf16(routed + bf16(shared)), as DequantMoE computes it
    from ds4.ops.moe_torch import DequantMoE
    yb = impl.shared(x, mw, add=y)
    assert yb.dtype == x.dtype and rel(yb, DequantMoE().shared(x, mw, add=y)) <= TOL
    assert rel(yb, (y + ys.float()).to(x.dtype)) <= TOL
    # the shared expert starts before routing (shared_up): on a side stream in a captured step, in line in an eager
    # one (since session 40, so that both form the block output in the same kernel), with the same bits as shared();
    # its output is added after the (here absent) reduction in one launch, or by the routed down kernel's epilogue
    # (one rank): the same bits either way
    up0 = impl.shared_up(x, mw)
    assert up0 is not None and torch.equal(up0.out, ys)
    # the add after a reduction (fp32, or bf16 under reduce=bf16) = the down kernel's fused add, bit for bit
    from ds4.ops import side_stream
    from ds4.ops.moe_cuda import SharedUp, add_shared
    done = SharedUp(ys, side_stream.Branch(None, x.device))
    for red in (y, y.to(torch.bfloat16)):
        assert torch.equal(add_shared(red, done), impl.shared(x, mw, add=red)), red.dtype

    # route_in_moe, captured with one token: route() leaves the router's tail to the routed kernels
    # (InKernelRoute); the (w, ids) it returned are written by the gate+up launch, equal to the eager router's
    # (a captured step joins its L2 prefetch branches at its end: ds4.ops.prefetch.join_pending)
    def block_reduced():
        up = impl.shared_up(x, mw)
        w, ids = impl.route(x, tok, mw)
        out = impl.shared(x, mw, add=impl.routed(x, w, ids, mw), up=up)
        prefetch.join_pending()
        return up, out, w, ids

    def block_one_rank():
        up = impl.shared_up(x, mw)
        w, ids = impl.route(x, tok, mw)
        out = impl.routed(x, w, ids, mw, shared=up)
        prefetch.join_pending()
        return up, out, w, ids

    side = torch.cuda.Stream()
    for block in (block_reduced, block_one_rank):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            block()  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        poison()
        with torch.cuda.graph(graph):
            up, out, gw, gids = block()
        graph.replay()
        torch.cuda.synchronize()
        assert up is not None, block.__name__
        assert out.dtype == x.dtype and torch.equal(out, yb), block.__name__
        assert torch.equal(gids, ids) and torch.equal(gw, w), block.__name__
        assert (impl._deferred is None) and (impl._defer_route(x, mw.gate, mw) is False)  # not capturing now


def test_bf16_cache_impl():
    from ds4.ops.moe_cuda import Bf16CacheMoE
    g = gen(77)
    mw, (d1, d3, d2) = _moe_weights(g, offset=32, e_local=16, n_experts=64)
    per_expert = 3 * 256 * 512 * 2
    impl = Bf16CacheMoE(cap_bytes=5 * per_expert, min_free_bytes=0, warmup_calls=3)
    for step in range(5):
        n = 1 + step % 3
        ids = torch.randint(28, 52, (n, 6), device=DEV, generator=g)
        w = torch.rand(n, 6, device=DEV, generator=g)
        x = rand_x(n, 512, g)
        poison()
        y = impl.routed(x, w, ids, mw)
        ref = ref_routed(x, w, ids, d1, d3, d2, 32, 10.0)
        assert torch.isfinite(y).all()
        assert rel(y, ref) <= TOL, (step, rel(y, ref))
    st = impl.stats()
    assert 0 < st["experts"] <= 5 and st["bytes"] <= 5 * per_expert and st["frozen_layers"] == 1


@pytest.mark.parametrize("B,V", [(1, 1), (1, 7), (3, 1024), (2, 1025), (1, 129280), (64, 4099)])
def test_argmax_matches_torch(B, V):
    """The greedy argmax kernel: torch.argmax(-1)'s index on random rows, rows of ties (the first wins),
    all -inf, a NaN (counts as the largest) — and again on new data (the per-row key and arrival counter
    reset themselves), also through sampling.argmax(kernel=True), as a run whose choices use the extension calls it."""
    from ds4.runtime.sampling import argmax
    g = gen(B * 131 + V)
    for rep in range(3):
        x = torch.randn(B, V, device=DEV, generator=g)
        if B > 1 and V > 8:
            x[1] = torch.round(x[1])          # many ties at the maximum
            x[-1, V // 3] = float("nan")
        if B > 2:
            x[2] = float("-inf")
        if rep == 2:
            x = x * 0 + 1.0                     # every value equal: index 0
        want = x.argmax(-1)
        got = kernels.argmax(x)
        assert got.dtype == torch.int64 and torch.equal(got, want), (got, want)
        assert torch.equal(argmax(x, kernel=True), want)


# ---------------------------------------------------------------- L2 prefetch (a hint: it must only read)
def test_l2_prefetch_reads_every_range_and_writes_nothing():
    """Direct ranges of odd sizes and unaligned starts (a chunk's unaligned head and tail are skipped), and
    expert-indexed ranges with repeated, non-local and out-of-range ids: every launch succeeds and leaves
    the memory as it was."""
    g = gen(77)
    base = torch.randint(0, 256, ((6 << 20) + 64,), device=DEV, dtype=torch.uint8, generator=g)
    views = [base[3:4], base[5:20], base[32:48], base[49:66], base[100:4196], base[7:4104], base[11:(5 << 20) + 14]]
    bf = torch.randn(33, 7, device=DEV, generator=g).to(torch.bfloat16)
    before = base.clone(), bf.clone()
    for i in range(0, len(views), 4):
        kernels.l2_prefetch(views[i:i + 4])
    kernels.l2_prefetch([bf])
    stacked = torch.randint(0, 256, (5, 100, 48), device=DEV, dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 256, (5, 100, 3), device=DEV, dtype=torch.uint8, generator=g)
    s_before = stacked.clone(), scales.clone()
    for ids, off in (([0, 4, 4, 2], 0), ([-1, 2, 9, 6, 6, 3], 2), ([[1, 1], [0, 3]], 0)):
        kernels.l2_prefetch([stacked, scales], torch.tensor(ids, device=DEV, dtype=torch.int64), off)
    kernels.l2_prefetch([stacked], torch.empty(0, device=DEV, dtype=torch.int64))  # no slots: nothing to do
    torch.cuda.synchronize()
    assert torch.equal(base, before[0]) and torch.equal(bf, before[1])
    assert torch.equal(stacked, s_before[0]) and torch.equal(scales, s_before[1])


def test_l2_prefetch_rejects_what_it_cannot_take():
    t = torch.zeros(4, 8, device=DEV, dtype=torch.uint8)
    with pytest.raises(ValueError, match="tensors"):
        kernels.l2_prefetch([t] * 5)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.l2_prefetch([t.t()])
    with pytest.raises(RuntimeError, match="int64"):
        kernels.l2_prefetch([t], torch.zeros(2, device=DEV, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="one E_local"):
        kernels.l2_prefetch([t, torch.zeros(3, 8, device=DEV, dtype=torch.uint8)], torch.zeros(2, device=DEV,
                                                                                             dtype=torch.int64))


def test_prefetch_branch_is_captured_and_replays(monkeypatch):
    """ds4.ops.prefetch while a graph is captured: a side branch (forked, and joined in the capture by
    join_pending) whose replay runs, and the GEMV it feeds gives the result of an uncaptured launch."""
    monkeypatch.setenv(prefetch.ENV, "all")
    g = gen(78)
    w, s = rand_fp8_weight(1024, 4096, g)
    x = torch.randn(1, 4096, device=DEV, generator=g).to(torch.bfloat16)
    want = kernels.gemv(x, w, s, "fp8")
    assert not prefetch.issue("o", [w, s], x)  # not capturing: nothing (the side stream now exists)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        assert prefetch.issue("o", [w, s], x)
        y = kernels.gemv(x, w, s, "fp8")
        assert prefetch.join_pending() == 1
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, want)
