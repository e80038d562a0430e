// The mHC Sinkhorn (spec §4) of one token's n x n comb logits in one thread's registers, shared by the hc
// finish (csrc/attn/hc.cu) and the launches that finish comb later in the decode step (the "ride", below).
#pragma once
#include <cuda_runtime.h>
#include <math.h>

#include "sinkhorn_ride.h"

namespace ds4 {

// reciprocal, MUFU approximation (<= 1 ulp; the sums here lie in [eps, n + eps], never subnormal)
__device__ __forceinline__ float rcp_approx(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// Every row (ROWS) or column of c scaled by the reciprocal of its sum + eps.
template <int N, bool ROWS>
__device__ __forceinline__ void sinkhorn_scale(float (&c)[N * N], float hc_eps) {
  float r[N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float sum = 0.f;
#pragma unroll
    for (int e = 0; e < N; ++e) sum += c[ROWS ? i * N + e : e * N + i];
    r[i] = rcp_approx(sum + hc_eps);
  }
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int k = 0; k < N; ++k) c[j * N + k] *= r[ROWS ? j : k];
}

// Sinkhorn of an N x N matrix held in one thread's registers (c: the logits), in
// ds4.ops.hc_torch.sinkhorn's op order: row softmax + eps, column normalise, then iters - 1 rounds of
// row and column normalisation. Each row / column is scaled by the reciprocal of its sum instead of
// divided by the sum: comb then differs from the reference's divisions by a few ulp (fp32), where 20
// iterations of divisions and shuffles across lanes were ~3 us of latency on the critical path.
template <int N>
__device__ __forceinline__ void sinkhorn_regs(float (&c)[N * N], int iters, float hc_eps) {
#pragma unroll
  for (int j = 0; j < N; ++j) {  // row softmax + eps
    float mx = c[j * N];
#pragma unroll
    for (int k = 1; k < N; ++k) mx = fmaxf(mx, c[j * N + k]);
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      c[j * N + k] = expf(c[j * N + k] - mx);
      sum += c[j * N + k];
    }
    const float r = rcp_approx(sum);
#pragma unroll
    for (int k = 0; k < N; ++k) c[j * N + k] = c[j * N + k] * r + hc_eps;
  }
  sinkhorn_scale<N, false>(c, hc_eps);  // column normalise
  for (int it = 1; it < iters; ++it) {
    sinkhorn_scale<N, true>(c, hc_eps);   // rows
    sinkhorn_scale<N, false>(c, hc_eps);  // columns
  }
}

template <int N>
__device__ __forceinline__ void sinkhorn_ride_n(float* comb, int iters, float eps) {
  float c[N * N];
#pragma unroll
  for (int i = 0; i < N * N; ++i) c[i] = comb[i];
  sinkhorn_regs<N>(c, iters, eps);
#pragma unroll
  for (int i = 0; i < N * N; ++i) comb[i] = c[i];
}

// Token t's comb finished in place by the calling thread: the finish's own arithmetic on the same fp32 logits,
// so the same bits as a finish with iters.
__device__ __forceinline__ void sinkhorn_ride(const SinkhornRide& r, int t) {
  float* c = r.comb + (long)t * r.n * r.n;
  if (r.n == 4) sinkhorn_ride_n<4>(c, r.iters, r.eps);
  else if (r.n == 2) sinkhorn_ride_n<2>(c, r.iters, r.eps);
  else sinkhorn_ride_n<1>(c, r.iters, r.eps);
}

}  // namespace ds4
