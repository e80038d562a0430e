// Routed experts (MXFP4), the shared expert (FP8) and cached BF16 experts, all top-k experts of a
// layer in two launches, expert ids read from the device tensor (no host sync):
//   launch 1 (gate+up): grid (row blocks of `inter`, distinct-expert entry). Each block derives the
//     distinct local experts of ids [n_tok, topk] itself (a few shared-memory passes over <= 64
//     ids), reads the w1 and w3 rows of its entry once for every token that chose that expert, and
//     writes h[t*topk+j] = bf16(silu(min(g,lim)) * clamp(u,+-lim) * route_weight).
//   launch 2 (down): grid over output rows of `dim`; each block stages the h rows in shared memory
//     and loops over the distinct experts, accumulating every token's output in fp32 registers.
//     No atomics, no per-expert temporaries; slots whose expert is not local contribute nothing.
// A token choosing one expert twice gets two entries (same weights, read twice), matching the
// per-slot semantics of the reference.
// One-token launches can use the tensor-core variants in moe_mma.cu (mma_dot.cuh; which ones `auto` takes:
// ds4_launch.h): the same two launches, each a resident wave of blocks streaming 16-row tiles
// (MmaStream) — gate+up: the (w1, w3) tile pairs of all local slots split evenly over the blocks;
// down: output row tiles, each summing the local slots as segments.
#include "ds4_common.cuh"
#include "ds4_launch.h"
#include "mma_dot.cuh"
#include "moe_dev.cuh"

#include <algorithm>
#include <cstdlib>

namespace ds4 {

constexpr int MOE_THREADS = 256;
constexpr int MOE_WARPS = MOE_THREADS / 32;
constexpr int MAX_SLOTS = 64;  // n_tok * topk per launch
constexpr long MOE_SMEM_CAP = 150 * 1024;

// Distinct (expert, occurrence-in-token) entries of the slots. s_e[u] = local expert of entry u,
// s_slot[u*NT + t] = slot (t*topk + j) of token t for entry u, or -1. Returns the entry count.
template <int NT>
__device__ int moe_entries(const int64_t* __restrict__ ids, int n_tok, int topk, int off, int nloc,
                           int* s_e, int* s_slot, int* s_key, int* s_rank, int* s_first) {
  const int P = n_tok * topk;
  const int tid = threadIdx.x;
  for (int i = tid; i < MAX_SLOTS * NT; i += blockDim.x) s_slot[i] = -1;
  if (tid < P) {
    const long e = ids ? ids[tid] - off : 0;
    s_key[tid] = (e >= 0 && e < nloc) ? (int)e : -1;
  }
  __syncthreads();
  if (tid < P) {
    const int e = s_key[tid];
    int r = 0;
    if (e >= 0)
      for (int q = (tid / topk) * topk; q < tid; ++q) r += (s_key[q] == e);
    s_rank[tid] = r;
  }
  __syncthreads();
  if (tid < P) {
    const int e = s_key[tid], r = s_rank[tid];
    int first = e >= 0;
    for (int q = 0; q < tid && first; ++q)
      if (s_key[q] == e && s_rank[q] == r) first = 0;
    s_first[tid] = first;
  }
  __syncthreads();
  int nU = 0;
  for (int q = 0; q < P; ++q) nU += s_first[q];
  if (tid < P && s_key[tid] >= 0) {
    const int e = s_key[tid], r = s_rank[tid];
    int ord = 0, q = 0;
    for (; q < P; ++q) {
      if (s_key[q] == e && s_rank[q] == r) break;
      ord += s_first[q];
    }
    if (q == tid) s_e[ord] = e;
    s_slot[ord * NT + tid / topk] = tid;
  }
  __syncthreads();
  return nU;
}

template <int FMT, int NT, int R, int U>
__global__ void __launch_bounds__(MOE_THREADS)
moe_gate_up_kernel(const MoEArgs a, const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ h) {
  ds4_pdl::begin();  // expert ids, route weights and x come from the previous kernels
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);
  __shared__ int s_e[MAX_SLOTS], s_slot[MAX_SLOTS * NT], s_key[MAX_SLOTS], s_rank[MAX_SLOTS], s_first[MAX_SLOTS];
  const int nU = moe_entries<NT>(a.ids, a.n_tok, a.topk, a.expert_offset, a.n_local, s_e, s_slot, s_key,
                                 s_rank, s_first);
  const int u = blockIdx.y;
  if (u >= nU) return;  // block-uniform
  constexpr int VALS = FmtInfo<FMT>::VALS, CS = Smem<FMT>::CS;
  const int K = a.dim;
  const long xrow = Smem<FMT>::row_floats(K);
  int slot[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) slot[t] = s_slot[u * NT + t];

