// Tensor-core dot products of FP8 / MXFP4 weight rows with one token's activations (batch-1
// decode), for sm_80 and newer: BF16 mma.sync m16n8k16 with fp32 accumulation. No FP8/FP4 MMA.
//
// Why: the FMA kernels (ds4_common.cuh) spend ~3 integer ops decoding each weight plus one FFMA
// (SASS of the FP8 kernel: per weight 1 FFMA, 1 SHF, 1 LOP3, 0.75 IMAD). Here a weight pair costs
// 1.5-2 integer ops and the tensor cores do the products. What limited these kernels at first was
// not the arithmetic but the access pattern (see MmaStream); the default (K >= 2048 for FP8, all FP4)
// is set in ds4_launch.h from H200 measurements.
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
// free as long as A and B agree, so lane (g, t) feeds an MMA straight from one of its own 16-byte
// chunks of rows g and g+8 (which chunks: MmaStream). B is staged in shared memory permuted so that
// one 64-bit load gives a lane its two B registers.
//  * FP8 (scale per 128x128 block): B column 0 = the activations of the lanes whose chunks lie in one
//    block (lanes g = 0), column 1 those of a second block when an MMA spans two (MmaStream, W = 4),
//    other columns 0; C columns 0 / 1 = the partial dot products of the two blocks.
//  * FP4 (scale per row and 32-value chunk = per lane chunk): B column n holds the activations only
//    at the k-slots of lane t = n (lane (n, n)), so C column n = the partial of lane n's chunk, which
//    is scaled before accumulation.
#pragma once
#include "act_quant.cuh"
#include "bulk_stage.cuh"
#include "cp_async.cuh"
#include "ds4_common.cuh"

#include <type_traits>

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
template <> struct Mma<FMT_FP4P> : Mma<FMT_FP4> {};
template <> struct Mma<FMT_FP4T> : Mma<FMT_FP4> {};
template <> struct Mma<FMT_FP8T> : Mma<FMT_FP8> {};

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

// FMT_FP8T: the same values per lane as FMT_FP8 (its chunks placed elsewhere), each word's bits permuted so that
// fp8p_regs (ds4_common.cuh) gives the registers (b0, b2) and (b1, b3) directly; the same staged B.
template <>
__device__ __forceinline__ void mma_chunk<FMT_FP8T>(const uint4& wg, const uint4& wg8, const uint4* xb, float (&d)[4]) {
  const uint32_t qa[4] = {wg.x, wg.y, wg.z, wg.w}, qb[4] = {wg8.x, wg8.y, wg8.z, wg8.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const uint4 b = xb[w >> 1];
    uint32_t ra[2], rb[2];
    fp8p_regs(qa[w], ra);
    fp8p_regs(qb[w], rb);
    mma_16816(d, ra[0], rb[0], ra[1], rb[1], (w & 1) ? b.z : b.x, (w & 1) ? b.w : b.y);
  }
}

// The 4 A-fragment registers of one word of 8 E2M1 values: register i = (n_i, n_{i+4}) as bf16x2 (x 2^-126).
// Stored nibble order: shift each pair to bits 15..12 / 31..28 first.
__device__ __forceinline__ void fp4_regs(uint32_t q, uint32_t (&r)[4]) {
  r[0] = fp4x2_to_bf16x2(q << 12);
  r[1] = fp4x2_to_bf16x2(q << 8);
  r[2] = fp4x2_to_bf16x2(q << 4);
  r[3] = fp4x2_to_bf16x2(q);
}

// Both MXFP4 layouts: word w = nibbles n0..n7 (k = 8w..8w+7); MMA 1: (n0, n4), (n1, n5); MMA 2: (n2, n6),
// (n3, n7); staged B per 8 values: [x0 x4 x1 x5 x2 x6 x3 x7]. FMT_FP4P words (fp4p_regs, ds4_common.cuh)
// give the same registers with about half the integer instructions.
template <int FMT>
__device__ __forceinline__ void mma_chunk_fp4(const uint4& wg, const uint4& wg8, const uint4* xb, float (&d)[4]) {
  const uint32_t qa[4] = {wg.x, wg.y, wg.z, wg.w}, qb[4] = {wg8.x, wg8.y, wg8.z, wg8.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const uint4 b = xb[w];
    uint32_t ra[4], rb[4];
    if (fmt_fp4p(FMT)) {
      fp4p_regs(qa[w], ra);
      fp4p_regs(qb[w], rb);
    } else {
      fp4_regs(qa[w], ra);
      fp4_regs(qb[w], rb);
    }
    mma_16816(d, ra[0], rb[0], ra[1], rb[1], b.x, b.y);
    mma_16816(d, ra[2], rb[2], ra[3], rb[3], b.z, b.w);
  }
}
template <>
__device__ __forceinline__ void mma_chunk<FMT_FP4>(const uint4& wg, const uint4& wg8, const uint4* xb, float (&d)[4]) {
  mma_chunk_fp4<FMT_FP4>(wg, wg8, xb, d);
}
template <>
__device__ __forceinline__ void mma_chunk<FMT_FP4P>(const uint4& wg, const uint4& wg8, const uint4* xb, float (&d)[4]) {
  mma_chunk_fp4<FMT_FP4P>(wg, wg8, xb, d);
}
template <>
__device__ __forceinline__ void mma_chunk<FMT_FP4T>(const uint4& wg, const uint4& wg8, const uint4* xb, float (&d)[4]) {
  mma_chunk_fp4<FMT_FP4T>(wg, wg8, xb, d);
}

