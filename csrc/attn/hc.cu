// mHC pre / post / head (spec §4) in three small launches per call site:
//   hc_partials: the (2+hc)*hc x hc*D fp32 matvec and the sum of squares, K split over ~128 blocks
//                per token (partials in a small fp32 workspace);
//   hc_finish:   reduce the partials, RMS factor, sigmoids, Sinkhorn (exact op order of
//                ds4.ops.hc_torch.sinkhorn), weighted sum of the streams (D split over blocks, each
//                block redoes the tiny Sinkhorn so no third launch is needed); with the block's
//                attn/ffn norm weight, one block per token (HC_NORM_THREADS wide with unrolled
//                passes over D) that also RMS-normalises the result, its warp 0 running the Sinkhorn
//                meanwhile. H200, no PDL, per call: 29.7 us at 128 threads, 13.7 us at 512, 8.6 us
//                with sinkhorn_warp below;
//   hc_post:     out[k] = post[k] x + sum_j comb[j, k] res[j], elementwise.
#include "attn_common.cuh"
#include "attn_launch.h"

namespace ds4_attn {

constexpr int HC_THREADS = 128;
constexpr int HC_NORM_THREADS = 512;
constexpr int HC_MAX_MIX = 80;   // hc <= 8
constexpr int HC_MAX_N = 8;

int hc_nsplit(int K) {
  // ~128 blocks per token at K = 16384 (one element per thread), at least one block
  int chunk = HC_THREADS;
  while ((K + chunk - 1) / chunk > 128) chunk += HC_THREADS;
  return (K + chunk - 1) / chunk;
}

template <int MAXM>
__global__ void __launch_bounds__(HC_THREADS) hc_partials_kernel(const void* __restrict__ h, bool h_f32,
                                                                  const float* __restrict__ fn, int K, int mix,
                                                                  int nsplit, float* __restrict__ part) {
  DS4_MARK(0);
  ds4_pdl::begin();
  const int split = blockIdx.x, t = blockIdx.y;
  const int chunk = (K + nsplit - 1) / nsplit;
  const int k0 = split * chunk, k1 = min(K, k0 + chunk);
  float acc[MAXM + 1];
#pragma unroll
  for (int m = 0; m <= MAXM; ++m) acc[m] = 0.f;
  const long hoff = (long)t * K;
  for (int k = k0 + threadIdx.x; k < k1; k += HC_THREADS) {
    const float v = ld_as_float(h, hoff + k, h_f32);
    acc[MAXM] += v * v;
#pragma unroll
    for (int m = 0; m < MAXM; ++m)
      if (m < mix) acc[m] += __ldg(fn + (long)m * K + k) * v;
  }
  DS4_MARK(1);
  __shared__ float red[HC_THREADS / 32][MAXM + 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int m = 0; m <= MAXM; ++m) {
    float v = acc[m];
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) red[warp][m] = v;
  }
  __syncthreads();
  for (int m = threadIdx.x; m <= mix; m += HC_THREADS) {
    const int src = m == mix ? MAXM : m;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < HC_THREADS / 32; ++w) v += red[w][src];
    part[((long)t * nsplit + split) * (mix + 1) + m] = v;
  }
  DS4_MARK(2);
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + expf(-x)); }

// Sinkhorn of an N x N matrix (N = 1, 2, 4) in one warp, lane j*N + k holding C[j][k] (c: the logits),
// in ds4.ops.hc_torch.sinkhorn's op order: row softmax + eps, column normalise, then iters - 1 rounds
// of row and column normalisation. Rows / columns are reduced with shuffles (row partners differ in
// the low log2(N) lane bits, column partners in the next ones). Lanes >= N*N run the same steps on
// their own values (xor offsets < N*N never leave that range) starting from 0, so they stay finite:
// a division with a NaN or zero operand takes the slow path of the IEEE division for the whole warp
// (H200: 8.7 us for 20 iterations when those lanes carried NaN, 5.4 us with a runtime N).
template <int N>
__device__ __forceinline__ float sinkhorn_warp(float c, int iters, float hc_eps) {
  constexpr unsigned full = 0xffffffffu;
  constexpr int NN = N * N;
  float mx = c;
#pragma unroll
  for (int o = 1; o < N; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(full, mx, o));
  const float e = expf(c - mx);
  float sum = e;
#pragma unroll
  for (int o = 1; o < N; o <<= 1) sum += __shfl_xor_sync(full, sum, o);
  c = e / sum + hc_eps;  // row softmax + eps
  sum = c;
#pragma unroll
  for (int o = N; o < NN; o <<= 1) sum += __shfl_xor_sync(full, sum, o);
  c = c / (sum + hc_eps);  // column normalise
  for (int it = 1; it < iters; ++it) {
    sum = c;
#pragma unroll
    for (int o = 1; o < N; o <<= 1) sum += __shfl_xor_sync(full, sum, o);
    c = c / (sum + hc_eps);  // rows
    sum = c;
#pragma unroll
    for (int o = N; o < NN; o <<= 1) sum += __shfl_xor_sync(full, sum, o);
    c = c / (sum + hc_eps);  // columns
  }
  return c;
}

