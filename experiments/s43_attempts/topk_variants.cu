// Session 43 probe source: csrc/attn/topk.cu's radix select with compile-time switches, for
// scripts/probe_topk.cu (TOPK_SRC). Not part of the extension.
//   TOPK_SPREAD 1: a thread holds pe = ceil(n / 1024) entries of the n visible ones (0: P, the allocation's form)
//   TOPK_AGG    1: a warp whose active keys of one slot fall in one bin adds them with one atomic
//   TOPK_BITS   8: four passes of 8 bits; 11: three passes (11, 11, 10 bits), the bin found by a block scan
//   TOPK_DIAG   2: load the keys and stop (the launch's and loads' floor; wrong output)
//   TOPK_STRIDED 1: thread t holds entries t + 1024 p (coalesced loads); equal keys past the need are taken
//               row of 1024 by row (one block scan each) only when the threshold's ties exceed the need
//   TOPK_VEC    1: the blocked layout's loads as float4 where the thread's entries are 16-byte aligned
#include "attn_common.cuh"
#include "attn_launch.h"

#ifndef TOPK_SPREAD
#define TOPK_SPREAD 1
#endif
#ifndef TOPK_AGG
#define TOPK_AGG 0
#endif
#ifndef TOPK_BITS
#define TOPK_BITS 8
#endif
#ifndef TOPK_DIAG
#define TOPK_DIAG 0
#endif
#ifndef TOPK_STRIDED
#define TOPK_STRIDED 0
#endif
#ifndef TOPK_VEC
#define TOPK_VEC 0
#endif

namespace ds4_attn {

constexpr int TOPK_THREADS = 1024;
constexpr int TOPK_WARPS = TOPK_THREADS / 32;
constexpr int NPASS = TOPK_BITS == 8 ? 4 : 3;
constexpr int MAXBINS = 1 << TOPK_BITS;

__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ int block_excl_scan(int v, int* warp_sums, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  __syncthreads();
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int s = lane < TOPK_WARPS ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    if (lane < TOPK_WARPS) warp_sums[lane] = s;
  }
  __syncthreads();
  *total = warp_sums[TOPK_WARPS - 1];
  return (warp ? warp_sums[warp - 1] : 0) + x - v;
}

__device__ __forceinline__ int pass_bits(int pass) { return TOPK_BITS == 8 ? 8 : (pass < 2 ? 11 : 10); }
__device__ __forceinline__ int pass_shift(int pass) {
  return TOPK_BITS == 8 ? 24 - 8 * pass : (pass == 0 ? 21 : (pass == 1 ? 10 : 0));
}

