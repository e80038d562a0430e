// mHC pre / post / head (spec §4) in small launches per call site:
//   hc_partials: the (2+hc)*hc x hc*D fp32 matvec and the sum of squares, K split over ~128 blocks
//                per token (partials in a small fp32 workspace); the fn values of a thread's first
//                pass are loaded before the PDL wait (weights). Its POST form first computes the
//                elements of the previous site's hc_post (below) and writes them: a block's post
//                followed by the next site's pre is 2 launches, not 3 (hc_post_pre);
//   hc_finish:   reduce the partials, RMS factor, sigmoids, Sinkhorn (exact op order of
//                ds4.ops.hc_torch.sinkhorn), weighted sum of the streams (D split over blocks, each
//                block redoes the tiny Sinkhorn so no third launch is needed); with the block's
//                attn/ffn norm weight, one block per token (HC_NORM_THREADS wide with unrolled
//                passes over D) that also RMS-normalises the result, its warp 0 running the Sinkhorn
//                meanwhile. H200, no PDL, per call: 29.7 us at 128 threads, 13.7 us at 512, 8.6 us
//                with a shuffle-based Sinkhorn in one warp, 8.0 us with it overlapped (session 5);
//                the Sinkhorn now runs in one thread's registers (sinkhorn_regs, ../sinkhorn_dev.cuh), or
//                with iters = 0 in a later launch of the decode step (the "ride", ds4.ops.hc_cuda). The V4
//                case (bf16, n = 4) takes hc_finish_norm_kernel instead: x and its norm in registers, 5.0 us;
//   hc_post:     out[k] = post[k] x + sum_j comb[j, k] res[j], elementwise.
#include "../ds4_common.cuh"  // the FP8 weight decode the projection fold shares with the ds4 GEMVs
#include "../sinkhorn_dev.cuh"
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

// The previous site's hc_post, fused into hc_partials (POST): x = that block's output [N, D],
// res = the residual streams it updates [N, n, D], out = the new streams (res's dtype).
struct HcPostArgs {
  const void* x = nullptr;
  bool x_f32 = false;
  const float* post = nullptr;  // [N, n]
  const float* comb = nullptr;  // [N, n, n]
  int n = 0, D = 0;
  void* out = nullptr;
};

// Element k = j * D + d of token t's new streams: post[j] x[d] + sum_i comb[i, j] res[i, d] in fp32
// (hc_post_kernel's order), stored in res's dtype; returns the stored value.
__device__ __forceinline__ float hc_post_elem(const HcPostArgs& a, const void* res, bool res_f32, int t, int k) {
  const int j = k / a.D, d = k - j * a.D;
  const float* cb = a.comb + (long)t * a.n * a.n;
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < HC_MAX_N; ++i)
    if (i < a.n) acc += cb[i * a.n + j] * ld_as_float(res, ((long)t * a.n + i) * a.D + d, res_f32);
  const float v = a.post[(long)t * a.n + j] * ld_as_float(a.x, (long)t * a.D + d, a.x_f32) + acc;
  const long o = (long)t * a.n * a.D + k;
  if (res_f32) {
    static_cast<float*>(a.out)[o] = v;
    return v;
  }
  const __nv_bfloat16 b = __float2bfloat16(v);
  static_cast<__nv_bfloat16*>(a.out)[o] = b;
  return __bfloat162float(b);
}