// d += chunk w of a round: the lane's 16-byte chunks of rows g / g+8 (wg / wg8) times its B values at
// src (lanes that carry B; the others feed zeros).
template <int FMT>
__device__ __forceinline__ void mma_round_chunk(const uint4& wg, const uint4& wg8, const uint4* src, int w, bool has_b,
                                                float (&d)[4]) {
  constexpr int NB = fmt_fp8(FMT) ? 2 : 4;  // uint4 of B per chunk
  uint4 xb[NB];
#pragma unroll
  for (int j = 0; j < NB; ++j) xb[j] = has_b ? src[w * NB + j] : make_uint4(0u, 0u, 0u, 0u);
  mma_chunk<FMT>(wg, wg8, xb, d);
}

// mma_round_chunk with B at a 32-bit shared-memory address (MmaStream): sa = the lane's B values for the
// round (or the zero block). With the generic pointer, the routed gate+up's SASS rebuilt the shared window's
// address on every round (S2R SR_CgaCtaId, MOV, VIADD, LEA, ...: about 10 instructions); the 32-bit address
// costs an AND and a multiply-add (experiments/decode_session33_h200.md).
__device__ __forceinline__ uint4 lds128(uint32_t a) {
  uint4 r;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(a));
  return r;
}
template <int FMT>
__device__ __forceinline__ void mma_round_chunk_sa(const uint4& wg, const uint4& wg8, uint32_t sa, int w,
                                                   float (&d)[4]) {
  constexpr int NB = fmt_fp8(FMT) ? 2 : 4;  // uint4 of B per chunk
  uint4 xb[NB];
#pragma unroll
  for (int j = 0; j < NB; ++j) xb[j] = lds128(sa + 16u * (w * NB + j));
  mma_chunk<FMT>(wg, wg8, xb, d);
}

// 8 bf16 activations (16 bytes) -> bf16 x 2^64 (exact: a power-of-two scaling of a bf16 value), permuted
// for mma_chunk.
template <int FMT>
__device__ __forceinline__ uint4 mma_stage_vec(const uint4& in4) {
  const uint32_t in[4] = {in4.x, in4.y, in4.z, in4.w};
  uint32_t v[8];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    v[2 * q] = __float_as_uint(__uint_as_float(in[q] << 16) * MMA_XS) >> 16;
    v[2 * q + 1] = __float_as_uint(__uint_as_float(in[q] & 0xffff0000u) * MMA_XS) >> 16;
  }
  if (fmt_fp8(FMT))  // [0 2 1 3 | 4 6 5 7]
    return make_uint4(v[0] | v[2] << 16, v[1] | v[3] << 16, v[4] | v[6] << 16, v[5] | v[7] << 16);
  return make_uint4(v[0] | v[4] << 16, v[1] | v[5] << 16, v[2] | v[6] << 16, v[3] | v[7] << 16);  // [0 4 1 5 2 6 3 7]
}

// Rows 0 .. nrows-1 of bf16 activations (row(r): 16-byte aligned, K % 8 == 0) -> bf16 x 2^64, permuted
// for mma_chunk, into shared memory rows of K. A thread issues up to 4 16-byte loads before it
// converts and stores any (the staging sits between a kernel's PDL wait and its first MMA). CG: loads
// through L2 only (ld.global.cg), for rows other blocks of the same launch wrote (moe_ffn.cu).
// AQ (numerics=qat, K % 128 == 0, blockDim % 32 == 0): the values staged are act_quant_sim(x, 128)'s (act_quant.cuh),
// the launch that would otherwise run before the kernel. Two passes over the same vectors: the loads as without AQ
// (4 in flight per thread) store the raw vectors, then each thread simulates its own vectors from shared memory (its
// own stores: no barrier) and stores them permuted. Vector i sits in thread i mod blockDim in both passes, so a
// 128-value block is 16 consecutive lanes of one warp; the second loop's bound is the warp's, so every lane takes part
// in the shuffles. (Before session 71 the AQ form loaded one vector at a time, simulating it before the next load:
// one dependent L2 round trip per vector a thread stages, 6 of them in the MoE down at V4's shapes; 4 loads held
// across the simulation spilled.)
template <int FMT, bool CG = false, bool AQ = false, typename RowFn>
__device__ __forceinline__ void stage_mma_rows(__nv_bfloat16* dst, RowFn row, int nrows, int K) {
  const int per = K / 8, total = nrows * per;
  for (int i0 = threadIdx.x; i0 < total; i0 += 4 * blockDim.x) {
    uint4 in4[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = i0 + j * blockDim.x, r = i / per;
      if (i < total) {
        const uint4* p = reinterpret_cast<const uint4*>(row(r) + (long)(i - r * per) * 8);
        in4[j] = CG ? __ldcg(p) : *p;
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = i0 + j * blockDim.x;
      if (i < total) *reinterpret_cast<uint4*>(dst + (long)i * 8) = AQ ? in4[j] : mma_stage_vec<FMT>(in4[j]);
    }
  }
  if constexpr (AQ) {
    const int lane = threadIdx.x & 31;
#pragma unroll 1
    for (int i = threadIdx.x; i - lane < total; i += blockDim.x) {
      uint4* d = reinterpret_cast<uint4*>(dst + (long)i * 8);
      const uint4 v = act_quant_vec<128>(i < total ? *d : make_uint4(0u, 0u, 0u, 0u));
      if (i < total) *d = mma_stage_vec<FMT>(v);
    }
  }
}

// The end of a staging by bulk copies (bulk_stage.cuh) that complete on bar: thread 0 waits for them, the block
// synchronises, then the nvec raw bf16 vectors from dst are converted in place as stage_mma_rows converts them, each
// thread its own (the caller's barrier follows). Every thread of the block calls it.
template <int FMT>
__device__ __forceinline__ void stage_mma_bulk_landed(uint64_t* bar, __nv_bfloat16* dst, int nvec) {
  if (threadIdx.x == 0) bulk_wait(bar);
  __syncthreads();
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    uint4* p = reinterpret_cast<uint4*>(dst) + i;
    *p = mma_stage_vec<FMT>(*p);
  }
}

