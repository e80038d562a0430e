// The router's tail for one token on one warp (spec §6.1), shared by the fused router (router.cu) and
// the one-token MoE kernels that route for themselves (moe_mma.cu, MoEArgs::route_logits): scores =
// sqrt(softplus(logits)) (torch's threshold 20); learned layers: top-k of score + bias, ties to the
// lower expert id; hash layers: tid2eid[token]; weights = scores[ids] / (their sum in selection order)
// * route_scale. The same arithmetic and selection as router_topk_kernel, so every path picks the
// same experts with the same weights.
#pragma once
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

namespace ds4 {

constexpr int ROUTER_MAX_K = 16;

// Hash layers: the k-th expert of token t is tid2eid[token_ids[t], k] (int64 or int32 table).
__device__ __forceinline__ int hash_expert(const void* tid2eid, int tid64, const int64_t* token_ids, int t, int topk,
                                           int k) {
  const long i = token_ids[t] * topk + k;
  return tid64 ? (int)reinterpret_cast<const int64_t*>(tid2eid)[i] : reinterpret_cast<const int32_t*>(tid2eid)[i];
}

__device__ __forceinline__ float router_score(float logit) { return sqrtf(logit > 20.f ? logit : log1pf(expf(logit))); }

// Token t's weights from its scores and selected ids (one thread): w[k] = scores[sel[k]] * route_scale / sum.
__device__ __forceinline__ void route_weights(const float* scores, const int* sel, int topk, float route_scale, float* w) {
  float sum = 0.f;
  for (int k = 0; k < topk; ++k) sum += scores[sel[k]];
  const float inv = route_scale / sum;
  for (int k = 0; k < topk; ++k) w[k] = scores[sel[k]] * inv;
}

// Order-preserving key of a biased score: key(a) > key(b) exactly when a > b, one key for -0 and +0. NaN
// maps to 0, below every number (the float comparisons it replaces never selected NaN); 0 also marks a
// taken expert.
__device__ __forceinline__ unsigned score_key(float v) {
  if (v != v) return 0u;
  unsigned u = __float_as_uint(v);
  if (u == 0x80000000u) u = 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Scores of token t (sc, E floats) and the keys of score + bias (key, E unsigned), threads `tid` of
// `nthreads`: sqrt(softplus(logit)) as the reference. The logits are read from L2 (__ldcg): the fused router's
// last block reads the other blocks' writes of the same launch.
__device__ __forceinline__ void route_scores(const float* logits, int E, const float* bias, int t, float* sc,
                                             unsigned* key, int tid, int nthreads) {
  for (int e = tid; e < E; e += nthreads) {
    const float s = router_score(__ldcg(logits + (long)t * E + e));
    sc[e] = s;
    key[e] = score_key(s + (bias ? bias[e] : 0.f));
  }
}

// Top-k of the keys key[0..E) (shared memory, consumed: winners set to 0) by one warp, best first, ties to the
// lower id -> sel[k]. Each round every lane scans its strided share in ascending order (its first best is its
// lowest id), then two warp reductions (redux.sync, sm_80+) give the best key and the lowest id holding it.
// Before, a 5-step shuffle tree of (value, id) pairs per round, and in router_topk_kernel a per-warp top-k
// with a second top-k over the warps' candidates: the same experts in the same order, in fewer dependent steps.
__device__ __forceinline__ void topk_warp(unsigned* key, int E, int topk, int* sel) {
  const int lane = threadIdx.x & 31;
  for (int k = 0; k < topk; ++k) {
    unsigned best = 0u, bi = 0xffffffffu;
    for (int e = lane; e < E; e += 32) {
      const unsigned ke = key[e];
      if (ke > best) { best = ke; bi = (unsigned)e; }
    }
    const unsigned m = __reduce_max_sync(0xffffffffu, best);
    const unsigned id = __reduce_min_sync(0xffffffffu, best == m ? bi : 0xffffffffu);
    const int i = id < (unsigned)E ? (int)id : 0;  // only NaN scores leave no candidate: keep the index in range
    if (lane == 0) sel[k] = i;
    if (id < (unsigned)E && (i & 31) == lane) key[i] = 0u;  // the owning lane removes the winner
    __syncwarp();
  }
}

// The selection of token t from its scores (route_scores) by one warp: ids -> sel, weights -> w (shared,
// topk entries). Ends with __syncwarp (the warp sees them).
__device__ __forceinline__ void route_select_warp(const float* sc, unsigned* key, int E, const void* tid2eid,
                                                  int tid64, const int64_t* token_ids, int t, int topk,
                                                  float route_scale, int* sel, float* w) {
  const int lane = threadIdx.x & 31;
  if (tid2eid) {
    if (lane < topk) sel[lane] = hash_expert(tid2eid, tid64, token_ids, t, topk, lane);
  } else {
    topk_warp(key, E, topk, sel);
  }
  __syncwarp();
  if (lane == 0) route_weights(sc, sel, topk, route_scale, w);
  __syncwarp();
}

// One warp routes token t from its logits [E]: sc / key are shared scratch of E floats / unsigned each; sel / w
// (shared, topk entries) receive the expert ids and weights. Ends with __syncwarp (the warp sees them).
__device__ __forceinline__ void route_token_warp(const float* logits, int E, const float* bias, const void* tid2eid,
                                                 int tid64, const int64_t* token_ids, int t, int topk,
                                                 float route_scale, float* sc, unsigned* key, int* sel, float* w) {
  route_scores(logits, E, bias, t, sc, key, threadIdx.x & 31, 32);
  __syncwarp();
  route_select_warp(sc, key, E, tid2eid, tid64, token_ids, t, topk, route_scale, sel, w);
}

}  // namespace ds4
