// Dense projections for 1..8 tokens: FP8 (E4M3 + E8M0 128x128), MXFP4 and BF16 weights,
// BF16 activations, fp32 accumulation. Two kernels:
//  * gemv_kernel (FMA): one warp owns R rows; consecutive lanes read consecutive 16-byte chunks of
//    a row (U chunks per row in flight per lane); warp-shuffle reduction. Any format, 1..8 tokens.
//  * gemv_mma_kernel (tensor cores, mma_dot.cuh): one token, FP8 / FP4. A warp owns 16 rows and a
//    slice of K; the warps of a block that share rows add their slices in shared memory (fixed
//    order: deterministic). K is split so that small-O matrices still fill the GPU.
#include "ds4_common.cuh"
#include "ds4_launch.h"
#include "mma_dot.cuh"

#include <cstdlib>

namespace ds4 {

constexpr int GEMV_THREADS = 256;
constexpr int GEMV_WARPS = GEMV_THREADS / 32;
constexpr long SMEM_CAP = 100 * 1024;  // fits sm_80 (163 KB) and sm_90 (227 KB) opt-in limits

template <int FMT, int NT, int R, int U>
__global__ void __launch_bounds__(GEMV_THREADS)
gemv_kernel(const __nv_bfloat16* __restrict__ x, long x_ld, int n_tok, const uint8_t* __restrict__ W,
            const uint8_t* __restrict__ S, int s_ld, void* __restrict__ out, int out_f32, long out_ld,
            int O, int K, int group_rows) {
  DS4_MARK(0);
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
  DS4_MARK(1);

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
  DS4_MARK(2);
}

constexpr int MMA_THREADS = 256;
constexpr int MMA_WARPS = MMA_THREADS / 32;

template <int FMT, int U>
__global__ void __launch_bounds__(MMA_THREADS)
gemv_mma_kernel(const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ W, const uint8_t* __restrict__ S,
                int s_ld, void* __restrict__ out, int out_f32, int O, int K, int group_rows, int ks) {
  extern __shared__ float4 smem4[];
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem4);
  __shared__ float red[MMA_WARPS][16];
  const int tpb = MMA_WARPS / ks;  // 16-row tiles per block; warp = (k part, tile)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tile = warp % tpb, part = warp / tpb;
  const int row0 = (blockIdx.x * tpb + tile) * 16;
  const bool live = row0 < O;  // warp-uniform; idle warps still reach the barriers
  const long xoff = group_rows > 0 ? (long)((blockIdx.x * tpb * 16) / group_rows) * K : 0;
  const int nr = K / mma_round_vals<FMT>();
  const int beg = nr * part / ks, end = live ? nr * (part + 1) / ks : beg;
  auto seg = [=](int) { return MmaSeg{W, S, xs}; };
  auto rows = mma_rows16<FMT, U>(seg, nr, row_bytes<FMT>(K), live ? row0 : 0, O, s_ld, beg, end);
  rows.prefetch();   // weights do not depend on the previous kernel: load them before waiting (PDL)
  ds4_pdl::begin();
  stage_mma_row<FMT>(xs, x + xoff, K);
  __syncthreads();
  const float2 v = rows.run();
  const int g = lane >> 2, t = lane & 3;
  auto store = [&](int r, float y) {
    if (r >= O) return;
    if (out_f32) reinterpret_cast<float*>(out)[r] = y;
    else reinterpret_cast<__nv_bfloat16*>(out)[r] = __float2bfloat16(y);
  };
  if (ks == 1) {
    if (live && t == 0) {
      store(row0 + g, v.x);
      store(row0 + g + 8, v.y);
    }
    return;
  }
  mma_rows16_store(red[warp], v);
  __syncthreads();
  if (part == 0 && live && lane < 16) {
    float y = 0.f;
    for (int p = 0; p < ks; ++p) y += red[p * tpb + tile][lane];
    store(row0 + lane, y);
  }
}