// comb of token t (block x = 0 writes it) by sinkhorn_warp in warp 0, from the reduced partials tot.
__device__ __forceinline__ void hc_comb_warp(const float* tot, int t, int n, int D, int mix, const float* scale,
                                             const float* base, int iters, float hc_eps, float norm_eps,
                                             float* __restrict__ comb) {
  const int lane = threadIdx.x, nn = n * n;
  const float r = rsqrtf(tot[mix] / (float)(n * D) + norm_eps);
  const float c0 = lane < nn ? tot[2 * n + lane] * r * scale[2] + base[2 * n + lane] : 0.f;
  const float c = n == 4 ? sinkhorn_warp<4>(c0, iters, hc_eps)
                : n == 2 ? sinkhorn_warp<2>(c0, iters, hc_eps) : sinkhorn_warp<1>(c0, iters, hc_eps);
  if (lane < nn && blockIdx.x == 0) comb[(long)t * nn + lane] = c;
}

// Reduces the token's partials and computes pre[] (shared memory; valid after the caller's
// __syncthreads) and, in block x = 0, post and comb (Sinkhorn) in global memory. scale / base are
// the kernel's shared-memory copies (read once, in parallel, before the PDL wait: one thread reading
// them in turn put a chain of dependent global loads before the Sinkhorn).
template <int THREADS>
__device__ __forceinline__ void hc_coeffs(const float* __restrict__ part, int t, int n, int D, int mix, int nsplit,
                                          const float* scale, const float* base, int iters,
                                          float hc_eps, float norm_eps, bool head, float* __restrict__ post,
                                          float* __restrict__ comb, float* tot, float* pre, float* cm,
                                          bool defer_warp_sinkhorn = false) {
  {  // one warp per mix entry: lanes stride over the splits, then a fixed shuffle tree (deterministic);
     // a serial loop over ~128 partials per thread was ~12 us of dependent L2 round trips
    const int lane = threadIdx.x & 31;
    for (int m = threadIdx.x >> 5; m <= mix; m += THREADS / 32) {
      float v = 0.f;
#pragma unroll 4
      for (int s = lane; s < nsplit; s += 32) v += part[((long)t * nsplit + s) * (mix + 1) + m];
      for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) tot[m] = v;
    }
  }
  __syncthreads();
  DS4_MARK(2);
  // n a power of two <= 4 (V4: n = 4): warp 0 runs Sinkhorn in registers (sinkhorn_warp); other n use
  // the serial loop below (~20 dependent divisions deep per iteration on one thread).
  const bool warp_sinkhorn = !head && (n == 1 || n == 2 || n == 4);
  if (threadIdx.x < 32) {  // lane j: pre[j]; lane n + j: post[j] (n <= 8)
    const int lane = threadIdx.x;
    const float r = rsqrtf(tot[mix] / (float)(n * D) + norm_eps);
    if (lane < n)
      pre[lane] = sigmoidf_(tot[lane] * r * scale[0] + base[lane]) + hc_eps;
    else if (!head && blockIdx.x == 0 && lane < 2 * n)
      post[(long)t * n + lane - n] = 2.f * sigmoidf_(tot[lane] * r * scale[1] + base[lane]);
  }
  if (threadIdx.x == 0) {
    const float r = rsqrtf(tot[mix] / (float)(n * D) + norm_eps);
    if (!head && !warp_sinkhorn) {
      const bool w = blockIdx.x == 0;
      const float s2 = scale[2];
      for (int i = 0; i < n * n; ++i) cm[i] = tot[2 * n + i] * r * s2 + base[2 * n + i];
      // row softmax + eps
      for (int j = 0; j < n; ++j) {
        float mx = -INFINITY;
        for (int k = 0; k < n; ++k) mx = fmaxf(mx, cm[j * n + k]);
        float sum = 0.f;
        for (int k = 0; k < n; ++k) {
          const float e = expf(cm[j * n + k] - mx);
          cm[j * n + k] = e;
          sum += e;
        }
        for (int k = 0; k < n; ++k) cm[j * n + k] = cm[j * n + k] / sum + hc_eps;
      }
      // column normalise
      for (int k = 0; k < n; ++k) {
        float sum = 0.f;
        for (int j = 0; j < n; ++j) sum += cm[j * n + k];
        for (int j = 0; j < n; ++j) cm[j * n + k] = cm[j * n + k] / (sum + hc_eps);
      }
      for (int it = 1; it < iters; ++it) {
        for (int j = 0; j < n; ++j) {
          float sum = 0.f;
          for (int k = 0; k < n; ++k) sum += cm[j * n + k];
          for (int k = 0; k < n; ++k) cm[j * n + k] = cm[j * n + k] / (sum + hc_eps);
        }
        for (int k = 0; k < n; ++k) {
          float sum = 0.f;
          for (int j = 0; j < n; ++j) sum += cm[j * n + k];
          for (int j = 0; j < n; ++j) cm[j * n + k] = cm[j * n + k] / (sum + hc_eps);
        }
      }
      if (w)
        for (int i = 0; i < n * n; ++i) comb[(long)t * n * n + i] = cm[i];
    }
  }
  if (warp_sinkhorn && !defer_warp_sinkhorn && threadIdx.x < 32)
    hc_comb_warp(tot, t, n, D, mix, scale, base, iters, hc_eps, norm_eps, comb);
}

