// Top-k indices of each row of fp32 scores [B, T] (the indexer's selection, spec §5.5). Rows up to 32768 entries:
// one block of TOPK_THREADS per row (longer rows: the wide form, further down), the row's n visible entries held in
// registers: thread t holds entries
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
  int before[2], total[2];  // the wide form: greater / equal keys of the blocks before this one, of the row
};

// Thread t owns the bins hi = nb - 1 - per t and hi - 1 (per = nb / TOPK_THREADS = 2 or 1) from the top.
__device__ __forceinline__ int topk_bin_hi(int nb) { return nb - 1 - (nb / TOPK_THREADS) * (int)threadIdx.x; }

// A radix pass's digit: given the thread's bin counts c0 (bin hi) and c1 (hi - 1, or 0), the bin holding the need-th
// largest of the keys that match prefix; prefix and need become that bin's (every thread, same values).
__device__ __forceinline__ void pick_digit(int c0, int c1, int hi, int shift, uint32_t& prefix, int& need,
                                           TopkSmem& sm) {
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
}

// Of the keys equal to the threshold, slot by slot in index order (slot p: entries base + 1024 p + t), those whose
// rank among the row's equal keys (taken = the rank of the first one here) is below need, written at dst[rank].
template <int S>
__device__ __forceinline__ void take_ties(const uint32_t (&key)[S], int cnt, uint32_t prefix, int need, int taken,
                                          int base, int64_t* __restrict__ dst, TopkSmem& sm) {
  const int t = threadIdx.x;
#pragma unroll
  for (int p = 0; p < S; ++p) {
    if (taken >= need) break;  // uniform over the block
    const bool eq = p < cnt && key[p] == prefix;
    int tot = 0;
    const int o = block_excl_scan(eq, sm.warp_sums, &tot);
    if (eq && taken + o < need) dst[taken + o] = base + p * TOPK_THREADS + t;
    taken += tot;
  }
}

// The entries of a row that take part (k <= n <= T): all T, or at a decode position the first max(visible, k); with
// n == k the selection is 0 .. k - 1, which the caller writes without a pass (topk_first_k).
__device__ __forceinline__ int topk_entries(int T, int k, const int64_t* __restrict__ pos, int r, int ratio) {
  return pos != nullptr ? (int)min((long)T, max((long)k, (pos[r] + 1) / ratio)) : T;
}
__device__ __forceinline__ void topk_first_k(int64_t* __restrict__ dst, int k) {
  for (int i = threadIdx.x; i < k; i += TOPK_THREADS) dst[i] = i;
}

// A radix pass's histogram of this block's keys that match prefix on mask, digit (key >> shift) & (nb - 1), into
// sm.hist (barriers before and after).
template <int S>
__device__ __forceinline__ void block_hist(const uint32_t (&key)[S], int cnt, uint32_t prefix, uint32_t mask,
                                           int shift, int nb, TopkSmem& sm) {
  for (int b = threadIdx.x; b < nb; b += TOPK_THREADS) sm.hist[b] = 0;
  __syncthreads();
#pragma unroll
  for (int p = 0; p < S; ++p)
    if (p < cnt && (key[p] & mask) == prefix) atomicAdd(&sm.hist[(key[p] >> shift) & (uint32_t)(nb - 1)], 1);
  __syncthreads();
}

// The block's keys above the threshold key prefix and equal to it: one scan for both counts, (equal) + (greater <<
// 16); at most 32768 equal and fewer than k <= 32768 greater in a block, so the sums stay below 2^31 and the low field
// never carries. Returns the thread's exclusive offsets packed the same way; *both = the block's totals.
template <int S>
__device__ __forceinline__ int count_selected(const uint32_t (&key)[S], int cnt, uint32_t prefix, TopkSmem& sm,
                                              int* both) {
  int n_gt = 0, n_eq = 0;
#pragma unroll
  for (int p = 0; p < S; ++p) {
    n_gt += p < cnt && key[p] > prefix;
    n_eq += p < cnt && key[p] == prefix;
  }
  return block_excl_scan(n_eq + (n_gt << 16), sm.warp_sums, both);
}

