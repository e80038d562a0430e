"""Tests for ds4.quant (formats + QAT simulations). CPU only, fast.

References used here are independent of the implementation: hand-written tables, pure-Python
per-element math (struct for float32 rounding), explicit Sylvester matrices.
"""

import math
import struct

import pytest
import torch

from ds4.quant import (
    E2M1_MAX,
    E4M3_MAX,
    act_quant,
    act_quant_sim,
    dequant_fp4,
    dequant_fp8,
    e8m0_to_float,
    float_to_e8m0,
    fp4_act_quant_sim,
    fp4_e2m1_decode,
    fp4_e2m1_encode,
    fp8_e4m3_decode,
    fp8_e4m3_encode,
    hadamard,
    pack_fp4,
    pack_fp4_mma,
    quant_fp4,
    quant_fp8,
    random_fp4,
    random_fp8,
    unpack_fp4,
    unpack_fp4_mma,
)

E4M3 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu
NAN = float("nan")
INF = float("inf")


def f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def exact(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------------------------
# pure-Python references
# ---------------------------------------------------------------------------------------------

FP4_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
             -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def py_e4m3(byte: int) -> float:
    s = -1.0 if byte & 0x80 else 1.0
    e = (byte >> 3) & 0xF
    m = byte & 7
    if e == 15 and m == 7:
        return NAN
    if e == 0:
        return s * m * 2.0 ** -9
    return s * (1 + m / 8) * 2.0 ** (e - 7)


def py_nearest_even(v: float, table: list[float]) -> int:
    """Index into a sorted, non-negative magnitude table: nearest, ties to even index."""
    a = abs(v)
    best = min(range(len(table)), key=lambda i: (abs(table[i] - a), i % 2))
    return best


E4M3_POS = [py_e4m3(b) for b in range(0x7F)]  # 0x00..0x7E, ascending


def py_e4m3_encode(v: float) -> int:
    if math.isnan(v):
        return 0x7F
    a = min(abs(v), 448.0)
    code = py_nearest_even(a, E4M3_POS)
    return code | (0x80 if math.copysign(1.0, v) < 0 else 0)


def py_e2m1_encode(v: float) -> int:
    a = min(abs(v), 6.0)
    code = py_nearest_even(a, FP4_TABLE[:8])
    return code | (8 if math.copysign(1.0, v) < 0 else 0)


def py_pow2_ceil_bits(amax: float, inv: float) -> float:
    """The reference bit trick on the fp32 product amax * fp32(inv)."""
    p = f32(f32(amax) * f32(inv))
    bits = f32_bits(p)
    e, m = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    k = e - 127 + (1 if m else 0)
    return 2.0 ** k


# ---------------------------------------------------------------------------------------------
# FP4 E2M1
# ---------------------------------------------------------------------------------------------

def test_fp4_decode_all_codes():
    got = fp4_e2m1_decode(torch.arange(16, dtype=torch.uint8))
    want = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                         -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    exact(got, want)
    assert got.dtype == torch.float32
    assert torch.signbit(got[8]) and not torch.signbit(got[0])


def test_fp4_encode_representable_and_ties():
    vals = torch.tensor(FP4_TABLE)
    exact(fp4_e2m1_encode(vals), torch.arange(16, dtype=torch.uint8))
    # ties go to the even code (even mantissa bit)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    exact(fp4_e2m1_decode(fp4_e2m1_encode(ties)), torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]))
    exact(fp4_e2m1_decode(fp4_e2m1_encode(-ties)),
          -torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]))
    # just off the ties, saturation, negative-to-zero, nan
    x = torch.tensor([0.2500001, 0.7499999, 1.2500001, 5.0000005, 6.5, 100.0, INF, -INF, -0.1, NAN])
    exact(fp4_e2m1_encode(x), torch.tensor([1, 1, 3, 7, 7, 7, 7, 15, 8, 0], dtype=torch.uint8))


def test_fp4_encode_matches_python_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(2000, generator=g) * 3,
                   torch.arange(-28, 29, dtype=torch.float32) * 0.25])  # all quarter points
    got = fp4_e2m1_encode(x).tolist()
    want = [py_e2m1_encode(v) for v in x.tolist()]
    assert got == want


def test_pack_unpack_order():
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x0, 0x7, 0x9]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.dtype == torch.int8
    assert packed.view(torch.uint8).tolist() == [[0x21, 0x0F, 0x97]]
    byte = torch.tensor([0xA3, 0x5C], dtype=torch.uint8)
    assert unpack_fp4(byte).tolist() == [0x3, 0xA, 0xC, 0x5]
    assert unpack_fp4(byte.view(torch.int8)).tolist() == [0x3, 0xA, 0xC, 0x5]
    g = torch.Generator().manual_seed(1)
    c = torch.randint(0, 16, (3, 5, 64), generator=g, dtype=torch.uint8)
    exact(unpack_fp4(pack_fp4(c)), c)
    with pytest.raises(ValueError):
        pack_fp4(torch.tensor([16, 0], dtype=torch.uint8))
    with pytest.raises(ValueError):
        pack_fp4(torch.tensor([1, 2, 3], dtype=torch.uint8))


def _bf16_bits_value(u: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (u & 0xFFFF) << 16))[0]