template <int THREADS>
__global__ void __launch_bounds__(THREADS, 1) hc_finish_kernel(const void* __restrict__ h, bool h_f32,
                                                                const float* __restrict__ part, int n, int D, int mix,
                                                                int nsplit, const float* __restrict__ scale,
                                                                const float* __restrict__ base, int iters,
                                                                float hc_eps, float norm_eps, bool head, void* x,
                                                                float* __restrict__ post, float* __restrict__ comb,
                                                                const void* __restrict__ norm, bool norm_f32) {
  DS4_MARK(0);
  __shared__ float s_scale[3], s_base[HC_MAX_MIX];
  for (int i = threadIdx.x; i < mix; i += THREADS) s_base[i] = base[i];  // weights: no PDL dependence
  if (threadIdx.x < (head ? 1 : 3)) s_scale[threadIdx.x] = scale[threadIdx.x];
  ds4_pdl::begin();
  DS4_MARK(1);
  const int t = blockIdx.y;
  __shared__ float tot[HC_MAX_MIX + 1];
  __shared__ float pre[HC_MAX_N];
  __shared__ float cm[HC_MAX_N * HC_MAX_N];
  // With the norm (one block per token), warp 0 runs the Sinkhorn while warps 1.. form x and normalise
  // it: the two are independent (comb is only read by hc_post, after the attention / FFN), so the
  // kernel takes the longer of them instead of their sum (H200 probe: Sinkhorn 3.5 us, weighted sum
  // + norm 2.2 us).
  const bool overlap = norm != nullptr && !head && (n == 1 || n == 2 || n == 4) && THREADS > 32;
  hc_coeffs<THREADS>(part, t, n, D, mix, nsplit, s_scale, s_base, iters, hc_eps, norm_eps, head, post, comb, tot, pre,
                     cm, overlap);
  __syncthreads();
  DS4_MARK(3);
  const long hoff = (long)t * n * D;
  if (norm != nullptr) {  // one block per token: x in h's dtype, then the block's RMSNorm (fp32) over it
    if (overlap && threadIdx.x < 32) {
      hc_comb_warp(tot, t, n, D, mix, s_scale, s_base, iters, hc_eps, norm_eps, comb);
      DS4_MARK(4);
      DS4_MARK(5);
      return;
    }
    const int w0 = overlap ? 1 : 0;  // first warp of the x / norm work
    const int tid = threadIdx.x - 32 * w0, nthr = THREADS - 32 * w0;
    extern __shared__ float xs[];  // [D]
    __shared__ float red[THREADS / 32];
    float ss = 0.f;
#pragma unroll 4
    for (int d = tid; d < D; d += nthr) {
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < HC_MAX_N; ++j)
        if (j < n) acc += pre[j] * ld_as_float(h, hoff + (long)j * D + d, h_f32);
      const float xv = h_f32 ? acc : bf16r(acc);
      xs[d] = xv;
      ss += xv * xv;
    }
    for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    if (overlap) asm volatile("bar.sync 1, %0;" ::"r"(nthr) : "memory");  // warps 1.. only
    else __syncthreads();
    float tot_ss = 0.f;
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w)
      if (w >= w0) tot_ss += red[w];
    const float r = rsqrtf(tot_ss / (float)D + norm_eps);
