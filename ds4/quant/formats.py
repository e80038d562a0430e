"""Checkpoint number formats of DeepSeek-V4-Flash (spec §10.3) in pure torch.

Formats
-------
* E4M3FN (OCP FP8): 1 sign, 4 exponent (bias 7), 3 mantissa bits; max ±448, no inf,
  NaN = 0x7F / 0xFF; subnormals m * 2^-9.
* E2M1 (OCP FP4): nibble ``s e1 e0 m``; codes 0..7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6 and
  codes 8..15 the same values negated (code 8 is -0).
* E8M0 (UE8M0): unsigned byte ``b`` -> 2^(b-127); 0xFF = NaN; byte 0 = 2^-127 (an fp32
  subnormal).
* FP8 weights: ``[..., O, I]`` E4M3 with one E8M0 scale per 128x128 block
  (``[..., ceil(O/128), ceil(I/128)]``).
* FP4 weights: ``[..., O, I/2]`` bytes packed along I (low nibble = even element, high nibble
  = odd element) with one E8M0 scale per 1x32 block along I (``[..., O, I/32]``).
* FP4 "mma" layout (``QWeight`` fmt ``fp4p``; the routed experts of ``moe=fp4_topk``): the same
  bytes with the 32 bits of each little-endian 4-byte word permuted (``pack_fp4_mma``), so that the
  tensor-core kernels decode a word in ~9 integer instructions instead of ~17 (csrc/ds4_common.cuh,
  ``fp4p_regs``). Words never straddle rows (I/2 is a multiple of 16), so row slices stay valid.

Functions marked [hot] are used inside decode steps: they perform no host synchronisation
(no ``.item()``, ``.tolist()``, no Python branching on tensor values, no host->device copies)
and are CUDA-graph friendly.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "E4M3_MAX",
    "E2M1_MAX",
    "e8m0_to_float",
    "float_to_e8m0",
    "fp8_e4m3_decode",
    "fp8_e4m3_encode",
    "fp4_e2m1_decode",
    "fp4_e2m1_encode",
    "pack_fp4",
    "unpack_fp4",
    "pack_fp4_mma",
    "unpack_fp4_mma",
    "dequant_fp8",
    "dequant_fp4",
    "quant_fp8",
    "quant_fp4",
    "random_fp8",
    "random_fp4",
]

E4M3_MAX = 448.0
E2M1_MAX = 6.0

_E8M0 = torch.float8_e8m0fnu
_E4M3 = torch.float8_e4m3fn
_FP4X2 = getattr(torch, "float4_e2m1fn_x2", None)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

def _as_uint8(t: Tensor) -> Tensor:
    """Reinterpret a 1-byte tensor (uint8/int8/float8_*/float4_x2) as uint8 (no copy)."""
    if t.dtype == torch.uint8:
        return t
    if t.element_size() != 1:
        raise TypeError(f"expected a 1-byte dtype, got {t.dtype}")
    return t.view(torch.uint8)


def _pow2_f64(k: Tensor) -> Tensor:
    """Exact float64 2^k for integer tensor k in [-1022, 1023]."""
    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)


# ----------------------------------------------------------------------------------------------
# E8M0
# ----------------------------------------------------------------------------------------------

def e8m0_to_float(s: Tensor) -> Tensor:
    """[hot] E8M0 (float8_e8m0fnu or uint8/int8 view) -> float32 2^(byte-127), exactly.

    Byte 255 -> NaN, byte 0 -> 2^-127 (fp32 subnormal, bits 0x00400000).
    """
    b = _as_uint8(s).to(torch.int32)
    bits = b << 23
    bits = torch.where(b == 0, torch.full_like(bits, 0x00400000), bits)
    bits = torch.where(b == 255, torch.full_like(bits, 0x7FC00000), bits)
    return bits.view(torch.float32)


def float_to_e8m0(x: Tensor) -> Tensor:
    """Exact powers of two 2^-127..2^127 (any float dtype) -> float8_e8m0fnu.

    Raises ValueError if any element is not an exact power of two in that range
    (NaN, inf, zero, negatives and non-powers included). Not hot (validates on the host).
    """
    x64 = x.to(torch.float64)
    mant, exp = torch.frexp(x64)  # x = mant * 2^exp, mant in [0.5, 1)
    ok = (mant == 0.5) & (exp - 1 >= -127) & (exp - 1 <= 127)
    if not bool(ok.all()):
        raise ValueError("float_to_e8m0: input contains values that are not powers of two "
                         "in [2^-127, 2^127]")
    byte = (exp - 1 + 127).to(torch.uint8)
    return byte.view(_E8M0)


# ----------------------------------------------------------------------------------------------
# E4M3
# ----------------------------------------------------------------------------------------------

def fp8_e4m3_decode(b: Tensor) -> Tensor:
    """[hot] E4M3FN codes (uint8/int8 view or float8_e4m3fn) -> float32. 0x7F/0xFF -> NaN."""
    return _as_uint8(b).view(_E4M3).to(torch.float32)


def fp8_e4m3_encode(x: Tensor) -> Tensor:
    """float tensor -> E4M3FN codes (uint8).

    Round-to-nearest-even on the float32 value (inputs are converted to float32 first),
    saturating to ±448 (also ±inf -> ±448), NaN -> 0x7F, subnormals (m * 2^-9) handled.
    """
    xf = x.to(torch.float32)
    q = xf.clamp(-E4M3_MAX, E4M3_MAX).to(_E4M3).view(torch.uint8)
    return torch.where(torch.isnan(xf), torch.full_like(q, 0x7F), q)


# ----------------------------------------------------------------------------------------------
# E2M1
# ----------------------------------------------------------------------------------------------

def fp4_e2m1_decode(codes: Tensor) -> Tensor:
    """[hot] E2M1 codes 0..15 (uint8; only the low nibble is used) -> float32.

    Bit construction: mag = e1 e0 m; e = e1e0; value = m*0.5 if e == 0 else 2^(e-1)*(1+m/2).
    """
    c = _as_uint8(codes).to(torch.int32)
    sign = ((c >> 3) & 1) * (-(2 ** 31))  # bit 3 -> bit 31 (0x80000000)
    e = (c >> 1) & 3
    m = c & 1
    normal = ((e + 126) << 23) | (m << 22)
    sub = m * 0x3F000000  # 0.5 or 0.0
    bits = torch.where(e == 0, sub, normal) | sign
    return bits.view(torch.float32)


def fp4_e2m1_encode(x: Tensor) -> Tensor:
    """float tensor -> E2M1 codes (uint8, 0..15).

    Round to nearest; a tie goes to the code with an even mantissa bit (= the even code),
    exactly like the hardware ``cvt.rn.satfinite.e2m1x2.f32``:
    0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5.0->4.0.
    Magnitudes above 6 (including inf) saturate to ±6. The sign is kept (negative values
    rounding to zero give code 8 = -0). NaN encodes as code 0 (E2M1 has no NaN).
    Computed in float32 (inputs converted first).
    """
    xf = x.to(torch.float32)
    a = xf.abs()
    # thresholds between consecutive magnitudes; '>' where the lower code is even
    # (tie goes down), '>=' where the upper code is even (tie goes up).
    mag = ((a > 0.25).to(torch.uint8) + (a >= 0.75).to(torch.uint8)
           + (a > 1.25).to(torch.uint8) + (a >= 1.75).to(torch.uint8)
           + (a > 2.5).to(torch.uint8) + (a >= 3.5).to(torch.uint8)
           + (a > 5.0).to(torch.uint8))
    sign = (torch.signbit(xf) & ~torch.isnan(xf)).to(torch.uint8) << 3
    return mag | sign


def pack_fp4(codes: Tensor) -> Tensor:
    """E2M1 codes [..., K] (uint8, 0..15, K even) -> packed int8 [..., K/2].

    Byte k holds element 2k in its low nibble and element 2k+1 in its high nibble.
    Raises ValueError for odd K or codes > 15 (not hot: validates on the host).
    """
    c = _as_uint8(codes)
    if c.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim must be even, got {c.shape[-1]}")
    if bool((c > 15).any()):
        raise ValueError("pack_fp4: codes must be in 0..15")
    lo = c[..., 0::2]
    hi = c[..., 1::2]
    return (lo | (hi << 4)).view(torch.int8)


def unpack_fp4(packed: Tensor) -> Tensor:
    """[hot] packed bytes [..., K/2] (int8/uint8/float4_e2m1fn_x2) -> codes uint8 [..., K]."""
    p = _as_uint8(packed)
    lo = p & 0xF
    hi = p >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def _word_sources(registers: list[list[tuple[int, int]]], value_bit) -> list[int]:
    """src[j] = the bit of a stored word that bit j of the permuted word holds, written from a device decode:
    register i is the OR of its pieces (q rotated left by s) & mask (a right shift: s < 0), and value_bit(i, p) is
    the stored bit that register i's bit p decodes. Output bit p of a piece with rotation s reads bit (p - s) % 32."""
    src = [-1] * 32
    for i, pieces in enumerate(registers):
        for rot, mask in pieces:
            for p in range(32):
                if mask >> p & 1:
                    src[(p - rot) % 32] = value_bit(i, p)
    assert sorted(src) == list(range(32)), src  # a permutation
    return src


