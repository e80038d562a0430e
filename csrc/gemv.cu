// Dense projections for 1..8 tokens: FP8 (E4M3 + E8M0 128x128), MXFP4 and BF16 weights,
// BF16 activations, fp32 accumulation. Two kernels:
//  * gemv_kernel (FMA): one warp owns R rows; consecutive lanes read consecutive 16-byte chunks of
//    a row (U chunks per row in flight per lane); warp-shuffle reduction. Any format, 1..8 tokens.
//  * gemv_mma_kernel (tensor cores, mma_dot.cuh): one token, FP8 / FP4. One resident wave of blocks;
//    block b owns an even share of the 16-row tiles and its warps stream them (MmaStream: contiguous
//    round ranges, loads in flight across tiles); the warps' partial sums meet in shared memory in a
//    fixed order (deterministic).
#include "ds4_common.cuh"
#include "ds4_launch.h"
#include "hc_fold.cuh"
#include "mma_dot.cuh"
#include "rmsnorm_dev.cuh"

#include <cstdlib>
#include <cstring>

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
          if constexpr (fmt_tiled(FMT)) wv[u][j] = ld_stream16(chunk_ptr<FMT>(W, rr[j], rb, c));
          else wv[u][j] = ld_stream16(wr[j] + (long)c * 16);
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

// The RMSNorm in front of a GEMV (gemv_rmsnorm: q_norm before wq_b): one row x of K bf16 ->
// bf16(x * rsqrt(mean(x^2) + eps) * nw) staged like stage_mma_rows. Same arithmetic, in the same order,
// as ds4_attn's rms_norm_vec_kernel (decode_glue.cu, also 256 threads; both through rmsnorm_dev.cuh):
// each thread sums the squares of its 16-byte vectors j = thread + i * 256, the warp sums are added in
// warp order, and each value is rounded once as bf16(x * r * w). Every block of the GEMV recomputes it
// (K <= 8192: a few KB from L2), which costs less than the launch it replaces on the decode step's
// critical path (H200: 132.3 against 137.3 us per layer, experiments/decode_session9_h200.md).
constexpr int RMS_VPT = 4;  // 16-byte vectors per thread: K <= 8 * MMA_STREAM_THREADS * RMS_VPT
// AQ (numerics=qat, K % 128 == 0): the normed values then act_quant_sim(., 128)'s simulation (as stage_mma_rows'
// AQ; the loop's bound is the warp's).
template <int FMT, bool AQ = false>
__device__ __forceinline__ void stage_mma_rmsnorm(__nv_bfloat16* dst, const __nv_bfloat16* x, int K,
                                                  const void* nw, bool nw_f32, float eps) {
  __shared__ float red[MMA_STREAM_WARPS];
  const int nvec = K / 8;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < RMS_VPT; ++i) {
    const int j = threadIdx.x + i * MMA_STREAM_THREADS;
    if (j < nvec) ss = ds4_norm::sumsq8(xv[j], ss);
  }
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
  __syncthreads();
  float t = 0.f;
  for (int w = 0; w < MMA_STREAM_WARPS; ++w) t += red[w];  // fixed order: same value in every thread
  const float r = rsqrtf(t / (float)K + eps);
  // second pass: x again (L1 / L2 hits) rather than held in registers beside the weight prefetch
  if constexpr (AQ) {
    const int lane = threadIdx.x & 31;
#pragma unroll 1
    for (int j = threadIdx.x; j - lane < nvec; j += MMA_STREAM_THREADS) {
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (j < nvec) {
        float w[8];
        ds4_norm::load8_weight(nw, nw_f32, j * 8, w);
        v = ds4_norm::scale8(xv[j], r, w);
      }
      v = act_quant_vec<128>(v);
      if (j < nvec) *reinterpret_cast<uint4*>(dst + (long)j * 8) = mma_stage_vec<FMT>(v);
    }
  } else {
#pragma unroll 1
    for (int j = threadIdx.x; j < nvec; j += MMA_STREAM_THREADS) {
      float w[8];
      ds4_norm::load8_weight(nw, nw_f32, j * 8, w);
      *reinterpret_cast<uint4*>(dst + (long)j * 8) = mma_stage_vec<FMT>(ds4_norm::scale8(xv[j], r, w));
    }
  }
}