template <int P>
__global__ void __launch_bounds__(TOPK_THREADS) topk_kernel(const float* __restrict__ scores, int T, int k,
                                                            const int64_t* __restrict__ pos, int ratio,
                                                            int64_t* __restrict__ out) {
  ds4_pdl::begin();
  __shared__ int hist[MAXBINS];
  __shared__ int warp_sums[TOPK_WARPS];
  __shared__ uint32_t s_prefix;
  __shared__ int s_need;
  const int r = blockIdx.x, lane = threadIdx.x & 31;
  const float* row = scores + (long)r * T;
  int64_t* dst = out + (long)r * k;
  int n = T;
  if (pos != nullptr) n = (int)min((long)T, max((long)k, (pos[r] + 1) / ratio));
  if (n == k) {
    for (int i = threadIdx.x; i < k; i += TOPK_THREADS) dst[i] = i;
    return;
  }
#if TOPK_STRIDED
  // entry of slot p: p * TOPK_THREADS + threadIdx.x
  const int cnt = threadIdx.x < n ? min(P, (n - 1 - (int)threadIdx.x) / TOPK_THREADS + 1) : 0;
  uint32_t key[P];
#pragma unroll
  for (int p = 0; p < P; ++p) key[p] = p < cnt ? order_key(row[p * TOPK_THREADS + threadIdx.x]) : 0u;
#else
#if TOPK_SPREAD
  const int pe = (n + TOPK_THREADS - 1) / TOPK_THREADS;
#else
  const int pe = P;
#endif
  const int i0 = threadIdx.x * pe;
  const int cnt = max(0, min(pe, n - i0));
  uint32_t key[P];
#if TOPK_VEC
  if (cnt == pe && pe % 4 == 0 && ((uintptr_t)(row + i0) & 15) == 0) {
#pragma unroll
    for (int p = 0; p < P; p += 4) {
      if (p < pe) {
        const float4 v = *reinterpret_cast<const float4*>(row + i0 + p);
        key[p] = order_key(v.x);
        if (p + 1 < P) key[p + 1] = order_key(v.y);
        if (p + 2 < P) key[p + 2] = order_key(v.z);
        if (p + 3 < P) key[p + 3] = order_key(v.w);
      } else {
        key[p] = 0u;
        if (p + 1 < P) key[p + 1] = 0u;
        if (p + 2 < P) key[p + 2] = 0u;
        if (p + 3 < P) key[p + 3] = 0u;
      }
    }
  } else {
#pragma unroll
    for (int p = 0; p < P; ++p) key[p] = p < cnt ? order_key(row[i0 + p]) : 0u;
  }
#else
#pragma unroll
  for (int p = 0; p < P; ++p) key[p] = p < cnt ? order_key(row[i0 + p]) : 0u;
#endif
#endif
#if TOPK_DIAG == 2
  uint32_t x = 0;
#pragma unroll
  for (int p = 0; p < P; ++p) x ^= key[p];
  if (x == 0x9e3779b9u) dst[0] = x;
  if (threadIdx.x < k) dst[threadIdx.x] = threadIdx.x;
  return;
#endif

  uint32_t prefix = 0, mask = 0;
  int need = k;
#pragma unroll 1
  for (int pass = 0; pass < NPASS; ++pass) {
    const int bits = pass_bits(pass), shift = pass_shift(pass), nb = 1 << bits;
    for (int b = threadIdx.x; b < nb; b += TOPK_THREADS) hist[b] = 0;
    __syncthreads();
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const bool act = p < cnt && (key[p] & mask) == prefix;
      const uint32_t bin = (key[p] >> shift) & (uint32_t)(nb - 1);
#if TOPK_AGG
      const unsigned am = __ballot_sync(0xffffffffu, act);
      if (am) {
        const unsigned lo = __reduce_min_sync(0xffffffffu, act ? bin : 0xffffffffu);
        const unsigned hi = __reduce_max_sync(0xffffffffu, act ? bin : 0u);
        if (lo == hi) {
          if (lane == 0) atomicAdd(&hist[lo], __popc(am));
        } else if (act) {
          atomicAdd(&hist[bin], 1);
        }
      }
#else
      if (act) atomicAdd(&hist[bin], 1);
#endif
    }
    __syncthreads();
    if (nb == 256) {
      if (threadIdx.x < 32) {
        int c[8], s = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          c[j] = hist[255 - 8 * lane - j];
          s += c[j];
        }
        int incl = s;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int y = __shfl_up_sync(0xffffffffu, incl, o);
          if (lane >= o) incl += y;
        }
        const int before = incl - s;
        const unsigned hit = __ballot_sync(0xffffffffu, incl >= need);
        if (lane == __ffs(hit) - 1) {
          int acc = before, j = 0;
          while (acc + c[j] < need) acc += c[j++];
          s_prefix = prefix | ((uint32_t)(255 - 8 * lane - j) << shift);
          s_need = need - acc;
        }
      }
    } else {  // nb = 1024 or 2048: thread t owns bins nb-1-per*t .. nb-per*(t+1), from the top
      const int per = nb / TOPK_THREADS;
      int c[2] = {0, 0}, s = 0;
#pragma unroll
      for (int j = 0; j < 2; ++j)
        if (j < per) {
          c[j] = hist[nb - 1 - per * threadIdx.x - j];
          s += c[j];
        }
      int tot;
      const int before = block_excl_scan(s, warp_sums, &tot);
      if (before < need && before + s >= need) {
        int acc = before, j = 0;
        while (acc + c[j] < need) acc += c[j++];
        s_prefix = prefix | ((uint32_t)(nb - 1 - per * threadIdx.x - j) << shift);
        s_need = need - acc;
      }
    }
    __syncthreads();
    prefix = s_prefix;
    need = s_need;
    mask |= (uint32_t)(nb - 1) << shift;
    __syncthreads();
  }
  int n_gt = 0, n_eq = 0;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    n_gt += p < cnt && key[p] > prefix;
    n_eq += p < cnt && key[p] == prefix;
  }
  int tot_gt = 0, tot_eq = 0;
  int o_gt = block_excl_scan(n_gt, warp_sums, &tot_gt);
  int o_eq = block_excl_scan(n_eq, warp_sums, &tot_eq);
#if TOPK_STRIDED
  const bool all_eq = tot_eq == need;  // every key equal to the threshold is taken: no index order needed
#pragma unroll
  for (int p = 0; p < P; ++p) {
    if (p >= cnt) break;
    const int e = p * TOPK_THREADS + threadIdx.x;
    if (key[p] > prefix) {
      dst[o_gt++] = e;
    } else if (all_eq && key[p] == prefix) {
      dst[tot_gt + o_eq++] = e;
    }
  }
  if (!all_eq) {  // ties past the need: the lowest indices, row by row (a row = entries p * 1024 .. + 1023)
    int taken = 0;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      if (taken >= need) break;  // uniform
      const bool eq = p < cnt && key[p] == prefix;
      int tot = 0;
      const int o = block_excl_scan(eq, warp_sums, &tot);
      if (eq && taken + o < need) dst[tot_gt + taken + o] = p * TOPK_THREADS + threadIdx.x;
      taken += tot;
    }
  }
}
#else
#pragma unroll
  for (int p = 0; p < P; ++p) {
    if (p >= cnt) break;
    if (key[p] > prefix) {
      dst[o_gt++] = i0 + p;
    } else if (key[p] == prefix) {
      if (o_eq < need) dst[tot_gt + o_eq] = i0 + p;
      ++o_eq;
    }
  }
}
#endif

int topk_max_len() { return TOPK_THREADS * 32; }

cudaError_t launch_topk(const float* scores, int B, int T, int k, const int64_t* pos, int ratio, int64_t* out,
                        cudaStream_t st) {
  if (B < 1 || k < 1 || k > T || T > topk_max_len() || ratio < 1) return cudaErrorInvalidValue;
  const dim3 grid(B), block(TOPK_THREADS);
  if (T <= TOPK_THREADS * 4) return ds4_pdl::launch(topk_kernel<4>, grid, block, 0, st, scores, T, k, pos, ratio, out);
  if (T <= TOPK_THREADS * 8) return ds4_pdl::launch(topk_kernel<8>, grid, block, 0, st, scores, T, k, pos, ratio, out);
  if (T <= TOPK_THREADS * 16)
    return ds4_pdl::launch(topk_kernel<16>, grid, block, 0, st, scores, T, k, pos, ratio, out);
  return ds4_pdl::launch(topk_kernel<32>, grid, block, 0, st, scores, T, k, pos, ratio, out);
}

}  // namespace ds4_attn
