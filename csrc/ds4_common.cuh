// Shared device helpers for the ds4 kernels. CUDA headers only (no torch): CI compiles every .cu
// with plain nvcc for sm_80 and sm_90. Nothing here needs sm_89+ (no FP8/FP4 MMA).
//
// Numerics of every weight-times-activation kernel:
//  * activations are converted once to fp32 and pre-scaled by 2^40 (DS4_XS);
//  * weights are decoded by bit tricks straight to fp32 values that are the true element times
//    2^-120 (E4M3) or 2^-126 (E2M1) — both exact, subnormals included (the spec's E4M3/E2M1
//    subnormals land on fp32 subnormals/normals, never rounded);
//  * products are therefore ~2^-80 / 2^-86 times the true product: far from fp32 underflow for any
//    activation above ~2^-40 and far from overflow for any activation below 2^88;
//  * each 16-byte chunk of a row lies in one scale block: its partial dot product (fp32) is
//    multiplied by the E8M0 scale (byte b -> fp32 with exponent field b; b = 0 -> 2^-127) and
//    accumulated in fp32; the constant 2^80 / 2^86 / 2^-40 is applied once at the end.
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "pdl.cuh"

namespace ds4 {

// FMT_FP4P: MXFP4 whose 32-bit words have their bits permuted at load time (fp4p_regs below):
// the same bytes and scales as FMT_FP4, decoded in about half the integer instructions.
// FMT_FP4T: FMT_FP4P words placed in MmaStream's fragment order (ds4.quant.tile_fp4_mma, run width 2): the
// routed experts' layout that the one-token tensor-core MoE kernels read in 512-B warp loads (mma_dot.cuh);
// the FMA MoE kernels (several tokens) find their chunks with chunk_ptr.
// FMT_FP8T: FP8 bytes placed in the same fragment order (ds4.quant.tile_fp8_mma): the dense projections' layout
// under linear=gemv_cuda and the shared expert's under moe=fp4_topk where the shapes allow (DS4_FP8_TILE,
// DS4_SHARED_TILE); the FMA GEMV and MoE kernels find their chunks with chunk_ptr.
enum Fmt : int { FMT_BF16 = 0, FMT_FP8 = 1, FMT_FP4 = 2, FMT_FP4P = 3, FMT_FP4T = 4, FMT_FP8T = 5 };
constexpr int FP4T_W = 2;  // the run width the tiled layouts are laid out for (ds4.quant.formats.TILE_W)

// Any MXFP4 layout (same row bytes, scales, values per chunk).
__host__ __device__ constexpr bool fmt_fp4(int f) { return f == FMT_FP4 || f == FMT_FP4P || f == FMT_FP4T; }
// The permuted-word layouts (fp4p_regs decodes them).
__host__ __device__ constexpr bool fmt_fp4p(int f) { return f == FMT_FP4P || f == FMT_FP4T; }
// Either FP8 layout (same bytes per value, 128 x 128 scale blocks).
__host__ __device__ constexpr bool fmt_fp8(int f) { return f == FMT_FP8 || f == FMT_FP8T; }
// The layouts in MmaStream's fragment order (whole 16-row tiles, run width FP4T_W).
__host__ __device__ constexpr bool fmt_tiled(int f) { return f == FMT_FP4T || f == FMT_FP8T; }
// Whether a matrix of `rows` rows of K values can be in layout `fmt`: the tiled layouts are whole 16-row tiles and
// whole rounds of 4 FP4T_W chunks per row (ds4.quant.fp4t_ok / fp8t_ok: tile_fp4_mma / tile_fp8_mma make no others);
// the others any shape.
__host__ __device__ constexpr bool layout_shape_ok(int fmt, int rows, int K) {
  return !fmt_tiled(fmt) || (rows % 16 == 0 && K % (4 * FP4T_W * (fmt_fp8(fmt) ? 16 : 32)) == 0);
}

// values per 16-byte chunk
template <int FMT> struct FmtInfo;
template <> struct FmtInfo<FMT_BF16> { static constexpr int VALS = 8;  };
template <> struct FmtInfo<FMT_FP8>  { static constexpr int VALS = 16; };
template <> struct FmtInfo<FMT_FP4>  { static constexpr int VALS = 32; };
template <> struct FmtInfo<FMT_FP4P> { static constexpr int VALS = 32; };
template <> struct FmtInfo<FMT_FP4T> { static constexpr int VALS = 32; };
template <> struct FmtInfo<FMT_FP8T> { static constexpr int VALS = 16; };

__host__ __device__ constexpr float pow2f(int e) {
  // exact powers of two in the normal fp32 range (compile-time friendly)
  return e >= 0 ? (e == 0 ? 1.0f : 2.0f * pow2f(e - 1)) : 0.5f * pow2f(e + 1);
}

constexpr float DS4_XS = 1099511627776.0f;  // 2^40 activation pre-scale

template <int FMT> __device__ __forceinline__ float post_factor();
template <> __device__ __forceinline__ float post_factor<FMT_BF16>() { return 9.094947017729282e-13f; }  // 2^-40
template <> __device__ __forceinline__ float post_factor<FMT_FP8>()  { return 1.2089258196146292e24f; }  // 2^80
template <> __device__ __forceinline__ float post_factor<FMT_FP4>()  { return 7.737125245533627e25f; }   // 2^86
template <> __device__ __forceinline__ float post_factor<FMT_FP4P>() { return 7.737125245533627e25f; }   // 2^86
template <> __device__ __forceinline__ float post_factor<FMT_FP4T>() { return 7.737125245533627e25f; }   // 2^86
template <> __device__ __forceinline__ float post_factor<FMT_FP8T>() { return 1.2089258196146292e24f; }  // 2^80

__device__ __forceinline__ float e8m0_to_f32(uint32_t b) {
  return __uint_as_float(b ? (b << 23) : 0x00400000u);
}
// Byte k (0..3) of w as e8m0_to_f32 gives it, in fewer ALU instructions: PRMT takes the byte out
// zero-extended, the shift (FMA pipe) makes it the exponent field, and the max turns b = 0's +0 into
// 2^-127 (every b >= 1 gives at least 2^-126; b = 255 gives +inf as before).
__device__ __forceinline__ float e8m0_byte_to_f32(uint32_t w, int k) {
  const uint32_t b = __byte_perm(w, 0u, 0x4440u | (uint32_t)k);
  return fmaxf(__uint_as_float(b << 23), 5.877471754111438e-39f);  // 2^-127
}

// The scale of an FP4 chunk in the tensor-core kernels (MmaStream): byte k (0..3) of w as 2^(b - 127) for
// b >= 1, in at most one ALU instruction. Byte 0 needs only the shift (FMA pipe): the bit that lands in the
// sign is dropped by the fabsf, which ptxas folds into the FFMA operand (|R|); bytes 1..3 are taken out by PRMT.
// b = 0 gives 0 here, not 2^-127: the scale multiplies a partial d = 2^-62 sum(v x) (mma_dot.cuh's 2^-126 and
// 2^64 factors), and 2^-127 d lies below half fp32's least subnormal (2^-150) whenever |sum(v x)| < 2^39 —
// with |v| <= 6 over 32 values, any activation below 2^31 in magnitude — so the FFMA that adds it returns its
// accumulator unchanged either way (up to the sign of a zero accumulator). The FMNMX that e8m0_byte_to_f32
// spends on that case is one of the FP4 kernels' ALU instructions, and those kernels are ALU-bound
// (experiments/decode_session22_h200.md).
__device__ __forceinline__ float e8m0_mma_scale(uint32_t w, int k) {
  return fabsf(__uint_as_float((k == 0 ? w : __byte_perm(w, 0u, 0x4440u | (uint32_t)k)) << 23));
}

// 16-byte streaming load of weights (read once: do not allocate in L1).
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ float4 ld_f4(const float* p) { return *reinterpret_cast<const float4*>(p); }

// Decode one 32-bit word of a chunk into fp32 values (raw: true value x 2^-120 / 2^-126).
template <int FMT> struct Dec;
template <> struct Dec<FMT_BF16> {
  static constexpr int PER_WORD = 2;
  __device__ __forceinline__ static void word(uint32_t q, float* v) {
    v[0] = __uint_as_float(q << 16);
    v[1] = __uint_as_float(q & 0xffff0000u);
  }
};
template <> struct Dec<FMT_FP8> {
  static constexpr int PER_WORD = 4;
  __device__ __forceinline__ static void word(uint32_t q, float* v) {
    // byte j moved to the top and shifted right arithmetically by 4: bit 31 = s (replicated over
    // 31..28), bits 26..20 = eeee mmm; mask -> E4M3 value x 2^-120 as fp32 (exact, subnormals too)
    v[0] = __uint_as_float((uint32_t)((int32_t)(q << 24) >> 4) & 0x87f00000u);
    v[1] = __uint_as_float((uint32_t)((int32_t)(q << 16) >> 4) & 0x87f00000u);
    v[2] = __uint_as_float((uint32_t)((int32_t)(q << 8) >> 4) & 0x87f00000u);
    v[3] = __uint_as_float((uint32_t)((int32_t)q >> 4) & 0x87f00000u);
  }
};
template <> struct Dec<FMT_FP4> {
  static constexpr int PER_WORD = 8;
  __device__ __forceinline__ static void word(uint32_t q, float* v) {
    // nibble j (element j; low nibble = even element) s e1 e0 m -> fp32 bit 31 = s,
    // bits 24..22 = e1 e0 m (value x 2^-126, exact, 0.5 as an fp32 subnormal)
#pragma unroll
    for (int j = 0; j < 8; ++j)
      v[j] = __uint_as_float((uint32_t)((int32_t)(q << (28 - 4 * j)) >> 6) & 0x81c00000u);
  }
};

// The FMT_FP4P word layout (ds4.quant.formats.pack_fp4_mma writes it; a permutation of the 32 bits of
// each little-endian word of 8 E2M1 nibbles n0..n7, n_j = element j = bits 4j..4j+3 = m e0 e1 s in FMT_FP4).
// Register i of the tensor-core A fragment pairs n_i (low bf16) with n_{i+4} (high bf16), both as
// s 000000e1e0 m000000 (the true value x 2^-126, the same placement as fp4x2_to_bf16x2 in mma_dot.cuh);
// the permutation puts each register's 8 bits where one rotation and one mask (two for register 3) find them:
//   r0 = q & M, r1 = rotl(q, 4) & M, r2 = rotl(q, 10) & M,
//   r3 = (rotl(q, 6) & 0x80C080C0) | (rotl(q, 14) & 0x01000100),     M = 0x81C081C0
// 9 integer instructions per word instead of ~17 for the stored nibble order (SASS of the FMT_FP4 kernel,
// experiments/ncu_h200_s8.txt: 2 shifts + 2 LOP3 per register).
// Two of the rotations never wrap a bit that their mask keeps (rotl 4 under M, rotl 6 under 0x80C080C0), so
// they are written as left shifts: ptxas may then issue them on the FMA pipe (IMAD.SHL) instead of the ALU
// pipe's funnel shifter. The FP4 tensor-core arithmetic is ALU-bound (scripts/probe_bulk.cu, session 22:
// the ALU pipe at ~70 % of its peak with the weights already in shared memory). Same bits for every word.
__device__ __forceinline__ uint32_t rotl32(uint32_t q, int s) { return __funnelshift_l(q, q, s); }
__device__ __forceinline__ void fp4p_regs(uint32_t q, uint32_t (&r)[4]) {
  constexpr uint32_t M = 0x81C081C0u;
  r[0] = q & M;
  r[1] = (q << 4) & M;
  r[2] = rotl32(q, 10) & M;
  r[3] = ((q << 6) & 0x80C080C0u) | (rotl32(q, 14) & 0x01000100u);
}
template <> struct Dec<FMT_FP4P> {
  static constexpr int PER_WORD = 8;
  __device__ __forceinline__ static void word(uint32_t q, float* v) {
    // bf16 s 000000e1e0 m000000 in a 16-bit half -> the fp32 with those top 16 bits: the same fp32 as
    // Dec<FMT_FP4> (bit 31 = s, bits 24..22 = e1 e0 m)
    uint32_t r[4];
    fp4p_regs(q, r);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[i] = __uint_as_float(r[i] << 16);
      v[i + 4] = __uint_as_float(r[i] & 0xffff0000u);
    }
  }
};