  const int e = s_e[u];
  const uint8_t *W1, *S1, *W3, *S3;
  expert_base<FMT>(a, e, 0, W1, S1);
  expert_base<FMT>(a, e, 1, W3, S3);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rbase = blockIdx.x * (MOE_WARPS * R) + warp * R;
  const long rb = row_bytes<FMT>(K);
  const int nch = K / VALS;
  const uint8_t* wr[2 * R];  // the matrix (w1 or w3) of row j
  const uint8_t* sr[2 * R];
  int rr[2 * R];
#pragma unroll
  for (int j = 0; j < R; ++j) {
    const int r = min(rbase + j, a.inter - 1);
    rr[j] = rr[R + j] = r;
    wr[j] = W1;
    wr[R + j] = W3;
    sr[j] = S1;
    sr[R + j] = S3;
  }
  float acc[2 * R][NT];
#pragma unroll
  for (int j = 0; j < 2 * R; ++j)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[j][t] = 0.f;
  uint4 wv[U][2 * R];
  float sc[U][2 * R];
  auto load = [&](int c0) {
#pragma unroll
    for (int uu = 0; uu < U; ++uu) {
      const int c = c0 + 32 * uu;
      if (c < nch) {
#pragma unroll
        for (int j = 0; j < 2 * R; ++j) {
          wv[uu][j] = ld_stream16(chunk_ptr<FMT>(wr[j], rr[j], rb, c));
          sc[uu][j] = chunk_scale<FMT>(sr[j], rr[j], c, a.s13_ld);
        }
      }
    }
  };
  load(lane);  // start the weight loads before staging the activations
#pragma unroll
  for (int t = 0; t < NT; ++t)
    if (slot[t] >= 0) load_row_smem<FMT>(xs + t * xrow, x + (long)t * K, K);
  __syncthreads();

  for (int c0 = lane; c0 < nch; c0 += 32 * U) {
#pragma unroll
    for (int uu = 0; uu < U; ++uu) {
      const int c = c0 + 32 * uu;
      if (c < nch) {
        const float* xp[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) xp[t] = slot[t] >= 0 ? xs + t * xrow + (long)c * CS : nullptr;
        chunk_fma<FMT, 2 * R, NT>(wv[uu], sc[uu], xp, acc);
      }
    }
    if (c0 + 32 * U < nch) load(c0 + 32 * U);
  }
  const float post = post_factor<FMT>();
  const float lim = a.limit;
#pragma unroll
  for (int j = 0; j < R; ++j)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (slot[t] < 0) continue;  // warp-uniform
      const float g = warp_sum(acc[j][t]) * post, up = warp_sum(acc[R + j][t]) * post;
      if (lane == 0 && rbase + j < a.inter)
        h[(long)slot[t] * a.inter + rbase + j] = swiglu_h(g, up, lim, a.rw ? a.rw[slot[t]] : 1.0f);
    }
}

