// Router on the device (spec §6.1): logits = x . gate^T (BF16 weights, fp32 accumulation);
// scores = sqrt(softplus(logits)) (torch's threshold 20); learned layers: top-k of scores + bias
// (ties to the lower expert id); hash layers: ids = tid2eid[token]; weights = scores[ids] / sum *
// route_scale (the selected scores summed in selection order).
//   router_fused_kernel (decode, <= ROUTER_FUSED_TOKENS tokens; opt-in, DS4_ROUTER_FUSED=1, see
//     ds4_bindings.cpp): one launch. Each warp owns one gate
//     row, loads it before the PDL wait (a weight) and writes its logits; the last block to arrive
//     (an arrival counter in device memory, reset by that block) runs the tail, one warp per token
//     (topk_warp, route_dev.cuh).
//     Before, the GEMV and a one-block tail with two barriers per round were two launches (H200
//     micro-benchmark: 10.6 us for both). A lane's activation loads are issued together: one at a
//     time (a loop that could exit early) the kernel took 16.6 us per call in the decode step.
//   router_topk_kernel (the default): the tail alone, one block per token (the scores by every thread,
//     the top-k by one warp); the logits come from the BF16 GEMV (gemv.cu: one row per warp for these
//     few rows) or the FFN site's hc finish (the router fold).
#include "ds4_common.cuh"
#include "ds4_launch.h"
#include "route_dev.cuh"
#include "sinkhorn_dev.cuh"