def _fp4_mma_sources() -> list[int]:
    """The fp4p word's bits (_word_sources), from the device decode fp4p_regs: register i = rotl(q, s) & mask over its
    pieces, its low bf16 half = element i, high half = element i + 4, each as s 000000e1e0 m000000 (bits 15, 8, 7, 6
    of the half = nibble bits 3, 2, 1, 0)."""
    m = 0x81C081C0
    nibble_bit = {6: 0, 7: 1, 8: 2, 15: 3}
    return _word_sources([[(0, m)], [(4, m)], [(10, m)], [(6, 0x80C080C0), (14, 0x01000100)]],
                         lambda i, p: 4 * (i if p < 16 else i + 4) + nibble_bit[p % 16])


_FP4_MMA_SRC = _fp4_mma_sources()
_FP4_MMA_INV = [_FP4_MMA_SRC.index(b) for b in range(32)]  # the inverse permutation (unpack)


def _permute_word_bits(w: Tensor, src: list[int], out: Tensor | None, chunk_words: int = 1 << 24) -> Tensor:
    """Bit j of every 32-bit word of `out` = bit src[j] of the same word of `w` (1-byte elements, the
    last dim a multiple of 4 bytes). out may be w itself (in place, chunk by chunk)."""
    if w.shape[-1] % 4 or not w.is_contiguous():
        raise ValueError(f"fp4 mma layout: needs contiguous rows of whole 4-byte words, got {tuple(w.shape)}")
    out = torch.empty_like(w) if out is None else out
    by_shift: dict[int, int] = {}  # bits that move by the same amount share one mask
    for j, b in enumerate(src):
        by_shift[j - b] = by_shift.get(j - b, 0) | (1 << b)
    to_i32 = lambda v: v - (1 << 32) if v >= 1 << 31 else v  # noqa: E731
    a, o = w.view(torch.int32).view(-1), out.view(torch.int32).view(-1)
    for c0 in range(0, a.numel(), chunk_words):
        q = a[c0:c0 + chunk_words]
        r = torch.zeros_like(q)
        for d, mask in by_shift.items():
            if d >= 0:
                r |= (q & to_i32(mask)) << d          # int32 shifts wrap like the uint32 ones
            else:
                r |= (q >> -d) & to_i32(mask >> -d)   # arithmetic shift: the mask drops the sign copies
        o[c0:c0 + chunk_words] = r
    return out