// Writes the thread's keys above the threshold at dst[o_gt ...] and, with all_eq (every key equal to it is taken: no
// index order needed), its equal ones at dst[o_eq ...]; slot p is entry base + 1024 p + t.
template <int S>
__device__ __forceinline__ void write_selected(const uint32_t (&key)[S], int cnt, uint32_t prefix, int base, int o_gt,
                                               int o_eq, bool all_eq, int64_t* __restrict__ dst) {
#pragma unroll
  for (int p = 0; p < S; ++p) {
    if (p >= cnt) break;
    const int e = base + p * TOPK_THREADS + (int)threadIdx.x;
    if (key[p] > prefix) {
      dst[o_gt++] = e;
    } else if (all_eq && key[p] == prefix) {
      dst[o_eq++] = e;
    }
  }
}

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
    block_hist<S>(key, cnt, prefix, mask, shift, nb, sm);
    const int hi = topk_bin_hi(nb);
    pick_digit(sm.hist[hi], nb > TOPK_THREADS ? sm.hist[hi - 1] : 0, hi, shift, prefix, need, sm);
    mask |= (uint32_t)(nb - 1) << shift;
  }
  // prefix = the k-th largest key; `need` keys equal to it are taken (lowest indices first)
  int both = 0;
  const int o_both = count_selected<S>(key, cnt, prefix, sm, &both);
  const int tot_gt = both >> 16;
  const bool all_eq = (both & 0xFFFF) == need;
  write_selected<S>(key, cnt, prefix, 0, o_both >> 16, tot_gt + (o_both & 0xFFFF), all_eq, dst);
  if (!all_eq) take_ties<S>(key, cnt, prefix, need, 0, 0, dst + tot_gt, sm);  // more equal keys than needed
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
  const int n = topk_entries(T, k, pos, r, ratio);
  if (n == k) return topk_first_k(dst, k);
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

// ---- the wide form: rows longer than one block holds (T > TOPK_ONE_BLOCK_LEN), spread over blocks ------------
// Block b of a row holds the entries b L .. b L + L - 1 (L = TOPK_WIDE_SLOTS x 1024, strided over its threads as
// above), g = ceil(n / L) blocks take part (the others exit at once; g = 1 runs the one-block selection). Each radix
// pass: every block histograms its own keys in shared memory and adds its nonzero bins to the row's global histogram
// (integer adds: the same counts in any order), the g blocks meet at a grid barrier, then every block reads the whole
// histogram and finds the same digit. After the third pass each block publishes its greater / equal counts, a fourth
// barrier, and each block writes its keys at offsets from the counts of the blocks before it (block order = index
// order, so the ties past the need are still the lowest indices). Deterministic: no position comes from an atomic.
// The row's scratch (histograms, counts, barrier) is global and self-cleaning: the histograms are zeroed after the
// last barrier (every read of them precedes it), the barrier leaves its arrivals at 0. So one wide launch at a time
// per device (they are ordered on the decode step's stream), like moe_ffn's barrier; and the grid barrier needs the
// row's blocks resident at once: B x G blocks of 1024 threads, at most one per SM (launch_topk checks).
// Session 44 (H200, one row, k = 512, scripts/probe_topk.cu): 14.4-16.1 us from 16384 to 524288 entries (its four
// barriers, nearly flat in T), against the one-block form's 8.7 at 16384 and 13.0 at 32768 entries: so the one-block
// form up to 32768. torch.topk (what rows past 32768 took before): 80 us at 262144 (scripts/bench_attn.py).
constexpr int TOPK_ONE_BLOCK_LEN = TOPK_THREADS * 32;
constexpr int TOPK_WIDE_SLOTS = 8;
constexpr int TOPK_WIDE_LEN = TOPK_THREADS * TOPK_WIDE_SLOTS;  // entries per block
constexpr int TOPK_WIDE_MAX_BLOCKS = 64;                      // per row: T <= 524288 (2^21 tokens at ratio 4)
constexpr int TOPK_WIDE_MAX_ROWS = 16;