// part[t, m, split] (m = mix: the sum of squares), split-contiguous so that hc_coeffs' lanes read
// consecutive words.
template <int MAXM, bool POST>
__global__ void __launch_bounds__(HC_THREADS) hc_partials_kernel(const void* __restrict__ h, bool h_f32,
                                                                  const float* __restrict__ fn, int K, int mix,
                                                                  int nsplit, float* __restrict__ part, HcPostArgs pa) {
  DS4_MARK(0);
  const int split = blockIdx.x, t = blockIdx.y;
  const int chunk = (K + nsplit - 1) / nsplit;
  const int k0 = split * chunk, k1 = min(K, k0 + chunk);
  // fn is a weight: the first pass's values are loaded before the wait for the previous kernel
  float f[MAXM];
  int k = k0 + threadIdx.x;
#pragma unroll
  for (int m = 0; m < MAXM; ++m) f[m] = (m < mix && k < k1) ? __ldg(fn + (long)m * K + k) : 0.f;
  ds4_pdl::begin();
  float acc[MAXM + 1];
#pragma unroll
  for (int m = 0; m <= MAXM; ++m) acc[m] = 0.f;
  const long hoff = (long)t * K;
  for (; k < k1; k += HC_THREADS) {
    const float v = POST ? hc_post_elem(pa, h, h_f32, t, k) : ld_as_float(h, hoff + k, h_f32);
    acc[MAXM] += v * v;
#pragma unroll
    for (int m = 0; m < MAXM; ++m)
      if (m < mix) acc[m] += f[m] * v;
    const int kn = k + HC_THREADS;
    if (kn < k1) {
#pragma unroll
      for (int m = 0; m < MAXM; ++m)
        if (m < mix) f[m] = __ldg(fn + (long)m * K + kn);
    }
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
    part[((long)t * (mix + 1) + m) * nsplit + split] = v;
  }
  DS4_MARK(2);
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + expf(-x)); }

template <int N>
__device__ __forceinline__ void hc_comb_n(const float* tot, int t, int D, int mix, const float* scale, const float* base,
                                          int iters, float hc_eps, float norm_eps, float* __restrict__ comb) {
  const float r = rsqrtf(tot[mix] / (float)(N * D) + norm_eps);
  float c[N * N];
#pragma unroll
  for (int i = 0; i < N * N; ++i) c[i] = tot[2 * N + i] * r * scale[2] + base[2 * N + i];
  if (iters > 0) ds4::sinkhorn_regs<N>(c, iters, hc_eps);  // iters = 0: comb gets the logits (a ride finishes it)
  if (blockIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < N * N; ++i) comb[(long)t * N * N + i] = c[i];
  }
}

// comb of token t (block x = 0 writes it), computed by the calling thread alone (n = 1, 2, 4).
__device__ __forceinline__ void hc_comb_thread(const float* tot, int t, int n, int D, int mix, const float* scale,
                                               const float* base, int iters, float hc_eps, float norm_eps,
                                               float* __restrict__ comb) {
  if (n == 4) hc_comb_n<4>(tot, t, D, mix, scale, base, iters, hc_eps, norm_eps, comb);
  else if (n == 2) hc_comb_n<2>(tot, t, D, mix, scale, base, iters, hc_eps, norm_eps, comb);
  else hc_comb_n<1>(tot, t, D, mix, scale, base, iters, hc_eps, norm_eps, comb);
}