def pack_fp4_mma(w: Tensor, out: Tensor | None = None) -> Tensor:
    """FP4 weight bytes [..., O, I/2] (stored layout) -> the fp4p layout (the routed-expert MoE kernels').

    A bit permutation inside each 4-byte word: same shape, dtype and scales. `out=w` converts in place."""
    return _permute_word_bits(w, _FP4_MMA_SRC, out)


def unpack_fp4_mma(w: Tensor, out: Tensor | None = None) -> Tensor:
    """[hot] The inverse of pack_fp4_mma: fp4p bytes -> the stored FP4 layout."""
    return _permute_word_bits(w, _FP4_MMA_INV, out)


# The fp4t layout (moe=fp4_topk's default where the shapes allow; DS4_FP4_TILE=0 keeps fp4p): fp4p words
# placed in the tensor-core kernels' fragment order, so that one warp instruction of csrc/mma_dot.cuh's
# MmaStream reads 512 contiguous bytes instead of 16-byte chunks of 8 rows. MmaStream's lane (g, t) of
# round r reads chunks 4 W r + W t + w (w < W) of rows g and g + 8 of a 16-row tile; fp4t stores tile T's (16 rows x row bytes) block where the stored
# layout has it, and inside it the chunk of (round r, chunk w, row half h, lane 4 g + t) at
# ((r W + w) 2 + h) 512 + (4 g + t) 16. W is fixed at TILE_W (the kernels' default run width).
TILE_W = 2


