// The router's tail for one token on one warp (spec §6.1), shared by the fused router (router.cu) and
// the one-token MoE kernels that route for themselves (moe.cu, MoEArgs::route_logits): scores =
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

// Top-k of the biased scores b[0..E) (shared memory, consumed: winners are set to -inf) by one warp:
// each lane scans its strided share in ascending order, a shuffle arg-max picks the expert. -> sel[k].
__device__ __forceinline__ void topk_warp(float* b, int E, int topk, int* sel) {
  const int lane = threadIdx.x & 31;
  for (int k = 0; k < topk; ++k) {
    float v = -INFINITY;
    int i = 0x7fffffff;
    for (int e = lane; e < E; e += 32) {  // ascending: the first of equal values is the lowest id
      const float be = b[e];
      if (be > v || (be == v && e < i)) { v = be; i = e; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, v, o);
      const int oi = __shfl_xor_sync(0xffffffffu, i, o);
      if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
    i = i < E ? i : 0;  // only NaN scores leave no candidate: keep the index in range
    if (lane == 0) sel[k] = i;
    if ((i & 31) == lane) b[i] = -INFINITY;  // the owning lane removes the winner
    __syncwarp();
  }
}

// One warp routes token t from its logits [E]: sc / bs are shared scratch of E floats each; sel / w
// (shared, topk entries) receive the expert ids and weights. Ends with __syncwarp (the warp sees them).
__device__ __forceinline__ void route_token_warp(const float* logits, int E, const float* bias, const void* tid2eid,
                                                 int tid64, const int64_t* token_ids, int t, int topk,
                                                 float route_scale, float* sc, float* bs, int* sel, float* w) {
  const int lane = threadIdx.x & 31;
  for (int e = lane; e < E; e += 32) {
    const float s = router_score(logits[(long)t * E + e]);
    sc[e] = s;
    bs[e] = s + (bias ? bias[e] : 0.f);
  }
  __syncwarp();
  if (tid2eid) {
    if (lane < topk) sel[lane] = hash_expert(tid2eid, tid64, token_ids, t, topk, lane);
  } else {
    topk_warp(bs, E, topk, sel);
  }
  __syncwarp();
  if (lane == 0) route_weights(sc, sel, topk, route_scale, w);
  __syncwarp();
}

}  // namespace ds4
