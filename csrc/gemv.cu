// Dense projections for 1..8 tokens: FP8 (E4M3 + E8M0 128x128), MXFP4 and BF16 weights,
// BF16 activations, fp32 accumulation. One warp owns R rows; consecutive lanes read consecutive
// 16-byte chunks of a row (U chunks per row in flight per lane); warp-shuffle reduction.
#include "ds4_common.cuh"
#include "ds4_launch.h"

namespace ds4 {

constexpr int GEMV_THREADS = 256;
constexpr int GEMV_WARPS = GEMV_THREADS / 32;
constexpr long SMEM_CAP = 100 * 1024;  // fits sm_80 (163 KB) and sm_90 (227 KB) opt-in limits

template <int FMT, int NT, int R, int U>
__global__ void __launch_bounds__(GEMV_THREADS)
gemv_kernel(const __nv_bfloat16* __restrict__ x, long x_ld, int n_tok, const uint8_t* __restrict__ W,
            const uint8_t* __restrict__ S, int s_ld, void* __restrict__ out, int out_f32, long out_ld,
            int O, int K, int group_rows) {
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);
  constexpr int VALS = FmtInfo<FMT>::VALS, CS = Smem<FMT>::CS;
  const long xrow = Smem<FMT>::row_floats(K);
  const int row0 = blockIdx.x * (GEMV_WARPS * R);
  const long xoff = group_rows > 0 ? (long)(row0 / group_rows) * K : 0;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rbase = row0 + warp * R;
  const long rb = row_bytes<FMT>(K);
  const int nch = K / VALS;
  const uint8_t* wr[R];
  int rr[R];
#pragma unroll
  for (int j = 0; j < R; ++j) {
    rr[j] = min(rbase + j, O - 1);
    wr[j] = W + rr[j] * rb;
  }
  float acc[R][NT];
#pragma unroll
  for (int j = 0; j < R; ++j)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[j][t] = 0.f;
  uint4 wv[U][R];
  float sc[U][R];
  auto load = [&](int c0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c < nch) {
#pragma unroll
        for (int j = 0; j < R; ++j) {
          wv[u][j] = ld_stream16(wr[j] + (long)c * 16);
          sc[u][j] = chunk_scale<FMT>(S, rr[j], c, s_ld);
        }
      }
    }
  };
  load(lane);  // weights do not depend on the activations: start their loads before the prologue
  ds4_pdl::begin();  // ... and before waiting for the kernel that produces x (PDL)
  for (int t = 0; t < n_tok; ++t) load_row_smem<FMT>(xs + t * xrow, x + t * x_ld + xoff, K);
  __syncthreads();

  for (int c0 = lane; c0 < nch; c0 += 32 * U) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c < nch) {
        const float* xp[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) xp[t] = t < n_tok ? xs + t * xrow + (long)c * CS : nullptr;
        chunk_fma<FMT, R, NT>(wv[u], sc[u], xp, acc);
      }
    }
    if (c0 + 32 * U < nch) load(c0 + 32 * U);
  }
  const float post = post_factor<FMT>();
#pragma unroll
  for (int j = 0; j < R; ++j)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float v = warp_sum(acc[j][t]) * post;
      if (lane == 0 && rbase + j < O && t < n_tok) {
        const long o = t * out_ld + rbase + j;
        if (out_f32) reinterpret_cast<float*>(out)[o] = v;
        else reinterpret_cast<__nv_bfloat16*>(out)[o] = __float2bfloat16(v);
      }
    }
}

template <int FMT>
static long gemv_smem(int nt, int K) { return (long)nt * Smem<FMT>::row_floats(K) * 4; }

int gemv_max_tokens(int fmt, int K) {
  const long per = fmt == FMT_BF16 ? gemv_smem<FMT_BF16>(1, K)
                 : fmt == FMT_FP8 ? gemv_smem<FMT_FP8>(1, K) : gemv_smem<FMT_FP4>(1, K);
  long n = SMEM_CAP / (per > 0 ? per : 1);
  return (int)(n > 8 ? 8 : n);
}