__device__ int g_topk_hist[TOPK_WIDE_MAX_ROWS][3][TOPK_BINS];
__device__ int2 g_topk_cnt[TOPK_WIDE_MAX_ROWS][TOPK_WIDE_MAX_BLOCKS];  // (greater, equal) per block
__device__ unsigned int g_topk_bar[TOPK_WIDE_MAX_ROWS][2];             // arrivals, generation

// The g blocks of a row meet (ds4's moe_ffn barrier, per row): everything each block wrote before is visible to
// every block after. Reads of the scratch go through L2 (__ldcg): L1 is not coherent across blocks.
__device__ __forceinline__ void topk_row_barrier(unsigned int* bar, int g) {
  __syncthreads();
  if (threadIdx.x == 0) {
    volatile unsigned int* gen = bar + 1;
    const unsigned int g0 = *gen;  // cannot move before this block arrives
    __threadfence();
    if (atomicAdd(bar, 1u) == (unsigned int)g - 1u) {
      atomicExch(bar, 0u);
      __threadfence();
      atomicAdd(bar + 1, 1u);
    } else {
      while (*gen == g0) __nanosleep(32);
    }
    __threadfence();
  }
  __syncthreads();
}

template <int S>
__device__ __forceinline__ void topk_wide_row(const float* __restrict__ row, int n, int k, int64_t* __restrict__ dst,
                                              TopkSmem& sm, int r, int g) {
  const int t = threadIdx.x, b = blockIdx.x;
  const int base = b * TOPK_THREADS * S, m = min(TOPK_THREADS * S, n - base);  // this block's entries (m >= 1)
  const int cnt = t < m ? min(S, (m - 1 - t) / TOPK_THREADS + 1) : 0;
  uint32_t key[S];
#pragma unroll
  for (int p = 0; p < S; ++p) key[p] = p < cnt ? order_key(row[base + p * TOPK_THREADS + t]) : 0u;
  int* gh = &g_topk_hist[r][0][0];
  unsigned int* bar = g_topk_bar[r];

  uint32_t prefix = 0, mask = 0;
  int need = k;
#pragma unroll 1
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
    const int nb = pass == 2 ? TOPK_BINS / 2 : TOPK_BINS;
    block_hist<S>(key, cnt, prefix, mask, shift, nb, sm);
    int* ghp = gh + pass * TOPK_BINS;
    for (int i = t; i < nb; i += TOPK_THREADS)
      if (const int c = sm.hist[i]) atomicAdd(&ghp[i], c);
    topk_row_barrier(bar, g);
    const int hi = topk_bin_hi(nb);
    pick_digit(__ldcg(&ghp[hi]), nb > TOPK_THREADS ? __ldcg(&ghp[hi - 1]) : 0, hi, shift, prefix, need, sm);
    mask |= (uint32_t)(nb - 1) << shift;
  }
  int both = 0;  // a block holds at most 8192 keys
  const int o_both = count_selected<S>(key, cnt, prefix, sm, &both);
  if (t == 0) g_topk_cnt[r][b] = make_int2(both >> 16, both & 0xFFFF);
  topk_row_barrier(bar, g);
  // every read of the histograms came before this barrier: zero them for the next launch
  for (int i = b * TOPK_THREADS + t; i < 3 * TOPK_BINS; i += g * TOPK_THREADS) gh[i] = 0;
  if (t < 32) {  // the counts of the blocks before this one, and of the row (warp 0; g <= 64 blocks)
    const int2 c0 = t < g ? __ldcg(&g_topk_cnt[r][t]) : make_int2(0, 0);
    const int2 c1 = t + 32 < g ? __ldcg(&g_topk_cnt[r][t + 32]) : make_int2(0, 0);
    int v[4] = {(t < b ? c0.x : 0) + (t + 32 < b ? c1.x : 0), (t < b ? c0.y : 0) + (t + 32 < b ? c1.y : 0),
                c0.x + c1.x, c0.y + c1.y};
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int o = 16; o; o >>= 1) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
    if (t == 0) {
      sm.before[0] = v[0];
      sm.before[1] = v[1];
      sm.total[0] = v[2];
      sm.total[1] = v[3];
    }
  }
  __syncthreads();
  const int tot_gt = sm.total[0], eq0 = sm.before[1];
  const bool all_eq = sm.total[1] == need;
  write_selected<S>(key, cnt, prefix, base, sm.before[0] + (o_both >> 16), tot_gt + eq0 + (o_both & 0xFFFF), all_eq,
                    dst);
  // more equal keys than needed: this block's, ranked after the blocks' before it (eq0), lowest indices first
  if (!all_eq) take_ties<S>(key, cnt, prefix, need, eq0, base, dst + tot_gt, sm);
}