// Tensor-core GEMV, one token: block b owns the 16-row tiles [b * tpb, (b + 1) * tpb) (tpb = tiles
// per block, even split of the grid), its warps stream their rounds (MmaStream). Grouped rows
// (wo_a): each group has its own activations; the groups a block's tiles touch are staged. NORM (one
// ungrouped row): x is RMS-normalised with the weight nw first (stage_mma_rmsnorm); a separate
// instantiation, so the plain kernels' registers are not touched by it. FOLD (one ungrouped bf16 row,
// O = D): the epilogue also forms the hc fold's streams and partials (hc_fold.cuh), its buffers after
// the stream's in shared memory; at most 2 blocks per SM (as the moe down's FOLD form). bulk (DS4_BULK_STAGE=g,
// sm_90, neither NORM nor AQ; bulk_stage.cuh): x's rows staged by one bulk copy, issued by thread 0 after the wait.
template <int FMT, int U, int CW, bool NORM = false, bool FOLD = false, bool AQ = false>
__global__ void __launch_bounds__(MMA_STREAM_THREADS, (FOLD ? 2 : mma_min_blocks<U, CW>()))
gemv_mma_kernel(const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ W, const uint8_t* __restrict__ S,
                int s_ld, void* __restrict__ out, int out_f32, int O, int K, int group_rows, int tpb,
                const void* __restrict__ nw, int nw_f32, float eps, const HcFold fold, int pre, const RowSkip skip,
                int bulk) {
  DS4_MARK(0);
  extern __shared__ float4 smem4[];
  float* part = reinterpret_cast<float*>(smem4);
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(part + mma_part_floats(tpb));
  // skip (launch_gemv_rmsnorm): its position, read before the PDL wait, was written at the decode step's start,
  // launches before this one; the kept rows' tiles then spread over the whole grid (bt <= tpb: smem fits)
  const bool skipping = skip.pos != nullptr && (skip.pos[0] + 1) / skip.ratio <= skip.k;
  const int T = skipping ? skip.rows / 16 : (O + 15) / 16;
  const int bt = skipping ? (T + (int)gridDim.x - 1) / (int)gridDim.x : tpb;
  const int t0 = blockIdx.x * bt, nt = max(0, min(bt, T - t0));
  auto zero_skipped = [&] {  // after the wait (an output): every block a share of rows [rows, O)
    if (!skipping) return;
    for (int r = skip.rows + blockIdx.x * blockDim.x + threadIdx.x; r < O; r += gridDim.x * blockDim.x) {
      if (out_f32) reinterpret_cast<float*>(out)[r] = 0.f;
      else reinterpret_cast<__nv_bfloat16*>(out)[r] = __float2bfloat16(0.f);
    }
  };
  if (nt == 0) {  // a block without a kept tile this launch
    ds4_pdl::begin();
    zero_skipped();
    return;
  }
  const int g0 = group_rows > 0 ? t0 * 16 / group_rows : 0;
  const int ng = group_rows > 0 ? ((t0 + nt) * 16 - 1) / group_rows - g0 + 1 : 1;
  auto tile = [=](int tl, int) {
    const int row0 = (t0 + tl) * 16;
    const int grp = group_rows > 0 ? row0 / group_rows - g0 : 0;
    return MmaTile{W, S, xs + (long)grp * K, row0, O};
  };
  auto st = mma_stream<FMT, U, CW>(tile, xs, nt, 1, K / mma_round_vals<FMT, CW>(), row_bytes<FMT>(K), s_ld,
                                   reinterpret_cast<uint8_t*>(xs + (long)ng * K));
  const int pre_rounds = pre < 0 ? (1 << 30) : pre;  // mma_prefetch_rounds
  st.prefetch(pre_rounds);  // weights do not depend on the previous kernel: load them before waiting (PDL)
  // the fold's buffers after the stream's (recomputed where used: nothing of the fold stays live in registers
  // across the stream)
  [[maybe_unused]] auto fs = [&] {
    return hc_fold_smem(reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(xs + (long)ng * K) +
                                                 mma_stream_smem<FMT, U, CW>()), tpb, fold.n, fold.mix);
  };
  if constexpr (FOLD) hc_fold_load_fn(fold, fs(), t0, nt, O);  // a weight: before the wait
  __shared__ uint64_t s_bar;
  const bool bulk_x = bulk_arch() && !NORM && !AQ && bulk != 0;
  ds4_pdl::begin();
  if (bulk_x && threadIdx.x == 0) {
    const uint32_t bytes = 2u * ng * K;
    bulk_begin(&s_bar, bytes);
    bulk_copy(xs, x + (long)g0 * K, bytes, &s_bar);
  }
  zero_skipped();
  st.prefetch_rest(pre_rounds);
  if constexpr (FOLD) hc_fold_load_act(fold, fs(), t0, nt, O);
  mma_part_zero(part, nt);
  if constexpr (NORM) {
    stage_mma_rmsnorm<FMT, AQ>(xs, x, K, nw, nw_f32 != 0, eps);
  } else if (bulk_x) {
    stage_mma_bulk_landed<FMT>(&s_bar, xs, ng * K / 8);
  } else {
    stage_mma_rows<FMT, false, AQ>(xs, [=](int g) { return x + (long)(g0 + g) * K; }, ng, K);
  }
  __syncthreads();
  DS4_MARK(1);
  st.run(part);
  __syncthreads();
  for (int i = threadIdx.x; i < nt * 16; i += blockDim.x) {
    const int r = t0 * 16 + i;
    if (r >= O) continue;
    const float y = mma_part_sum(part, i >> 4, i & 15);
    if (out_f32) reinterpret_cast<float*>(out)[r] = y;
    else reinterpret_cast<__nv_bfloat16*>(out)[r] = __float2bfloat16(y);
    if constexpr (FOLD) fs().ys[i] = __bfloat162float(__float2bfloat16(y));
  }
  if constexpr (FOLD) hc_fold_epilogue(fold, fs(), t0, nt, O);
  DS4_MARK(2);
}