template <> struct Dec<FMT_FP4T> : Dec<FMT_FP4P> {};  // the same words, placed elsewhere (chunk_ptr)

// The FMT_FP8T word layout (ds4.quant.formats.tile_fp8_mma writes it): besides the chunk placement (chunk_ptr), the
// 32 bits of each word of 4 E4M3 bytes b0..b3 are permuted so that register 0 of the tensor-core A fragment pairs
// b0 (low bf16) with b2 and register 1 pairs b1 with b3, both as s 0000eeee mmm0000 (the true value x 2^-120, the
// placement of fp8x2_to_bf16x2 in mma_dot.cuh):
//   r0 = q & 0x87F087F0, r1 = ((q << 4) & 0x80F080F0) | ((q >> 4) & 0x07000700)
// 3 LOP3 and one shift on the ALU pipe (the left shift drops no kept bit: an IMAD.SHL on the FMA pipe) where the
// stored byte order compiles to 4 LOP3, one shift and two IMAD.SHL per word. Why: the FP4 tensor-core kernels are
// bound by the ALU pipe (experiments/decode_session22_h200.md), and the FP8 decode took about as many ALU
// instructions per byte. No layout does it in 3 ALU instructions (scripts/fp4_decode_search.py, its FP8 lines): with
// 2 LOP3 register 1's bits would be one shifted copy of what register 0 leaves. H200, same machine, against the
// stored byte order: the FP8 GEMVs 1-3 % faster alone, the step 103.9 / 103.7 against 104.8 / 104.8 us per layer
// (experiments/decode_session45_h200.md).
__device__ __forceinline__ void fp8p_regs(uint32_t q, uint32_t (&r)[2]) {
  r[0] = q & 0x87F087F0u;
  r[1] = ((q << 4) & 0x80F080F0u) | ((q >> 4) & 0x07000700u);
}
template <> struct Dec<FMT_FP8T> {
  static constexpr int PER_WORD = 4;
  __device__ __forceinline__ static void word(uint32_t q, float* v) {
    // the bf16 halves as the top of an fp32: the same fp32 as Dec<FMT_FP8> (bit 31 = s, bits 26..20 = eeee mmm)
    uint32_t r[2];
    fp8p_regs(q, r);
    v[0] = __uint_as_float(r[0] << 16);
    v[1] = __uint_as_float(r[1] << 16);
    v[2] = __uint_as_float(r[0] & 0xffff0000u);
    v[3] = __uint_as_float(r[1] & 0xffff0000u);
  }
};