// tot[m] = sum over the splits of token t's partial m (m <= mix), by NW warps: one warp per entry, two
// entries per pass with their loads issued together; lanes stride over the splits, then a fixed
// shuffle tree (deterministic). A serial loop over ~128 partials per thread was ~12 us of dependent L2
// round trips.
constexpr int HC_RED_PER = 8;
template <int NW>
__device__ __forceinline__ void hc_reduce_partials(const float* __restrict__ part, int t, int mix, int nsplit,
                                                   float* tot) {
  const int lane = threadIdx.x & 31;
  for (int m0 = threadIdx.x >> 5; m0 <= mix; m0 += 2 * NW) {
    const int m1 = m0 + NW;
    const float* p0 = part + ((long)t * (mix + 1) + m0) * nsplit;
    const float* p1 = part + ((long)t * (mix + 1) + min(m1, mix)) * nsplit;
    float v0 = 0.f, v1 = 0.f;
    // HC_RED_PER splits per lane and entry loaded together: nsplit <= 32 HC_RED_PER (the fold's 256 at V4) in one
    // L2 round trip (a 4-way unrolled loop made it two), added in the same order as one at a time
    for (int s0 = lane; s0 < nsplit; s0 += 32 * HC_RED_PER) {
      float a0[HC_RED_PER], a1[HC_RED_PER];
#pragma unroll
      for (int k = 0; k < HC_RED_PER; ++k) {
        const int s = s0 + 32 * k;
        a0[k] = s < nsplit ? p0[s] : 0.f;
        a1[k] = s < nsplit ? p1[s] : 0.f;
      }
#pragma unroll
      for (int k = 0; k < HC_RED_PER; ++k)
        if (s0 + 32 * k < nsplit) {
          v0 += a0[k];
          v1 += a1[k];
        }
    }
    for (int o = 16; o; o >>= 1) {
      v0 += __shfl_xor_sync(0xffffffffu, v0, o);
      v1 += __shfl_xor_sync(0xffffffffu, v1, o);
    }
    if (lane == 0) {
      tot[m0] = v0;
      if (m1 <= mix) tot[m1] = v1;
    }
  }
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
  hc_reduce_partials<THREADS / 32>(part, t, mix, nsplit, tot);
  __syncthreads();
  DS4_MARK(2);
  // n = 1, 2, 4 (V4: n = 4): one thread runs the Sinkhorn in registers (hc_comb_thread); other n use
  // the serial loop below (true divisions, ~20 dependent divisions deep per iteration).
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
  if (warp_sinkhorn && !defer_warp_sinkhorn && threadIdx.x == 0)
    hc_comb_thread(tot, t, n, D, mix, scale, base, iters, hc_eps, norm_eps, comb);
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
  // kernel takes the longer of them instead of their sum (H200 probe, session 4: Sinkhorn 3.5 us across
  // a warp, weighted sum + norm 2.2 us).
  const bool overlap = norm != nullptr && !head && (n == 1 || n == 2 || n == 4) && THREADS > 32;
  hc_coeffs<THREADS>(part, t, n, D, mix, nsplit, s_scale, s_base, iters, hc_eps, norm_eps, head, post, comb, tot, pre,
                     cm, overlap);
  __syncthreads();
  DS4_MARK(3);
  const long hoff = (long)t * n * D;
  if (norm != nullptr) {  // one block per token: x in h's dtype, then the block's RMSNorm (fp32) over it
    if (overlap && threadIdx.x < 32) {
      if (threadIdx.x == 0) hc_comb_thread(tot, t, n, D, mix, s_scale, s_base, iters, hc_eps, norm_eps, comb);
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

// hc_finish with the block norm for the V4 case (bf16 h, n = 1, 2, 4, D % 8 == 0, D <= 8 * HCN_VEC * 32 *
// HCN_WARPS), one block per token: HCN_WARPS warps form x and normalise it in registers (8-value
// chunks, HCN_VEC per thread), one more warp runs the Sinkhorn meanwhile. Before the PDL wait a
// thread loads its norm weights (a weight); right after it, it issues the loads of its h chunks,
// which are consumed only after the partial reduction. The generic kernel above instead makes ~5
// dependent passes over global / shared memory (H200 probe: 8.2 us per launch with the Sinkhorn
// overlapped, its thread-0 timeline 3.9 us).
//
// With R > 0 (the router fold, launch_hc_finish_router; opt-in) the launch has ceil(E / R) blocks per
// token: every block forms the token's normalised x the same way (the same bits), block 0 alone writes
// x, post and comb (and runs the Sinkhorn), and block b also computes the router logits of gate rows
// [b R, b R + R): logits[t, e] = sum_d bf16 x[d] * gate[e, d] in fp32, the gate rows loaded before the PDL
// wait. The router's BF16 GEMV launch then leaves the step's chain (its top-k reads these logits).
// With Q > 0 (the projection fold, launch_hc_finish_proj; opt-in) the same, with Q rows of an FP8 weight (E4M3,
// E8M0 scales per 128 x 128 block: the attention's merged wq_a + wkv) per block instead of gate rows:
// y[t, o] = bf16(sum_d bf16 x[d] * w[o, d] * s[o / 128, d / 128]), the rows and their scales loaded
// before the PDL wait; the wq_a + wkv GEMV launch then leaves the step's chain. One 8-value chunk per
// thread (D <= 8 * 32 * HCN_WARPS), so a thread holds Q 8-byte pieces of weight rows. The weights are
// decoded and scaled as the ds4 GEMV kernels do (ds4_common.cuh: Dec<FMT_FP8>, DS4_XS, post_factor).
constexpr int HCN_WARPS = 16;
constexpr int HCN_THREADS = 32 * (HCN_WARPS + 1);
constexpr int HCN_VEC = 2;
constexpr int HCR_ROWS = 2;   // gate rows per block of the router fold
constexpr int HCQ_ROWS = 12;  // FP8 rows per block of the projection fold (V4's 1536 rows: 128 blocks)

// The projection fold's weight: w FP8 E4M3 [O, D] row-major, s E8M0 [ceil(O / 128), s_ld], y bf16 [N, O].
struct HcProj {
  const uint8_t* w = nullptr;
  const uint8_t* s = nullptr;
  int s_ld = 0, O = 0;
  __nv_bfloat16* y = nullptr;
};

// Reduce-scatter of P (16 or 32) values per lane over a warp: afterwards v[0] of lane l is the warp's sum of value
// l / (32 / P) (returned as the index), in a fixed order; P - 1 + log2(32 / P) shuffles instead of 5 P. Step OFF
// halves the N values still held: lanes with bit OFF set keep the upper half, the others the lower half.
template <int N, int OFF, int P>
__device__ __forceinline__ void reduce_scatter_step(float (&v)[P], int lane) {
  if constexpr (OFF >= 1) {
    if constexpr (N > 1) {
      const bool hi = lane & OFF;
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {
        const float send = hi ? v[i] : v[i + N / 2], keep = hi ? v[i + N / 2] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, OFF);
      }
      reduce_scatter_step<N / 2, OFF / 2>(v, lane);
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], OFF);
      reduce_scatter_step<1, OFF / 2>(v, lane);
    }
  }
}
template <int P>
__device__ __forceinline__ int warp_reduce_scatter(float (&v)[P], int lane) {
  static_assert(P == 16 || P == 32, "16 or 32 values");
  reduce_scatter_step<P, 16>(v, lane);
  return lane / (32 / P);
}