// One 16-row tile of a product, as one segment sees it: the weight matrix (rows of rowb bytes), its
// scales, the staged activations the segment multiplies, the tile's first row and the matrix's rows
// (rows >= nrows are clamped on load and dropped by the caller's epilogue).
struct MmaTile {
  const uint8_t* W;
  const uint8_t* S;
  const __nv_bfloat16* xs;
  int row0, nrows;
};

constexpr int MMA_STREAM_WARPS = 8;  // warps per block of every kernel that uses MmaStream
constexpr int MMA_STREAM_THREADS = 32 * MMA_STREAM_WARPS;
constexpr int MMA_STREAM_MAX_TILES = 32;  // 16-row tiles per block (shared memory for the partial sums)

// Floats of the partial sums of nt tiles (MmaStream::run's `part`) for blocks of nw warps.
__host__ __device__ constexpr int mma_part_floats(int nt, int nw = MMA_STREAM_WARPS) { return nt * nw * 16; }

// 16 zero uint4 in shared memory (one array per kernel): the B values of the lanes that carry none in
// MmaStream. Those lanes then issue the same LDS as the others; a predicated load instead needs its 4-16
// registers zeroed (CS2R) before it on every round (the routed top-6 pair 0.8 us faster on an H200,
// experiments/decode_session22_h200.md). MmaStream's constructor writes the zeros; every kernel has a barrier
// between constructing its stream and running it.
__device__ __forceinline__ uint4* mma_zero_b() {
  __shared__ uint4 z[16];
  return z;
}

// A block's share of a batch-1 product, streamed: local tiles 0 .. nt-1, each the sum of nseg
// segments of nr rounds. A round covers 4 W chunks of each of the tile's 16 rows: lane (g, t) reads W
// consecutive 16-B chunks (4 W r + W t + w, w < W) of rows g and g + 8, so every row is read in runs of
// 64 W contiguous bytes. The run length is what DRAM cares about: read-only kernels with this pattern
// moved 1.9 TB/s at W = 1 and 2.9 TB/s at W = 2 on an H200 where row-contiguous reads moved 3.7
// (scripts/probe_phases.cu, top-6 gate+up shape). MMA w of a round takes chunk w of every lane.
// The block's (tile, segment, round) sequence is cut into one contiguous range per warp; a warp keeps
// U rounds of weight loads in flight across tile and segment boundaries (no drain between tiles), and
// on leaving a tile writes its partial sums (x POST) to part[(tile * MMA_STREAM_WARPS + warp) * 16 + row];
// part must be zeroed before run() and the block synchronised after it; the caller's epilogue adds the
// warps of a tile in a fixed order. tile(tl, s) -> MmaTile for local tile tl, segment s; every
// MmaTile::xs lies in [xbase, xbase + 2^17).
// Scales: FP4, per row and chunk: C column n of MMA w = lane n's chunk, scaled before accumulation.
// FP8, per 128 x 128 block: a round of W <= 2 lies in one block (B column 0, all lanes); at W = 4 lanes
// t = 0, 1 lie in block 2r and t = 2, 3 in block 2r + 1, so B column 0 carries the first pair's
// activations and column 1 the second's, and C columns 0 / 1 are scaled by the two blocks.
// Per-round bookkeeping is kept to a few instructions (row and scale pointers are recomputed only when
// the segment changes; a slot's activation offset, tile and last-round flag share one register).
// FMT_FP4T / FMT_FP8T (tiled): a tile's rows lie where they lie in the row-major layout (16 rows x rowb bytes from
// row0 * rowb), but inside it the 16-B chunk of (round r, chunk w, row half h, lane) sits at
// ((r W + w) 2 + h) 512 + lane 16: each load of a warp reads 512 contiguous bytes (W must be FP4T_W).
// NW: the block's warps (MMA_STREAM_WARPS, or a kernel of its own size: the rounds are cut over NW warps and part holds
// NW partials per tile).
template <int FMT, int U, int W, typename TileFn, int NW = MMA_STREAM_WARPS>
struct MmaStream {
  static constexpr int SC = fmt_fp4(FMT) ? W : 1;  // scale registers per slot
  static constexpr bool TILED = fmt_tiled(FMT);
  static_assert(!TILED || W == FP4T_W, "FMT_FP4T / FMT_FP8T are laid out for run width FP4T_W");
  TileFn tile;
  const __nv_bfloat16* xbase;
  int nseg, nr, s_ld, n;  // n = rounds of this warp
  long rowb;
  int lt, ls, lr, left;   // load cursor, rounds still to load
  const uint8_t *pa, *pb, *psa, *psb;  // the load segment's rows g, g+8 (at the lane's chunks), scales
  int xoff;               // the load segment's activations (+ the lane's chunks) - xbase, in elements
  uint4 wa[U][W], wb[U][W];
  uint32_t sc[U][SC];
  uint32_t meta[U];       // activation offset | tile << 17 | last round of the tile for this warp << 31