def fp4t_ok(rows: int, row_bytes: int) -> bool:
    """Whether an [rows, row_bytes] FP4 matrix can be laid out as fp4t (whole 16-row tiles and rounds)."""
    return rows % 16 == 0 and row_bytes % (64 * TILE_W) == 0


def _tile_view(w: Tensor) -> tuple[list[int], int, int]:
    *lead, rows, rb = w.shape
    if not fp4t_ok(rows, rb):
        raise ValueError(f"fp4t: rows {rows} must be a multiple of 16 and row bytes {rb} of {64 * TILE_W}")
    return lead, rows // 16, rb // (64 * TILE_W)


def _relay_tiles(w: Tensor, out: Tensor | None, src: tuple[int, ...], order: tuple[int, ...],
                 chunk_bytes: int) -> Tensor:
    """Permute the bytes inside every 16-row tile of w (viewed as tile x src) by `order` into out, a chunk of
    whole tiles at a time, so that out may be w itself with a transient of one chunk, not of the whole
    stacked tensor (a layer's w1 is 1 GB at V4-Flash's shapes)."""
    if not w.is_contiguous():
        raise ValueError(f"fp4t: needs a contiguous tensor, got strides {w.stride()}")
    out = torch.empty_like(w) if out is None else out
    tiles = w.view(-1, *src)
    dst = out.view(tiles.shape[0], -1)
    per = max(1, chunk_bytes // dst.shape[1])
    for t0 in range(0, tiles.shape[0], per):
        # the permuted chunk is materialised before it is written back (in place: an alias would be the
        # identity permutation, which writes what is there)
        dst[t0:t0 + per] = tiles[t0:t0 + per].permute(0, *order).reshape(-1, dst.shape[1])
    return out


def tile_fp4_mma(w: Tensor, out: Tensor | None = None, chunk_bytes: int = 1 << 26) -> Tensor:
    """fp4p bytes [..., O, I/2] -> the fp4t layout (same shape, dtype and scales); `out=w` converts in place."""
    _, _, nr = _tile_view(w)
    # tile, half, g, round, t, w, byte -> tile, round, w, half, g, t, byte
    return _relay_tiles(w, out, (2, 8, nr, 4, TILE_W, 16), (3, 5, 1, 2, 4, 6), chunk_bytes)


def untile_fp4_mma(w: Tensor, out: Tensor | None = None, chunk_bytes: int = 1 << 26) -> Tensor:
    """The inverse of tile_fp4_mma: fp4t bytes -> fp4p bytes; `out=w` converts in place."""
    _, _, nr = _tile_view(w)
    # tile, round, w, half, g, t, byte -> tile, half, g, round, t, w, byte
    return _relay_tiles(w, out, (nr, TILE_W, 2, 8, 4, 16), (3, 4, 1, 5, 2, 6), chunk_bytes)


# The split-K pair's chunk-major w2 (fp4k; csrc/moe_splitk.cu's kernel SPLITK_K, an experiment): a split-K gate+up block
# multiplies one 32-value chunk c of inter by all rows of w2, and in fp4t that chunk's 16-byte pieces sit 64 bytes
# apart (three other blocks' chunks between them). fp4k puts them where the down phase's lane (g, t) reads them: the
# piece of (chunk c, group q of 4 row tiles, row half h, lane 4 g + t) — tile 4 q + t's row g + 8 h — at
# ((c G + q) 2 + h) 512 + (4 g + t) 16 (G = rows / 64): every warp load reads 512 contiguous bytes and a chunk is one
# run. Its E8M0 scales likewise: the byte of (tile 4 q + 2 u + j, row g + 8 h, chunk c) at
# (c G + q) 64 + (8 u + g) 4 + 2 h + j (u, j < 2), so lane (g, u) of a group loads its four as one word.
# The pair alone took 38.2 us with it against 43.9 from fp4t (H100, experiments/session84.md); no load-time option
# lays w2 out this way (the other readers of w2 take fp4t).
def fp4k_ok(rows: int, row_bytes: int) -> bool:
    """Whether an fp4t [rows, row_bytes] matrix can be laid out as fp4k (whole groups of 4 row tiles)."""
    return fp4t_ok(rows, row_bytes) and rows % 64 == 0


def chunk_fp4_splitk(w: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """fp4t bytes [..., O, I/2] and their scales [..., O, I/32] -> fp4k (new tensors of the same shapes and dtypes)."""
    *lead, rows, rb = w.shape
    if not fp4k_ok(rows, rb) or tuple(s.shape) != (*lead, rows, rb // 16):
        raise ValueError(f"fp4k: rows {rows} must be a multiple of 64 and row bytes {rb} of {64 * TILE_W}, scales "
                         f"[..., rows, row bytes / 16]; got {tuple(w.shape)}, {tuple(s.shape)}")
    G, R = rows // 64, rb // (64 * TILE_W)
    # fp4t: q, t, round, w, h, g, lane column tn, byte (chunk c = round 4 W + tn W + w) -> c (round, tn, w), q, h, g, t
    wk = w.reshape(-1, G, 4, R, TILE_W, 2, 8, 4, 16).permute(0, 3, 7, 4, 1, 5, 6, 2, 8).reshape(w.shape)
    # rows (q, u, j, h, g), chunk c -> c, q, u, g, h, j
    sk = s.reshape(-1, G, 2, 2, 2, 8, rb // 16).permute(0, 6, 1, 2, 5, 4, 3).reshape(s.shape)
    return wk.contiguous(), sk.contiguous()


# The fp8t layout (linear=gemv_cuda's default for the dense FP8 projections and moe=fp4_topk's for the shared
# expert where the shapes allow; DS4_FP8_TILE=0 keeps fp8): the stored E4M3 bytes placed by the same permutation as
# fp4t, and the 32 bits of each 4-byte word then permuted (_FP8_MMA_SRC). MmaStream reads 16-byte chunks whatever
# they hold, so FP8 rows (one byte a value, K bytes a row) tile exactly as FP4 rows do, and a chunk's words stay
# whole, so the two permutations commute; the E8M0 128 x 128 scales keep their place.
def _fp8_mma_sources() -> list[int]:
    """The fp8t word's bits (_word_sources; stored E4M3 bytes b0..b3, byte k = bits 8k..8k+7), from the device decode
    fp8p_regs (csrc/ds4_common.cuh): r0 = q & 0x87F087F0 holds (b0, b2) and r1 = ((q << 4) & 0x80F080F0) |
    ((q >> 4) & 0x07000700) holds (b1, b3), each bf16 half as s 0000eeee mmm0000 (half bit 15 = byte bit 7, half bits
    10..4 = byte bits 6..0): the A-fragment registers the stored byte order gives with two shifts and two masks each
    (fp8x2_to_bf16x2, csrc/mma_dot.cuh)."""
    return _word_sources([[(0, 0x87F087F0)], [(4, 0x80F080F0), (-4, 0x07000700)]],
                         lambda i, p: 8 * (i + (2 if p >= 16 else 0)) + (7 if p % 16 == 15 else p % 16 - 4))


_FP8_MMA_SRC = _fp8_mma_sources()
_FP8_MMA_INV = [_FP8_MMA_SRC.index(b) for b in range(32)]


def fp8t_ok(rows: int, cols: int) -> bool:
    """Whether an FP8 [rows, cols] matrix can be laid out as fp8t (whole 16-row tiles and rounds)."""
    return fp4t_ok(rows, cols)


def tile_fp8_mma(w: Tensor, out: Tensor | None = None, chunk_bytes: int = 1 << 26) -> Tensor:
    """fp8 (float8_e4m3fn) [..., O, I] -> the fp8t layout (same shape, dtype and scales); `out=w` converts in place."""
    u8 = tile_fp4_mma(w.view(torch.uint8), None if out is None else out.view(torch.uint8), chunk_bytes)
    return _permute_word_bits(u8, _FP8_MMA_SRC, u8, max(1, chunk_bytes // 4)).view(w.dtype)


def untile_fp8_mma(w: Tensor, out: Tensor | None = None, chunk_bytes: int = 1 << 26) -> Tensor:
    """The inverse of tile_fp8_mma: fp8t bytes -> the stored fp8 layout; `out=w` converts in place."""
    # the words' bits first, into out (or a new tensor), whose tiles are then undone in place
    u8 = _permute_word_bits(w.view(torch.uint8), _FP8_MMA_INV, None if out is None else out.view(torch.uint8),
                            max(1, chunk_bytes // 4))
    return untile_fp4_mma(u8, u8, chunk_bytes).view(w.dtype)


# ----------------------------------------------------------------------------------------------
# block dequantisation
# ----------------------------------------------------------------------------------------------

def dequant_fp8(w: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32,
                block: int = 128) -> Tensor:
    """[hot] FP8 block-scaled weight -> dense.

    w: float8_e4m3fn (or uint8 view) [..., O, I]; scale: E8M0 [..., ceil(O/block),
    ceil(I/block)] (leading dims must match w's). Partial last blocks are supported.
    W[..., i, j] = e4m3(w[..., i, j]) * 2^(scale[..., i//block, j//block] - 127), computed in
    float32 and cast to ``dtype``.
    """
    wf = fp8_e4m3_decode(w)
    s = e8m0_to_float(scale)
    *lead, O, I = wf.shape
    nbo, nbi = -(-O // block), -(-I // block)
    if tuple(s.shape) != (*lead, nbo, nbi):
        raise ValueError(f"dequant_fp8: scale shape {tuple(s.shape)} does not match weight "
                         f"{tuple(wf.shape)} with block {block}")
    # The scales applied in place on the fresh fp32 decode: one fp32 temporary per value, not two.
    if O % block == 0 and I % block == 0:
        wf.view(*lead, nbo, block, nbi, block).mul_(s[..., :, None, :, None])
    else:
        sf = s[..., :, None, :, None].expand(*lead, nbo, block, nbi, block)
        wf.mul_(sf.reshape(*lead, nbo * block, nbi * block)[..., :O, :I])
    return wf.to(dtype)


def dequant_fp4(w: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """[hot] MXFP4 weight -> dense.

    w: packed int8/uint8/float4_e2m1fn_x2 [..., O, I/2]; scale: E8M0 [..., O, I/32].
    W[..., i, j] = e2m1(nibble(i, j)) * 2^(scale[..., i, j//32] - 127), computed in float32 and
    cast to ``dtype``.
    """
    p = _as_uint8(w)
    *lead, O, half = p.shape
    I = 2 * half
    if I % 32 or tuple(scale.shape) != (*lead, O, I // 32):
        raise ValueError(f"dequant_fp4: scale shape {tuple(scale.shape)} does not match "
                         f"weight [{', '.join(map(str, (*lead, O, I)))}] (blocks of 32)")
    # Each packed byte's two values looked up in a 256-entry table (unpack_fp4 + fp4_e2m1_decode of every byte), and
    # the scales applied in place: 6 bytes of temporaries per value instead of the ~20 of decoding every code's bits
    # in int32 tensors, which set a CPU run's peak at the torch MoE's decode step.
    table = fp4_e2m1_decode(unpack_fp4(torch.arange(256, dtype=torch.uint8, device=p.device)))  # [512]: 256 x 2
    v = table.view(256, 2)[p.to(torch.int32)].view(*lead, O, I // 32, 32)
    v.mul_(e8m0_to_float(scale)[..., None])
    return v.view(*lead, O, I).to(dtype)


# ----------------------------------------------------------------------------------------------
# quantisation (weights; not hot but sync-free apart from nothing)
# ----------------------------------------------------------------------------------------------

def _smallest_pow2_exponent(amax: Tensor, qmax: float) -> Tensor:
    """Smallest integer k in [-127, 127] with amax <= qmax * 2^k (exact, float64 math)."""
    a = amax.to(torch.float64).clamp(min=2.0 ** -1000)
    k = torch.ceil(torch.log2(a / qmax)).clamp(-1000, 1000).to(torch.int64)
    # correct possible off-by-one of the approximate log2
    k = torch.where(a > qmax * _pow2_f64(k), k + 1, k)
    k = torch.where(a <= qmax * _pow2_f64(k - 1), k - 1, k)
    return k.clamp(-127, 127)


def quant_fp8(w: Tensor, block: int = 128) -> tuple[Tensor, Tensor]:
    """float weight [..., O, I] -> (float8_e4m3fn [..., O, I], E8M0 [..., ceil(O/b), ceil(I/b)]).

    Per block x block tile: scale = smallest power of two s (2^-127..2^127) with
    amax/s <= 448 (all-zero tiles get 2^-127); q = e4m3(w/s) round-to-nearest-even.
    Round trip is exact for inputs that are already block-FP8 representable.
    Inputs are converted to float32 first.
    """
    wf = w.to(torch.float32)
    *lead, O, I = wf.shape
    nbo, nbi = -(-O // block), -(-I // block)
    pad = torch.nn.functional.pad(wf, (0, nbi * block - I, 0, nbo * block - O))
    tiles = pad.view(*lead, nbo, block, nbi, block)
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., nbo, nbi]
    k = _smallest_pow2_exponent(amax, E4M3_MAX)
    inv = _pow2_f64(-k)[..., :, None, :, None]
    scaled = (tiles.to(torch.float64) * inv).to(torch.float32)  # exact (pow2 scaling)
    scaled = scaled.view(*lead, nbo * block, nbi * block)[..., :O, :I]
    q = fp8_e4m3_encode(scaled).view(_E4M3).contiguous()
    s = (k + 127).to(torch.uint8).view(_E8M0)
    return q, s


def quant_fp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """float weight [..., O, I] (I % 32 == 0) -> (packed int8 [..., O, I/2], E8M0 [..., O, I/32]).

    Per 1x32 block along I: scale = smallest power of two s with amax/s <= 6 (all-zero blocks
    get 2^-127); codes = fp4_e2m1_encode(w/s) (ties to even). Inputs converted to float32.
    """
    wf = w.to(torch.float32)
    *lead, O, I = wf.shape
    if I % 32:
        raise ValueError(f"quant_fp4: last dim must be a multiple of 32, got {I}")
    blocks = wf.view(*lead, O, I // 32, 32)
    amax = blocks.abs().amax(dim=-1)
    k = _smallest_pow2_exponent(amax, E2M1_MAX)
    scaled = (blocks.to(torch.float64) * _pow2_f64(-k)[..., None]).to(torch.float32)
    codes = fp4_e2m1_encode(scaled.view(*lead, O, I))
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8)
    s = (k + 127).to(torch.uint8).view(_E8M0)
    return packed, s


def random_fp8(shape, generator: torch.Generator | None = None, std: float = 0.02,
               device=None) -> tuple[Tensor, Tensor]:
    """Random block-FP8 weight: normal(0, std) drawn on ``device`` with ``generator``, then
    quant_fp8. Returns (float8_e4m3fn [..., O, I], E8M0 scale). Deterministic given the
    generator state (the generator must live on ``device``)."""
    if device is None and generator is not None:
        device = generator.device
    w = torch.randn(tuple(shape), generator=generator, device=device, dtype=torch.float32)
    return quant_fp8(w * std)


def random_fp4(shape, generator: torch.Generator | None = None, std: float = 0.02,
               device=None) -> tuple[Tensor, Tensor]:
    """Random MXFP4 weight of logical shape [..., O, I]: normal(0, std) on ``device`` with
    ``generator``, then quant_fp4. Returns (packed int8 [..., O, I/2], E8M0 [..., O, I/32])."""
    if device is None and generator is not None:
        device = generator.device
    w = torch.randn(tuple(shape), generator=generator, device=device, dtype=torch.float32)
    return quant_fp4(w * std)