static int sm_count() {
  static int count[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 132;
  if (count[dev] == 0) cudaDeviceGetAttribute(&count[dev], cudaDevAttrMultiProcessorCount, dev);
  return count[dev] > 0 ? count[dev] : 132;
}

// K split: the fewest parts (1, 2, 4, 8) that give at least two blocks per SM, keeping >= 2 rounds
// per warp; group_rows must stay a multiple of the block's rows.
static int gemv_mma_split(int O, int nr, int group_rows) {
  const int tiles = (O + 15) / 16;
  int ks = 1;
  while (ks < MMA_WARPS && nr / (2 * ks) >= 2 &&
         (tiles + MMA_WARPS / ks - 1) / (MMA_WARPS / ks) < 2 * sm_count())
    ks *= 2;
  while (group_rows > 0 && group_rows % (16 * (MMA_WARPS / ks)) != 0 && ks < MMA_WARPS) ks *= 2;
  return ks;
}

template <int FMT>
static cudaError_t gemv_mma_go(const void* x, const void* W, const void* S, int s_ld, void* out, bool out_f32, int O,
                               int K, int group_rows, cudaStream_t st) {
  constexpr int U = 4;
  const int nr = K / mma_round_vals<FMT>();
  const int ks = gemv_mma_split(O, nr, group_rows);
  if (group_rows > 0 && group_rows % (16 * (MMA_WARPS / ks)) != 0) return cudaErrorInvalidValue;
  const long smem = 2L * K;
  auto kern = gemv_mma_kernel<FMT, U>;
  cudaError_t e = set_smem(kern, smem);
  if (e != cudaSuccess) return e;
  const int tpb = MMA_WARPS / ks;
  dim3 grid(((O + 15) / 16 + tpb - 1) / tpb);
  return ds4_pdl::launch(kern, grid, dim3(MMA_THREADS), smem, st, reinterpret_cast<const __nv_bfloat16*>(x),
                         reinterpret_cast<const uint8_t*>(W), reinterpret_cast<const uint8_t*>(S), s_ld, out,
                         out_f32 ? 1 : 0, O, K, group_rows, ks);
}

bool mma_auto(int fmt) {
  const char* env = std::getenv("DS4_MMA");
  return fmt == FMT_FP4 && !(env && env[0] == '0');
}

template <int FMT>
static long gemv_smem(int nt, int K) { return (long)nt * Smem<FMT>::row_floats(K) * 4; }

int gemv_max_tokens(int fmt, int K) {
  const long per = fmt == FMT_BF16 ? gemv_smem<FMT_BF16>(1, K)
                 : fmt == FMT_FP8 ? gemv_smem<FMT_FP8>(1, K) : gemv_smem<FMT_FP4>(1, K);
  long n = SMEM_CAP / (per > 0 ? per : 1);
  return (int)(n > 8 ? 8 : n);
}

template <int FMT, int NT, int R>
static cudaError_t gemv_go(const void* x, long x_ld, int n_tok, const void* W, const void* S, int s_ld,
                           void* out, bool out_f32, long out_ld, int O, int K, int group_rows,
                           cudaStream_t st) {
  constexpr int U = 8 / R;  // 16-byte chunks in flight per row and lane: R * U = 8
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

cudaError_t launch_gemv(int fmt, int kernel, const void* x, long x_ld, int n_tok, const void* W, const void* S,
                        int s_ld, void* out, bool out_f32, long out_ld, int O, int K, int group_rows,
                        cudaStream_t st) {
  if (n_tok < 1 || n_tok > 8 || O < 1 || K < 1) return cudaErrorInvalidValue;
  const bool mma_ok = n_tok == 1 && mma_shape_ok(fmt, K);
  if (kernel == KERNEL_MMA && !mma_ok) return cudaErrorInvalidValue;
  if (kernel == KERNEL_MMA || (kernel == KERNEL_AUTO && mma_ok && mma_auto(fmt))) {
    if (fmt == FMT_FP8) return gemv_mma_go<FMT_FP8>(x, W, S, s_ld, out, out_f32, O, K, group_rows, st);
    return gemv_mma_go<FMT_FP4>(x, W, S, s_ld, out, out_f32, O, K, group_rows, st);
  }
  if (group_rows > 0 && group_rows % (GEMV_WARPS * 2) != 0) return cudaErrorInvalidValue;
  // FP8, one token, K <= 4096: 4 rows per warp x 2 chunks per row in flight instead of 2 x 4 (H200 phase
  // probe, scripts/probe_phases.cu: wq_b 15.2 -> 14.4 us, grouped wo_a 15.7 -> 14.2; wo_b at K = 8192
  // 17.5 -> 17.6, so it keeps 2 x 4)
  if (fmt == FMT_FP8 && n_tok == 1 && K <= 4096 && (group_rows <= 0 || group_rows % (GEMV_WARPS * 4) == 0))
    return gemv_go<FMT_FP8, 1, 4>(x, x_ld, n_tok, W, S, s_ld, out, out_f32, out_ld, O, K, group_rows, st);
  if (fmt == FMT_FP8) return gemv_nt<FMT_FP8, 2>(n_tok, x, x_ld, W, S, s_ld, out, out_f32, out_ld, O, K, group_rows, st);
  if (fmt == FMT_FP4) return gemv_nt<FMT_FP4, 2>(n_tok, x, x_ld, W, S, s_ld, out, out_f32, out_ld, O, K, group_rows, st);
  if (fmt == FMT_BF16) return gemv_nt<FMT_BF16, 2>(n_tok, x, x_ld, W, S, s_ld, out, out_f32, out_ld, O, K, group_rows, st);
  return cudaErrorInvalidValue;
}

}  // namespace ds4