  __device__ __forceinline__ MmaStream(TileFn f, const __nv_bfloat16* xb, int nt, int nseg_, int nr_, long rowb_,
                                       int s_ld_)
      : tile(f), xbase(xb), nseg(nseg_), nr(nr_), s_ld(s_ld_), rowb(rowb_) {
    const int warp = threadIdx.x >> 5;
    const long total = (long)nt * nseg * nr;
    const long beg = total * warp / NW;
    n = left = (int)(total * (warp + 1) / NW - beg);
    lr = (int)(beg % nr);
    const long ts = beg / nr;
    // nseg 0 (a down launch of parallel.experts=ep on a rank none of whose experts the token chose): no rounds, so
    // the cursor is never read, but a remainder by zero would be undefined
    const int nsg = nseg > 0 ? nseg : 1;
    ls = (int)(ts % nsg);
    lt = (int)(ts / nsg);
    if (n > 0) seek();
    if (threadIdx.x < 16) mma_zero_b()[threadIdx.x] = make_uint4(0u, 0u, 0u, 0u);
  }

  __device__ __forceinline__ void seek() {  // pointers of segment (lt, ls)
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const MmaTile p = tile(lt, ls);
    const int ra = min(p.row0 + g, p.nrows - 1), rb8 = min(p.row0 + g + 8, p.nrows - 1);
    if (TILED) {  // whole tiles (rows % 16 == 0: the launchers check)
      pa = p.W + (long)p.row0 * rowb + lane * 16;
      pb = pa + 512;
    } else {
      pa = p.W + (long)ra * rowb + t * W * 16;
      pb = p.W + (long)rb8 * rowb + t * W * 16;
    }
    if (fmt_fp8(FMT)) {
      psa = psb = p.S + (long)(p.row0 >> 7) * s_ld;
    } else {  // lane t needs columns 2(t&1), 2(t&1)+1: chunks 4 W r + 2 (t&1) W + [0, 2 W) of both rows
      psa = p.S + (long)ra * s_ld + 2 * (t & 1) * W;
      psb = p.S + (long)rb8 * s_ld + 2 * (t & 1) * W;
    }
    xoff = (int)(p.xs - xbase) + t * W * Mma<FMT>::VALS;
  }

  // 2W scale bytes of a row from p (4-byte aligned for W >= 2, 2-byte for W = 1) into sc words
  __device__ __forceinline__ void fp4_scales(const uint8_t* p, uint32_t* dst) const {
    if (W == 1) {
      dst[0] = __ldg(reinterpret_cast<const unsigned short*>(p));
    } else {
#pragma unroll
      for (int i = 0; i < W / 2; ++i) dst[i] = __ldg(reinterpret_cast<const unsigned*>(p) + i);
    }
  }

  __device__ __forceinline__ void load(int k) {
#pragma unroll
    for (int w = 0; w < W; ++w) {
      if (TILED) {
        wa[k][w] = ld_stream16(pa + (long)(lr * W + w) * 1024);
        wb[k][w] = ld_stream16(pb + (long)(lr * W + w) * 1024);
      } else {
        wa[k][w] = ld_stream16(pa + lr * 64 * W + 16 * w);
        wb[k][w] = ld_stream16(pb + lr * 64 * W + 16 * w);
      }
    }
    if (fmt_fp8(FMT)) {
      if (W == 4) sc[k][0] = __ldg(psa + 2 * lr) | (uint32_t)__ldg(psa + 2 * lr + 1) << 8;
      else sc[k][0] = __ldg(psa + ((W * lr) >> 1));
    } else if (W == 1) {  // row g in the low half, row g+8 in the high half
      uint32_t lo, hi;
      fp4_scales(psa + 4 * lr, &lo);
      fp4_scales(psb + 4 * lr, &hi);
      sc[k][0] = lo | hi << 16;
    } else {  // W/2 words of row g, then W/2 of row g+8
      // a 64-bit multiply-add (FMA pipe) per address, as for the weights, not a sign extension and two adds
      fp4_scales(psa + (long)lr * (4 * W), &sc[k][0]);
      fp4_scales(psb + (long)lr * (4 * W), &sc[k][W / 2]);
    }
    const bool seg_end = lr + 1 == nr, tile_end = seg_end && ls + 1 == nseg;
    meta[k] = (uint32_t)(xoff + lr * 4 * W * Mma<FMT>::VALS) | (uint32_t)lt << 17 |
              (uint32_t)(tile_end || left == 1) << 31;
    --left;
    if (seg_end) {
      lr = 0;
      if (++ls == nseg) {
        ls = 0;
        ++lt;
      }
      if (left > 0) seek();
    } else {
      ++lr;
    }
  }

