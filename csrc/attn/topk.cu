// Top-k indices of each row of fp32 scores [B, T] (the indexer's selection, spec §5.5), one block of
// TOPK_THREADS per row with the row's n visible entries held in registers: thread t holds entries
// t, t + 1024, t + 2048, ... (slots p = 0 .. S - 1, S = ceil(n / 1024); coalesced loads):
//   1. keys: the float bits mapped to unsigned so that unsigned order = float order (-inf lowest);
//   2. radix select, 3 passes from the top (digits of 11, 11 and 10 bits): a shared histogram of the keys
//      that match the digits found so far, a block scan over its bins finds the bin holding the k-th
//      largest key;
//   3. every key above that threshold key is written, and of the keys equal to it the lowest indices until
//      k: all of them when they are exactly the ones needed (the usual case), else slot by slot (slot p holds
//      entries 1024 p .. 1024 p + 1023 in thread order), one block scan per slot until k are taken. Positions
//      come from block scans, so the output is deterministic.
// Decode positions (pos, ratio): entries t >= n_vis = (pos + 1) / ratio score -inf (the indexer writes
// them so), so only the first n = max(n_vis, k) entries are read: the selection is the same (ties at -inf go
// lowest index first either way), and with n_vis <= k it is simply 0 .. k-1, written without a pass.
// The slots per thread follow n, not T (the allocation): the kernel's form P (chosen by T) holds the row
// bodies of 4, 8, 16 and P slots and runs the narrowest that fits n.
// Session 43's probe (H200, one row, k = 512, experiments/decode_session43_h200.md): the blocked layout (each
// thread a run of consecutive entries) spent 5.6 us of its 14.8 us on loads at 16384 entries, 18 of 33 us at
// 32768; rows of 32 slots with 16 used cost about 6 us more than rows of 16; a warp-aggregated histogram add
// (ballot + two redux per slot) cost 2.5-14 us more than the plain shared atomics it saved. This kernel: 8.7 us at
// 16384 entries, 12.9 at 32768 (zero scores; 14.8 and 33.0 blocked).
// The output order is not sorted (attention does not depend on it). torch.topk on one row ran as
// one ~85 us block-sized sort at T = 16K entries; this reads the row once.
#include "attn_common.cuh"
#include "attn_launch.h"

namespace ds4_attn {

constexpr int TOPK_THREADS = 1024;
constexpr int TOPK_WARPS = TOPK_THREADS / 32;
constexpr int TOPK_BINS = 2048;  // the widest digit: 11 bits

__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// exclusive prefix sum of v over the block (thread order); *total = the block's sum
__device__ __forceinline__ int block_excl_scan(int v, int* warp_sums, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  __syncthreads();  // warp_sums may still be read by a previous scan
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int s = lane < TOPK_WARPS ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    if (lane < TOPK_WARPS) warp_sums[lane] = s;  // inclusive sums of the warps
  }
  __syncthreads();
  *total = warp_sums[TOPK_WARPS - 1];
  return (warp ? warp_sums[warp - 1] : 0) + x - v;
}

struct TopkSmem {
  int hist[TOPK_BINS];
  int warp_sums[TOPK_WARPS];
  uint32_t prefix;
  int need;
};