int sm_count() {
  static int count[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 132;
  if (count[dev] == 0) cudaDeviceGetAttribute(&count[dev], cudaDevAttrMultiProcessorCount, dev);
  return count[dev] > 0 ? count[dev] : 132;
}

// The tensor-core kernels' widest run per lane and row (W chunks of 16 B): DS4_MMA_W = 1, 2 or 4
// (default MMA_W_DEFAULT), and their depth (chunks per lane and row in flight, U = depth / W rounds):
// DS4_MMA_DEPTH = 8, 4 or 2 for every launch, else mma_depth_default (mma_min_blocks); DS4_MMA_LOAD=smem
// takes the shared-memory stream instead (MmaSmemStream; depth 0). All read at every launch so one
// process can sweep them (scripts/bench_kernels.py --mma w2d8,w2d4,w2d0,...).
constexpr int MMA_W_DEFAULT = 2;
int mma_max_width() {
  const char* env = std::getenv("DS4_MMA_W");
  const int w = env ? std::atoi(env) : MMA_W_DEFAULT;
  return w == 1 || w == 2 ? w : 4;
}
// Default depth per shape (H200 micro-benchmark, experiments/decode_session8_h200.md, depth 8 / 2):
// rows of K <= 2048 and the grouped wo_a gain from the extra resident warps of depth 2 (wq_b 11.40 ->
// 9.84 us, grouped wo_a 11.52 -> 10.39, routed down 16.45 -> 15.37); the longer rows keep depth 8 (wo_b
// 11.52 vs 12.75 at depth 2, routed gate+up 25.37 vs 28.39).
int mma_depth_default(int K, bool grouped) { return K <= 2048 || grouped ? 2 : 8; }
// An environment depth (8 / 4 / 2, rounded down to one of them); 0 where the variable is unset or empty.
int env_depth(const char* name) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return 0;
  const int d = std::atoi(env);
  return d >= 8 ? 8 : d >= 4 ? 4 : 2;
}
// DS4_LONG_ROW_DEPTH (bench token lrdN) replaces the rule's 8 alone: wq_a + wkv, wo_b and the shared expert's
// gate+up at V4's shapes, not the routed gate+up (gate_up_depth in moe_mma.cu). An ablation: the routed gate+up gained
// from depth 4 once session 33 had made a round cheaper; these at 4 did not (lrd4, 110.3 / 109.9 against 109.6 /
// 109.3 us per layer, H200, experiments/decode_session34_h200.md).
int mma_depth_for(int K, bool grouped, int long_rows) {
  const char* load = std::getenv("DS4_MMA_LOAD");  // "smem": the shared-memory stream (depth 0)
  if (load && std::strcmp(load, "smem") == 0) return 0;
  if (const int d = env_depth("DS4_MMA_DEPTH")) return d;
  const int d = mma_depth_default(K, grouped);
  return d == 8 && long_rows ? long_rows : d;
}
int mma_depth(int K, bool grouped) { return mma_depth_for(K, grouped, env_depth("DS4_LONG_ROW_DEPTH")); }