def test_fp4_mma_layout_decodes_like_the_kernels():
    """pack_fp4_mma's words, decoded the way csrc/ds4_common.cuh's fp4p_regs does (rotations and masks,
    written out here in pure Python), give every element's E2M1 value x 2^-126 in the A-fragment pairs
    (element i, element i + 4); the permutation round-trips and works in place."""
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    rotl = lambda q, s: ((q << s) | (q >> (32 - s))) & 0xFFFFFFFF if s else q  # noqa: E731
    M = 0x81C081C0
    g = torch.Generator().manual_seed(3)
    w = torch.randint(-128, 128, (2, 3, 48), generator=g, dtype=torch.int8)
    w[0, 0, :4] = torch.tensor([-1, -1, -1, -1], dtype=torch.int8)  # all ones: every bit must land once
    p = pack_fp4_mma(w)
    assert p.shape == w.shape and p.dtype == w.dtype and not torch.equal(p, w)
    exact(unpack_fp4_mma(p), w)
    for q, qn in zip(p.view(torch.int32).flatten().tolist(), w.view(torch.int32).flatten().tolist()):
        q, qn = q & 0xFFFFFFFF, qn & 0xFFFFFFFF
        regs = [q & M, rotl(q, 4) & M, rotl(q, 10) & M, (rotl(q, 6) & 0x80C080C0) | (rotl(q, 14) & 0x01000100)]
        for i, r in enumerate(regs):
            for half, elem in ((r, i), (r >> 16, i + 4)):
                code = (qn >> (4 * elem)) & 0xF
                want = (-1.0 if code & 8 else 1.0) * e2m1[code & 7]
                assert _bf16_bits_value(half) * 2.0 ** 126 == want, (hex(q), i, elem)
    inplace = w.clone()
    assert pack_fp4_mma(inplace, out=inplace).data_ptr() == inplace.data_ptr()
    exact(inplace, p)
    with pytest.raises(ValueError, match="whole 4-byte words"):
        pack_fp4_mma(torch.zeros(4, 6, dtype=torch.int8))


