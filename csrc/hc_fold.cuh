// The hc fold (opt-in, DS4_HC_FOLD=1; ds4.ops.hc_cuda): the next mHC site's first launch (hc_partials
// with its POST form, ds4_attn hc.cu) done by the epilogue of the one-token tensor-core kernel that
// produces the block's output y (wo_b's GEMV, the MoE down kernel), so that site is 1 launch, not 2.
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

constexpr int HC_FOLD_MAX_N = 4;

// Shared-memory floats of a block's fold buffers for nt tiles (see HcFoldSmem).
__host__ __device__ constexpr long hc_fold_smem_floats(int nt, int n, int mix) {
  return (long)nt * 16 * n * mix                  // fn slice
         + ((long)nt * 16 * n + 1) / 2            // res slice (bf16)
         + 16                                     // post, comb (n + n * n <= 20; padded to 16 B blocks below)
         + 16                                     // (pad)
         + (long)nt * 16                          // y of the block's rows, as stored
         + (long)(MMA_STREAM_THREADS / 16) * (mix + 1)  // one reduction slot per 16-lane subgroup
         + 8;                                     // alignment slack
}

struct HcFoldSmem {
  float* fn;            // [mix * n][nt * 16]: fn[m, j D + t0 * 16 + i] at (m * n + j) * nt * 16 + i
  __nv_bfloat16* res;   // [n][nt * 16]
  float* pc;            // post [n] then comb [n * n]
  float* ys;            // [nt * 16]
  float* red;           // [MMA_STREAM_THREADS / 16][mix + 1]
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
  s.red = p;
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
    cp_async16(s.res + (long)j * nt * 16 + c * 8, static_cast<const __nv_bfloat16*>(f.res) + (long)j * D + t0 * 16 + c * 8);
  }
  for (int i = threadIdx.x; i < f.n + f.n * f.n; i += blockDim.x)
    cp_async4(s.pc + i, i < f.n ? f.post + i : f.comb + (i - f.n));
  cp_async_commit();
}

// The epilogue: the caller has stored its rows and put them (as stored) in s.ys, for local tiles
// [0, nt) (global tiles t0 + tl, nsplit = D / 16 of them); every thread of the block calls this.
__device__ __forceinline__ void hc_fold_epilogue(const HcFold& f, const HcFoldSmem& s, int t0, int nt, int D) {
  cp_async_wait<0>();
  __syncthreads();  // s.ys, and every thread's copies
  const int n = f.n, mix = f.mix, et = 16 * n;   // elements per tile
  const int G = et < 32 ? et : 32;                // lanes of one reduction subgroup (one tile)
  const int nsplit = D / 16, total = nt * et, lane = threadIdx.x & 31;
  for (int e0 = 0; e0 < total; e0 += blockDim.x) {
    const int e = e0 + threadIdx.x;
    const bool ok = e < total;
    const int tl = ok ? e / et : 0, j = ok ? (e - tl * et) >> 4 : 0, rr = e & 15;
    const int i = tl * 16 + rr;  // the block's row
    float v = 0.f;
    if (ok) {
      float acc = 0.f;
#pragma unroll
      for (int q = 0; q < HC_FOLD_MAX_N; ++q)
        if (q < n) acc += s.pc[n + q * n + j] * __bfloat162float(s.res[q * nt * 16 + i]);
      const __nv_bfloat16 b = __float2bfloat16(s.pc[j] * s.ys[i] + acc);
      static_cast<__nv_bfloat16*>(f.out)[(long)j * D + t0 * 16 + i] = b;
      v = __bfloat162float(b);
    }
    // the tile's partials: shuffle over the subgroup's G lanes, one slot per subgroup
    const int sub = threadIdx.x / G;
    for (int m = 0; m <= mix; ++m) {
      float p = m < mix ? s.fn[((long)m * n + j) * nt * 16 + i] * v : v * v;
      if (!ok) p = 0.f;
      for (int o = G >> 1; o; o >>= 1) p += __shfl_xor_sync(0xffffffffu, p, o);
      if ((lane & (G - 1)) == 0) s.red[sub * (mix + 1) + m] = p;
    }
    __syncthreads();
    // one thread per (tile of this pass, m): the tile's subgroups in order (deterministic)
    const int sub_per_tile = et / G, tiles = min(nt - e0 / et, (int)blockDim.x / et);
    for (int k = threadIdx.x; k < tiles * (mix + 1); k += blockDim.x) {
      const int tt = k / (mix + 1), m = k - tt * (mix + 1);
      float acc = 0.f;
      for (int q = 0; q < sub_per_tile; ++q) acc += s.red[(tt * sub_per_tile + q) * (mix + 1) + m];
      f.part[(long)m * nsplit + t0 + e0 / et + tt] = acc;
    }
    __syncthreads();  // s.red is rewritten by the next pass
  }
}

}  // namespace ds4