template <int FMT, int U, int CW, bool NORM = false, bool FOLD = false, bool AQ = false>
static cudaError_t gemv_mma_go(const void* x, const void* W, const void* S, int s_ld, void* out, bool out_f32, int O,
                               int K, int group_rows, cudaStream_t st, const void* nw = nullptr, bool nw_f32 = false,
                               float eps = 0.f, const HcFold& fold = HcFold{}, const RowSkip& skip = RowSkip{}) {
  auto kern = gemv_mma_kernel<FMT, U, CW, NORM, FOLD, AQ>;
  const int T = (O + 15) / 16;
  auto smem_for = [&](int tpb) {  // partial sums + the activations of the groups tpb tiles can touch (+ stream, fold)
    const int ng = group_rows > 0 ? (tpb * 16 + group_rows - 1) / group_rows + 1 : 1;
    return 4L * mma_part_floats(tpb) + (long)ng * K * 2 + mma_stream_smem<FMT, U, CW>() +
           (FOLD ? 4L * hc_fold_smem_floats(tpb, fold.n, fold.mix) : 0L);
  };
  if constexpr (U == 0) {  // the shared-memory stream does not fit beside these activations: registers
    if (smem_for(1) > SMEM_CAP)
      return gemv_mma_go<FMT, 8 / CW, CW, NORM, FOLD, AQ>(x, W, S, s_ld, out, out_f32, O, K, group_rows, st, nw, nw_f32,
                                                          eps, fold, skip);
  }
  // one resident wave (register-bound occupancy; an AQ instance its plain twin's), the tiles split evenly over it
  int wave = 0;
  cudaError_t e = twin_wave(kern, gemv_mma_kernel<FMT, U, CW, NORM, FOLD, false>, MMA_STREAM_THREADS, smem_for(1), wave);
  if (e != cudaSuccess) return e;
  int tpb = mma_tiles_per_block(T, wave);
  while (tpb > 1 && smem_for(tpb) > SMEM_CAP) tpb /= 2;  // many small groups: more blocks instead
  const int blocks = (T + tpb - 1) / tpb;
  const long smem = smem_for(tpb);
  if ((e = set_smem(kern, smem)) != cudaSuccess) return e;
  if ((e = launch_spacer_before('g', st)) != cudaSuccess) return e;
  return ds4_pdl::launch(kern, dim3(blocks), dim3(MMA_STREAM_THREADS), smem, st, reinterpret_cast<const __nv_bfloat16*>(x),
                         reinterpret_cast<const uint8_t*>(W), reinterpret_cast<const uint8_t*>(S), s_ld, out,
                         out_f32 ? 1 : 0, O, K, group_rows, tpb, nw, nw_f32 ? 1 : 0, eps, fold,
                         mma_prefetch_rounds(false), skip, bulk_stage_site('g') && bulk_piece_ok(x, 2L * K) ? 1 : 0);
}

__global__ void spacer_kernel() { ds4_pdl::begin(); }

cudaError_t launch_spacer_before(char kind, cudaStream_t st) {
  const char* env = std::getenv("DS4_SPACER");
  if (!env || !std::strchr(env, kind)) return cudaSuccess;
  return ds4_pdl::launch(spacer_kernel, dim3(1), dim3(32), 0, st);
}

bool bulk_stage_site(char site) {
  const char* v = std::getenv("DS4_BULK_STAGE");
  if (v == nullptr || *v == '\0') return false;
  if (std::strcmp(v, "all") != 0 && std::strchr(v, site) == nullptr) return false;
  return ds4_pdl::device_major() >= 9;
}

bool bulk_piece_ok(const void* p, long bytes) {
  return p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 == 0 && bytes > 0 && bytes % 16 == 0;
}

int mma_prefetch_rounds(bool down) {
  const char* env = std::getenv(down ? "DS4_PREFETCH_DOWN" : "DS4_PREFETCH");
  if (!env || !env[0]) return -1;
  const int n = std::atoi(env);
  return n < 0 ? -1 : n;
}

bool mma_auto(int fmt, int K, int O) {
  const char* env = std::getenv("DS4_MMA");
  if (env && env[0] == '0') return false;
  if (fmt_fp4(fmt) || (env && std::strcmp(env, "all") == 0)) return true;
  // DS4_MMA=k2048: the rule before wq_b moved (FP8 rows of K >= 2048 only), for the ablation
  const bool wide_only = env && std::strcmp(env, "k2048") == 0;
  return fmt_fp8(fmt) && (K >= 2048 || (!wide_only && K >= 1024 && O >= 16384));
}

template <int FMT>
static long gemv_smem(int nt, int K) { return (long)nt * Smem<FMT>::row_floats(K) * 4; }

int gemv_max_tokens(int fmt, int K) {
  const long per = fmt == FMT_BF16 ? gemv_smem<FMT_BF16>(1, K)
                 : fmt_fp8(fmt) ? gemv_smem<FMT_FP8>(1, K) : gemv_smem<FMT_FP4>(1, K);
  long n = SMEM_CAP / (per > 0 ? per : 1);
  return (int)(n > 8 ? 8 : n);
}