// One row's selection with S slots per thread (S * TOPK_THREADS >= n).
template <int S>
__device__ __forceinline__ void topk_row(const float* __restrict__ row, int n, int k, int64_t* __restrict__ dst,
                                         TopkSmem& sm) {
  const int t = threadIdx.x;
  const int cnt = t < n ? min(S, (n - 1 - t) / TOPK_THREADS + 1) : 0;  // this thread's slots 0 .. cnt - 1
  uint32_t key[S];
#pragma unroll
  for (int p = 0; p < S; ++p) key[p] = p < cnt ? order_key(row[p * TOPK_THREADS + t]) : 0u;  // never counted

  uint32_t prefix = 0, mask = 0;
  int need = k;  // how many of the keys matching `prefix` on `mask` are still to be taken
#pragma unroll 1
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
    const int nb = pass == 2 ? TOPK_BINS / 2 : TOPK_BINS;  // 2^11, 2^11, 2^10 bins
    for (int b = t; b < nb; b += TOPK_THREADS) sm.hist[b] = 0;
    __syncthreads();
#pragma unroll
    for (int p = 0; p < S; ++p)
      if (p < cnt && (key[p] & mask) == prefix) atomicAdd(&sm.hist[(key[p] >> shift) & (uint32_t)(nb - 1)], 1);
    __syncthreads();
    // thread t owns bins hi = nb - 1 - per t and hi - 1 (per = 2) from the top; the one whose bins reach the need
    // names the digit
    const int per = nb / TOPK_THREADS, hi = nb - 1 - per * t;
    const int c0 = sm.hist[hi], c1 = per > 1 ? sm.hist[hi - 1] : 0;
    int total;
    const int before = block_excl_scan(c0 + c1, sm.warp_sums, &total);
    if (before < need && before + c0 + c1 >= need) {
      const bool in0 = before + c0 >= need;
      sm.prefix = prefix | ((uint32_t)(in0 ? hi : hi - 1) << shift);
      sm.need = need - (in0 ? before : before + c0);
    }
    __syncthreads();
    prefix = sm.prefix;
    need = sm.need;
    mask |= (uint32_t)(nb - 1) << shift;
  }
  // prefix = the k-th largest key; `need` keys equal to it are taken (lowest indices first)
  int n_gt = 0, n_eq = 0;
#pragma unroll
  for (int p = 0; p < S; ++p) {
    n_gt += p < cnt && key[p] > prefix;
    n_eq += p < cnt && key[p] == prefix;
  }
  // one scan for both counts: (equal) + (greater << 16); at most 32768 equal (n <= 32768) and fewer than k <= 32768
  // greater, so the sums stay below 2^31 and the low field never carries
  int both = 0;
  const int o_both = block_excl_scan(n_eq + (n_gt << 16), sm.warp_sums, &both);
  const int tot_gt = both >> 16, tot_eq = both & 0xFFFF;
  int o_gt = o_both >> 16, o_eq = o_both & 0xFFFF;
  const bool all_eq = tot_eq == need;  // every key equal to the threshold is taken: no index order needed
#pragma unroll
  for (int p = 0; p < S; ++p) {
    if (p >= cnt) break;
    const int e = p * TOPK_THREADS + t;
    if (key[p] > prefix) {
      dst[o_gt++] = e;
    } else if (all_eq && key[p] == prefix) {
      dst[tot_gt + o_eq++] = e;
    }
  }
  if (!all_eq) {  // more keys equal the threshold than are needed: the lowest indices, slot by slot
    int taken = 0;
#pragma unroll
    for (int p = 0; p < S; ++p) {
      if (taken >= need) break;  // uniform over the block
      const bool eq = p < cnt && key[p] == prefix;
      int tot = 0;
      const int o = block_excl_scan(eq, sm.warp_sums, &tot);
      if (eq && taken + o < need) dst[tot_gt + taken + o] = p * TOPK_THREADS + t;
      taken += tot;
    }
  }
}

template <int P>
__global__ void __launch_bounds__(TOPK_THREADS) topk_kernel(const float* __restrict__ scores, int T, int k,
                                                            const int64_t* __restrict__ pos, int ratio,
                                                            int64_t* __restrict__ out) {
  ds4_pdl::begin();
  __shared__ TopkSmem sm;
  const int r = blockIdx.x;
  const float* row = scores + (long)r * T;
  int64_t* dst = out + (long)r * k;
  int n = T;  // entries that take part (k <= n <= T)
  if (pos != nullptr) n = (int)min((long)T, max((long)k, (pos[r] + 1) / ratio));
  if (n == k) {
    for (int i = threadIdx.x; i < k; i += TOPK_THREADS) dst[i] = i;
    return;
  }
  const int slots = (n + TOPK_THREADS - 1) / TOPK_THREADS;  // <= P: n <= T <= P * TOPK_THREADS
  if (slots <= 4) {
    topk_row<4>(row, n, k, dst, sm);
  } else if (slots <= 8) {
    topk_row<(P < 8 ? P : 8)>(row, n, k, dst, sm);
  } else if (slots <= 16) {
    topk_row<(P < 16 ? P : 16)>(row, n, k, dst, sm);
  } else {
    topk_row<P>(row, n, k, dst, sm);
  }
}

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
