// The hc fold (the default; DS4_HC_FOLD=0 turns it off, ds4.ops.hc_cuda): the next mHC site's first
// launch (hc_partials with its POST form, ds4_attn hc.cu) done by the epilogue of the one-token
// tensor-core kernel that produces the block's output y (wo_b's GEMV, the MoE down kernel), so that site
// is 1 launch, not 2 (H200: 127.6 against 130.7 us per layer, experiments/decode_session14_h200.md).
//
// For its 16-row tiles a block forms, like hc.cu's hc_post_elem, the new streams
//   s[j, r] = post[j] * y[r] + sum_i comb[i, j] * res[i, r]     (y as stored: bf16; s rounded to bf16)
// writes them, and the tile's partials of the next site's matvec: part[m, tile] = sum over the tile's
// rows and streams of fn[m, j D + r] * s[j, r] (m < mix) and part[mix, tile] = sum of s^2 — the layout
// hc_finish reads (nsplit = D / 16 tiles; hc.cu's own partials split K over ~128 blocks instead).
// fn (a weight) is copied to shared memory before the kernel's PDL wait, res / post / comb right after
// it (cp.async; they land while the weights stream), so the epilogue reads only shared memory.
#pragma once
#include "ds4_launch.h"
#include "mma_dot.cuh"

namespace ds4 {

constexpr int HC_FOLD_LANES = 8;  // lanes per (tile, mix) sum in hc_fold_sums

// Shared-memory floats of a block's fold buffers for up to nt tiles (see HcFoldSmem; the kernels size and
// lay them out for their tiles per block and index them with the block's own tile count).
__host__ __device__ constexpr long hc_fold_smem_floats(int nt, int n, int mix) {
  return (long)nt * 16 * n * mix                  // fn slice
         + ((long)nt * 16 * n + 1) / 2            // res slice (bf16)
         + 16                                     // post, comb (n + n * n <= 20; padded to 16 B blocks below)
         + 16                                     // (pad)
         + (long)nt * 16                          // y of the block's rows, as stored
         + (long)nt * 16 * n                      // the new streams' values, as stored
         + 8;                                     // alignment slack
}

struct HcFoldSmem {
  float* fn;            // [mix * n][nt * 16]: fn[m, j D + t0 * 16 + i] at (m * n + j) * nt * 16 + i
  __nv_bfloat16* res;   // [n][nt * 16]
  float* pc;            // post [n] then comb [n * n]
  float* ys;            // [nt * 16]
  float* sv;            // [nt][n][16]: the new streams' values, as stored
};

__device__ __forceinline__ HcFoldSmem hc_fold_smem(float* base, int nt, int n, int mix) {
  HcFoldSmem s;
  float* p = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(base) + 15) & ~uintptr_t(15));
  s.fn = p;
  p += (long)nt * 16 * n * mix;
  s.res = reinterpret_cast<__nv_bfloat16*>(p);
  p += ((long)nt * 16 * n + 1) / 2;
  p = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 15) & ~uintptr_t(15));
  s.pc = p;
  p += 32;
  s.ys = p;
  p += (long)nt * 16;
  s.sv = p;
  return s;
}

// Before the PDL wait: the fn columns of tiles [t0, t0 + nt) (16-byte copies; D % 16 == 0 keeps every
// run aligned).
__device__ __forceinline__ void hc_fold_load_fn(const HcFold& f, const HcFoldSmem& s, int t0, int nt, int D) {
  const int per = nt * 4;  // 16-byte copies per (m, j) run of nt * 16 floats
  const int total = f.mix * f.n * per;
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int mj = i / per, c = i - mj * per;
    const int m = mj / f.n, j = mj - m * f.n;
    cp_async16(s.fn + (long)mj * nt * 16 + c * 4, f.fn + (long)m * f.n * D + (long)j * D + t0 * 16 + c * 4);
  }
  cp_async_commit();
}

// After the PDL wait: the streams' rows of the block's tiles, post and comb (written by earlier kernels).
__device__ __forceinline__ void hc_fold_load_act(const HcFold& f, const HcFoldSmem& s, int t0, int nt, int D) {
  const int per = nt * 2;  // 16-byte copies (8 bf16) per stream row of nt * 16 values
  for (int i = threadIdx.x; i < f.n * per; i += blockDim.x) {
    const int j = i / per, c = i - j * per;
    cp_async16(s.res + (long)j * nt * 16 + c * 8,
               static_cast<const __nv_bfloat16*>(f.res) + (long)j * D + t0 * 16 + c * 8);
  }
  for (int i = threadIdx.x; i < f.n + f.n * f.n; i += blockDim.x)
    cp_async4(s.pc + i, i < f.n ? f.post + i : f.comb + (i - f.n));
  cp_async_commit();
}