// U: 16-byte chunks in flight per row and lane (R * U = 8 by default)
template <int FMT, int NT, int R, int U = 8 / R>
static cudaError_t gemv_go(const void* x, long x_ld, int n_tok, const void* W, const void* S, int s_ld,
                           void* out, bool out_f32, long out_ld, int O, int K, int group_rows,
                           cudaStream_t st) {
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

// Host: f(fmt, cw, u) (std::integral_constant each) for a dense one-token tensor-core product: FP8 / FP4 at
// mma_width's run width, FP8T at its laid-out one (with_tiled_shape), at `depth`.
template <typename F>
static cudaError_t with_dense_mma(int fmt, int K, int depth, F f) {
  using std::integral_constant;
  if (fmt == FMT_FP8T)
    return with_tiled_shape(depth, [&](auto cw, auto u) { return f(integral_constant<int, FMT_FP8T>{}, cw, u); });
  return with_mma_shape(mma_width(fmt, K, mma_max_width()), depth, [&](auto cw, auto u) {
    return fmt == FMT_FP8 ? f(integral_constant<int, FMT_FP8>{}, cw, u) : f(integral_constant<int, FMT_FP4>{}, cw, u);
  });
}

// Whether launch_gemv may take the tensor-core kernel: one token, whole rounds, 16-row tiles inside groups, a
// tile's activations (two groups' when grouped) in shared memory.
static bool gemv_mma_fits(int fmt, int n_tok, int K, int group_rows) {
  return n_tok == 1 && mma_shape_ok(fmt, K) && (group_rows <= 0 || group_rows % 16 == 0) &&
         4L * mma_part_floats(1) + 2L * K * (group_rows > 0 ? 2 : 1) <= SMEM_CAP;
}

// Whether launch_gemv takes the tensor-core kernel (with `kernel`'s choice and mma_auto's rule, DS4_MMA honoured).
static bool gemv_takes_mma(int fmt, int kernel, int n_tok, int O, int K, int group_rows) {
  const bool fits = gemv_mma_fits(fmt, n_tok, K, group_rows);
  return fits && (kernel == KERNEL_MMA || (kernel == KERNEL_AUTO && mma_auto(fmt, K, O)));
}

// numerics=qat's kernels with the FP8 activation simulation in their staging (AQ) exist at fewer shapes than the
// plain ones (each instance costs compile time): the tiled FP8 layout's run width or width 2 (FP8 / FP4), the register
// stream at depth 8 or 2 (the default rule's two, mma_depth_default). Only at the plain launch's own depth: the depth
// sets the stream's rounds in flight (U), and with them the twin whose wave cuts the tiles (gemv_mma_go), so another
// depth would sum in another order. Elsewhere (DS4_MMA_DEPTH / DS4_LONG_ROW_DEPTH 4, DS4_MMA_LOAD=smem) the caller
// runs the act_quant_sim launch first (gemv_act_quant_ok says which).
static bool aq_shape_ok(int fmt, int K, int depth) {
  return (depth == 8 || depth == 2) && (fmt == FMT_FP8T || mma_width(fmt, K, mma_max_width()) == 2);
}

template <typename F>
static cudaError_t with_dense_mma_aq(int fmt, int depth, F f) {
  using std::integral_constant;
  using W2 = integral_constant<int, 2>;
  const bool deep = depth >= 8;
  if (fmt == FMT_FP8T) {
    using CW = integral_constant<int, FP4T_W>;
    using F8T = integral_constant<int, FMT_FP8T>;
    return deep ? f(F8T{}, CW{}, integral_constant<int, 8 / FP4T_W>{}) : f(F8T{}, CW{}, integral_constant<int, 2 / FP4T_W>{});
  }
  auto go = [&](auto fc) { return deep ? f(fc, W2{}, integral_constant<int, 4>{}) : f(fc, W2{}, integral_constant<int, 1>{}); };
  return fmt == FMT_FP8 ? go(integral_constant<int, FMT_FP8>{}) : go(integral_constant<int, FMT_FP4>{});
}

// Host: f(fmt, cw, u, aq) (std::integral_constant each) at with_dense_mma's shapes, or with aq at with_dense_mma_aq's.
template <typename F>
static cudaError_t with_dense_mma_for(bool aq, int fmt, int K, int depth, F f) {
  if (aq) return with_dense_mma_aq(fmt, depth, [&](auto fc, auto cw, auto u) { return f(fc, cw, u, std::true_type{}); });
  return with_dense_mma(fmt, K, depth, [&](auto fc, auto cw, auto u) { return f(fc, cw, u, std::false_type{}); });
}

bool gemv_act_quant_ok(int fmt, int kernel, int n_tok, int O, int K, int group_rows) {
  return (fmt_fp8(fmt) || fmt == FMT_FP4) && group_rows <= 0 && K % 128 == 0 && layout_shape_ok(fmt, O, K) &&
         aq_shape_ok(fmt, K, mma_depth(K, false)) && gemv_takes_mma(fmt, kernel, n_tok, O, K, group_rows);
}

cudaError_t launch_gemv(int fmt, int kernel, const void* x, long x_ld, int n_tok, const void* W, const void* S,
                        int s_ld, void* out, bool out_f32, long out_ld, int O, int K, int group_rows,
                        cudaStream_t st, bool aq) {
  // FMT_FP4P / FMT_FP4T are the routed experts' layouts (moe.cu); dense weights keep the stored one
  if (n_tok < 1 || n_tok > 8 || O < 1 || K < 1 || fmt_fp4p(fmt) || !layout_shape_ok(fmt, O, K))
    return cudaErrorInvalidValue;
  if (aq && !gemv_act_quant_ok(fmt, kernel, n_tok, O, K, group_rows)) return cudaErrorInvalidValue;
  if (kernel == KERNEL_MMA && !gemv_mma_fits(fmt, n_tok, K, group_rows)) return cudaErrorInvalidValue;
  if (gemv_takes_mma(fmt, kernel, n_tok, O, K, group_rows)) {
    return with_dense_mma_for(aq, fmt, K, mma_depth(K, group_rows > 0), [&](auto f, auto cw, auto u, auto a) {
      constexpr int F = decltype(f)::value, CW = decltype(cw)::value, U = decltype(u)::value;
      return gemv_mma_go<F, U, CW, false, false, decltype(a)::value>(x, W, S, s_ld, out, out_f32, O, K, group_rows, st);
    });
  }
  if (group_rows > 0 && group_rows % (GEMV_WARPS * 2) != 0) return cudaErrorInvalidValue;
  // FP8, one token, K <= 4096: 4 rows per warp x 2 chunks per row in flight instead of 2 x 4 (H200 phase
  // probe, scripts/probe_phases.cu: wq_b 15.2 -> 14.4 us, grouped wo_a 15.7 -> 14.2; wo_b at K = 8192
  // 17.5 -> 17.6, so it keeps 2 x 4)
  if (fmt_fp8(fmt) && n_tok == 1 && K <= 4096 && (group_rows <= 0 || group_rows % (GEMV_WARPS * 4) == 0))
    return fmt == FMT_FP8T
               ? gemv_go<FMT_FP8T, 1, 4>(x, x_ld, n_tok, W, S, s_ld, out, out_f32, out_ld, O, K, group_rows, st)
               : gemv_go<FMT_FP8, 1, 4>(x, x_ld, n_tok, W, S, s_ld, out, out_f32, out_ld, O, K, group_rows, st);
  if (fmt == FMT_FP8) return gemv_nt<FMT_FP8, 2>(n_tok, x, x_ld, W, S, s_ld, out, out_f32, out_ld, O, K, group_rows, st);
  if (fmt == FMT_FP8T)
    return gemv_nt<FMT_FP8T, 2>(n_tok, x, x_ld, W, S, s_ld, out, out_f32, out_ld, O, K, group_rows, st);
  if (fmt == FMT_FP4) return gemv_nt<FMT_FP4, 2>(n_tok, x, x_ld, W, S, s_ld, out, out_f32, out_ld, O, K, group_rows, st);
  // BF16, one token, few rows (the router's 256 x 4096 gate): one row per warp, so the rows spread over twice
  // the blocks (32 instead of 16 for the gate), and 16 chunks in flight, so a 4096-wide row is all requested
  // before the PDL wait (during the hc finish before it); with 8, a second round of weight loads came after
  // the wait, on the decode step's critical path. A row's sum is the same in every form (each lane adds its
  // chunks in order, then the warp's shuffle tree). The CSA compressor's 2048-row projection in this form too
  // measured no faster (H200: 119.3 / 118.4 against 118.1 us per layer, experiments/decode_session24_h200.md),
  // so more rows keep 2 rows x 4 chunks per warp.
  if (fmt == FMT_BF16 && n_tok == 1 && O <= 1024 && group_rows <= 0)
    return gemv_go<FMT_BF16, 1, 1, 16>(x, x_ld, n_tok, W, S, s_ld, out, out_f32, out_ld, O, K, group_rows, st);
  if (fmt == FMT_BF16) return gemv_nt<FMT_BF16, 2>(n_tok, x, x_ld, W, S, s_ld, out, out_f32, out_ld, O, K, group_rows, st);
  return cudaErrorInvalidValue;
}

// The compressors' deferred projection (ds4_launch.h launch_gemv_deferred): BF16 rows, NT >= every tokens, one warp
// per row and DEFER_U 16-byte chunks per lane in flight. Its own kernel rather than gemv_kernel's NT form, which
// stages the tokens as padded fp32 (80 KB of shared memory for four 4096-wide tokens; that first form ran 18-21 us
// on the due step's critical path, H200, session 38, where this one ran 12-14). Here the tokens stay bf16 in shared
// memory (8 KB each); a lane reads a chunk's NT tokens as one 16-byte load each, conflict-free.
constexpr int DEFER_U = 8;
template <int NT>
__global__ void __launch_bounds__(GEMV_THREADS)
gemv_deferred_kernel(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ ring, int every,
                     const int64_t* __restrict__ pos, const uint8_t* __restrict__ W, float* __restrict__ out, int O,
                     int K) {
  extern __shared__ uint4 xs[];  // [NT][K / 8]
  // The position was written at the decode step's start, before this branch forked: it may be read before the PDL
  // wait. Not due: x goes to its ring slot (block 0, after the wait: x is the previous kernel's output) and every
  // block exits without a weight load.
  const int slot = (int)(pos[0] % every);
  const int nch = K / 8;
  if (slot != every - 1) {
    ds4_pdl::begin();
    if (blockIdx.x == 0)
      for (int i = threadIdx.x; i < nch; i += blockDim.x)
        reinterpret_cast<uint4*>(ring + (long)slot * K)[i] = reinterpret_cast<const uint4*>(x)[i];
    return;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = min(blockIdx.x * GEMV_WARPS + warp, O - 1);
  const uint8_t* wr = W + (long)row * K * 2;
  uint4 wv[DEFER_U];
  auto load = [&](int c0) {
#pragma unroll
    for (int u = 0; u < DEFER_U; ++u)
      if (c0 + 32 * u < nch) wv[u] = ld_stream16(wr + (long)(c0 + 32 * u) * 16);
  };
  load(lane);  // weights do not depend on the activations: start their loads before the PDL wait
  ds4_pdl::begin();
  for (int i = threadIdx.x; i < every * nch; i += blockDim.x) {  // token t < every - 1 from the ring, the last is x
    const int t = i / nch, c = i - t * nch;
    xs[i] = reinterpret_cast<const uint4*>(t < every - 1 ? ring + (long)t * K : x)[c];
  }
  __syncthreads();
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.f;
  for (int c0 = lane; c0 < nch; c0 += 32 * DEFER_U) {
#pragma unroll
    for (int u = 0; u < DEFER_U; ++u) {
      const int c = c0 + 32 * u;
      if (c >= nch) break;
      const uint32_t w4[4] = {wv[u].x, wv[u].y, wv[u].z, wv[u].w};
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        if (t >= every) break;
        const uint4 xv = xs[t * nch + c];
        const uint32_t x4[4] = {xv.x, xv.y, xv.z, xv.w};
        float p = 0.f;  // the chunk's 8 products in order, then into the token's sum
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          p = fmaf(__uint_as_float(w4[k] << 16), __uint_as_float(x4[k] << 16), p);
          p = fmaf(__uint_as_float(w4[k] & 0xffff0000u), __uint_as_float(x4[k] & 0xffff0000u), p);
        }
        acc[t] += p;
      }
    }
    if (c0 + 32 * DEFER_U < nch) load(c0 + 32 * DEFER_U);
  }
  const int r = blockIdx.x * GEMV_WARPS + warp;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const float v = warp_sum(acc[t]);
    if (lane == 0 && r < O && t < every) out[(long)t * O + r] = v;
  }
}