template <int FMT, int NT, int R, int U, bool OUT_F32>
__global__ void __launch_bounds__(MOE_THREADS)
moe_down_kernel(const MoEArgs a, const __nv_bfloat16* __restrict__ h, const void* __restrict__ add,
                void* __restrict__ out) {
  ds4_pdl::begin();
  extern __shared__ float4 smem4[];
  float* hs = reinterpret_cast<float*>(smem4);
  __shared__ int s_e[MAX_SLOTS], s_slot[MAX_SLOTS * NT], s_key[MAX_SLOTS], s_rank[MAX_SLOTS], s_first[MAX_SLOTS];
  const int nU = moe_entries<NT>(a.ids, a.n_tok, a.topk, a.expert_offset, a.n_local, s_e, s_slot, s_key,
                                 s_rank, s_first);
  constexpr int VALS = FmtInfo<FMT>::VALS, CS = Smem<FMT>::CS;
  const int K = a.inter;
  const long hrow = Smem<FMT>::row_floats(K);
  const int P = a.n_tok * a.topk;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rbase = blockIdx.x * (MOE_WARPS * R) + warp * R;
  const long rb = row_bytes<FMT>(K);
  const int nch = K / VALS;
  int rr[R];
#pragma unroll
  for (int j = 0; j < R; ++j) rr[j] = min(rbase + j, a.dim - 1);
  float acc[R][NT];
#pragma unroll
  for (int j = 0; j < R; ++j)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[j][t] = 0.f;

  // iterate over (entry, chunk) pairs, U per lane in flight
  const long total = (long)nU * nch;
  int u0 = 0, c0 = lane;
  while (c0 >= nch && u0 < nU) { c0 -= nch; ++u0; }
  uint4 wv[U][R];
  float sc[U][R];
  int cu[U], uu_e[U];
  auto load = [&]() {
#pragma unroll
    for (int k = 0; k < U; ++k) {
      int u = u0, c = c0 + 32 * k;
      while (c >= nch) { c -= nch; ++u; }
      cu[k] = c;
      uu_e[k] = u;
      if (u < nU) {
        const uint8_t *W, *S;
        expert_base<FMT>(a, s_e[u], 2, W, S);
#pragma unroll
        for (int j = 0; j < R; ++j) {
          wv[k][j] = ld_stream16(chunk_ptr<FMT>(W, rr[j], rb, c));
          sc[k][j] = chunk_scale<FMT>(S, rr[j], c, a.s2_ld);
        }
      }
    }
  };
  load();  // start the weight loads before staging h
  for (int p = 0; p < P; ++p)
    if (s_key[p] >= 0) load_row_smem<FMT>(hs + p * hrow, h + (long)p * K, K);
  __syncthreads();

  for (long it0 = lane; it0 < total; it0 += 32 * U) {
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int u = uu_e[k];
      if (u < nU) {
        const float* xp[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const int s = s_slot[u * NT + t];
          xp[t] = s >= 0 ? hs + s * hrow + (long)cu[k] * CS : nullptr;
        }
        chunk_fma<FMT, R, NT>(wv[k], sc[k], xp, acc);
      }
    }
    c0 += 32 * U;
    while (c0 >= nch && u0 < nU) { c0 -= nch; ++u0; }
    if (it0 + 32 * U < total) load();
  }
  const float post = post_factor<FMT>();
#pragma unroll
  for (int j = 0; j < R; ++j)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float v = warp_sum(acc[j][t]) * post;
      if (lane == 0 && rbase + j < a.dim && t < a.n_tok) {
        down_store<OUT_F32>(out, (long)t * a.dim + rbase + j, add, a.add_bf16, v);
      }
    }
}

static long moe_row_bytes(int fmt, int K) {
  return 4 * (fmt == FMT_BF16 ? Smem<FMT_BF16>::row_floats(K)
              : fmt_fp8(fmt) ? Smem<FMT_FP8>::row_floats(K) : Smem<FMT_FP4>::row_floats(K));
}