__device__ __forceinline__ void bf16x8_to_float(const uint4& u, float* f) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

template <int N, int R = 0, int Q = 0>
__global__ void __launch_bounds__(HCN_THREADS, 1) hc_finish_norm_kernel(
    const __nv_bfloat16* __restrict__ h, const float* __restrict__ part, int D, int mix, int nsplit,
    const float* __restrict__ scale, const float* __restrict__ base, int iters, float hc_eps, float norm_eps,
    __nv_bfloat16* __restrict__ x, float* __restrict__ post, float* __restrict__ comb, const void* __restrict__ norm,
    bool norm_f32, const __nv_bfloat16* __restrict__ gate = nullptr, int E = 0, float* __restrict__ logits = nullptr,
    const HcProj proj = HcProj{}, bool early_trigger = false) {
  static_assert(R == 0 || Q == 0, "one fold per launch");
  constexpr int VEC = Q > 0 ? 1 : HCN_VEC;  // 8-value chunks per x thread (the projection fold: D <= 4096)
  constexpr int RQ = R > Q ? R : Q;         // the block's dot products
  DS4_MARK(0);
  __shared__ float s_scale[3], s_base[HC_MAX_MIX], tot[HC_MAX_MIX + 1], pre[HC_MAX_N], red[HCN_WARPS];
  __shared__ float s_lg[HCN_WARPS][RQ > 0 ? RQ : 1];
  const int t = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool sk_warp = warp == HCN_WARPS;  // the last warp: thread 0 (the probe's timeline) is an x / norm thread
  const bool lead = blockIdx.x == 0;       // writes x, post and comb (a fold's other blocks: their products only)
  const int nch = D / 8;
  ds4_pdl::release_early(early_trigger);  // (hc_trigger_early)
  for (int i = threadIdx.x; i < mix; i += HCN_THREADS) s_base[i] = base[i];
  if (threadIdx.x < 3) s_scale[threadIdx.x] = scale[threadIdx.x];
  float wn[VEC][8];
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    const int c = threadIdx.x + v * 32 * HCN_WARPS;
    if (sk_warp || c >= nch) continue;
    if (norm_f32) {
      const float4 a = reinterpret_cast<const float4*>(norm)[2 * c], b = reinterpret_cast<const float4*>(norm)[2 * c + 1];
      const float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int e = 0; e < 8; ++e) wn[v][e] = f[e];
    } else {
      bf16x8_to_float(reinterpret_cast<const uint4*>(norm)[c], wn[v]);
    }
  }
  uint4 gv[R > 0 ? R : 1][VEC];  // the router fold's gate rows (a weight: before the wait as well)