  // the first loads: may run before the activations are staged (weights are constant). upto < U: only the
  // first upto rounds (before a PDL wait); prefetch_rest(upto) after it loads the others, in the same order.
  __device__ __forceinline__ void prefetch(int upto = U) {
#pragma unroll
    for (int k = 0; k < U; ++k)
      if (k < upto && left > 0) load(k);
  }
  __device__ __forceinline__ void prefetch_rest(int from) {
#pragma unroll
    for (int k = 0; k < U; ++k)
      if (k >= from && left > 0) load(k);
  }

  // FP4 scale of (row half hr: 0 = g, 1 = g+8, column j of the lane's pair, chunk w)
  __device__ __forceinline__ float fp4_scale(int k, int hr, int j, int w) const {
    if (W == 1) return e8m0_mma_scale(sc[k][0], 2 * hr + j);
    const int byte = j * W + w;  // of the row's 2W bytes
    return e8m0_mma_scale(sc[k][hr * (W / 2) + (byte >> 2)], byte & 3);
  }

  __device__ __forceinline__ void run(float* part) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const bool lane_b = fmt_fp4(FMT) ? g == t : (W == 4 ? g == (t >> 1) : g == 0);  // lanes that carry B
    const uint4* zb = mma_zero_b();
    // the lane's B base in shared memory: the staged activations (offset from meta) or the zero block
    const uint32_t bsel = (uint32_t)__cvta_generic_to_shared(lane_b ? reinterpret_cast<const void*>(xbase) : zb);
    const uint32_t bmask = lane_b ? 0x1ffffu : 0u;
    float acc0 = 0.f, acc1 = 0.f;
    for (int i0 = 0; i0 < n; i0 += U) {
#pragma unroll
      for (int k = 0; k < U; ++k) {
        if (i0 + k < n) {
          const uint32_t m = meta[k];
          const uint32_t sa = bsel + ((m & bmask) << 1);
          if (fmt_fp8(FMT)) {  // one accumulator over the W MMAs, then the block scale(s)
            float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int w = 0; w < W; ++w) mma_round_chunk_sa<FMT>(wa[k][w], wb[k][w], sa, w, d);
            const float f0 = e8m0_byte_to_f32(sc[k][0], 0);
            acc0 = fmaf(d[0], f0, acc0);
            acc1 = fmaf(d[2], f0, acc1);
            if (W == 4) {
              const float f1 = e8m0_byte_to_f32(sc[k][0], 1);
              acc0 = fmaf(d[1], f1, acc0);
              acc1 = fmaf(d[3], f1, acc1);
            }
          } else {
#pragma unroll
            for (int w = 0; w < W; ++w) {
              float d[4] = {0.f, 0.f, 0.f, 0.f};
              mma_round_chunk_sa<FMT>(wa[k][w], wb[k][w], sa, w, d);
              acc0 = fmaf(d[0], fp4_scale(k, 0, 0, w), acc0);
              acc0 = fmaf(d[1], fp4_scale(k, 0, 1, w), acc0);
              acc1 = fmaf(d[2], fp4_scale(k, 1, 0, w), acc1);
              acc1 = fmaf(d[3], fp4_scale(k, 1, 1, w), acc1);
            }
          }
          if (m >> 31) {  // the warp leaves the tile: flush (warp-uniform)
            // C columns live in lanes t = 0 (0, 1) and t = 1 (2, 3); other lanes hold zeros. Rows sum
            // over the lane pair (t = 0, 1).
            acc0 += __shfl_xor_sync(0xffffffffu, acc0, 1);
            acc1 += __shfl_xor_sync(0xffffffffu, acc1, 1);
            if (t == 0) {
              float* dst = part + (((m >> 17) & 0x3ffu) * NW + warp) * 16;
              dst[g] = acc0 * Mma<FMT>::POST;
              dst[g + 8] = acc1 * Mma<FMT>::POST;
            }
            acc0 = acc1 = 0.f;
          }
          if (left > 0) load(k);
        }
      }
    }
  }
};

// ---- the same work through shared memory (U == 0 in the kernels' template: DS4_MMA_LOAD=smem) ----------
// Why: MmaStream's lanes load their fragments straight from global memory, so a warp's requests are
// 16 rows x 128 B runs (W = 2) and the bytes in flight live in registers (~120 per thread, 2 blocks per
// SM). A read-only kernel with that pattern moves 2.9-3.1 TB/s on an H200 where row-contiguous reads
// move 3.7-3.8 (scripts/probe_phases.cu), and ncu shows the kernels latency-bound (issue slots 27-39 %
// busy). Here the block copies each stage — 16 rows x 8 rounds of a (tile, segment), with its scales —
// row-contiguously into shared memory with cp.async (sm_80+; nothing in flight holds a register),
// MMA_SMEM_STAGES stages in flight; each warp then takes one round of the stage (its fragments from
// shared memory, the same MMAs and scale order as MmaStream). Warps meet at a barrier per stage.
// Stage buffer: 16 rows of 8 rounds (512 W bytes) + a pad that spreads a phase's 8 lanes over the
// banks, then the scales (FP4: 16 rows x 32 W bytes, 4-byte copies — K % 128 == 0 keeps them aligned;
// FP8: the 4-byte words around the stage's <= 4 W bytes of the tile's scale row, and their offset).
// W = 1 or 2 (mma_smem_width).
constexpr int MMA_SMEM_STAGES = 4;
constexpr int MMA_SMEM_ROUNDS = MMA_STREAM_WARPS;  // rounds per stage: one per warp