int moe_max_tokens(int fmt, int topk, int dim, int inter) {
  const long gu = moe_row_bytes(fmt, dim), dn = moe_row_bytes(fmt, inter) * topk;
  long n = MOE_SMEM_CAP / (gu > dn ? gu : dn);
  if (n * topk > MAX_SLOTS) n = MAX_SLOTS / topk;
  return (int)(n > 8 ? 8 : n);
}

static bool moe_shape_ok(const MoEArgs& a) {
  const int v = a.fmt == FMT_BF16 ? 8 : (fmt_fp8(a.fmt) ? 16 : 32);
  if (a.n_tok < 1 || a.n_tok > 8 || a.topk < 1 || a.n_tok * a.topk > MAX_SLOTS) return false;
  if (a.dim % v || a.inter % v || a.dim % 8 || a.inter % 8) return false;
  if (a.n_tok > moe_max_tokens(a.fmt, a.topk, a.dim, a.inter)) return false;
  if (!a.ids && a.topk != 1) return false;
  return true;
}

template <int FMT, int NT>
static cudaError_t gate_up_go(const MoEArgs& a, const void* x, void* h, cudaStream_t st) {
  constexpr int R = 2, U = 2;
  const long smem = (long)a.n_tok * moe_row_bytes(FMT, a.dim);
  auto kern = moe_gate_up_kernel<FMT, NT, R, U>;
  cudaError_t e = set_smem(kern, smem);
  if (e != cudaSuccess) return e;
  dim3 grid((a.inter + MOE_WARPS * R - 1) / (MOE_WARPS * R), a.n_tok * a.topk);
  return ds4_pdl::launch(kern, grid, dim3(MOE_THREADS), smem, st, a, reinterpret_cast<const __nv_bfloat16*>(x),
                         reinterpret_cast<__nv_bfloat16*>(h));
}

template <int FMT>
static cudaError_t gate_up_nt(const MoEArgs& a, const void* x, void* h, cudaStream_t st) {
  if (a.n_tok <= 1) return gate_up_go<FMT, 1>(a, x, h, st);
  if (a.n_tok <= 2) return gate_up_go<FMT, 2>(a, x, h, st);
  if (a.n_tok <= 4) return gate_up_go<FMT, 4>(a, x, h, st);
  return gate_up_go<FMT, 8>(a, x, h, st);
}

cudaError_t launch_moe_gate_up(const MoEArgs& a, const void* x, void* h, cudaStream_t st, bool aq) {
  if (a.kernel == KERNEL_DP4A) return aq ? cudaErrorInvalidValue : launch_moe_gate_up_dp4a(a, x, h, st);
  if (kernel_splitk(a.kernel))  // h: the split-K pair's partial rows
    return aq ? cudaErrorInvalidValue : launch_moe_splitk(a, x, static_cast<float*>(h), st);
  const int mma = moe_use_mma(a);
  if (mma < 0 || (a.route_logits && (!moe_route_ok(a) || !a.ids_out || !a.rw_out))) return cudaErrorInvalidValue;
  if (aq && !moe_act_quant_ok(a, true)) return cudaErrorInvalidValue;
  if (mma) return launch_moe_gate_up_mma(a, x, h, st, aq);
  if (!moe_shape_ok(a) || !moe_layout_ok(a)) return cudaErrorInvalidValue;
  if (a.fmt == FMT_FP4) return gate_up_nt<FMT_FP4>(a, x, h, st);
  if (a.fmt == FMT_FP4P) return gate_up_nt<FMT_FP4P>(a, x, h, st);
  if (a.fmt == FMT_FP4T) return gate_up_nt<FMT_FP4T>(a, x, h, st);
  if (a.fmt == FMT_FP8) return gate_up_nt<FMT_FP8>(a, x, h, st);
  if (a.fmt == FMT_FP8T) return gate_up_nt<FMT_FP8T>(a, x, h, st);
  if (a.fmt == FMT_BF16) return gate_up_nt<FMT_BF16>(a, x, h, st);
  return cudaErrorInvalidValue;
}