template <int S>
__global__ void __launch_bounds__(TOPK_THREADS) topk_wide_kernel(const float* __restrict__ scores, int T, int k,
                                                                 const int64_t* __restrict__ pos, int ratio,
                                                                 int64_t* __restrict__ out) {
  ds4_pdl::begin();
  __shared__ TopkSmem sm;
  const int r = blockIdx.y;
  const float* row = scores + (long)r * T;
  int64_t* dst = out + (long)r * k;
  const int n = topk_entries(T, k, pos, r, ratio);
  if (n == k) {
    if (blockIdx.x == 0) topk_first_k(dst, k);
    return;
  }
  const int g = (n + TOPK_THREADS * S - 1) / (TOPK_THREADS * S);  // blocks that take part (<= gridDim.x)
  if ((int)blockIdx.x >= g) return;
  if (g == 1) {  // the one-block selection (no scratch, no barrier)
    if (n <= 4 * TOPK_THREADS) topk_row<4>(row, n, k, dst, sm);
    else topk_row<S>(row, n, k, dst, sm);
    return;
  }
  topk_wide_row<S>(row, n, k, dst, sm, r, g);
}

static int topk_wide_blocks(int T) { return (T + TOPK_WIDE_LEN - 1) / TOPK_WIDE_LEN; }

bool topk_wide_ok(int B, int T) {
  const int G = topk_wide_blocks(T);
  return B >= 1 && T >= 1 && B <= TOPK_WIDE_MAX_ROWS && G <= TOPK_WIDE_MAX_BLOCKS && (long)B * G <= attn_sm_count();
}

bool topk_ok(int B, int T) { return B >= 1 && T >= 1 && (T <= TOPK_ONE_BLOCK_LEN || topk_wide_ok(B, T)); }

cudaError_t launch_topk_wide(const float* scores, int B, int T, int k, const int64_t* pos, int ratio, int64_t* out,
                             cudaStream_t st) {
  if (k < 1 || k > T || ratio < 1 || !topk_wide_ok(B, T)) return cudaErrorInvalidValue;
  return ds4_pdl::launch(topk_wide_kernel<TOPK_WIDE_SLOTS>, dim3(topk_wide_blocks(T), B), dim3(TOPK_THREADS), 0, st,
                         scores, T, k, pos, ratio, out);
}

int topk_max_len() { return TOPK_WIDE_LEN * TOPK_WIDE_MAX_BLOCKS; }

cudaError_t launch_topk(const float* scores, int B, int T, int k, const int64_t* pos, int ratio, int64_t* out,
                        cudaStream_t st) {
  if (B < 1 || k < 1 || k > T || ratio < 1 || !topk_ok(B, T)) return cudaErrorInvalidValue;
  if (T > TOPK_ONE_BLOCK_LEN) return launch_topk_wide(scores, B, T, k, pos, ratio, out, st);
  const dim3 grid(B), block(TOPK_THREADS);
  if (T <= TOPK_THREADS * 4) return ds4_pdl::launch(topk_kernel<4>, grid, block, 0, st, scores, T, k, pos, ratio, out);
  if (T <= TOPK_THREADS * 8) return ds4_pdl::launch(topk_kernel<8>, grid, block, 0, st, scores, T, k, pos, ratio, out);
  if (T <= TOPK_THREADS * 16)
    return ds4_pdl::launch(topk_kernel<16>, grid, block, 0, st, scores, T, k, pos, ratio, out);
  return ds4_pdl::launch(topk_kernel<32>, grid, block, 0, st, scores, T, k, pos, ratio, out);
}

}  // namespace ds4_attn