namespace ds4 {

// One block per token, a thread per expert for the scores and keys, then warp 0 selects (topk_warp). Session
// 9's form (5.5-6.0 us per call in the 8-layer profile) had each warp select the top-k of its 32 experts by
// shuffle trees, then warp 0 the top-k of those candidates: the same experts in the same order. In the decode
// step (H200, two builds on one machine, session 28): 113.5-114.2 against 114.5-115.2 us per layer; the 8-layer
// profile charges it 4.4-4.9 us on the critical path of a learned layer, session 27's 7.4-8.1.
// ride: warp 1 (the block has two warps at least then) finishes token t's mHC Sinkhorn while warp 0 selects.
constexpr int RT_MAX_THREADS = 1024;  // E <= 1024
__global__ void __launch_bounds__(RT_MAX_THREADS) router_topk_kernel(const float* __restrict__ logits, int E,
                                                                     const float* __restrict__ bias,
                                                                     const void* __restrict__ tid2eid, int tid64,
                                                                     const int64_t* __restrict__ token_ids, int topk,
                                                                     float route_scale, float* __restrict__ w_out,
                                                                     int64_t* __restrict__ ids_out,
                                                                     const SinkhornRide ride, bool early_trigger) {
  ds4_pdl::release_early(early_trigger);  // (router_trigger_early)
  ds4_pdl::begin(early_trigger);
  extern __shared__ float sh[];  // scores [E], then keys [E]
  unsigned* key = reinterpret_cast<unsigned*>(sh + E);
  __shared__ int sel[ROUTER_MAX_K];
  __shared__ float w[ROUTER_MAX_K];
  const int t = blockIdx.x;
  route_scores(logits, E, tid2eid ? nullptr : bias, t, sh, key, threadIdx.x, blockDim.x);
  __syncthreads();
  if (threadIdx.x >= 32) {
    if (threadIdx.x == 32 && ride.comb != nullptr) sinkhorn_ride(ride, t);
    return;
  }
  route_select_warp(sh, key, E, tid2eid, tid64, token_ids, t, topk, route_scale, sel, w);
  if (threadIdx.x < topk) {
    w_out[(long)t * topk + threadIdx.x] = w[threadIdx.x];
    ids_out[(long)t * topk + threadIdx.x] = sel[threadIdx.x];
  }
}

constexpr int RF_WARPS = 4;  // gate rows per block of the fused kernel (one per warp)
constexpr int RF_BATCH = 16; // 16-byte weight chunks per lane in registers (a 4096-wide row: all of it)

// Blocks of the current router_fused_kernel launch that have written their logits. Zero at module
// load; the last block resets it. One fused router runs at a time per device: the decode step runs
// them in stream order, and with PDL a kernel starts only after the one two launches before it ended.
__device__ unsigned router_arrivals = 0;

// 8 bf16 values of a 16-byte chunk -> fp32 (exact)
__device__ __forceinline__ void bf16x8_f32(const uint4& u, float* f) {
  Dec<FMT_BF16>::word(u.x, f);
  Dec<FMT_BF16>::word(u.y, f + 2);
  Dec<FMT_BF16>::word(u.z, f + 4);
  Dec<FMT_BF16>::word(u.w, f + 6);
}

// smem: scores [n_tok][E] (fp32) then the keys of the biased scores [n_tok][E] (score_key)
__global__ void __launch_bounds__(RF_WARPS * 32) router_fused_kernel(
    const __nv_bfloat16* __restrict__ x, int n_tok, const __nv_bfloat16* __restrict__ gate, int E, int dim,
    const float* __restrict__ bias, const void* __restrict__ tid2eid, int tid64, const int64_t* __restrict__ token_ids,
    int topk, float route_scale, float* __restrict__ logits, float* __restrict__ w_out, int64_t* __restrict__ ids_out,
    const SinkhornRide ride) {
  extern __shared__ float rs[];
  __shared__ int s_last;
  __shared__ int sel[ROUTER_FUSED_TOKENS][ROUTER_MAX_K];
  __shared__ float wsel[ROUTER_FUSED_TOKENS][ROUTER_MAX_K];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.x * RF_WARPS + warp;
  const int nch = dim / 8;
  const uint4* wr = reinterpret_cast<const uint4*>(gate) + (long)min(row, E - 1) * nch;
  uint4 wv[RF_BATCH];
#pragma unroll
  for (int j = 0; j < RF_BATCH; ++j)  // the gate is a weight: its loads go out before the PDL wait
    if (lane + 32 * j < nch) wv[j] = __ldg(wr + lane + 32 * j);
  ds4_pdl::begin();
  const bool one_batch = nch <= 32 * RF_BATCH;  // the whole row stays in registers across tokens
  for (int t = 0; t < n_tok; ++t) {
    float acc = 0.f;
    for (int c0 = 0; c0 < nch; c0 += 32 * RF_BATCH) {
      if (!one_batch && (t > 0 || c0 > 0)) {
#pragma unroll
        for (int j = 0; j < RF_BATCH; ++j)
          if (c0 + lane + 32 * j < nch) wv[j] = __ldg(wr + c0 + lane + 32 * j);
      }
      // all of the batch's activation loads first (issued together: one L2 round trip, not RF_BATCH)
      const uint4* xr = reinterpret_cast<const uint4*>(x + (long)t * dim);
      uint4 xv[RF_BATCH];
#pragma unroll
      for (int j = 0; j < RF_BATCH; ++j)
        if (c0 + lane + 32 * j < nch) xv[j] = xr[c0 + lane + 32 * j];
#pragma unroll
      for (int j = 0; j < RF_BATCH; ++j) {
        if (c0 + lane + 32 * j < nch) {
          float wf[8], xf[8];
          bf16x8_f32(wv[j], wf);
          bf16x8_f32(xv[j], xf);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc = fmaf(wf[e], xf[e], acc);
        }
      }
    }
    acc = warp_sum(acc);
    if (lane == 0 && row < E) logits[(long)t * E + row] = acc;
  }
  // the last block to arrive runs the tail over every block's logits
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(&router_arrivals, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  if (threadIdx.x == 0) router_arrivals = 0;
  float* sc = rs;                                             // [n_tok][E] scores
  unsigned* key = reinterpret_cast<unsigned*>(rs + n_tok * E);  // [n_tok][E] keys of score + bias
  for (int t = 0; t < n_tok; ++t)  // (other blocks' logits: route_scores reads them from L2)
    route_scores(logits, E, tid2eid ? nullptr : bias, t, sc + t * E, key + t * E, threadIdx.x, blockDim.x);
  __syncthreads();
  for (int t = warp; t < n_tok; t += RF_WARPS) {
    route_select_warp(sc + t * E, key + t * E, E, tid2eid, tid64, token_ids, t, topk, route_scale, sel[t], wsel[t]);
    if (lane < topk) {
      w_out[(long)t * topk + lane] = wsel[t][lane];
      ids_out[(long)t * topk + lane] = sel[t][lane];
    }
  }
  if (ride.comb != nullptr && threadIdx.x < n_tok) sinkhorn_ride(ride, threadIdx.x);  // (an opt-in path: after)
}

bool router_fused_ok(int n_tok, int E, int dim) {
  return n_tok >= 1 && n_tok <= ROUTER_FUSED_TOKENS && E >= 1 && (long)n_tok * E <= ROUTER_FUSED_SLOTS && dim >= 8 &&
         dim % 8 == 0;
}

cudaError_t launch_router_fused(const void* x, int n_tok, const void* gate, int E, int dim, const float* bias,
                                const void* tid2eid, bool tid64, const int64_t* token_ids, int topk,
                                float route_scale, float* logits, float* w_out, int64_t* ids_out, cudaStream_t st,
                                const SinkhornRide& ride) {
  if (!router_fused_ok(n_tok, E, dim) || topk < 1 || topk > ROUTER_MAX_K || topk > E || !sinkhorn_ride_ok(ride, n_tok))
    return cudaErrorInvalidValue;
  const int blocks = (E + RF_WARPS - 1) / RF_WARPS;
  return ds4_pdl::launch(router_fused_kernel, dim3(blocks), dim3(RF_WARPS * 32), 2L * n_tok * E * sizeof(float), st,
                         static_cast<const __nv_bfloat16*>(x), n_tok, static_cast<const __nv_bfloat16*>(gate), E, dim,
                         bias, tid2eid, tid64 ? 1 : 0, token_ids, topk, route_scale, logits, w_out, ids_out, ride);
}

// DS4_ROUTER_TRIGGER=early (read per launch; opt-in, the ablation): the top-k lets the next launch (the routed gate+up)
// launch at its start, before its own PDL wait, so the gate+up's blocks are resident (before the shared expert's,
// forked on a side stream by an event) when the ids land. Safe for a next launch that waits (PDL) before it reads:
// the top-k's completion still implies its predecessor's.
static bool router_trigger_early() { return ds4_pdl::trigger_early("DS4_ROUTER_TRIGGER", false); }

cudaError_t launch_router_topk(const float* logits, int n_tok, int E, const float* bias, const void* tid2eid,
                               bool tid64, const int64_t* token_ids, int topk, float route_scale, float* w_out,
                               int64_t* ids_out, cudaStream_t st, const SinkhornRide& ride) {
  if (n_tok < 1 || E < 1 || E > RT_MAX_THREADS || topk < 1 || topk > ROUTER_MAX_K || topk > E ||
      !sinkhorn_ride_ok(ride, n_tok))
    return cudaErrorInvalidValue;
  // a thread per expert: narrower blocks, the scores in several passes per thread, measured slower in the decode
  // step (H200, session 28, E = 256: one warp 119.2 / 119.5, two warps 116.1 / 116.3 against 114.3 / 113.6 us per
  // layer), the block then spending longer beside the shared expert's blocks
  int threads = ((E + 31) / 32) * 32;
  if (ride.comb != nullptr && threads < 64) threads = 64;  // a ride: warp 1 runs it
  return ds4_pdl::launch(router_topk_kernel, dim3(n_tok), dim3(threads), 2L * E * sizeof(float), st, logits, E, bias,
                         tid2eid, tid64 ? 1 : 0, token_ids, topk, route_scale, w_out, ids_out, ride,
                         router_trigger_early());
}

}  // namespace ds4