template <int FMT, int NT, int R, bool F32>
static cudaError_t down_go(const MoEArgs& a, const void* h, const void* add, void* out, cudaStream_t st) {
  constexpr int U = 4;
  const long smem = (long)a.n_tok * a.topk * moe_row_bytes(FMT, a.inter);
  auto kern = moe_down_kernel<FMT, NT, R, U, F32>;
  cudaError_t e = set_smem(kern, smem);
  if (e != cudaSuccess) return e;
  dim3 grid((a.dim + MOE_WARPS * R - 1) / (MOE_WARPS * R));
  return ds4_pdl::launch(kern, grid, dim3(MOE_THREADS), smem, st, a, reinterpret_cast<const __nv_bfloat16*>(h), add,
                         out);
}

template <int FMT, bool F32>
static cudaError_t down_nt(const MoEArgs& a, const void* h, const void* add, void* out, cudaStream_t st) {
  if (a.n_tok <= 1) return down_go<FMT, 1, 2, F32>(a, h, add, out, st);
  if (a.n_tok <= 2) return down_go<FMT, 2, 2, F32>(a, h, add, out, st);
  if (a.n_tok <= 4) return down_go<FMT, 4, 2, F32>(a, h, add, out, st);
  return down_go<FMT, 8, 2, F32>(a, h, add, out, st);
}

template <int FMT>
static cudaError_t down_nt(const MoEArgs& a, const void* h, const void* add, void* out, bool out_f32, cudaStream_t st) {
  return out_f32 ? down_nt<FMT, true>(a, h, add, out, st) : down_nt<FMT, false>(a, h, add, out, st);
}

cudaError_t launch_moe_down(const MoEArgs& a, const void* h, const void* add, void* out, bool out_f32,
                            cudaStream_t st, const HcFold* fold, bool aq) {
  if (a.kernel == KERNEL_DP4A) return cudaErrorInvalidValue;  // a gate+up kernel only
  if (kernel_splitk(a.kernel))  // h: the gate+up's partial rows
    return aq ? cudaErrorInvalidValue
              : launch_moe_splitk_reduce(a, static_cast<const float*>(h), add, out, out_f32, st, fold);
  const int mma = moe_use_mma(a);
  if (mma < 0 || (a.route_logits && !moe_route_ok(a)) || (aq && !moe_act_quant_ok(a, false)))
    return cudaErrorInvalidValue;
  if (fold != nullptr) {  // the hc fold: one token, bf16 out, the tensor-core kernel
    if (mma != 1 || out_f32 || a.n_tok != 1 || !hc_fold_ok(1, a.fmt, a.dim, a.inter, a.topk, fold->n) ||
        fold->mix != (2 + fold->n) * fold->n)
      return cudaErrorInvalidValue;
    return launch_moe_down_mma(a, h, add, out, false, st, fold, aq);
  }
  if (mma) return launch_moe_down_mma(a, h, add, out, out_f32, st, nullptr, aq);
  if (!moe_shape_ok(a) || !moe_layout_ok(a)) return cudaErrorInvalidValue;
  if (a.fmt == FMT_FP4) return down_nt<FMT_FP4>(a, h, add, out, out_f32, st);
  if (a.fmt == FMT_FP4P) return down_nt<FMT_FP4P>(a, h, add, out, out_f32, st);
  if (a.fmt == FMT_FP4T) return down_nt<FMT_FP4T>(a, h, add, out, out_f32, st);
  if (a.fmt == FMT_FP8) return down_nt<FMT_FP8>(a, h, add, out, out_f32, st);
  if (a.fmt == FMT_FP8T) return down_nt<FMT_FP8T>(a, h, add, out, out_f32, st);
  if (a.fmt == FMT_BF16) return down_nt<FMT_BF16>(a, h, add, out, out_f32, st);
  return cudaErrorInvalidValue;
}

}  // namespace ds4