template <int W> __host__ __device__ constexpr int mma_smem_row_bytes() { return 512 * W + (W == 1 ? 64 : 16); }
template <int FMT, int W> __host__ __device__ constexpr int mma_smem_scale_bytes() {
  return fmt_fp4(FMT) ? 16 * 32 * W : 32;
}
template <int FMT, int W> __host__ __device__ constexpr int mma_smem_stage_bytes() {
  return 16 * mma_smem_row_bytes<W>() + mma_smem_scale_bytes<FMT, W>();
}
// Host: the dynamic shared memory a kernel adds for the stream (U == 0; plus 16 for alignment).
template <int FMT, int U, int W> __host__ __device__ constexpr long mma_stream_smem() {
  return U == 0 ? (long)MMA_SMEM_STAGES * mma_smem_stage_bytes<FMT, W>() + 16 : 0;
}

template <int FMT, int W, typename TileFn>
struct MmaSmemStream {
  static_assert(W == 1 || W == 2, "the shared-memory stream reads runs of 1 or 2 chunks per lane");
  static_assert(!fmt_tiled(FMT), "the shared-memory stream reads row-major rows (with_tiled_shape never asks it)");
  static constexpr int RB = mma_smem_row_bytes<W>(), SB = mma_smem_stage_bytes<FMT, W>();
  TileFn tile;   // (local tile, segment) -> MmaTile; its xs are the activations the segment multiplies
  uint8_t* buf;  // MMA_SMEM_STAGES stage buffers (16-byte aligned)
  int nseg, nr, s_ld, cps, ns;  // cps: stages per (tile, segment); ns: the block's stages
  long rowb;

  __device__ __forceinline__ MmaSmemStream(TileFn f, int nt, int nseg_, int nr_, long rowb_, int s_ld_, uint8_t* buf_)
      : tile(f), buf(buf_), nseg(nseg_), nr(nr_), s_ld(s_ld_), rowb(rowb_) {
    cps = (nr + MMA_SMEM_ROUNDS - 1) / MMA_SMEM_ROUNDS;
    ns = nt * nseg * cps;
  }

  // stage i -> local tile, segment, first round, rounds
  __device__ __forceinline__ void where(int i, int& tl, int& sg, int& r0, int& nrs) const {
    const int c = i % cps, u = i / cps;
    sg = u % nseg;
    tl = u / nseg;
    r0 = c * MMA_SMEM_ROUNDS;
    nrs = min(MMA_SMEM_ROUNDS, nr - r0);
  }

  // every thread's share of stage i's copies into its buffer (no commit)
  __device__ __forceinline__ void issue(int i) {
    int tl, sg, r0, nrs;
    where(i, tl, sg, r0, nrs);
    const MmaTile p = tile(tl, sg);
    uint8_t* b = buf + (i % MMA_SMEM_STAGES) * SB;
    const int per_row = nrs * 4 * W;  // 16-byte chunks of a row in this stage
    for (int q = threadIdx.x; q < 16 * per_row; q += blockDim.x) {
      const int r = q / per_row, c = q - r * per_row;
      const long row = min(p.row0 + r, p.nrows - 1);
      cp_async16(b + r * RB + c * 16, p.W + row * rowb + (long)r0 * 64 * W + c * 16);
    }
    uint8_t* sb = b + 16 * RB;
    if (fmt_fp4(FMT)) {  // per row: the scale bytes of chunks 4 W r0 .. 4 W (r0 + nrs), 4-byte aligned
      const int words = nrs * W;  // 4 W bytes per round
      for (int q = threadIdx.x; q < 16 * words; q += blockDim.x) {
        const int r = q / words, c = q - r * words;
        const long row = min(p.row0 + r, p.nrows - 1);
        cp_async4(sb + r * 32 * W + c * 4, p.S + row * s_ld + (long)r0 * 4 * W + c * 4);
      }
    } else {  // FP8: bytes (W r) >> 1 of the tile's scale row for the stage's rounds
      const uint8_t* srow = p.S + (long)(p.row0 >> 7) * s_ld;
      const uintptr_t lo = reinterpret_cast<uintptr_t>(srow + ((W * r0) >> 1));
      const uintptr_t hi = reinterpret_cast<uintptr_t>(srow + ((W * (r0 + nrs - 1)) >> 1)) + 1;
      const uintptr_t a0 = lo & ~uintptr_t(3);
      const int nw = (int)((hi - a0 + 3) >> 2);  // <= 3 words (the scale tensor's allocation covers them)
      if (threadIdx.x < nw) cp_async4(sb + 4 + 4 * threadIdx.x, reinterpret_cast<const void*>(a0 + 4 * threadIdx.x));
      if (threadIdx.x == 0) *reinterpret_cast<int*>(sb) = (int)(lo - a0);
    }
  }