#pragma unroll
  for (int j = 0; j < R; ++j) {
    const int e = blockIdx.x * R + j;
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const int c = threadIdx.x + v * 32 * HCN_WARPS;
      gv[j][v] = (!sk_warp && c < nch && e < E) ? __ldg(reinterpret_cast<const uint4*>(gate + (long)e * D) + c)
                                                : make_uint4(0, 0, 0, 0);
    }
  }
  uint2 wq[VEC][Q > 0 ? Q : 1];   // the projection fold's rows (weights: before the wait as well), 8 bytes each
  float wsc[VEC][Q > 0 ? Q : 1];  // and their E8M0 scales at the thread's chunks
  if constexpr (Q > 0) {
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const int c = threadIdx.x + v * 32 * HCN_WARPS;
#pragma unroll
      for (int j = 0; j < Q; ++j) {
        const int o = blockIdx.x * Q + j;
        const bool ok = !sk_warp && c < nch && o < proj.O;
        wq[v][j] = ok ? __ldg(reinterpret_cast<const uint2*>(proj.w + (long)o * D) + c) : make_uint2(0u, 0u);
        wsc[v][j] = ok ? ds4::e8m0_to_f32(__ldg(proj.s + (long)(o >> 7) * proj.s_ld + (c >> 4))) : 0.f;
      }
    }
  }
  ds4_pdl::begin(early_trigger);
  DS4_MARK(1);
  uint4 hv[VEC][N];
  const __nv_bfloat16* ht = h + (long)t * N * D;
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    const int c = threadIdx.x + v * 32 * HCN_WARPS;
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (!sk_warp && c < nch) hv[v][j] = reinterpret_cast<const uint4*>(ht + (long)j * D)[c];
  }
  hc_reduce_partials<HCN_THREADS / 32>(part, t, mix, nsplit, tot);
  __syncthreads();
  DS4_MARK(2);
  if (sk_warp) {
    if (lane == 0 && lead) hc_comb_n<N>(tot, t, D, mix, s_scale, s_base, iters, hc_eps, norm_eps, comb);
    return;
  }
  constexpr int NT = 32 * HCN_WARPS;  // the x / norm threads (named barrier 1)
  if (warp == 0) {  // lane j: pre[j]; lane N + j: post[j]
    const float r = rsqrtf(tot[mix] / (float)(N * D) + norm_eps);
    if (lane < N)
      pre[lane] = sigmoidf_(tot[lane] * r * s_scale[0] + s_base[lane]) + hc_eps;
    else if (lane < 2 * N && lead)
      post[(long)t * N + lane - N] = 2.f * sigmoidf_(tot[lane] * r * s_scale[1] + s_base[lane]);
  }
  asm volatile("bar.sync 1, %0;" ::"r"(NT) : "memory");
  float pj[N];
#pragma unroll
  for (int j = 0; j < N; ++j) pj[j] = pre[j];
  float xv[VEC][8], ss = 0.f;
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    const int c = threadIdx.x + v * NT;
    if (c >= nch) continue;
    float hf[N][8];
#pragma unroll
    for (int j = 0; j < N; ++j) bf16x8_to_float(hv[v][j], hf[j]);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < N; ++j) acc += pj[j] * hf[j][e];
      xv[v][e] = bf16r(acc);  // x in h's dtype, as hc_pre returns it before the norm
      ss += xv[v][e] * xv[v][e];
    }
  }
  for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (lane == 0) red[warp] = ss;
  asm volatile("bar.sync 1, %0;" ::"r"(NT) : "memory");
  float tot_ss = 0.f;