#pragma unroll 4
    for (int d = tid; d < D; d += nthr) {
      const float y = xs[d] * r * ld_as_float(norm, d, norm_f32);
      if (h_f32)
        static_cast<float*>(x)[(long)t * D + d] = y;
      else
        static_cast<__nv_bfloat16*>(x)[(long)t * D + d] = __float2bfloat16(y);
    }
    return;
  }
  for (int d = blockIdx.x * THREADS + threadIdx.x; d < D; d += gridDim.x * THREADS) {
    float acc = 0.f;
    for (int j = 0; j < n; ++j) acc += pre[j] * ld_as_float(h, hoff + (long)j * D + d, h_f32);
    if (h_f32)
      static_cast<float*>(x)[(long)t * D + d] = acc;
    else
      static_cast<__nv_bfloat16*>(x)[(long)t * D + d] = __float2bfloat16(acc);
  }
}

__global__ void hc_post_kernel(const void* __restrict__ x, bool x_f32, const void* __restrict__ res, bool res_f32,
                               const float* __restrict__ post, const float* __restrict__ comb, int N, int n, int D,
                               void* out) {
  ds4_pdl::begin();
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long)N * D) return;
  const int t = (int)(i / D), d = (int)(i % D);
  const float xv = ld_as_float(x, i, x_f32);
  float r[HC_MAX_N];
#pragma unroll
  for (int j = 0; j < HC_MAX_N; ++j) r[j] = j < n ? ld_as_float(res, ((long)t * n + j) * D + d, res_f32) : 0.f;
  const float* cb = comb + (long)t * n * n;
  for (int k = 0; k < n; ++k) {
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < HC_MAX_N; ++j)
      if (j < n) acc += cb[j * n + k] * r[j];
    const float v = post[(long)t * n + k] * xv + acc;
    const long o = ((long)t * n + k) * D + d;
    if (res_f32)
      static_cast<float*>(out)[o] = v;
    else
      static_cast<__nv_bfloat16*>(out)[o] = __float2bfloat16(v);
  }
}

cudaError_t launch_hc_partials(const void* h, bool h_f32, const float* fn, int N, int K, int mix, int nsplit,
                               float* part, cudaStream_t st) {
  if (mix < 1 || mix > HC_MAX_MIX || N < 1 || K < 1 || nsplit < 1 || N > 65535) return cudaErrorInvalidValue;
  dim3 grid(nsplit, N);
  auto kern = mix <= 4 ? hc_partials_kernel<4> : mix <= 24 ? hc_partials_kernel<24>
            : mix <= 48 ? hc_partials_kernel<48> : hc_partials_kernel<80>;
  return ds4_pdl::launch(kern, grid, dim3(HC_THREADS), 0, st, h, h_f32, fn, K, mix, nsplit, part);
}

cudaError_t launch_hc_finish(const void* h, bool h_f32, const float* part, int N, int n, int D, int mix, int nsplit,
                             const float* scale, const float* base, int iters, float hc_eps, float norm_eps,
                             bool head, void* x, float* post, float* comb, const void* norm, bool norm_f32,
                             cudaStream_t st) {
  if (n < 1 || n > HC_MAX_N || mix > HC_MAX_MIX || N < 1 || N > 65535) return cudaErrorInvalidValue;
  if (head ? mix != n : mix != (2 + n) * n) return cudaErrorInvalidValue;
  if (norm != nullptr && (long)D * 4 > 48 * 1024) return cudaErrorInvalidValue;
  if (norm != nullptr)
    return ds4_pdl::launch(hc_finish_kernel<HC_NORM_THREADS>, dim3(1, N), dim3(HC_NORM_THREADS), (size_t)D * sizeof(float),
                           st, h, h_f32, part, n, D, mix, nsplit, scale, base, iters, hc_eps, norm_eps, head, x, post,
                           comb, norm, norm_f32);
  const int per_block = HC_THREADS * 4;
  dim3 grid((D + per_block - 1) / per_block, N);
  return ds4_pdl::launch(hc_finish_kernel<HC_THREADS>, grid, dim3(HC_THREADS), 0, st, h, h_f32, part, n, D, mix, nsplit,
                         scale, base, iters, hc_eps, norm_eps, head, x, post, comb, norm, norm_f32);
}

cudaError_t launch_hc_post(const void* x, bool x_f32, const void* res, bool res_f32, const float* post,
                           const float* comb, int N, int n, int D, void* out, cudaStream_t st) {
  if (n < 1 || n > HC_MAX_N) return cudaErrorInvalidValue;
  const long total = (long)N * D;
  if (total == 0) return cudaSuccess;
  const int threads = 256;
  return ds4_pdl::launch(hc_post_kernel, dim3((unsigned)((total + threads - 1) / threads)), dim3(threads), 0, st, x,
                         x_f32, res, res_f32, post, comb, N, n, D, out);
}

}  // namespace ds4_attn