def test_qweight_fp4p_dequantises_like_fp4():
    from ds4.ops.base import QWeight
    g = torch.Generator().manual_seed(4)
    w = torch.randint(-128, 128, (3, 40, 32), generator=g, dtype=torch.int8)
    s = torch.randint(118, 130, (3, 40, 2), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    a, b = QWeight("fp4", w, s), QWeight("fp4p", pack_fp4_mma(w), s)
    assert b.in_features == a.in_features == 64
    exact(b.dequant(), a.dequant())
    exact(b[1].dequant(torch.bfloat16), a[1].dequant(torch.bfloat16))


def test_fp4t_tiling_is_the_kernels_fragment_order():
    """fp4t (ds4.quant.tile_fp4_mma): the 16 bytes csrc/mma_dot.cuh's MmaStream loads for lane (g, t), round r,
    chunk w of a tile's row half h at ((r W + w) 2 + h) 512 + (4 g + t) 16 inside the tile's block are the
    bytes the row-major layout has at row 16 T + 8 h + g, byte (4 W r + W t + w) 16; untile undoes it."""
    from ds4.quant import TILE_W, fp4t_ok, tile_fp4_mma, untile_fp4_mma
    g = torch.Generator().manual_seed(9)
    E, O, rb = 2, 48, 3 * 64 * TILE_W  # 3 tiles of 16 rows, 3 rounds per row
    w = torch.randint(-128, 128, (E, O, rb), generator=g, dtype=torch.int8)
    t = tile_fp4_mma(w)
    assert t.shape == w.shape and t.dtype == w.dtype and not torch.equal(t, w)
    assert torch.equal(untile_fp4_mma(t), w)
    W, flat = TILE_W, t.view(E, -1)
    for e in range(E):
        for T in range(O // 16):
            for r in range(rb // (64 * W)):
                for cw in range(W):
                    for h in range(2):
                        for lane in range(32):
                            gg, tt = lane >> 2, lane & 3
                            got = flat[e, T * 16 * rb + ((r * W + cw) * 2 + h) * 512 + lane * 16:][:16]
                            c = 4 * W * r + W * tt + cw
                            exact(got, w[e, 16 * T + 8 * h + gg, 16 * c:16 * c + 16])
    assert fp4t_ok(32, 2 * 64 * TILE_W) and not fp4t_ok(40, 64 * TILE_W) and not fp4t_ok(32, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        tile_fp4_mma(torch.zeros(24, 64 * TILE_W, dtype=torch.int8))


def test_fp4k_is_the_split_k_down_phase_order():
    """fp4k (ds4.quant.chunk_fp4_splitk, csrc/moe_splitk.cu's chunk-major w2): the 16 bytes the down phase's lane
    (g, t) loads for chunk c, group q, row half h at ((c G + q) 2 + h) 512 + (4 g + t) 16 are the row-major layout's
    row 16 (4 q + t) + 8 h + g, bytes 16 c ..; the scale word lane (g, u < 2) loads at (c G + q) 64 + (8 u + g) 4 holds
    byte 2 h + j = the scale of row 16 (4 q + 2 u + j) + 8 h + g, chunk c."""
    from ds4.quant import TILE_W, chunk_fp4_splitk, fp4k_ok, tile_fp4_mma
    g = torch.Generator().manual_seed(11)
    E, O, rb = 2, 128, 2 * 64 * TILE_W  # 2 groups of 4 tiles, 8 chunks per row
    w = torch.randint(-128, 128, (E, O, rb), generator=g, dtype=torch.int8)
    s = torch.randint(0, 255, (E, O, rb // 16), generator=g, dtype=torch.uint8)
    wk, sk = chunk_fp4_splitk(tile_fp4_mma(w), s)
    assert wk.shape == w.shape and sk.shape == s.shape and wk.dtype == w.dtype and sk.dtype == s.dtype
    G, flat, sflat = O // 64, wk.view(E, -1), sk.view(E, -1)
    for e in range(E):
        for c in range(rb // 16):
            for q in range(G):
                for h in range(2):
                    for lane in range(32):
                        gg, tt = lane >> 2, lane & 3
                        got = flat[e, ((c * G + q) * 2 + h) * 512 + lane * 16:][:16]
                        exact(got, w[e, 16 * (4 * q + tt) + 8 * h + gg, 16 * c:16 * c + 16])
                        if tt < 2:
                            for j in range(2):
                                assert sflat[e, (c * G + q) * 64 + (8 * tt + gg) * 4 + 2 * h + j] == \
                                    s[e, 16 * (4 * q + 2 * tt + j) + 8 * h + gg, c]
    assert fp4k_ok(64, 64 * TILE_W) and not fp4k_ok(48, 64 * TILE_W)
    with pytest.raises(ValueError, match="multiple of 64"):
        chunk_fp4_splitk(torch.zeros(48, 64 * TILE_W, dtype=torch.int8), torch.zeros(48, 8, dtype=torch.uint8))


@pytest.mark.parametrize("chunk_bytes", [1, 3 * 16 * 128, 1 << 26])
def test_fp4t_relayout_in_place_by_chunks(chunk_bytes):
    """tile / untile with out=w (moe=fp4_topk's prepare at load) convert a chunk of whole tiles at a time: the
    same bytes as the out-of-place form, for stacked and single matrices, with chunks that cut the stack mid-expert."""
    from ds4.quant import TILE_W, tile_fp4_mma, untile_fp4_mma
    g = torch.Generator().manual_seed(11)
    for shape in ((3, 80, 2 * 64 * TILE_W), (32, 64 * TILE_W)):
        w = torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
        want = tile_fp4_mma(w.clone(), chunk_bytes=1 << 30)
        t = w.clone()
        assert tile_fp4_mma(t, out=t, chunk_bytes=chunk_bytes) is t
        exact(t, want)
        assert untile_fp4_mma(t, out=t, chunk_bytes=chunk_bytes) is t
        exact(t, w)
    with pytest.raises(ValueError, match="contiguous"):
        tile_fp4_mma(torch.zeros(32, 2 * 64 * TILE_W, dtype=torch.int8)[:, :64 * TILE_W])


def test_fp8t_is_fp4ts_chunk_order_with_the_kernels_word_bits():
    """fp8t (ds4.quant.tile_fp8_mma, linear=gemv_cuda's dense FP8 layout): the 16-byte chunks of E4M3 rows (one byte a
    value) in fp4t's order, each 4-byte word's bits then permuted so that csrc/ds4_common.cuh's fp8p_regs (written out
    here in pure Python) gives the A-fragment pairs (b0, b2) and (b1, b3) as bf16 of the E4M3 value x 2^-120, every
    byte value but NaN's in every position; in place and back; QWeight("fp8t") dequantises like fp8."""
    from ds4.ops.base import QWeight
    from ds4.quant import dequant_fp8, fp8_e4m3_decode, fp8t_ok, tile_fp4_mma, tile_fp8_mma, untile_fp8_mma
    g = torch.Generator().manual_seed(13)
    b = torch.randint(0, 256, (48, 384), generator=g, dtype=torch.uint8)
    # every byte value in every word position: row r holds value v at column (v - r) % 256
    b[:16, :256] = ((torch.arange(256) + torch.arange(16)[:, None]) % 256).to(torch.uint8)
    b[16, :4] = 0xFF  # all ones: every bit must land once
    w = torch.where((b & 0x7F) == 0x7F, b - 1, b).view(torch.float8_e4m3fn)  # no NaN codes
    s = torch.randint(118, 130, (1, 3), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    t = tile_fp8_mma(w)
    assert t.dtype == torch.float8_e4m3fn and t.shape == w.shape
    value = fp8_e4m3_decode(torch.arange(256, dtype=torch.uint8)).tolist()
    chunks = tile_fp4_mma(w.view(torch.uint8))  # the bytes in fp8t's order, before the word bits are permuted
    for q, qn in zip(t.view(torch.int32).flatten().tolist(), chunks.view(torch.int32).flatten().tolist()):
        q, qn = q & 0xFFFFFFFF, qn & 0xFFFFFFFF
        r0 = q & 0x87F087F0
        r1 = ((q << 4) & 0x80F080F0) | ((q >> 4) & 0x07000700)
        for half, byte in ((r0, 0), (r0 >> 16, 2), (r1, 1), (r1 >> 16, 3)):
            want = value[(qn >> (8 * byte)) & 0xFF]
            assert _bf16_bits_value(half) * 2.0 ** 120 == want, (hex(q), hex(qn), byte)
    exact(untile_fp8_mma(t).view(torch.uint8), w.view(torch.uint8))
    inplace = w.clone()
    assert tile_fp8_mma(inplace, out=inplace).data_ptr() == inplace.data_ptr()
    exact(inplace.view(torch.uint8), t.view(torch.uint8))
    assert untile_fp8_mma(inplace, out=inplace, chunk_bytes=3 * 16 * 128).data_ptr() == inplace.data_ptr()
    exact(inplace.view(torch.uint8), w.view(torch.uint8))
    a, q = QWeight("fp8", w, s), QWeight("fp8t", t, s)
    assert q.in_features == a.in_features == 384 and q.out_features == 48
    exact(q.dequant(), dequant_fp8(w, s))
    assert fp8t_ok(48, 384) and not fp8t_ok(40, 384) and not fp8t_ok(48, 320)


def test_qweight_fp4t_dequantises_like_fp4():
    from ds4.ops.base import QWeight
    from ds4.quant import tile_fp4_mma
    g = torch.Generator().manual_seed(5)
    w = torch.randint(-128, 128, (2, 32, 256), generator=g, dtype=torch.int8)
    s = torch.randint(118, 130, (2, 32, 16), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    a, b = QWeight("fp4", w, s), QWeight("fp4t", tile_fp4_mma(pack_fp4_mma(w)), s)
    assert b.in_features == a.in_features == 512
    exact(b.dequant(), a.dequant())
    exact(b[1].dequant(torch.bfloat16), a[1].dequant(torch.bfloat16))


# ---------------------------------------------------------------------------------------------
# FP8 E4M3
# ---------------------------------------------------------------------------------------------

def test_e4m3_decode_hand_values():
    b = torch.tensor([0x00, 0x80, 0x01, 0x07, 0x08, 0x38, 0x3C, 0x40, 0x7E, 0xFE, 0x7F, 0xFF],
                     dtype=torch.uint8)
    want = torch.tensor([0.0, -0.0, 2.0 ** -9, 7 * 2.0 ** -9, 2.0 ** -6, 1.0, 1.5, 2.0,
                         448.0, -448.0, NAN, NAN])
    got = fp8_e4m3_decode(b)
    exact(got, want)
    assert torch.signbit(got[1])
    all_codes = fp8_e4m3_decode(torch.arange(256, dtype=torch.uint8))
    exact(all_codes, torch.tensor([py_e4m3(i) for i in range(256)]))
    assert int(torch.isnan(all_codes).sum()) == 2


def test_e4m3_encode_hand_values():
    x = torch.tensor([1.0, 448.0, -448.0, 449.0, 470.0, 1e6, -1e6, INF, -INF, NAN, -NAN,
                      2.0 ** -9, 7 * 2.0 ** -9, 2.0 ** -10, 1.5 * 2.0 ** -10, 3 * 2.0 ** -10,
                      5 * 2.0 ** -10, 1.0625, 1.1875, 1.0625001, -0.0, 1e-30])
    want = [0x38, 0x7E, 0xFE, 0x7E, 0x7E, 0x7E, 0xFE, 0x7E, 0xFE, 0x7F, 0x7F,
            0x01, 0x07, 0x00, 0x01, 0x02,
            0x02, 0x38, 0x3A, 0x39, 0x80, 0x00]
    assert fp8_e4m3_encode(x).tolist() == want


def test_e4m3_encode_matches_python_reference():
    g = torch.Generator().manual_seed(2)
    x = torch.cat([torch.randn(1500, generator=g) * 50,
                   torch.randn(500, generator=g) * 2.0 ** -7,
                   fp8_e4m3_decode(torch.arange(256, dtype=torch.uint8)).nan_to_num(0.0)])
    got = fp8_e4m3_encode(x).tolist()
    want = [py_e4m3_encode(v) for v in x.tolist()]
    assert got == want
    # decode(encode(v)) == v for every representable value
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    exact(fp8_e4m3_encode(fp8_e4m3_decode(codes)), codes)


# ---------------------------------------------------------------------------------------------
# E8M0
# ---------------------------------------------------------------------------------------------

def test_e8m0_decode():
    b = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    want = torch.tensor([2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 2.0, 2.0 ** 127, NAN])
    assert want[0].item() == 2.0 ** -127  # the fp32 subnormal is exact
    for t in (b, b.view(torch.int8), b.view(E8M0)):
        got = e8m0_to_float(t)
        assert got.dtype == torch.float32
        exact(got, want)
    all_b = e8m0_to_float(torch.arange(255, dtype=torch.uint8))
    assert all_b.tolist() == [2.0 ** (i - 127) for i in range(255)]


def test_float_to_e8m0():
    b = torch.arange(255, dtype=torch.uint8)
    vals = torch.tensor([2.0 ** (i - 127) for i in range(255)], dtype=torch.float32)
    out = float_to_e8m0(vals)
    assert out.dtype == E8M0
    exact(out.view(torch.uint8), b)
    for bad in ([3.0], [0.0], [-2.0], [NAN], [INF], [1.5]):
        with pytest.raises(ValueError):
            float_to_e8m0(torch.tensor(bad))
    with pytest.raises(ValueError):
        float_to_e8m0(torch.tensor([2.0 ** 128], dtype=torch.float64))
    with pytest.raises(ValueError):
        float_to_e8m0(torch.tensor([2.0 ** -128], dtype=torch.float64))


# ---------------------------------------------------------------------------------------------
# block dequant against slow loops
# ---------------------------------------------------------------------------------------------

def _rand_fp8(shape, g):
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    codes[codes == 0x7F] = 0x7E
    codes[codes == 0xFF] = 0xFE
    return codes


def slow_dequant_fp8(codes, sbytes, block=128):
    *lead, O, I = codes.shape
    out = torch.empty(codes.shape, dtype=torch.float64)
    cf = codes.reshape(-1, O, I)
    sf = sbytes.reshape(-1, *sbytes.shape[-2:])
    of = out.view(-1, O, I)
    for e in range(cf.shape[0]):
        for i in range(O):
            for bj in range(sf.shape[-1]):
                scale = 2.0 ** (int(sf[e, i // block, bj]) - 127)
                row = cf[e, i, bj * block:(bj + 1) * block].tolist()
                of[e, i, bj * block:bj * block + len(row)] = torch.tensor(
                    [py_e4m3(c) * scale for c in row], dtype=torch.float64)
    return out.to(torch.float32)


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (3, 130, 260), (2, 1, 1)])
def test_dequant_fp8_vs_loop(shape):
    g = torch.Generator().manual_seed(3)
    codes = _rand_fp8(shape, g)
    *lead, O, I = shape
    sshape = (*lead, -(-O // 128), -(-I // 128))
    sbytes = torch.randint(112, 142, sshape, generator=g, dtype=torch.uint8)
    sbytes.view(-1)[0] = 0  # 2^-127 (fp32 subnormal path)
    want = slow_dequant_fp8(codes, sbytes)
    got = dequant_fp8(codes.view(E4M3), sbytes.view(E8M0))
    exact(got, want)
    got_bf16 = dequant_fp8(codes.view(E4M3), sbytes.view(E8M0), dtype=torch.bfloat16)
    assert got_bf16.dtype == torch.bfloat16
    exact(got_bf16, want.to(torch.bfloat16))
    bad = torch.zeros(*sshape[:-1], sshape[-1] + 1, dtype=torch.uint8)
    with pytest.raises(ValueError):
        dequant_fp8(codes.view(E4M3), bad.view(E8M0))


def slow_dequant_fp4(packed, sbytes):
    pb = packed.view(torch.uint8)
    *lead, O, Ih = pb.shape
    I = Ih * 2
    pf = pb.reshape(-1, O, Ih).tolist()
    sf = sbytes.reshape(-1, O, I // 32).tolist()
    out = []
    for e in range(len(pf)):
        rows = []
        for i in range(O):
            row = []
            for j in range(I):
                byte = pf[e][i][j // 2]
                nib = byte & 0xF if j % 2 == 0 else byte >> 4
                row.append(FP4_TABLE[nib] * 2.0 ** (sf[e][i][j // 32] - 127))
            rows.append(row)
        out.append(rows)
    return torch.tensor(out, dtype=torch.float64).reshape(*lead, O, I).to(torch.float32)


@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 96), (1, 32)])
def test_dequant_fp4_vs_loop(shape):
    g = torch.Generator().manual_seed(4)
    *lead, O, I = shape
    packed = torch.randint(0, 256, (*lead, O, I // 2), generator=g, dtype=torch.uint8)
    sbytes = torch.randint(100, 150, (*lead, O, I // 32), generator=g, dtype=torch.uint8)
    sbytes.view(-1)[-1] = 0
    want = slow_dequant_fp4(packed, sbytes)
    exact(dequant_fp4(packed.view(torch.int8), sbytes.view(E8M0)), want)
    exact(dequant_fp4(packed, sbytes.view(E8M0), dtype=torch.bfloat16), want.to(torch.bfloat16))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_dequant_fp4_table_gives_the_decoded_bits_for_every_byte_and_scale(device):
    """dequant_fp4 looks each packed byte up in a table (session 68, for its working set): the bits of decoding every
    nibble and multiplying by its scale, for all 256 bytes under all 256 scale bytes (-0, 2^-127 and NaN included)."""
    packed = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8).repeat(256, 16)  # [256, 4096 bytes]
    sbytes = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)[:, None].repeat(1, 256)  # row r: r
    want = fp4_e2m1_decode(unpack_fp4(packed)).view(256, 256, 32) * e8m0_to_float(sbytes.view(E8M0))[..., None]
    got = dequant_fp4(packed, sbytes.view(E8M0))
    assert torch.equal(got.view(torch.int32), want.view(256, 8192).view(torch.int32))


# ---------------------------------------------------------------------------------------------
# quant -> dequant
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(256, 256), (130, 300), (2, 129, 128)])
def test_quant_fp8_round_trip_exact(shape):
    g = torch.Generator().manual_seed(5)
    codes = _rand_fp8(shape, g)
    *lead, O, I = shape
    sbytes = torch.randint(100, 140, (*lead, -(-O // 128), -(-I // 128)), generator=g,
                           dtype=torch.uint8)
    w = dequant_fp8(codes.view(E4M3), sbytes.view(E8M0))
    q, s = quant_fp8(w)
    assert q.dtype == E4M3 and s.dtype == E8M0
    assert q.shape == w.shape and s.shape == sbytes.shape
    exact(dequant_fp8(q, s), w)
    # the scale is the smallest power of two with amax / s <= 448
    nbo, nbi = s.shape[-2:]
    pad = torch.nn.functional.pad(w, (0, nbi * 128 - I, 0, nbo * 128 - O))
    amax = pad.reshape(*lead, nbo, 128, nbi, 128).abs().amax(dim=(-3, -1)).double()
    ratio = amax / e8m0_to_float(s).double()
    assert torch.all(ratio <= 448) and torch.all(ratio > 224)


def test_quant_fp8_general_and_zero_blocks():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(256, 200, generator=g) * 0.02
    w[:128, :128] = 0
    q, s = quant_fp8(w)
    assert s.view(torch.uint8)[0, 0].item() == 0  # zero block -> 2^-127, valid
    assert not torch.isnan(e8m0_to_float(s)).any()
    d = dequant_fp8(q, s)
    assert torch.all(d[:128, :128] == 0)
    # relative error of e4m3 RNE (normal range) <= 2^-4, subnormal <= s*2^-10
    sfull = e8m0_to_float(s).repeat_interleave(128, 0).repeat_interleave(128, 1)[:256, :200]
    bound = torch.maximum(w.abs() * 2.0 ** -4, sfull * 2.0 ** -10)
    assert torch.all((d - w).abs() <= bound)
    # bf16 input accepted
    q2, s2 = quant_fp8(w.to(torch.bfloat16))
    assert q2.shape == w.shape


@pytest.mark.parametrize("shape", [(4, 64), (2, 3, 128)])
def test_quant_fp4_round_trip_exact(shape):
    g = torch.Generator().manual_seed(7)
    *lead, O, I = shape
    packed = torch.randint(0, 256, (*lead, O, I // 2), generator=g, dtype=torch.uint8)
    sbytes = torch.randint(100, 140, (*lead, O, I // 32), generator=g, dtype=torch.uint8)
    w = dequant_fp4(packed, sbytes.view(E8M0))
    q, s = quant_fp4(w)
    assert q.dtype == torch.int8 and s.dtype == E8M0
    assert q.shape == packed.shape and s.shape == sbytes.shape
    exact(dequant_fp4(q, s), w)
    amax = w.reshape(*lead, O, I // 32, 32).abs().amax(-1).double()
    ratio = amax / e8m0_to_float(s).double()
    nz = amax > 0
    assert torch.all(ratio[nz] <= 6) and torch.all(ratio[nz] > 3)


def test_quant_fp4_general():
    g = torch.Generator().manual_seed(8)
    w = torch.randn(8, 128, generator=g)
    w[0, :32] = 0
    q, s = quant_fp4(w)
    assert s.view(torch.uint8)[0, 0].item() == 0
    d = dequant_fp4(q, s)
    sfull = e8m0_to_float(s).repeat_interleave(32, -1)
    assert torch.all((d - w).abs() <= torch.maximum(w.abs() / 4, sfull / 4))
    # must equal per-element nearest-even rounding of w / s
    want = torch.tensor([FP4_TABLE[py_e2m1_encode(v)] for v in (w / sfull).reshape(-1).tolist()])
    exact(d, want.view(8, 128) * sfull)


def test_random_weights_deterministic():
    a = random_fp8((256, 384), torch.Generator().manual_seed(9), std=0.02, device="cpu")
    b = random_fp8((256, 384), torch.Generator().manual_seed(9), std=0.02, device="cpu")
    c = random_fp8((256, 384), torch.Generator().manual_seed(10), std=0.02, device="cpu")
    assert a[0].dtype == E4M3 and a[1].dtype == E8M0 and a[1].shape == (2, 3)
    exact(a[0].view(torch.uint8), b[0].view(torch.uint8))
    exact(a[1].view(torch.uint8), b[1].view(torch.uint8))
    assert not torch.equal(a[0].view(torch.uint8), c[0].view(torch.uint8))
    std = dequant_fp8(*a).std().item()
    assert 0.018 < std < 0.022
    p = random_fp4((64, 256), torch.Generator().manual_seed(9), std=0.05, device="cpu")
    p2 = random_fp4((64, 256), torch.Generator().manual_seed(9), std=0.05, device="cpu")
    assert p[0].dtype == torch.int8 and p[0].shape == (64, 128) and p[1].shape == (64, 8)
    exact(p[0], p2[0])
    exact(p[1].view(torch.uint8), p2[1].view(torch.uint8))
    std = dequant_fp4(*p).std().item()
    assert 0.04 < std < 0.06


# ---------------------------------------------------------------------------------------------
# QAT simulations
# ---------------------------------------------------------------------------------------------

def test_act_quant_scale_hand_values():
    # one block of 4 per row; amax per row chosen
    x = torch.tensor([[448.0, 1.0, -3.0, 0.0],
                      [449.0, 0.5, 0.0, 0.0],
                      [1e-5, -1e-6, 0.0, 0.0],
                      [0.0, 0.0, 0.0, 0.0],
                      [-224.0, 1.0, 0.0, 0.0],
                      [0.0, 896.0, 0.0, 1.0]])
    q, s = act_quant(x, block=4)
    assert q.dtype == E4M3 and s.dtype == torch.float32 and s.shape == (6, 1)
    assert s[:, 0].tolist() == [1.0, 2.0, 2.0 ** -22, 2.0 ** -22, 0.5, 2.0]
    assert q[0].float().tolist() == [448.0, 1.0, -3.0, 0.0]
    assert q[1].float().tolist() == [224.0, 0.25, 0.0, 0.0]  # 224.5 -> 224 (RNE)
    assert q[4].float().tolist() == [-448.0, 2.0, 0.0, 0.0]


def test_act_quant_matches_bit_trick_reference():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(16, 512, generator=g) * torch.logspace(-6, 3, 16).unsqueeze(1)
    x[3, 128:256] *= 448.0 / x[3, 128:256].abs().max()  # amax exactly 448 -> s 1
    x[4, :128] = 0
    x = x.to(torch.bfloat16)
    q, s = act_quant(x)
    assert s.shape == (16, 4) and q.shape == (16, 512)
    xs = x.float()
    for r in range(16):
        for b in range(4):
            blk = xs[r, b * 128:(b + 1) * 128]
            amax = max(blk.abs().max().item(), 1e-4)
            sc = py_pow2_ceil_bits(amax, 1 / 448)
            assert s[r, b].item() == sc
            want = [py_e4m3_encode(max(-448.0, min(448.0, v / sc))) for v in blk.tolist()]
            assert q[r, b * 128:(b + 1) * 128].view(torch.uint8).tolist() == want
    assert s[3, 1].item() == 1.0
    # partial last block: K = 200, block 128 -> 2 scales
    q2, s2 = act_quant(xs[:, :200])
    assert s2.shape == (16, 2) and q2.shape == (16, 200)
    exact(s2[:, 0], s[:, 0])


def test_act_quant_sim_bounds_and_idempotence():
    g = torch.Generator().manual_seed(12)
    x = (torch.randn(8, 4, 448, generator=g) * 3).to(torch.bfloat16)
    y = act_quant_sim(x, block=64)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    q, s = act_quant(x, block=64)
    exact(y, (q.float() * s.repeat_interleave(64, -1)).to(torch.bfloat16))
    xf, yf = x.float(), y.float()
    sfull = s.repeat_interleave(64, -1)
    assert torch.all((yf - xf).abs() <= torch.maximum(xf.abs() * 2.0 ** -4, sfull * 2.0 ** -10))
    assert not torch.equal(y, x)  # it really rounds (bf16 has more mantissa than e4m3)
    exact(act_quant_sim(y, block=64), y)
    xf32 = torch.randn(3, 256, generator=g)
    y32 = act_quant_sim(xf32)
    assert y32.dtype == torch.float32
    exact(act_quant_sim(y32), y32)


def test_fp4_act_quant_sim_reference_bounds_idempotence():
    # hand case: amax 6 -> s = 1, values round with ties to even
    x = torch.zeros(1, 32)
    x[0, :8] = torch.tensor([6.0, 5.0, 2.5, 0.25, 0.75, 1.25, 1.75, -3.5])
    exact(fp4_act_quant_sim(x)[0, :8], torch.tensor([6.0, 4.0, 2.0, 0.0, 1.0, 1.0, 2.0, -4.0]))
    g = torch.Generator().manual_seed(13)
    x = (torch.randn(6, 128, generator=g) * torch.logspace(-3, 2, 6).unsqueeze(1))
    x[2, :32] = 0
    x = x.to(torch.bfloat16)
    y = fp4_act_quant_sim(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    xf = x.float()
    want = torch.empty_like(xf)
    sfull = torch.empty_like(xf)
    for r in range(6):
        for b in range(4):
            blk = xf[r, b * 32:(b + 1) * 32]
            sc = py_pow2_ceil_bits(max(blk.abs().max().item(), 6 * 2.0 ** -126), 1 / 6)
            sfull[r, b * 32:(b + 1) * 32] = sc
            want[r, b * 32:(b + 1) * 32] = torch.tensor(
                [FP4_TABLE[py_e2m1_encode(max(-6.0, min(6.0, v / sc)))] * sc for v in blk.tolist()])
    exact(y.float(), want)
    assert torch.all((y.float() - xf).abs() <= torch.maximum(xf.abs() / 4, sfull / 4))
    assert torch.all(y[2, :32] == 0)
    exact(fp4_act_quant_sim(y), y)


# ---------------------------------------------------------------------------------------------
# Hadamard
# ---------------------------------------------------------------------------------------------

def sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def test_hadamard_vs_matrix():
    h4 = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]],
                      dtype=torch.float64)
    exact(sylvester(4), h4)  # scipy.linalg.hadamard ordering
    g = torch.Generator().manual_seed(14)
    for n in (2, 4, 8, 16, 32, 64, 128):
        x = torch.randn(3, 5, n, generator=g)
        want = (x.double() @ sylvester(n) * n ** -0.5).float()
        torch.testing.assert_close(hadamard(x), want, rtol=0, atol=2e-6)
    # a non-symmetric probe: basis vector e_1 -> row 1 of H / sqrt(n)
    e = torch.zeros(8)
    e[1] = 1
    exact(hadamard(e), (h4.new_tensor(sylvester(8)[1].tolist()) * 8 ** -0.5).float())


def test_hadamard_involution_and_dtype():
    g = torch.Generator().manual_seed(15)
    x = torch.randn(4, 128, generator=g)
    torch.testing.assert_close(hadamard(hadamard(x)), x, rtol=0, atol=2e-6)
    xb = x.to(torch.bfloat16)
    yb = hadamard(xb)
    assert yb.dtype == torch.bfloat16
    exact(yb, (xb.double() @ sylvester(128) * 128 ** -0.5).float().to(torch.bfloat16))
    with pytest.raises(ValueError):
        hadamard(torch.randn(2, 12))


# ---------------------------------------------------------------------------------------------
# hot functions must not sync: they run on the meta device (any .item()/.tolist()/bool() fails)
# ---------------------------------------------------------------------------------------------

def test_hot_functions_have_no_host_sync():
    m = dict(device="meta")
    e8 = torch.empty(3, 4, dtype=E8M0, **m)
    assert e8m0_to_float(e8).shape == (3, 4)
    assert fp8_e4m3_decode(torch.empty(7, dtype=torch.uint8, **m)).dtype == torch.float32
    assert fp4_e2m1_decode(torch.empty(7, dtype=torch.uint8, **m)).dtype == torch.float32
    assert fp4_e2m1_encode(torch.empty(7, **m)).dtype == torch.uint8
    assert unpack_fp4(torch.empty(2, 8, dtype=torch.int8, **m)).shape == (2, 16)
    assert dequant_fp8(torch.empty(2, 256, 300, dtype=E4M3, **m),
                       torch.empty(2, 2, 3, dtype=E8M0, **m), torch.bfloat16).shape == (2, 256, 300)
    assert dequant_fp8(torch.empty(256, 256, dtype=E4M3, **m),
                       torch.empty(2, 2, dtype=E8M0, **m)).shape == (256, 256)
    assert dequant_fp4(torch.empty(2, 16, 64, dtype=torch.int8, **m),
                       torch.empty(2, 16, 4, dtype=E8M0, **m)).shape == (2, 16, 128)
    x = torch.empty(2, 3, 512, dtype=torch.bfloat16, **m)
    q, s = act_quant(x)
    assert q.shape == x.shape and s.shape == (2, 3, 4)
    assert act_quant_sim(x, 64).shape == x.shape
    assert fp4_act_quant_sim(x).dtype == torch.bfloat16
    assert hadamard(x[..., :128]).shape == (2, 3, 128)


def test_constants():
    assert E4M3_MAX == 448.0 and E2M1_MAX == 6.0


def test_quant_scale_edges():
    # amax exactly qmax * 2^k -> scale 2^k; the next float32 above -> 2^(k+1)
    for k in (-20, -1, 0, 3, 40):
        for qmax, quant, rows, width in ((448.0, quant_fp8, 128, 128), (6.0, quant_fp4, 1, 32)):
            top = qmax * 2.0 ** k
            above = torch.nextafter(torch.tensor(top), torch.tensor(INF)).item()
            for amax, want in ((top, 2.0 ** k), (-above, 2.0 ** (k + 1))):
                w = torch.zeros(rows, width)
                w[0, 5] = amax
                _, sc = quant(w)
                assert e8m0_to_float(sc).reshape(-1)[0].item() == want
    # extreme range: scales clamp to / stay inside the E8M0 range
    _, sc = quant_fp8(torch.full((128, 128), 1e-40))
    assert sc.view(torch.uint8).item() == 0
    _, sc = quant_fp4(torch.full((1, 32), 3e38))
    assert e8m0_to_float(sc).item() == 2.0 ** 126


def test_qat_cuda_dispatch_runs_the_twin_on_cpu():
    """ds4.ops.qat_cuda takes the kernel only for CUDA bf16 rows its block divides; on the CPU it is the torch twin."""
    from ds4.ops.qat_cuda import act_quant_sim as dispatched
    from ds4.ops.qat_cuda import kernel_takes
    x = (torch.randn(3, 256) * 7).to(torch.bfloat16)
    assert not kernel_takes(x, 128)
    assert torch.equal(dispatched(x, 128), act_quant_sim(x, 128))
    assert torch.equal(dispatched(x, 64), act_quant_sim(x, 64))


def test_qat_staging_is_cuda_only(monkeypatch):
    """qat_cuda.staged: the FP8 simulation goes into a GEMV's staging only with DS4_ACT_QUANT=staged (or unset: the
    default) and one CUDA bf16 row (here on the CPU: never, whatever the variable says)."""
    from ds4.ops.qat_cuda import staged
    x = torch.randn(1, 1024).to(torch.bfloat16)
    for m in (None, "staged", "kernel"):
        if m is None:
            monkeypatch.delenv("DS4_ACT_QUANT", raising=False)
        else:
            monkeypatch.setenv("DS4_ACT_QUANT", m)
        assert not staged(x, "fp8t", 4096, 1024), m  # a CPU row


def test_act_quant_mode_refuses_unknown_values(monkeypatch):
    """DS4_ACT_QUANT: unset or empty is "staged" (the default since session 71); kernel / torch / staged as named; any
    other value is an error, not the default in silence."""
    from ds4.ops.qat_cuda import act_quant_sim as dispatched
    from ds4.ops.qat_cuda import mode, staging_on
    monkeypatch.delenv("DS4_ACT_QUANT", raising=False)
    assert mode() == "staged" and staging_on()
    monkeypatch.setenv("DS4_ACT_QUANT", "")
    assert mode() == "staged"
    for m in ("kernel", "torch", "staged"):
        monkeypatch.setenv("DS4_ACT_QUANT", m)
        assert mode() == m and staging_on() == (m == "staged")
    monkeypatch.setenv("DS4_ACT_QUANT", "stage")
    with pytest.raises(ValueError, match="DS4_ACT_QUANT='stage'"):
        staging_on()
    with pytest.raises(ValueError, match="expected one of kernel, torch, staged"):
        dispatched(torch.zeros(1, 128, dtype=torch.bfloat16))