cudaError_t launch_gemv_deferred(const void* x, void* ring, int every, const int64_t* pos, const void* W, void* out,
                                 int O, int K, cudaStream_t st) {
  if (every < 2 || every > 8 || O < 1 || K < 8 || K % 8 || !ring || !pos) return cudaErrorInvalidValue;
  if ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(ring) | reinterpret_cast<uintptr_t>(W)) & 15)
    return cudaErrorInvalidValue;
  const long smem = (long)(every <= 2 ? 2 : every <= 4 ? 4 : 8) * K * 2;
  if (smem > SMEM_CAP) return cudaErrorInvalidValue;
  auto go = [&](auto kern) {
    cudaError_t e = set_smem(kern, smem);
    if (e != cudaSuccess) return e;
    return ds4_pdl::launch(kern, dim3((O + GEMV_WARPS - 1) / GEMV_WARPS), dim3(GEMV_THREADS), smem, st,
                           static_cast<const __nv_bfloat16*>(x), static_cast<__nv_bfloat16*>(ring), every, pos,
                           static_cast<const uint8_t*>(W), static_cast<float*>(out), O, K);
  };
  if (every <= 2) return go(gemv_deferred_kernel<2>);
  if (every <= 4) return go(gemv_deferred_kernel<4>);
  return go(gemv_deferred_kernel<8>);
}

