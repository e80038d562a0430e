// Router tail on the device (spec §6.1): one block per token, one thread per expert.
// scores = sqrt(softplus(logits)) (torch's threshold 20); learned layers: top-k of scores + bias
// (k rounds of a block arg-max, ties to the lower expert id); hash layers: ids = tid2eid[token].
// weights = scores[ids] / sum * route_scale. The logits come from the BF16 GEMV (gemv.cu).
#include "ds4_common.cuh"
#include "ds4_launch.h"

namespace ds4 {

constexpr int ROUTER_MAX_K = 16;

__global__ void router_topk_kernel(const float* __restrict__ logits, int E, const float* __restrict__ bias,
                                   const void* __restrict__ tid2eid, int tid64,
                                   const int64_t* __restrict__ token_ids, int topk, float route_scale,
                                   float* __restrict__ w_out, int64_t* __restrict__ ids_out) {
  ds4_pdl::begin();
  extern __shared__ float sh[];  // scores [E]
  __shared__ float red_v[32];
  __shared__ int red_i[32];
  __shared__ int sel[ROUTER_MAX_K];
  const int t = blockIdx.x, e = threadIdx.x;
  float biased = -INFINITY;
  if (e < E) {
    const float l = logits[(long)t * E + e];
    const float s = sqrtf(l > 20.f ? l : log1pf(expf(l)));
    sh[e] = s;
    biased = s + (bias ? bias[e] : 0.f);
  }
  __syncthreads();
  if (tid2eid) {
    if (e < topk) {
      const long tok = token_ids[t];
      sel[e] = tid64 ? (int)reinterpret_cast<const int64_t*>(tid2eid)[tok * topk + e]
                     : reinterpret_cast<const int32_t*>(tid2eid)[tok * topk + e];
    }
  } else {
    const int lane = e & 31, warp = e >> 5, nw = (blockDim.x + 31) >> 5;
    for (int k = 0; k < topk; ++k) {
      float v = biased;
      int i = e < E ? e : 0x7fffffff;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
      }
      if (lane == 0) { red_v[warp] = v; red_i[warp] = i; }
      __syncthreads();
      if (warp == 0) {
        v = lane < nw ? red_v[lane] : -INFINITY;
        i = lane < nw ? red_i[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          const float ov = __shfl_xor_sync(0xffffffffu, v, o);
          const int oi = __shfl_xor_sync(0xffffffffu, i, o);
          if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
        }
        if (lane == 0) sel[k] = i;
      }
      __syncthreads();
      if (e == sel[k]) biased = -INFINITY;
    }
  }
  __syncthreads();
  if (e == 0) {
    float sum = 0.f;
    for (int k = 0; k < topk; ++k) sum += sh[sel[k]];
    const float inv = route_scale / sum;
    for (int k = 0; k < topk; ++k) {
      w_out[(long)t * topk + k] = sh[sel[k]] * inv;
      ids_out[(long)t * topk + k] = sel[k];
    }
  }
}

cudaError_t launch_router_topk(const float* logits, int n_tok, int E, const float* bias, const void* tid2eid,
                               bool tid64, const int64_t* token_ids, int topk, float route_scale, float* w_out,
                               int64_t* ids_out, cudaStream_t st) {
  if (n_tok < 1 || E < 1 || E > 1024 || topk < 1 || topk > ROUTER_MAX_K || topk > E) return cudaErrorInvalidValue;
  const int threads = ((E + 31) / 32) * 32;
  return ds4_pdl::launch(router_topk_kernel, dim3(n_tok), dim3(threads), E * sizeof(float), st, logits, E, bias,
                         tid2eid, tid64 ? 1 : 0, token_ids, topk, route_scale, w_out, ids_out);
}

}  // namespace ds4