  // the first MMA_SMEM_STAGES - 1 stages (weights only: may run before the PDL wait); upto / prefetch_rest as
  // MmaStream's, per stage (one commit group each, in order either way)
  __device__ __forceinline__ void prefetch(int upto = MMA_SMEM_STAGES - 1) {
#pragma unroll
    for (int i = 0; i < MMA_SMEM_STAGES - 1; ++i) {
      if (i >= upto) break;
      if (i < ns) issue(i);
      cp_async_commit();
    }
  }
  __device__ __forceinline__ void prefetch_rest(int from) {
#pragma unroll
    for (int i = 0; i < MMA_SMEM_STAGES - 1; ++i) {
      if (i < from) continue;
      if (i < ns) issue(i);
      cp_async_commit();
    }
  }

  __device__ __forceinline__ void run(float* part) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const bool has_b = fmt_fp4(FMT) ? g == t : g == 0;
    float acc0 = 0.f, acc1 = 0.f;
    for (int i = 0; i < ns; ++i) {
      cp_async_wait<MMA_SMEM_STAGES - 2>();  // this thread's copies of stage i have landed
      __syncthreads();                          // everyone's, and stage i - 1's buffer is free again
      if (i + MMA_SMEM_STAGES - 1 < ns) issue(i + MMA_SMEM_STAGES - 1);
      cp_async_commit();
      int tl, sg, r0, nrs;
      where(i, tl, sg, r0, nrs);
      const uint8_t* b = buf + (i % MMA_SMEM_STAGES) * SB;
      const uint8_t* sb = b + 16 * RB;
      if (warp < nrs) {
        const int rr = r0 + warp;  // this warp's round
        const MmaTile p = tile(tl, sg);
        const uint4* src = reinterpret_cast<const uint4*>(p.xs + (long)rr * 4 * W * Mma<FMT>::VALS +
                                                          t * W * Mma<FMT>::VALS);
        const uint8_t* ra = b + g * RB + warp * 64 * W + t * 16 * W;
        const uint8_t* rb8 = ra + 8 * RB;
        if (fmt_fp8(FMT)) {
          float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int w = 0; w < W; ++w)
            mma_round_chunk<FMT>(*reinterpret_cast<const uint4*>(ra + 16 * w),
                                 *reinterpret_cast<const uint4*>(rb8 + 16 * w), src, w, has_b, d);
          const int off = *reinterpret_cast<const int*>(sb);
          const float f0 = e8m0_to_f32(sb[4 + off + ((W * rr) >> 1) - ((W * r0) >> 1)]);
          acc0 = fmaf(d[0], f0, acc0);
          acc1 = fmaf(d[2], f0, acc1);
        } else {
          // scale bytes of rows g / g + 8 for this round: 4 W per row, lane t's pair from 2 (t & 1) W
          const uint8_t* sa = sb + g * 32 * W + warp * 4 * W + 2 * (t & 1) * W;
          const uint8_t* s8 = sa + 8 * 32 * W;
#pragma unroll
          for (int w = 0; w < W; ++w) {
            float d[4] = {0.f, 0.f, 0.f, 0.f};
            mma_round_chunk<FMT>(*reinterpret_cast<const uint4*>(ra + 16 * w),
                                 *reinterpret_cast<const uint4*>(rb8 + 16 * w), src, w, has_b, d);
            acc0 = fmaf(d[0], e8m0_to_f32(sa[w]), acc0);
            acc0 = fmaf(d[1], e8m0_to_f32(sa[W + w]), acc0);
            acc1 = fmaf(d[2], e8m0_to_f32(s8[w]), acc1);
            acc1 = fmaf(d[3], e8m0_to_f32(s8[W + w]), acc1);
          }
        }
      }
      const bool tile_end = i + 1 == ns || (i + 1) / (cps * nseg) != tl;
      if (tile_end) {  // block-uniform: every warp writes its partial sums of the tile
        acc0 += __shfl_xor_sync(0xffffffffu, acc0, 1);
        acc1 += __shfl_xor_sync(0xffffffffu, acc1, 1);
        if (t == 0) {
          float* dst = part + (tl * MMA_STREAM_WARPS + warp) * 16;
          dst[g] = acc0 * Mma<FMT>::POST;
          dst[g + 8] = acc1 * Mma<FMT>::POST;
        }
        acc0 = acc1 = 0.f;
      }
    }
    cp_async_wait<0>();
  }
};

// The kernels' stream: U > 0 rounds in flight per warp in registers (MmaStream), U == 0 the
// shared-memory stages (MmaSmemStream; sbuf: mma_stream_smem bytes of dynamic shared memory). NW: the block's
// warps (the register stream only).
template <int FMT, int U, int W, int NW = MMA_STREAM_WARPS, typename TileFn>
__device__ __forceinline__ auto mma_stream(TileFn f, const __nv_bfloat16* xbase, int nt, int nseg, int nr, long rowb,
                                           int s_ld, uint8_t* sbuf) {
  if constexpr (U == 0) {
    static_assert(NW == MMA_STREAM_WARPS, "the shared-memory stream is laid out for MMA_STREAM_WARPS warps");
    uint8_t* b = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(sbuf) + 15) & ~uintptr_t(15));
    return MmaSmemStream<FMT, W, TileFn>(f, nt, nseg, nr, rowb, s_ld, b);
  } else {
    return MmaStream<FMT, U, W, TileFn, NW>(f, xbase, nt, nseg, nr, rowb, s_ld);
  }
}