#pragma unroll
  for (int w = 0; w < HCN_WARPS; ++w) tot_ss += red[w];
  const float r = rsqrtf(tot_ss / (float)D + norm_eps);
  float lg[RQ > 0 ? RQ : 1] = {};  // zero: the projection fold accumulates over the thread's chunks
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    const int c = threadIdx.x + v * NT;
    if (c >= nch) continue;
    uint32_t o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      o[i] = pack_bf16(xv[v][2 * i] * r * wn[v][2 * i], xv[v][2 * i + 1] * r * wn[v][2 * i + 1]);
    if (lead) reinterpret_cast<uint4*>(x + (long)t * D)[c] = make_uint4(o[0], o[1], o[2], o[3]);
    if constexpr (R > 0) {  // the stored (bf16) x against this block's gate rows
      float xf[8], gf[8];
      bf16x8_to_float(make_uint4(o[0], o[1], o[2], o[3]), xf);
#pragma unroll
      for (int j = 0; j < R; ++j) {
        bf16x8_to_float(gv[j][v], gf);
#pragma unroll
        for (int e = 0; e < 8; ++e) lg[j] = fmaf(xf[e], gf[e], lg[j]);
      }
    }
    if constexpr (Q > 0) {  // the stored (bf16) x against this block's FP8 rows; the chunk lies in one scale block
      float xf[8], wf[8];
      bf16x8_to_float(make_uint4(o[0], o[1], o[2], o[3]), xf);
#pragma unroll
      for (int e = 0; e < 8; ++e) xf[e] *= ds4::DS4_XS;
#pragma unroll
      for (int j = 0; j < Q; ++j) {
        ds4::Dec<ds4::FMT_FP8>::word(wq[v][j].x, wf);
        ds4::Dec<ds4::FMT_FP8>::word(wq[v][j].y, wf + 4);
        float a = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) a = fmaf(xf[e], wf[e], a);
        lg[j] = fmaf(a, wsc[v][j], lg[j]);
      }
    }
  }
  if constexpr (R > 0) {  // fixed order: lanes by a shuffle tree, then the warps in turn
#pragma unroll
    for (int j = 0; j < R; ++j) {
      float v = lg[j];
      for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) s_lg[warp][j] = v;
    }
    asm volatile("bar.sync 1, %0;" ::"r"(NT) : "memory");
    const int e = blockIdx.x * R + threadIdx.x;
    if (threadIdx.x < R && e < E) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < HCN_WARPS; ++w) sum += s_lg[w][threadIdx.x];
      logits[(long)t * E + e] = sum;
    }
  }
  if constexpr (Q > 0) {  // a fixed order: a reduce-scatter over the lanes, the warps in turn; then the exact 2^80
    constexpr int P = Q <= 16 ? 16 : 32;
    float pv[P];
#pragma unroll
    for (int j = 0; j < P; ++j) pv[j] = j < Q ? lg[j] : 0.f;
    const int j = warp_reduce_scatter<P>(pv, lane);
    if (j < Q && (lane & (32 / P - 1)) == 0) s_lg[warp][j] = pv[0];
    asm volatile("bar.sync 1, %0;" ::"r"(NT) : "memory");
    const int row = blockIdx.x * Q + threadIdx.x;
    if (threadIdx.x < Q && row < proj.O) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < HCN_WARPS; ++w) sum += s_lg[w][threadIdx.x];
      proj.y[(long)t * proj.O + row] = __float2bfloat16(sum * ds4::post_factor<ds4::FMT_FP8>());
    }
  }
  DS4_MARK(3);
}