// Row byte length and scale byte of chunk c of row r.
template <int FMT> __host__ __device__ __forceinline__ long row_bytes(int K) {
  return FMT == FMT_BF16 ? 2L * K : (fmt_fp8(FMT) ? (long)K : (long)K / 2);
}

// The 16-B chunk c of row r of a matrix at W with rb bytes per row, as the row-at-a-time (FMA) kernels read
// it. FMT_FP4T / FMT_FP8T: row r = 16 tile + 8 half + g lies in its tile's block (16 rb bytes from 16 tile rb)
// and its chunk c = (4 round + t) FP4T_W + w at ((round FP4T_W + w) 2 + half) 512 + (4 g + t) 16 inside it
// (MmaStream's fragment order, ds4.quant.tile_fp4_mma / tile_fp8_mma); the whole matrix is tiles and rounds (the
// launchers check). The scales keep their row-major place.
template <int FMT>
__device__ __forceinline__ const uint8_t* chunk_ptr(const uint8_t* W, int r, long rb, int c) {
  if constexpr (fmt_tiled(FMT)) {
    const int w = c % FP4T_W, t = (c / FP4T_W) & 3, round = c / (4 * FP4T_W);
    return W + (long)(r >> 4) * 16 * rb + (((round * FP4T_W + w) * 2 + ((r >> 3) & 1)) * 32 + (r & 7) * 4 + t) * 16L;
  } else {
    return W + (long)r * rb + (long)c * 16;
  }
}
template <int FMT>
__device__ __forceinline__ float chunk_scale(const uint8_t* __restrict__ S, int r, int c, int s_ld) {
  if (FMT == FMT_BF16) return 1.0f;
  if (fmt_fp8(FMT)) return e8m0_to_f32(__ldg(S + (long)(r >> 7) * s_ld + (c >> 3)));
  return e8m0_to_f32(__ldg(S + (long)r * s_ld + c));
}

