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

// Shared-memory floats of a block's fold buffers for up to nt tiles (see HcFoldSmem; the kernels size and
// lay them out for their tiles per block and index them with the block's own tile count) in blocks of `threads`.
__host__ __device__ constexpr long hc_fold_smem_floats(int nt, int n, int mix, int threads = MMA_STREAM_THREADS) {
  return (long)nt * 16 * n * mix                  // fn slice
         + ((long)nt * 16 * n + 1) / 2            // res slice (bf16)
         + 16                                     // post, comb (n + n * n <= 20; padded to 16 B blocks below)
         + 16                                     // (pad)
         + (long)nt * 16                          // y of the block's rows, as stored
         + (long)(threads / 4 + 1) * (mix + 1)    // one reduction slot per lane quad and mix (+1: pad)
         + 8;                                     // alignment slack
}

struct HcFoldSmem {
  float* fn;            // [mix * n][nt * 16]: fn[m, j D + t0 * 16 + i] at (m * n + j) * nt * 16 + i
  __nv_bfloat16* res;   // [n][nt * 16]
  float* pc;            // post [n] then comb [n * n]
  float* ys;            // [nt * 16]
  float* red;           // [mix + 1][quads + 1]: quads = blockDim.x / 4 (hc_fold_smem_floats' threads / 4), one pad column
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
    cp_async16(s.res + (long)j * nt * 16 + c * 8,
               static_cast<const __nv_bfloat16*>(f.res) + (long)j * D + t0 * 16 + c * 8);
  }
  for (int i = threadIdx.x; i < f.n + f.n * f.n; i += blockDim.x)
    cp_async4(s.pc + i, i < f.n ? f.post + i : f.comb + (i - f.n));
  cp_async_commit();
}

// The epilogue for n streams (MIX = (2 + n) n mixes), one pass over up to blockDim elements (thread e of the
// pass: tile e / (16 n), stream (e / 16) % n, row e % 16 — consecutive lanes take consecutive rows of one
// stream of one tile). Each thread forms its element's MIX + 1 products at once (unrolled: independent
// chains), sums them over its lane quad (2 shuffles each), and the quads' sums of a tile are added by one
// thread per (tile, m) from shared memory in a fixed order (deterministic). A first version reduced each
// mix over 16-64 lanes with 5 dependent shuffles in a loop: ~125 dependent shuffles on every block's tail
// (session 14, run 3). The slots of one mix are a row of quads + 1 floats: the threads of one tile read
// the rows of consecutive mixes at the same column, which a stride of quads (a multiple of 32) put in one
// shared-memory bank (25-way conflicts, 16 loads each, on every folding block's tail).
template <int N>
__device__ __forceinline__ void hc_fold_pass(const HcFold& f, const HcFoldSmem& s, int t0, int nt, int D, int e0) {
  constexpr int MIX = (2 + N) * N, ET = 16 * N;  // mixes, elements per tile
  const int total = nt * ET, e = e0 + threadIdx.x, nsplit = D / 16;
  const bool ok = e < total;
  const int tl = ok ? e / ET : 0, j = ok ? (e - tl * ET) >> 4 : 0, rr = e & 15, i = tl * 16 + rr;
  float v = 0.f;
  if (ok) {
    float acc = 0.f;
#pragma unroll
    for (int q = 0; q < N; ++q) acc += s.pc[N + q * N + j] * __bfloat162float(s.res[q * nt * 16 + i]);
    const __nv_bfloat16 b = __float2bfloat16(s.pc[j] * s.ys[i] + acc);
    static_cast<__nv_bfloat16*>(f.out)[(long)j * D + t0 * 16 + i] = b;
    v = __bfloat162float(b);
  }
  const int quads = blockDim.x / 4, rs = quads + 1;  // slots per mix row (padded: see above)
#pragma unroll
  for (int m0 = 0; m0 <= MIX; m0 += 8) {  // 8 mixes at a time: few live registers in the 64-register kernels
    float p[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int m = m0 + k;
      p[k] = m < MIX ? (ok ? s.fn[((long)m * N + j) * nt * 16 + i] * v : 0.f) : v * v;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      p[k] += __shfl_xor_sync(0xffffffffu, p[k], 1);
      p[k] += __shfl_xor_sync(0xffffffffu, p[k], 2);
    }
    if ((threadIdx.x & 3) == 0) {
#pragma unroll
      for (int k = 0; k < 8; ++k)
        if (m0 + k <= MIX) s.red[(m0 + k) * rs + (threadIdx.x >> 2)] = p[k];
    }
  }
  __syncthreads();
  // one thread per (tile of this pass, m): the tile's ET / 4 quads in order
  const int tiles = min(nt - e0 / ET, (int)blockDim.x / ET);
  for (int k = threadIdx.x; k < tiles * (MIX + 1); k += blockDim.x) {
    const int tt = k / (MIX + 1), m = k - tt * (MIX + 1);
    const float* r = s.red + m * rs + tt * (ET / 4);
    float acc = 0.f;
#pragma unroll
    for (int q = 0; q < ET / 4; ++q) acc += r[q];
    f.part[(long)m * nsplit + t0 + e0 / ET + tt] = acc;
  }
  __syncthreads();  // s.red is rewritten by the next pass
}

// The epilogue: the caller has stored its rows and put them (as stored) in s.ys, for local tiles
// [0, nt) (global tiles t0 + tl, nsplit = D / 16 of them); every thread of the block calls this.
__device__ __forceinline__ void hc_fold_epilogue(const HcFold& f, const HcFoldSmem& s, int t0, int nt, int D) {
  cp_async_wait<0>();
  __syncthreads();  // s.ys, and every thread's copies
  const int total = nt * 16 * f.n;
  for (int e0 = 0; e0 < total; e0 += blockDim.x) {
    if (f.n == 4) hc_fold_pass<4>(f, s, t0, nt, D, e0);
    else if (f.n == 2) hc_fold_pass<2>(f, s, t0, nt, D, e0);
    else hc_fold_pass<1>(f, s, t0, nt, D, e0);
  }
}

}  // namespace ds4