// The norm-fused GEMV exists only on the tensor cores. It takes AUTO's rule without the row count: the
// indexer's wq_b (8192 x 1024) alone is faster on the FMA kernel, but fused it saves the rms_norm launch
// before it on the indexer's chain (DS4_MMA=0 / k2048 still keep the norm apart).
bool gemv_rmsnorm_ok(int fmt, int O, int K) {
  return (fmt_fp8(fmt) || fmt == FMT_FP4) && layout_shape_ok(fmt, O, K) && O >= 1 && K >= 8 && K % 8 == 0 &&
         K <= 8 * MMA_STREAM_THREADS * RMS_VPT && mma_shape_ok(fmt, K) && 4L * mma_part_floats(1) + 2L * K <= SMEM_CAP &&
         mma_auto(fmt, K, 1 << 30);
}

cudaError_t launch_gemv_rmsnorm(int fmt, const void* x, const void* W, const void* S, int s_ld, void* out, bool out_f32,
                                int O, int K, const void* nw, bool nw_f32, float eps, cudaStream_t st,
                                const RowSkip& skip, bool aq) {
  if (!gemv_rmsnorm_ok(fmt, O, K) || nw == nullptr || (aq && !gemv_act_quant_ok(fmt, KERNEL_AUTO, 1, O, K, 0)))
    return cudaErrorInvalidValue;
  if (skip.pos != nullptr && (skip.ratio < 1 || skip.k < 1 || skip.rows < 16 || skip.rows % 16 || skip.rows >= O))
    return cudaErrorInvalidValue;
  return with_dense_mma_for(aq, fmt, K, mma_depth(K, false), [&](auto f, auto cw, auto u, auto a) {
    constexpr int F = decltype(f)::value, CW = decltype(cw)::value, U = decltype(u)::value;
    return gemv_mma_go<F, U, CW, true, false, decltype(a)::value>(x, W, S, s_ld, out, out_f32, O, K, 0, st, nw, nw_f32,
                                                                  eps, {}, skip);
  });
}