template <typename KernelT>
static cudaError_t set_smem(KernelT k, long bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}

template <int FMT, int NT, int R>
static cudaError_t gemv_go(const void* x, long x_ld, int n_tok, const void* W, const void* S, int s_ld,
                           void* out, bool out_f32, long out_ld, int O, int K, int group_rows,
                           cudaStream_t st) {
  constexpr int U = 4;
  const long smem = gemv_smem<FMT>(n_tok, K);
  auto kern = gemv_kernel<FMT, NT, R, U>;
  cudaError_t e = set_smem(kern, smem);
  if (e != cudaSuccess) return e;
  const int rows_pb = GEMV_WARPS * R;
  dim3 grid((O + rows_pb - 1) / rows_pb);
  return ds4_pdl::launch(kern, grid, dim3(GEMV_THREADS), smem, st, reinterpret_cast<const __nv_bfloat16*>(x), x_ld,
                         n_tok, reinterpret_cast<const uint8_t*>(W), reinterpret_cast<const uint8_t*>(S), s_ld, out,
                         out_f32 ? 1 : 0, out_ld, O, K, group_rows);
}

template <int FMT, int R>
static cudaError_t gemv_nt(int n_tok, const void* x, long x_ld, const void* W, const void* S, int s_ld,
                           void* out, bool out_f32, long out_ld, int O, int K, int group_rows,
                           cudaStream_t st) {
#define DS4_GO(NT) return gemv_go<FMT, NT, R>(x, x_ld, n_tok, W, S, s_ld, out, out_f32, out_ld, O, K, group_rows, st)
  if (n_tok <= 1) DS4_GO(1);
  if (n_tok <= 2) DS4_GO(2);
  if (n_tok <= 4) DS4_GO(4);
  DS4_GO(8);
#undef DS4_GO
}

template <int FMT>
static cudaError_t gemv_r(int R, int n_tok, const void* x, long x_ld, const void* W, const void* S,
                          int s_ld, void* out, bool out_f32, long out_ld, int O, int K, int group_rows,
                          cudaStream_t st) {
  // rows-per-warp variants other than 2 exist for single-token decode only (fewer instantiations)
  if (R == 1 && n_tok == 1) return gemv_go<FMT, 1, 1>(x, x_ld, n_tok, W, S, s_ld, out, out_f32, out_ld, O, K, group_rows, st);
  if (R == 4 && n_tok == 1) return gemv_go<FMT, 1, 4>(x, x_ld, n_tok, W, S, s_ld, out, out_f32, out_ld, O, K, group_rows, st);
  return gemv_nt<FMT, 2>(n_tok, x, x_ld, W, S, s_ld, out, out_f32, out_ld, O, K, group_rows, st);
}

cudaError_t launch_gemv(int fmt, int rows_per_warp, const void* x, long x_ld, int n_tok, const void* W,
                        const void* S, int s_ld, void* out, bool out_f32, long out_ld, int O, int K,
                        int group_rows, cudaStream_t st) {
  if (n_tok < 1 || n_tok > 8 || O < 1 || K < 1) return cudaErrorInvalidValue;
  int R = rows_per_warp;
  if (R != 1 && R != 2 && R != 4) R = 2;
  if (n_tok > 1) R = 2;
  if (group_rows > 0 && group_rows % (GEMV_WARPS * R) != 0) return cudaErrorInvalidValue;
  if (fmt == FMT_FP8) return gemv_r<FMT_FP8>(R, n_tok, x, x_ld, W, S, s_ld, out, out_f32, out_ld, O, K, group_rows, st);
  if (fmt == FMT_FP4) return gemv_r<FMT_FP4>(R, n_tok, x, x_ld, W, S, s_ld, out, out_f32, out_ld, O, K, group_rows, st);
  if (fmt == FMT_BF16) return gemv_r<FMT_BF16>(R, n_tok, x, x_ld, W, S, s_ld, out, out_f32, out_ld, O, K, group_rows, st);
  return cudaErrorInvalidValue;
}

}  // namespace ds4
