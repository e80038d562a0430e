// Top-k indices of each row of fp32 scores [B, T] (the indexer's selection, spec §5.5), one block of
// TOPK_THREADS per row with the row's n visible entries held in registers, spread over all the threads
// (pe = ceil(n / TOPK_THREADS) consecutive entries per thread, at most P: the form chosen by T):
//   1. keys: the float bits mapped to unsigned so that unsigned order = float order (-inf lowest);
//   2. radix select, 4 passes of 8 bits from the top: a shared 256-bin histogram of the keys that
//      match the digits found so far, one warp finds the bin holding the k-th largest key;
//   3. every key above that threshold key, and the first (by index) keys equal to it until k are
//      written: positions from block-wide exclusive scans, so the output is deterministic.
// Decode positions (pos, ratio): entries t >= n_vis = (pos + 1) / ratio score -inf (the indexer writes
// them so), so only the first max(n_vis, k) entries are read: the selection is the same (ties at -inf go
// lowest index first either way), and with n_vis <= k it is simply 0 .. k-1, written without a pass.
// (H200, T = 16384 entries allocated at context 64: 25.7 us per call scanning all of them, most of it
// shared-memory atomics of the equal -inf keys on one histogram bin in every pass.)
// The output order is not sorted (attention does not depend on it). torch.topk on one row ran as
// one ~85 us block-sized sort at T = 16K entries; this reads the row once.
#include "attn_common.cuh"
#include "attn_launch.h"

namespace ds4_attn {

constexpr int TOPK_THREADS = 1024;
constexpr int TOPK_WARPS = TOPK_THREADS / 32;

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

template <int P>
__global__ void __launch_bounds__(TOPK_THREADS) topk_kernel(const float* __restrict__ scores, int T, int k,
                                                            const int64_t* __restrict__ pos, int ratio,
                                                            int64_t* __restrict__ out) {
  ds4_pdl::begin();
  __shared__ int hist[256];
  __shared__ int warp_sums[TOPK_WARPS];
  __shared__ uint32_t s_prefix;
  __shared__ int s_need;
  const int r = blockIdx.x;
  const float* row = scores + (long)r * T;
  int64_t* dst = out + (long)r * k;
  int n = T;  // entries that take part (k <= n <= T)
  if (pos != nullptr) n = (int)min((long)T, max((long)k, (pos[r] + 1) / ratio));
  if (n == k) {
    for (int i = threadIdx.x; i < k; i += TOPK_THREADS) dst[i] = i;
    return;
  }
  // The entries per thread follow n, not T: with P (chosen by T) per thread, n just over a power of two
  // (T = 16423 at the long-context profile's position 65536, n = 16384) left half the threads with 32 entries
  // and half with none, about twice the time of 16 each (H200: 32.0 against 15.5 us per call,
  // experiments/decode_session42_h200.md).
  const int pe = (n + TOPK_THREADS - 1) / TOPK_THREADS;  // <= P: n <= T <= P * TOPK_THREADS
  const int i0 = threadIdx.x * pe;
  const int cnt = max(0, min(pe, n - i0));  // this thread's entries: i0 .. i0 + cnt - 1
  uint32_t key[P];
#pragma unroll
  for (int p = 0; p < P; ++p) key[p] = p < cnt ? order_key(row[i0 + p]) : 0u;  // slots >= cnt: never counted

  uint32_t prefix = 0, mask = 0;
  int need = k;  // how many of the keys matching `prefix` on `mask` are still to be taken
#pragma unroll 1
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += TOPK_THREADS) hist[b] = 0;
    __syncthreads();
#pragma unroll
    for (int p = 0; p < P; ++p)
      if (p < cnt && (key[p] & mask) == prefix) atomicAdd(&hist[(key[p] >> shift) & 0xFF], 1);
    __syncthreads();
    if (threadIdx.x < 32) {  // bins from the top: lane l owns bins 255-8l .. 248-8l
      const int lane = threadIdx.x;
      int c[8], s = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        c[j] = hist[255 - 8 * lane - j];
        s += c[j];
      }
      int incl = s;  // inclusive prefix over lanes = keys in bins >= this lane's lowest bin
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
      }
      const int before = incl - s;
      const unsigned hit = __ballot_sync(0xffffffffu, incl >= need);
      if (lane == __ffs(hit) - 1) {  // the lane whose bins reach the need
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
    __syncthreads();
  }
  // prefix = the k-th largest key; `need` keys equal to it are taken (lowest indices first)
  int n_gt = 0, n_eq = 0;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    n_gt += p < cnt && key[p] > prefix;
    n_eq += p < cnt && key[p] == prefix;
  }
  int tot_gt = 0, tot_eq = 0;
  int o_gt = block_excl_scan(n_gt, warp_sums, &tot_gt);
  int o_eq = block_excl_scan(n_eq, warp_sums, &tot_eq);
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
