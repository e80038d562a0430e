// Tensor-core dot products of FP8 / MXFP4 weight rows with one token's activations (batch-1
// decode), for sm_80 and newer: BF16 mma.sync m16n8k16 with fp32 accumulation. No FP8/FP4 MMA.
//
// Why: the FMA kernels (ds4_common.cuh) spend ~3 integer ops decoding each weight plus one FFMA;
// at FP4 that is, by instruction count, about twice the issue time the bytes take at copy bandwidth.
// Here a weight pair costs 1.5-2 integer ops and the tensor cores do the products (H200, top-6 FP4
// MoE: 57.6 -> 48.6 us; for FP8 the FMA kernels stayed faster, see ds4_launch.h).
//
// Decode (exact, bit placement only): an E4M3 byte s eeee mmm becomes the bf16 s 0000eeee mmm0000,
// i.e. the true value x 2^-120 (E4M3 subnormals land on bf16 subnormals); an E2M1 nibble s e1e0 m
// becomes the bf16 s 000000e1e0 m000000, the true value x 2^-126. Two values sitting 16 bits apart
// in the stored word decode with one mask-shift-merge into one bf16x2 register.
// Activations: bf16 x 2^64 (exact; overflows only for |x| >= 2^64), so products stay far above the
// fp32 subnormal range; the constant 2^120/2^126 / 2^64 is applied once at the end.
//
// Fragments (PTX m16n8k16): lane = 4 g + t holds A rows g and g+8 at k-slots {2t, 2t+1, 2t+8, 2t+9},
// B column g at the same k-slots, C rows g / g+8, columns 2t, 2t+1. The k order inside an MMA is
// free as long as A and B agree, so lane (g, t) feeds the MMA straight from its own 16-byte chunk:
// chunk 4 r + t of rows g and g+8 ("round" r covers 4 chunks of 16 rows). B is staged in shared
// memory permuted so that one 64-bit load gives a lane its two B registers.
//  * FP8 (scale per 128x128 block, uniform over a round): B column 0 = the activations (lanes g = 0),
//    other columns 0; C column 0 = the round's partial dot product.
//  * FP4 (scale per row and 32-value chunk = per lane chunk): B column n holds the activations only
//    at the k-slots of lane t = n (lane (n, n)), so C column n = the partial of chunk 4 r + n, which
//    is scaled before accumulation.
#pragma once
#include "ds4_common.cuh"