static bool hc_finish_norm_ok(const void* h, bool h_f32, int n, int D, const void* x, const void* norm) {
  const bool aligned = ((reinterpret_cast<uintptr_t>(h) | reinterpret_cast<uintptr_t>(x) |
                         reinterpret_cast<uintptr_t>(norm)) & 15) == 0;  // 16-byte chunk loads / stores
  return aligned && !h_f32 && (n == 1 || n == 2 || n == 4) && D % 8 == 0 && D / 8 <= HCN_VEC * 32 * HCN_WARPS;
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

template <bool POST>
static cudaError_t launch_partials(const void* h, bool h_f32, const float* fn, int N, int K, int mix, int nsplit,
                                   float* part, const HcPostArgs& pa, cudaStream_t st) {
  if (mix < 1 || mix > HC_MAX_MIX || N < 1 || K < 1 || nsplit < 1 || N > 65535) return cudaErrorInvalidValue;
  dim3 grid(nsplit, N);
  auto kern = mix <= 4 ? hc_partials_kernel<4, POST> : mix <= 24 ? hc_partials_kernel<24, POST>
            : mix <= 48 ? hc_partials_kernel<48, POST> : hc_partials_kernel<80, POST>;
  return ds4_pdl::launch(kern, grid, dim3(HC_THREADS), 0, st, h, h_f32, fn, K, mix, nsplit, part, pa);
}

cudaError_t launch_hc_partials(const void* h, bool h_f32, const float* fn, int N, int K, int mix, int nsplit,
                               float* part, cudaStream_t st) {
  return launch_partials<false>(h, h_f32, fn, N, K, mix, nsplit, part, HcPostArgs{}, st);
}

cudaError_t launch_hc_post_partials(const void* x, bool x_f32, const void* res, bool res_f32, const float* post,
                                    const float* comb, int N, int n, int D, void* out, const float* fn, int mix,
                                    int nsplit, float* part, cudaStream_t st) {
  if (n < 1 || n > HC_MAX_N) return cudaErrorInvalidValue;
  return launch_partials<true>(res, res_f32, fn, N, n * D, mix, nsplit, part,
                               HcPostArgs{x, x_f32, post, comb, n, D, out}, st);
}

// The one-token hc finish (and its router fold) lets the next launch (wq_a + wkv's GEMV at the attention site, the
// router's top-k at the FFN site) launch at its start, before its own PDL wait, instead of after it: that GEMV's blocks
// become resident, and load their first weight rounds, while the MoE down before the finish drains. Safe for any next
// launch that waits (PDL) before it reads: the finish's completion still implies its predecessor's. One H100, three
// interleaved passes: 117.2 / 117.6 / 117.8 against 119.1 / 119.1 / 119.2 us per layer (experiments/session74.md).
// DS4_HC_TRIGGER=wait (read per launch; the ablation, bench token nohtrig) keeps the trigger after the wait.
static bool hc_trigger_early() { return ds4_pdl::trigger_early("DS4_HC_TRIGGER", true); }

cudaError_t launch_hc_finish(const void* h, bool h_f32, const float* part, int N, int n, int D, int mix, int nsplit,
                             const float* scale, const float* base, int iters, float hc_eps, float norm_eps,
                             bool head, void* x, float* post, float* comb, const void* norm, bool norm_f32,
                             cudaStream_t st) {
  if (n < 1 || n > HC_MAX_N || mix > HC_MAX_MIX || N < 1 || N > 65535) return cudaErrorInvalidValue;
  if (head ? mix != n : mix != (2 + n) * n) return cudaErrorInvalidValue;
  if (norm != nullptr && (long)D * 4 > 48 * 1024) return cudaErrorInvalidValue;
  if (norm != nullptr && !head && hc_finish_norm_ok(h, h_f32, n, D, x, norm)) {
    auto kern = n == 4 ? hc_finish_norm_kernel<4> : n == 2 ? hc_finish_norm_kernel<2> : hc_finish_norm_kernel<1>;
    return ds4_pdl::launch(kern, dim3(1, N), dim3(HCN_THREADS), 0, st, static_cast<const __nv_bfloat16*>(h), part, D,
                           mix, nsplit, scale, base, iters, hc_eps, norm_eps, static_cast<__nv_bfloat16*>(x), post,
                           comb, norm, norm_f32, static_cast<const __nv_bfloat16*>(nullptr), 0,
                           static_cast<float*>(nullptr), HcProj{}, hc_trigger_early());
  }
  if (norm != nullptr)
    return ds4_pdl::launch(hc_finish_kernel<HC_NORM_THREADS>, dim3(1, N), dim3(HC_NORM_THREADS), (size_t)D * sizeof(float),
                           st, h, h_f32, part, n, D, mix, nsplit, scale, base, iters, hc_eps, norm_eps, head, x, post,
                           comb, norm, norm_f32);
  const int per_block = HC_THREADS * 4;
  dim3 grid((D + per_block - 1) / per_block, N);
  return ds4_pdl::launch(hc_finish_kernel<HC_THREADS>, grid, dim3(HC_THREADS), 0, st, h, h_f32, part, n, D, mix, nsplit,
                         scale, base, iters, hc_eps, norm_eps, head, x, post, comb, norm, norm_f32);
}

// The Sinkhorn of comb in place as a launch of its own, one thread per token (comb as a finish with iters = 0 left
// it): where no launch of the step can take it along (ds4.ops.base.SinkhornRide.run), the same bits.
__global__ void __launch_bounds__(32) hc_sinkhorn_kernel(ds4::SinkhornRide ride, int ntok) {
  ds4_pdl::begin();
  const int t = blockIdx.x * 32 + threadIdx.x;
  if (t < ntok) ds4::sinkhorn_ride(ride, t);
}

cudaError_t launch_hc_sinkhorn(const ds4::SinkhornRide& ride, int N, cudaStream_t st) {
  if (ride.comb == nullptr || !ds4::sinkhorn_ride_ok(ride, N)) return cudaErrorInvalidValue;
  return ds4_pdl::launch(hc_sinkhorn_kernel, dim3((unsigned)((N + 31) / 32)), dim3(32), 0, st, ride, N);
}

bool hc_router_fold_ok(int n, int D) {
  return (n == 1 || n == 2 || n == 4) && D % 8 == 0 && D / 8 <= HCN_VEC * 32 * HCN_WARPS;
}

cudaError_t launch_hc_finish_router(const void* h, const float* part, int N, int n, int D, int mix, int nsplit,
                                    const float* scale, const float* base, int iters, float hc_eps, float norm_eps,
                                    void* x, float* post, float* comb, const void* norm, bool norm_f32,
                                    const void* gate, int E, float* logits, cudaStream_t st) {
  if (!hc_router_fold_ok(n, D) || mix != (2 + n) * n || N < 1 || N > 65535 || E < 1 || norm == nullptr ||
      !hc_finish_norm_ok(h, false, n, D, x, norm) || (reinterpret_cast<uintptr_t>(gate) & 15))
    return cudaErrorInvalidValue;
  auto kern = n == 4 ? hc_finish_norm_kernel<4, HCR_ROWS>
            : n == 2 ? hc_finish_norm_kernel<2, HCR_ROWS> : hc_finish_norm_kernel<1, HCR_ROWS>;
  return ds4_pdl::launch(kern, dim3((E + HCR_ROWS - 1) / HCR_ROWS, N), dim3(HCN_THREADS), 0, st,
                         static_cast<const __nv_bfloat16*>(h), part, D, mix, nsplit, scale, base, iters, hc_eps,
                         norm_eps, static_cast<__nv_bfloat16*>(x), post, comb, norm, norm_f32,
                         static_cast<const __nv_bfloat16*>(gate), E, logits, HcProj{}, hc_trigger_early());
}

bool hc_proj_fold_ok(int n, int D) {
  return (n == 1 || n == 2 || n == 4) && D % 128 == 0 && D / 8 <= 32 * HCN_WARPS;
}

cudaError_t launch_hc_finish_proj(const void* h, const float* part, int N, int n, int D, int mix, int nsplit,
                                  const float* scale, const float* base, int iters, float hc_eps, float norm_eps,
                                  void* x, float* post, float* comb, const void* norm, bool norm_f32, const void* w,
                                  const void* s, int s_ld, int O, void* y, cudaStream_t st) {
  if (!hc_proj_fold_ok(n, D) || mix != (2 + n) * n || N < 1 || N > 65535 || O < 1 || s_ld < D / 128 ||
      norm == nullptr || !hc_finish_norm_ok(h, false, n, D, x, norm) || (reinterpret_cast<uintptr_t>(w) & 15))
    return cudaErrorInvalidValue;
  auto kern = n == 4 ? hc_finish_norm_kernel<4, 0, HCQ_ROWS>
            : n == 2 ? hc_finish_norm_kernel<2, 0, HCQ_ROWS> : hc_finish_norm_kernel<1, 0, HCQ_ROWS>;
  const HcProj proj{static_cast<const uint8_t*>(w), static_cast<const uint8_t*>(s), s_ld, O,
                    static_cast<__nv_bfloat16*>(y)};
  return ds4_pdl::launch(kern, dim3((O + HCQ_ROWS - 1) / HCQ_ROWS, N), dim3(HCN_THREADS), 0, st,
                         static_cast<const __nv_bfloat16*>(h), part, D, mix, nsplit, scale, base, iters, hc_eps,
                         norm_eps, static_cast<__nv_bfloat16*>(x), post, comb, norm, norm_f32,
                         static_cast<const __nv_bfloat16*>(nullptr), 0, static_cast<float*>(nullptr), proj,
                         false);  // (the opt-in projection fold keeps the wait-first order: the early trigger was not
                                  // measured with it)
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