// Values of a row one round covers (W chunks per lane, 4 lanes per row).
template <int FMT, int W> __host__ __device__ constexpr int mma_round_vals() { return 4 * W * Mma<FMT>::VALS; }

// Zeroes the partial sums of nt tiles (before the block's first barrier; blocks of nw warps).
__device__ __forceinline__ void mma_part_zero(float* part, int nt, int nw = MMA_STREAM_WARPS) {
  for (int i = threadIdx.x; i < mma_part_floats(nt, nw); i += blockDim.x) part[i] = 0.f;
}

// Row r of local tile tl: the NW warps' partial sums added in a fixed order (deterministic).
template <int NW = MMA_STREAM_WARPS>
__device__ __forceinline__ float mma_part_sum(const float* part, int tl, int r) {
  float y = 0.f;
#pragma unroll
  for (int w = 0; w < NW; ++w) y += part[(tl * NW + w) * 16 + r];
  return y;
}

// Whether the MMA path takes a 1-token product of a K-wide row (FP8 / FP4 only).
__host__ __device__ inline bool mma_shape_ok(int fmt, int K) {
  if (fmt == FMT_FP8) return K % (4 * 16) == 0;
  if (fmt == FMT_FP8T) return K % (4 * 16 * FP4T_W) == 0;  // whole rounds at the laid-out run width
  if (fmt_fp4(fmt)) return K % (4 * 32) == 0;
  return false;
}

// Chunks per lane per round for a K-wide row: the largest of 4, 2, 1 that is <= `most` and divides the
// row into whole rounds (values per chunk: 16 FP8, 32 FP4).
inline int mma_width(int fmt, int K, int most) {
  const int vals = fmt_fp8(fmt) ? 16 : 32;
  for (int w = 4; w > 1; w /= 2)
    if (w <= most && K % (4 * w * vals) == 0) return w;
  return 1;
}

// Host: tiles per block when T tiles are split evenly over one resident wave of `wave` blocks.
inline int mma_tiles_per_block(int T, int wave) {
  const int tpb = (T + wave - 1) / wave;
  return tpb < MMA_STREAM_MAX_TILES ? tpb : MMA_STREAM_MAX_TILES;
}

// Chunks per lane and row in flight (U rounds x W chunks), the "depth", and the kernels' occupancy
// floor: depth 8 asks for 2 blocks of 8 warps per SM (<= 128 registers per thread; ~120 without the
// bound), depth 4 / 2 for 3 / 4 blocks (<= 85 / 64 registers), trading bytes in flight per warp for
// more warps to hide the decode's instruction latency (ncu, H200: the depth-8 kernels issue on 27-39 % of
// cycles with 4 warps per scheduler, neither DRAM- nor ALU-bound).
template <int U, int W> __host__ __device__ constexpr int mma_min_blocks() {
  return U == 0 ? 2 : U * W >= 8 ? 2 : U * W >= 4 ? 3 : 4;  // U == 0: the shared-memory stream
}

// Host: f(std::integral_constant<int, W>{}, std::integral_constant<int, U>{}) for a run width w from
// mma_width and a depth (chunks per lane and row in flight: 8, 4 or 2; U = max(1, depth / w)); depth 0:
// the shared-memory stream (U = 0, W at most 2).
template <typename F>
inline cudaError_t with_mma_shape(int w, int depth, F f) {
  using std::integral_constant;
  if (depth == 0) {
    if (w == 1) return f(integral_constant<int, 1>{}, integral_constant<int, 0>{});
    return f(integral_constant<int, 2>{}, integral_constant<int, 0>{});
  }
  if (w == 4) {
    if (depth >= 8) return f(integral_constant<int, 4>{}, integral_constant<int, 2>{});
    return f(integral_constant<int, 4>{}, integral_constant<int, 1>{});
  }
  if (w == 2) {
    if (depth >= 8) return f(integral_constant<int, 2>{}, integral_constant<int, 4>{});
    if (depth >= 4) return f(integral_constant<int, 2>{}, integral_constant<int, 2>{});
    return f(integral_constant<int, 2>{}, integral_constant<int, 1>{});
  }
  if (depth >= 8) return f(integral_constant<int, 1>{}, integral_constant<int, 8>{});
  if (depth >= 4) return f(integral_constant<int, 1>{}, integral_constant<int, 4>{});
  return f(integral_constant<int, 1>{}, integral_constant<int, 2>{});
}

// Host: with_mma_shape's call for the tiled layouts (FMT_FP4T / FMT_FP8T): their run width FP4T_W and the register
// stream at depth 8, 4 or 2 (the shared-memory stream reads rows contiguously, so a depth-0 request takes 2).
template <typename F>
inline cudaError_t with_tiled_shape(int depth, F f) {
  using std::integral_constant;
  using CW = integral_constant<int, FP4T_W>;
  if (depth >= 8) return f(CW{}, integral_constant<int, 8 / FP4T_W>{});
  if (depth >= 4) return f(CW{}, integral_constant<int, 4 / FP4T_W>{});
  return f(CW{}, integral_constant<int, 2 / FP4T_W>{});
}

}  // namespace ds4