namespace ds4 {

constexpr float MMA_XS = 18446744073709551616.0f;  // 2^64 activation pre-scale

template <int FMT> struct Mma;
template <> struct Mma<FMT_FP8> {
  static constexpr int VALS = 16;                     // values per 16-byte chunk
  static constexpr float POST = 72057594037927936.0f;  // 2^56 = 2^120 / 2^64
};
template <> struct Mma<FMT_FP4> {
  static constexpr int VALS = 32;
  static constexpr float POST = 4611686018427387904.0f;  // 2^62 = 2^126 / 2^64
};

// values per round of one row: 4 lanes x one chunk
template <int FMT> __host__ __device__ constexpr int mma_round_vals() { return 4 * Mma<FMT>::VALS; }

// E4M3 bytes at bits 15..8 and 31..24 -> bf16x2 (x 2^-120)
__device__ __forceinline__ uint32_t fp8x2_to_bf16x2(uint32_t q) {
  return (q & 0x80008000u) | ((q >> 4) & 0x07f007f0u);
}
// E2M1 nibbles at bits 15..12 and 31..28 -> bf16x2 (x 2^-126)
__device__ __forceinline__ uint32_t fp4x2_to_bf16x2(uint32_t q) {
  return (q & 0x80008000u) | ((q >> 6) & 0x01c001c0u);
}

__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// d += the chunk's products: wg / wg8 = the lane's 16 bytes of rows g / g+8; xb = the lane's B
// values for this chunk (permuted, 64 bytes for FP8, 64 for FP4 as 4 x uint4 / 2 x uint4).
template <int FMT> __device__ __forceinline__ void mma_chunk(const uint4& wg, const uint4& wg8, const uint4* xb,
                                                             float (&d)[4]);

template <>
__device__ __forceinline__ void mma_chunk<FMT_FP8>(const uint4& wg, const uint4& wg8, const uint4* xb, float (&d)[4]) {
  // word w = bytes b0..b3 (k = 4w..4w+3): A k-slots (2t, 2t+1) <- (b0, b2), (2t+8, 2t+9) <- (b1, b3);
  // staged B per 4 values: [x0 x2 x1 x3]
  const uint32_t qa[4] = {wg.x, wg.y, wg.z, wg.w}, qb[4] = {wg8.x, wg8.y, wg8.z, wg8.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const uint4 b = xb[w >> 1];
    const uint32_t b0 = (w & 1) ? b.z : b.x, b1 = (w & 1) ? b.w : b.y;
    mma_16816(d, fp8x2_to_bf16x2(qa[w] << 8), fp8x2_to_bf16x2(qb[w] << 8), fp8x2_to_bf16x2(qa[w]),
              fp8x2_to_bf16x2(qb[w]), b0, b1);
  }
}

template <>
__device__ __forceinline__ void mma_chunk<FMT_FP4>(const uint4& wg, const uint4& wg8, const uint4* xb, float (&d)[4]) {
  // word w = nibbles n0..n7 (k = 8w..8w+7): MMA 1: (n0, n4), (n1, n5); MMA 2: (n2, n6), (n3, n7);
  // staged B per 8 values: [x0 x4 x1 x5 x2 x6 x3 x7]
  const uint32_t qa[4] = {wg.x, wg.y, wg.z, wg.w}, qb[4] = {wg8.x, wg8.y, wg8.z, wg8.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const uint4 b = xb[w];
    mma_16816(d, fp4x2_to_bf16x2(qa[w] << 12), fp4x2_to_bf16x2(qb[w] << 12), fp4x2_to_bf16x2(qa[w] << 8),
              fp4x2_to_bf16x2(qb[w] << 8), b.x, b.y);
    mma_16816(d, fp4x2_to_bf16x2(qa[w] << 4), fp4x2_to_bf16x2(qb[w] << 4), fp4x2_to_bf16x2(qa[w]),
              fp4x2_to_bf16x2(qb[w]), b.z, b.w);
  }
}

// bf16 [K] (16-byte aligned, K % 8 == 0) -> bf16 x 2^64, permuted for mma_chunk, into shared memory.
template <int FMT>
__device__ __forceinline__ void stage_mma_row(__nv_bfloat16* dst, const __nv_bfloat16* __restrict__ src, int K) {
  for (int m = threadIdx.x * 8; m < K; m += blockDim.x * 8) {
    const uint4 u = *reinterpret_cast<const uint4*>(src + m);
    const uint32_t in[4] = {u.x, u.y, u.z, u.w};
    uint32_t v[8];  // bf16 bits of x[m + j] * 2^64 (exact: a power-of-two scaling of a bf16 value)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[2 * j] = __float_as_uint(__uint_as_float(in[j] << 16) * MMA_XS) >> 16;
      v[2 * j + 1] = __float_as_uint(__uint_as_float(in[j] & 0xffff0000u) * MMA_XS) >> 16;
    }
    uint4 o;
    if (FMT == FMT_FP8) {  // [0 2 1 3 | 4 6 5 7]
      o = make_uint4(v[0] | v[2] << 16, v[1] | v[3] << 16, v[4] | v[6] << 16, v[5] | v[7] << 16);
    } else {  // [0 4 1 5 2 6 3 7]
      o = make_uint4(v[0] | v[4] << 16, v[1] | v[5] << 16, v[2] | v[6] << 16, v[3] | v[7] << 16);
    }
    *reinterpret_cast<uint4*>(dst + m) = o;
  }
}

// One segment of a warp's work: a weight matrix (rows of rb bytes), its scales, the staged
// activations it multiplies.
struct MmaSeg {
  const uint8_t* W;
  const uint8_t* S;
  const __nv_bfloat16* xs;
};

// A warp's 16 rows (row0 + g, row0 + g + 8; rows >= nrows are clamped and their results ignored)
// over rounds [beg, end) of the concatenated segments seg(0), seg(1), ... (nr rounds each). U
// rounds of weight loads are kept in flight; prefetch() issues the first ones (it may run before the
// activations are staged), run() consumes them and returns the row sums x POST (valid in lanes t = 0:
// .x = row0 + g, .y = row0 + g + 8).
template <int FMT, int U, typename SegFn>
struct MmaRows16 {
  SegFn seg;
  int nr, s_ld, row0, ra, rb8, beg, end;
  long rowb;
  int cu, cr;  // load cursor (segment, round)
  uint4 wa[U], wb[U];
  uint32_t sc[U];
  int su[U], sr[U];

  __device__ __forceinline__ MmaRows16(SegFn f, int nr_, long rowb_, int row0_, int nrows, int s_ld_, int beg_,
                                       int end_)
      : seg(f), nr(nr_), s_ld(s_ld_), row0(row0_), beg(beg_), end(end_), rowb(rowb_) {
    const int g = (threadIdx.x & 31) >> 2;
    ra = min(row0 + g, nrows - 1);
    rb8 = min(row0 + g + 8, nrows - 1);
    cu = nr > 0 ? beg / nr : 0;
    cr = beg - cu * nr;
  }

