// Session 43 probe source (sm_90 only): the radix select of csrc/attn/topk.cu spread over a thread-block cluster of
// TOPK_CL blocks per row (TOPK_CT threads each) for scripts/probe_topk.cu (TOPK_SRC). Not part of the extension.
// Block c of a row holds entries [c m, (c+1) m) of the n visible ones (m = ceil(n / CL)), spread over its threads.
// Each pass: a block histogram in shared memory (a warp whose active keys of a slot share one bin adds them with one
// atomic), its non-zero bins added into rank 0's histogram of that pass (distributed shared memory), one cluster
// barrier, then every block reads the merged histogram and finds the same threshold digit. The output offsets
// come from the blocks' (greater, equal) counts gathered in rank 0, so the selection and its order are those of
// the one-block kernel.
#include <cooperative_groups.h>

#include "attn_common.cuh"
#include "attn_launch.h"

#ifndef TOPK_CL
#define TOPK_CL 8
#endif
#ifndef TOPK_CT
#define TOPK_CT 512
#endif

namespace ds4_attn {
namespace cg = cooperative_groups;

constexpr int CL = TOPK_CL, CT = TOPK_CT, CW = CT / 32;

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
    int s = lane < CW ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    if (lane < CW) warp_sums[lane] = s;
  }
  __syncthreads();
  *total = warp_sums[CW - 1];
  return (warp ? warp_sums[warp - 1] : 0) + x - v;
}

template <int P>
__global__ void __launch_bounds__(CT) topk_kernel(const float* __restrict__ scores, int T, int k,
                                                  const int64_t* __restrict__ pos, int ratio,
                                                  int64_t* __restrict__ out) {
  ds4_pdl::begin();
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = (int)cluster.block_rank();
  __shared__ int hist[256];
  __shared__ int ghist[4][256];  // rank 0: the merged histogram of each pass
  __shared__ int cnts[2 * CL];   // rank 0: each block's (greater, equal) counts
  __shared__ int warp_sums[32];
  __shared__ uint32_t s_prefix;
  __shared__ int s_need;
  const int r = blockIdx.y, lane = threadIdx.x & 31;
  const float* row = scores + (long)r * T;
  int64_t* dst = out + (long)r * k;
  int n = T;
  if (pos != nullptr) n = (int)min((long)T, max((long)k, (pos[r] + 1) / ratio));
  if (n == k) {
    if (rank == 0)
      for (int i = threadIdx.x; i < k; i += CT) dst[i] = i;
    return;
  }
  const int m = (n + CL - 1) / CL, lo = min(n, rank * m), hi = min(n, lo + m);
  const int pe = (hi - lo + CT - 1) / CT;
  const int i0 = lo + threadIdx.x * pe;
  const int cnt = max(0, min(pe, hi - i0));
  uint32_t key[P];
#pragma unroll
  for (int p = 0; p < P; ++p) key[p] = p < cnt ? order_key(row[i0 + p]) : 0u;
  for (int b = threadIdx.x; b < 4 * 256; b += CT) (&ghist[0][0])[b] = 0;
  cluster.sync();  // rank 0's histograms are zero before any block adds to them
  uint32_t prefix = 0, mask = 0;
  int need = k;
#pragma unroll 1
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    for (int b = threadIdx.x; b < 256; b += CT) hist[b] = 0;
    __syncthreads();
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const bool act = p < cnt && (key[p] & mask) == prefix;
      const uint32_t bin = (key[p] >> shift) & 0xFFu;
      const unsigned am = __ballot_sync(0xffffffffu, act);
      if (am) {
        const unsigned blo = __reduce_min_sync(0xffffffffu, act ? bin : 0xffffffffu);
        const unsigned bhi = __reduce_max_sync(0xffffffffu, act ? bin : 0u);
        if (blo == bhi) {
          if (lane == 0) atomicAdd(&hist[blo], __popc(am));
        } else if (act) {
          atomicAdd(&hist[bin], 1);
        }
      }
    }
    __syncthreads();
    int* g0 = cluster.map_shared_rank(&ghist[pass][0], 0);
    for (int b = threadIdx.x; b < 256; b += CT)
      if (hist[b]) atomicAdd(g0 + b, hist[b]);
    cluster.sync();
    if (threadIdx.x < 32) {
      int c[8], s = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        c[j] = g0[255 - 8 * lane - j];
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
    __syncthreads();
    prefix = s_prefix;
    need = s_need;
    mask |= 0xFFu << shift;
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
  int* c0 = cluster.map_shared_rank(cnts, 0);
  if (threadIdx.x == 0) {
    c0[2 * rank] = tot_gt;
    c0[2 * rank + 1] = tot_eq;
  }
  cluster.sync();
  int gt_before = 0, eq_before = 0, gt_all = 0;
#pragma unroll
  for (int c = 0; c < CL; ++c) {
    const int g = c0[2 * c], e = c0[2 * c + 1];
    gt_all += g;
    if (c < rank) {
      gt_before += g;
      eq_before += e;
    }
  }
  cluster.sync();  // rank 0's shared memory stays until every block has read it
  o_gt += gt_before;
  o_eq += eq_before;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    if (p >= cnt) break;
    if (key[p] > prefix) {
      dst[o_gt++] = i0 + p;
    } else if (key[p] == prefix) {
      if (o_eq < need) dst[gt_all + o_eq] = i0 + p;
      ++o_eq;
    }
  }
}

int topk_max_len() { return CL * CT * 32; }

template <int P>
static cudaError_t launch_p(const float* scores, int B, int T, int k, const int64_t* pos, int ratio, int64_t* out,
                            cudaStream_t st) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(CL, B);
  cfg.blockDim = dim3(CT);
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = CL;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, topk_kernel<P>, scores, T, k, pos, ratio, out);
}

cudaError_t launch_topk(const float* scores, int B, int T, int k, const int64_t* pos, int ratio, int64_t* out,
                        cudaStream_t st) {
  if (B < 1 || k < 1 || k > T || T > topk_max_len() || ratio < 1) return cudaErrorInvalidValue;
  const int per = ((T + CL - 1) / CL + CT - 1) / CT;  // entries per thread at most
  if (per <= 2) return launch_p<2>(scores, B, T, k, pos, ratio, out, st);
  if (per <= 4) return launch_p<4>(scores, B, T, k, pos, ratio, out, st);
  if (per <= 8) return launch_p<8>(scores, B, T, k, pos, ratio, out, st);
  if (per <= 16) return launch_p<16>(scores, B, T, k, pos, ratio, out, st);
  return launch_p<32>(scores, B, T, k, pos, ratio, out, st);
}

}  // namespace ds4_attn