// acc[j][t] += scale_j * dot(chunk_j, x_t[k0 .. k0+VALS)) for R rows and NT tokens.
// xp[t] points at token t's (pre-scaled fp32) activation at k0; nullptr = skip token (warp-uniform).
template <int FMT, int R, int NT>
__device__ __forceinline__ void chunk_fma(const uint4 (&w)[R], const float (&sc)[R],
                                          const float* const (&xp)[NT], float (&acc)[R][NT]) {
  constexpr int PW = Dec<FMT>::PER_WORD;
  float p[R][NT];
#pragma unroll
  for (int j = 0; j < R; ++j)
#pragma unroll
    for (int t = 0; t < NT; ++t) p[j][t] = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float v[R][PW];
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const uint32_t q = i == 0 ? w[j].x : (i == 1 ? w[j].y : (i == 2 ? w[j].z : w[j].w));
      Dec<FMT>::word(q, v[j]);
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (xp[t] == nullptr) continue;
#pragma unroll
      for (int q4 = 0; q4 < PW; q4 += (PW >= 4 ? 4 : 2)) {
        if (PW >= 4) {
          const float4 xv = ld_f4(xp[t] + i * PW + q4);
#pragma unroll
          for (int j = 0; j < R; ++j) {
            p[j][t] = fmaf(v[j][q4 + 0], xv.x, p[j][t]);
            p[j][t] = fmaf(v[j][q4 + 1], xv.y, p[j][t]);
            p[j][t] = fmaf(v[j][q4 + 2], xv.z, p[j][t]);
            p[j][t] = fmaf(v[j][q4 + 3], xv.w, p[j][t]);
          }
        } else {
          const float2 xv = *reinterpret_cast<const float2*>(xp[t] + i * PW + q4);
#pragma unroll
          for (int j = 0; j < R; ++j) {
            p[j][t] = fmaf(v[j][q4 + 0], xv.x, p[j][t]);
            p[j][t] = fmaf(v[j][q4 + 1], xv.y, p[j][t]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < R; ++j)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[j][t] = fmaf(p[j][t], sc[j], acc[j][t]);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Shared-memory layout of an activation row: chunk c (VALS values) at float offset c * CS, with
// CS = VALS + pad so that 8 (16) consecutive lanes reading the same word of consecutive chunks hit
// distinct banks (FP8: stride 20 floats, FP4: 36, BF16: 10 with 8-byte loads).
template <int FMT> struct Smem {
  static constexpr int VALS = FmtInfo<FMT>::VALS;
  static constexpr int CS = VALS + (FMT == FMT_BF16 ? 2 : 4);
  __host__ __device__ static constexpr long row_floats(int K) { return (long)(K / VALS) * CS; }
};

// bf16 [K] (16-byte aligned, K % 8 == 0) -> fp32 x 2^40 into the padded smem row.
template <int FMT>
__device__ __forceinline__ void load_row_smem(float* dst, const __nv_bfloat16* __restrict__ src, int K) {
  constexpr int VALS = Smem<FMT>::VALS, CS = Smem<FMT>::CS;
  for (int m = threadIdx.x * 8; m < K; m += blockDim.x * 8) {
    const uint4 u = *reinterpret_cast<const uint4*>(src + m);
    const int c = m / VALS, w = m - c * VALS;
    float* d = dst + (long)c * CS + w;
    const uint32_t ws[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k)
      *reinterpret_cast<float2*>(d + 2 * k) =
          make_float2(__uint_as_float(ws[k] << 16) * DS4_XS, __uint_as_float(ws[k] & 0xffff0000u) * DS4_XS);
  }
}

// Host: SMs of the current device (gemv.cu).
int sm_count();

// Host: blocks of `kern` that fit on the whole GPU at once (at least one per SM).
template <typename KernelT>
inline int resident_wave(KernelT kern, int threads, long smem) {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kern, threads, (size_t)smem) != cudaSuccess || n < 1) n = 1;
  return n * sm_count();
}

// Host: lets kernel k use `bytes` of dynamic shared memory (an opt-in above 48 KB).
template <typename KernelT>
inline cudaError_t set_smem(KernelT k, long bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}

// Host: set_smem for kern, and into `wave` the blocks of one resident wave of `twin` at `smem`: kern itself, or for
// numerics=qat's staged (AQ) instances their plain twin, whose grid they launch with so that their warps cut the
// rounds, and sum, as the plain kernel does whatever registers ptxas gave them (with more, part of the grid waits for
// a second wave: slower, not other bits).
template <typename KernelT>
inline cudaError_t twin_wave(KernelT kern, KernelT twin, int threads, long smem, int& wave) {
  cudaError_t e = set_smem(kern, smem);
  if (e == cudaSuccess && twin != kern) e = set_smem(twin, smem);
  wave = resident_wave(twin, threads, smem);
  return e;
}

}  // namespace ds4