  __device__ __forceinline__ void load(int k) {
    const int t = threadIdx.x & 3;
    const MmaSeg p = seg(cu);
    const uint8_t* base = p.W + (long)(4 * cr + t) * 16;
    wa[k] = ld_stream16(base + (long)ra * rowb);
    wb[k] = ld_stream16(base + (long)rb8 * rowb);
    if (FMT == FMT_FP8) {
      sc[k] = __ldg(p.S + (long)(row0 >> 7) * s_ld + (cr >> 1));  // chunks 4cr..4cr+3: one 128-block
    } else {  // the scales of chunks 4cr + 2(t&1), +1 of both rows (2 bytes each; s_ld % 4 == 0)
      const int c = 4 * cr + 2 * (t & 1);
      const uint32_t lo = __ldg(reinterpret_cast<const unsigned short*>(p.S + (long)ra * s_ld + c));
      const uint32_t hi = __ldg(reinterpret_cast<const unsigned short*>(p.S + (long)rb8 * s_ld + c));
      sc[k] = lo | hi << 16;
    }
    su[k] = cu;
    sr[k] = cr;
    if (++cr == nr) {
      cr = 0;
      ++cu;
    }
  }

  __device__ __forceinline__ void prefetch() {
#pragma unroll
    for (int k = 0; k < U; ++k)
      if (beg + k < end) load(k);
  }

  __device__ __forceinline__ float2 run() {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bool has_b = FMT == FMT_FP4 ? g == t : g == 0;
    float acc0 = 0.f, acc1 = 0.f;
    const int n = end - beg;
    for (int i0 = 0; i0 < n; i0 += U) {
#pragma unroll
      for (int k = 0; k < U; ++k) {
        if (i0 + k < n) {
          const MmaSeg p = seg(su[k]);
          constexpr int NB = FMT == FMT_FP8 ? 2 : 4;  // uint4 of B per chunk
          uint4 xb[NB];
          const uint4* src = reinterpret_cast<const uint4*>(p.xs + (long)(4 * sr[k] + t) * Mma<FMT>::VALS);
#pragma unroll
          for (int j = 0; j < NB; ++j) xb[j] = has_b ? src[j] : make_uint4(0u, 0u, 0u, 0u);
          float d[4] = {0.f, 0.f, 0.f, 0.f};
          mma_chunk<FMT>(wa[k], wb[k], xb, d);
          const uint32_t s = sc[k];
          if (FMT == FMT_FP8) {
            const float f = e8m0_to_f32(s);
            acc0 = fmaf(d[0], f, acc0);
            acc1 = fmaf(d[2], f, acc1);
          } else {
            acc0 = fmaf(d[0], e8m0_to_f32(s & 0xffu), acc0);
            acc0 = fmaf(d[1], e8m0_to_f32((s >> 8) & 0xffu), acc0);
            acc1 = fmaf(d[2], e8m0_to_f32((s >> 16) & 0xffu), acc1);
            acc1 = fmaf(d[3], e8m0_to_f32(s >> 24), acc1);
          }
          if (i0 + k + U < n) load(k);
        }
      }
    }
    // FP4: columns 0..3 live in lanes t = 0 (chunks 0, 1) and t = 1 (chunks 2, 3); FP8: column 0 in
    // t = 0, lane t = 1 holds zeros. Either way rows sum over the lane pair (t = 0, 1).
    acc0 += __shfl_xor_sync(0xffffffffu, acc0, 1);
    acc1 += __shfl_xor_sync(0xffffffffu, acc1, 1);
    return make_float2(acc0 * Mma<FMT>::POST, acc1 * Mma<FMT>::POST);
  }
};

// Stores the row sums run() returned (lanes t = 0) as red16[0..15] = rows row0 .. row0 + 15.
__device__ __forceinline__ void mma_rows16_store(float* red16, float2 v) {
  const int lane = threadIdx.x & 31;
  if ((lane & 3) == 0) {
    red16[lane >> 2] = v.x;
    red16[(lane >> 2) + 8] = v.y;
  }
}

template <int FMT, int U, typename SegFn>
__device__ __forceinline__ MmaRows16<FMT, U, SegFn> mma_rows16(SegFn f, int nr, long rowb, int row0, int nrows,
                                                               int s_ld, int beg, int end) {
  return MmaRows16<FMT, U, SegFn>(f, nr, rowb, row0, nrows, s_ld, beg, end);
}

// Whether the MMA path takes a 1-token product of a K-wide row (FP8 / FP4 only).
__host__ __device__ inline bool mma_shape_ok(int fmt, int K) {
  if (fmt == FMT_FP8) return K % (4 * 16) == 0;
  if (fmt == FMT_FP4) return K % (4 * 32) == 0;
  return false;
}

}  // namespace ds4