// The epilogue for n streams (MIX = (2 + n) n mixes). First every element (tile tl, stream j, row rr) of the block's
// tiles: its new stream value formed (hc.cu's hc_post_elem), stored, and kept as stored in s.sv[(tl n + j) 16 + rr].
// Then each (tile, mix) sum over its tile's 16 n elements, taken by HC_FOLD_LANES consecutive lanes, 2 n products each,
// and added over the lanes by 3 shuffles in a fixed order (deterministic). Lane `sub` of mix m takes the elements
// 8 c + sub, c = (q + m) mod 2n for q = 0, 1, ...: the 4 mixes of a warp read fn rows at the same bank offset, each at
// its own c (no bank conflict at one tile per block, V4's shapes).
// Why this form (session 78): the one before it reduced each element's MIX + 1 products over lane quads (2 shuffles
// each) and the quads' sums by one thread per (tile, mix), in passes of blockDim elements; at one tile per block
// 2 warps did it all, about 140 shared-memory and shuffle instructions each, and the MoE step probe
// (scripts/probe_moe_step.py) put 1.8 us (median) of the routed down's blocks in it, beside the SM's other block still
// streaming weights. Here 7 warps take the sums, about 19 such instructions each: the probe's 0.96 us (mean), and
// 113.6-113.9 against 115.3 / 115.5 us per layer for the form before (H100, experiments/session78.md).
template <int N>
__device__ __forceinline__ void hc_fold_sums(const HcFold& f, const HcFoldSmem& s, int t0, int nt, int D) {
  constexpr int MIX = (2 + N) * N, ET = 16 * N, Q = ET / HC_FOLD_LANES;
  for (int e = threadIdx.x; e < nt * ET; e += blockDim.x) {
    const int tl = e / ET, j = (e - tl * ET) >> 4, i = tl * 16 + (e & 15);
    float acc = 0.f;
#pragma unroll
    for (int q = 0; q < N; ++q) acc += s.pc[N + q * N + j] * __bfloat162float(s.res[q * nt * 16 + i]);
    const __nv_bfloat16 b = __float2bfloat16(s.pc[j] * s.ys[i] + acc);
    static_cast<__nv_bfloat16*>(f.out)[(long)j * D + t0 * 16 + i] = b;
    s.sv[e] = __bfloat162float(b);
  }
  __syncthreads();
  const int pairs = nt * (MIX + 1), per_round = blockDim.x / HC_FOLD_LANES, sub = threadIdx.x % HC_FOLD_LANES;
  for (int p0 = 0; p0 < pairs; p0 += per_round) {  // (a uniform bound: every lane reaches the shuffles)
    const int p = p0 + (int)threadIdx.x / HC_FOLD_LANES;
    const bool ok = p < pairs;
    const int tl = ok ? p / (MIX + 1) : 0, m = ok ? p - tl * (MIX + 1) : 0;
    const float* v = s.sv + (long)tl * ET;
    float acc = 0.f;
#pragma unroll
    for (int q = 0; q < Q; ++q) {
      const int el = ((q + m) % Q) * HC_FOLD_LANES + sub, j = el >> 4;
      const float w = m < MIX ? s.fn[((long)m * N + j) * nt * 16 + tl * 16 + (el & 15)] : v[el];  // (MIX: s^2)
      acc += ok ? w * v[el] : 0.f;
    }
#pragma unroll
    for (int o = 1; o < HC_FOLD_LANES; o <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (ok && sub == 0) f.part[(long)m * (D / 16) + t0 + tl] = acc;
  }
}

// The epilogue: the caller has stored its rows and put them (as stored) in s.ys, for local tiles
// [0, nt) (global tiles t0 + tl, nsplit = D / 16 of them); every thread of the block calls this (blockDim a multiple
// of 32). It ends without a barrier: nothing after it in a kernel reads the fold's shared memory.
__device__ __forceinline__ void hc_fold_epilogue(const HcFold& f, const HcFoldSmem& s, int t0, int nt, int D) {
  cp_async_wait<0>();
  __syncthreads();  // s.ys, and every thread's copies
  if (f.n == 4) hc_fold_sums<4>(f, s, t0, nt, D);
  else if (f.n == 2) hc_fold_sums<2>(f, s, t0, nt, D);
  else hc_fold_sums<1>(f, s, t0, nt, D);
}

}  // namespace ds4