bool moe_down_fold_ok(int fmt, int topk, int dim, int inter, int n);  // moe_mma.cu

bool hc_fold_ok(int kind, int fmt, int rows, int cols, int topk, int n) {
  if (!(n == 1 || n == 2 || n == 4) || rows < 16 || rows % 16 != 0) return false;
  // at one tile per block (the launchers halve their tiles per block until the buffers fit)
  const long fold = 4L * hc_fold_smem_floats(1, n, (2 + n) * n);
  if (kind == 0)
    return (fmt_fp8(fmt) || fmt == FMT_FP4) && layout_shape_ok(fmt, rows, cols) && mma_shape_ok(fmt, cols) &&
           mma_auto(fmt, cols, rows) &&
           4L * mma_part_floats(1) + 2L * cols + fold <= SMEM_CAP;
  return kind == 1 && moe_down_fold_ok(fmt, topk, rows, cols, n);
}

cudaError_t launch_gemv_fold(int fmt, const void* x, const void* W, const void* S, int s_ld, void* out, int O, int K,
                             const HcFold& fold, cudaStream_t st, bool aq) {
  if (!hc_fold_ok(0, fmt, O, K, 1, fold.n) || fold.mix != (2 + fold.n) * fold.n ||
      (aq && !gemv_act_quant_ok(fmt, KERNEL_AUTO, 1, O, K, 0)))
    return cudaErrorInvalidValue;
  return with_dense_mma_for(aq, fmt, K, mma_depth(K, false), [&](auto f, auto cw, auto u, auto a) {
    constexpr int F = decltype(f)::value, CW = decltype(cw)::value, U = decltype(u)::value;
    return gemv_mma_go<F, U, CW, false, true, decltype(a)::value>(x, W, S, s_ld, out, false, O, K, 0, st, nullptr,
                                                                  false, 0.f, fold);
  });
}

}  // namespace ds4
