// The one-token tensor-core MoE launches (mma_dot.cuh's MmaStream): the kernels `auto` takes for one token
// (ds4_launch.h), which moe.cu's launch_moe_gate_up / launch_moe_down call where moe_use_mma says so —
//   gate+up: a resident wave of blocks streaming the (w1, w3) 16-row tile pairs of all local slots, split evenly;
//   down: output row tiles of `dim`, each summing the local slots as segments; with the hc fold in its epilogue
//     where asked.
// A translation unit apart from moe.cu's FMA kernels because its template instances (formats x depths x
// outputs) are most of the MoE code's compile time: the build and CI's sm_80 compile run the two in parallel.
#include "ds4_common.cuh"
#include "ds4_launch.h"
#include "hc_fold.cuh"
#include "mma_dot.cuh"
#include "moe_dev.cuh"

#include <algorithm>
#include <cstdlib>

namespace ds4 {

constexpr long MOE_MMA_SMEM_CAP = 160 * 1024;

// The step probe (an alt build, -DDS4_MOE_PROBE; scripts/probe_moe_step.py): thread 0 of each block of the routed
// experts' launches (ids or routing given; the shared expert's are not recorded) notes %globaltimer at the kernel's
// marks (moe_mark; clock64 at marks 0 and 5 into [6], [7]: the SM clock over the block's life; the down's epilogue
// marks 8 and 9 after them) and at its exit copies them to g_moe_probe[k][launch % MOE_PROBE_SLOTS][block] (k = 0
// gate+up, 1 down). The launch is the block's ticket / grid size: every block takes one ticket at its exit, and a
// kind's next launch (the next layer's) ends after all blocks of this one. Taken at the exit so that the atomic does
// not delay the marks. Compiled out of the library's build.
// (MOE_PROBE_BLOCKS, MOE_PROBE_SLOTS, MOE_PROBE_MARKS: ds4_launch.h, the host's record shape)
#ifdef DS4_MOE_PROBE
__device__ unsigned long long g_moe_probe[2][MOE_PROBE_SLOTS][MOE_PROBE_BLOCKS][MOE_PROBE_MARKS];
__device__ unsigned g_moe_probe_tickets[2];
__device__ __forceinline__ unsigned long long* moe_probe_row() {
  __shared__ unsigned long long row[MOE_PROBE_MARKS];
  return row;
}
__device__ __forceinline__ bool moe_probed(const MoEArgs& a) {
  return threadIdx.x == 0 && (a.ids != nullptr || a.route_logits != nullptr);
}
__device__ __forceinline__ void moe_mark(const MoEArgs& a, int i) {
  if (!moe_probed(a)) return;
  const unsigned long long ns = ds4_pdl::globaltimer();
  if (i == 0)
    for (int j = 0; j < MOE_PROBE_MARKS; ++j) moe_probe_row()[j] = 0ULL;  // (marks a kind does not have stay 0)
  moe_probe_row()[i] = ns;
  if (i == 0 || i == 5) moe_probe_row()[i == 0 ? 6 : 7] = (unsigned long long)clock64();
}
// at each exit of a kernel of kind k; done: the block reached mark 5 (else its row is written as zeros)
__device__ __forceinline__ void moe_probe_exit(const MoEArgs& a, int k, bool done) {
  if (!moe_probed(a)) return;
  const unsigned launch = atomicAdd(&g_moe_probe_tickets[k], 1u) / gridDim.x;
  if (blockIdx.x >= MOE_PROBE_BLOCKS) return;
  unsigned long long* dst = g_moe_probe[k][launch % MOE_PROBE_SLOTS][blockIdx.x];
  for (int i = 0; i < MOE_PROBE_MARKS; ++i) dst[i] = done ? moe_probe_row()[i] : 0ULL;
}
#else
__device__ __forceinline__ void moe_mark(const MoEArgs&, int) {}
__device__ __forceinline__ void moe_probe_exit(const MoEArgs&, int, bool) {}
#endif

cudaError_t moe_probe_read(unsigned long long* host, unsigned* tickets, bool clear) {
#ifdef DS4_MOE_PROBE
  cudaError_t e = cudaMemcpyFromSymbol(host, g_moe_probe, sizeof(g_moe_probe));
  if (e == cudaSuccess) e = cudaMemcpyFromSymbol(tickets, g_moe_probe_tickets, sizeof(g_moe_probe_tickets));
  if (e != cudaSuccess || !clear) return e;
  static unsigned long long zeros[2][MOE_PROBE_SLOTS][MOE_PROBE_BLOCKS][MOE_PROBE_MARKS] = {};
  static unsigned zt[2] = {0, 0};
  e = cudaMemcpyToSymbol(g_moe_probe, zeros, sizeof(zeros));
  return e == cudaSuccess ? cudaMemcpyToSymbol(g_moe_probe_tickets, zt, sizeof(zt)) : e;
#else
  (void)host;
  (void)tickets;
  (void)clear;
  return cudaErrorNotSupported;
#endif
}

// The (w1, w3) row pairs of all local slots, 16 rows each: pair p = u * RT + rt (local slot u,
// row tile rt of `inter`). Block b streams pairs [b * ppb, (b + 1) * ppb) as local tiles 2 pl (w1) and
// 2 pl + 1 (w3) (ppb: the pairs split evenly over the grid, from the device's count of local slots).
// Epilogue: h[slot, row] = swiglu(gate, up) * route weight. AQ (numerics=qat, the launch's aq): x staged
// FP8-simulated. bulk (DS4_BULK_STAGE=u, sm_90, not AQ; bulk_stage.cuh): x staged by a bulk copy, which thread 0
// issues once x is final and the block has its tiles (routed: before its first weight rounds).
template <int FMT, int U, int W, bool AQ = false>
__global__ void __launch_bounds__(MMA_STREAM_THREADS, (mma_min_blocks<U, W>()))
moe_gate_up_mma_kernel(const MoEArgs a, const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ h,
                       int bulk) {
  // Expert ids, route weights (or the router's logits) and x come from the previous kernels. One expert without
  // routing (the shared expert: its slot and weight are constants) reads none of them before staging x, so its
  // blocks load their first weight rounds before the wait (what a programmatic fork of its branch, DS4_PFORK=shared,
  // lets overlap the kernels before it).
  const bool weights_first = a.ids == nullptr && a.rw == nullptr && a.route_logits == nullptr;
  moe_mark(a, 0);
  if (!weights_first) ds4_pdl::begin();
  moe_mark(a, 1);
  extern __shared__ float4 smem4[];
  float* part = reinterpret_cast<float*>(smem4);
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(part + mma_part_floats(MMA_STREAM_MAX_TILES));
  __shared__ PairTables t;
  moe_slots(a, part, t.ids, t.rw, true);  // part is free until mma_part_zero below
  const unsigned m = moe_local_slots(a, t.ids);
  const int RT = (a.inter + 15) / 16, total = __popc(m) * RT;
  const int ppb = (total + gridDim.x - 1) / gridDim.x;
  const int p0 = blockIdx.x * ppb, np = min(ppb, total - p0);
  if (np <= 0) {  // block-uniform; every block waits before it exits (completion stays transitive: csrc/pdl.cuh)
    if (weights_first) ds4_pdl::begin();
    moe_probe_exit(a, 0, false);
    return;
  }
  routed_pair_tiles<FMT>(a, m, p0, np, RT, t);
  __syncthreads();
  auto tile = [=](int tl, int) { return MmaTile{t.tw[tl], t.ts[tl], xs, t.row0[tl], a.inter}; };
  auto st = mma_stream<FMT, U, W>(tile, xs, 2 * np, 1, a.dim / mma_round_vals<FMT, W>(), row_bytes<FMT>(a.dim),
                                  a.s13_ld, reinterpret_cast<uint8_t*>(xs + a.dim));
  __shared__ uint64_t s_bar;
  const bool bulk_x = bulk_arch() && !AQ && bulk != 0;
  auto issue_x = [&] {
    if (bulk_x && threadIdx.x == 0) {
      bulk_begin(&s_bar, 2u * a.dim);
      bulk_copy(xs, x, 2u * a.dim, &s_bar);
    }
  };
  if (!weights_first) issue_x();
  st.prefetch();
  moe_mark(a, 2);
  if (weights_first) {
    ds4_pdl::begin();
    issue_x();
  }
  gate_up_pairs<FMT, AQ>(st, x, a.dim, xs, part, np, t.row0, a.inter, a.limit, [&](int pl) { return t.rw[t.slot[pl]]; },
                     [&](int pl, int row) -> __nv_bfloat16& { return h[(long)t.slot[pl] * a.inter + row]; },
                     bulk_x ? &s_bar : nullptr);
  moe_mark(a, 5);
  moe_probe_exit(a, 0, true);
}

// The down kernels' warps per block on the register stream: MMA_STREAM_WARPS, or 16 in an alt build
// (-DDS4_DOWN_WARPS=16; written in session 54 without a GPU; session 59, one H100: 8.4 us per layer slower,
// experiments/decode_session59_h100.md). Why
// try: V4's dim of 4096 is 256 tiles, one per block, about 2 blocks per SM, so the routed down runs 16 warps per SM
// (4 per scheduler; ncu, session 49: issue slots 40 % busy, no eligible warp on 59 % of cycles) whatever its
// registers would allow. Blocks of 16 warps at 64 registers (depth 2, the rule's; the fold's epilogue too, which then
// spills about 100 bytes after the MMA loop) cut each tile's rounds over twice the warps, 2 blocks and 32 warps per
// SM; the partial sums then add 16 warps per row. Half the blocks of 8 warps' floor, the fold's the same as the plain
// down's (so both get the same wave, tiles per block and sums; at depth 4 / 8 one block per SM).
#ifndef DS4_DOWN_WARPS
#define DS4_DOWN_WARPS 8
#endif
static_assert(DS4_DOWN_WARPS == MMA_STREAM_WARPS || DS4_DOWN_WARPS == 2 * MMA_STREAM_WARPS,
              "DS4_DOWN_WARPS: 8 or 16");
template <int U> __host__ __device__ constexpr int down_warps() { return U == 0 ? MMA_STREAM_WARPS : DS4_DOWN_WARPS; }
template <int U, int W, bool FOLD> __host__ __device__ constexpr int down_min_blocks() {
  return down_warps<U>() == MMA_STREAM_WARPS ? (FOLD ? 2 : mma_min_blocks<U, W>())
         : mma_min_blocks<U, W>() >= 2       ? mma_min_blocks<U, W>() / 2
                                             : 1;
}

// DS4_DOWN_H_FIRST=1 (an alt build for the MoE step probe, -DDS4_DOWN_H_FIRST=1 in DS4_NVCC_FLAGS; a diagnostic, the
// same bits): the down's weight rounds not loaded before its PDL wait are requested only once h has landed, so that
// h's loads queue behind no weight round of the launch (with DS4_PREFETCH_DOWN=0: none at all). Session 82's
// question: is h's staging time (3.3-4.0 us in the step on an H100, by thread loads or bulk copies, first or not) its
// loads' latency behind the weight traffic? A build-time switch: as a launch argument it moved the registers of 79
// kernels (the V4 fold down 88 -> 92) and gave some of the depth-2 downs spills.
#ifndef DS4_DOWN_H_FIRST
#define DS4_DOWN_H_FIRST 0
#endif

// DS4_DOWN_STAGE_PROBE (an alt build for the MoE step probe, a diagnostic, the same bits): session 83's standalone
// scripts/probe_h_read.cu stages the same 24 KB of h in 256 blocks in 0.8 us on an H100, where the down's blocks take
// 3.3-3.9 us (experiments/session83.md). Is the down's first staging slow for a cold start (its code's instruction
// fetches after gigabytes of weights went through L2, or its address translations) rather than for the loads?
//   1 (prewarm): before the PDL wait every thread runs the staging once on h as it stands (the previous layer's; the
//     staging after the wait rewrites the same places from the same threads), so the code and h's pages are warm;
//   2 (twice): after the staging the block stages h again by L2 loads (.cg: the lines are not in L1 either) and the
//     probe's mark 2 is taken again before it, so the probe's "stage" is the second staging and its "wait" the
//     wait plus the first.
// Answer (session 84, H100, experiments/session84.md): not a cold start. The second staging, code and pages warm and
// h's lines in L2, took as long as a first (2.55 us in the step, 2.67 alone); prewarm cut the staging after the wait
// to 2.54 us but made the step slower (116.2-117.0 against 113.8-114.3 us per layer). What h's loads wait behind is
// the weight rounds the block requested before them (session 79's reading).
#ifndef DS4_DOWN_STAGE_PROBE
#define DS4_DOWN_STAGE_PROBE 0
#endif

// Row tiles of `dim`, each the sum over the local slots (segments) of their w2 rows times h; block b
// streams tiles [b * tpb, (b + 1) * tpb).
// The expert ids are read, and the first weight rounds loaded, before the PDL wait: in the decode step
// the ids come from the router, two launches back (the gate+up kernel in between waits for the router
// before it lets this kernel launch), so they are final here; only h and add come from the kernel right
// before. Contract (ds4_launch.h): a down launch's ids are not written by the launch just before it.
// FOLD (bf16 out, one token): the epilogue also forms the hc fold's streams and partials (hc_fold.cuh), its
// buffers after the stream's in shared memory; at most 2 blocks per SM (of 8 warps, 128 registers: the epilogue spilled
// at depth 2's 64, and V4's 256 down tiles fill 2 blocks per SM either way). AQ (numerics=qat, the launch's aq): h
// staged FP8-simulated. bulk (DS4_BULK_STAGE=d, sm_90, not AQ; bulk_stage.cuh): bit 0, h staged by bulk copies
// (thread 0 issues them right after the PDL wait); bit 1, with them the block's add rows into shared memory, for the
// epilogue (where its tiles are whole and at most 4). DS4_DOWN_H_FIRST (below): h staged before the rest of the rounds.
template <int FMT, int U, int W, bool OUT_F32, bool FOLD = false, bool AQ = false>
__global__ void __launch_bounds__(32 * down_warps<U>(), (down_min_blocks<U, W, FOLD>()))
moe_down_mma_kernel(const MoEArgs a, const __nv_bfloat16* __restrict__ h, const void* __restrict__ add,
                    void* __restrict__ out, int tpb, const HcFold fold, int pre, int bulk) {
  moe_mark(a, 0);
  extern __shared__ float4 smem4[];
  constexpr int NW = down_warps<U>();
  float* part = reinterpret_cast<float*>(smem4);
  __nv_bfloat16* hs = reinterpret_cast<__nv_bfloat16*>(part + mma_part_floats(tpb, NW));
  __shared__ const uint8_t* s_w[32];
  __shared__ const uint8_t* s_s[32];
  __shared__ int s_slot[32], s_ids[32];
  __shared__ float s_rw[32];
  __shared__ uint64_t s_bar;
  __shared__ float4 s_add4[16];  // bulk's add rows: 4 tiles of bf16 or fp32
  moe_slots(a, reinterpret_cast<float*>(hs), s_ids, s_rw, false);  // hs is free until the staging below
  const unsigned m = moe_local_slots(a, s_ids);
  const int nU = __popc(m);
  const int lane = threadIdx.x & 31;
  if (threadIdx.x < 32 && ((m >> lane) & 1u)) {
    const int u = __popc(m & ((1u << lane) - 1u));
    const int e = s_ids[lane] - a.expert_offset;
    expert_base<FMT>(a, e, 2, s_w[u], s_s[u]);
    s_slot[u] = lane;
  }
  __syncthreads();
  const int t0 = blockIdx.x * tpb, nt = min(tpb, (a.dim + 15) / 16 - t0);
  auto tile = [=](int tl, int u) { return MmaTile{s_w[u], s_s[u], hs + (long)u * a.inter, (t0 + tl) * 16, a.dim}; };
  auto st = mma_stream<FMT, U, W, NW>(tile, hs, nt, nU, a.inter / mma_round_vals<FMT, W>(), row_bytes<FMT>(a.inter),
                                      a.s2_ld, reinterpret_cast<uint8_t*>(hs + (long)a.topk * a.inter));
  const int pre_rounds = pre < 0 ? (1 << 30) : pre;  // mma_prefetch_rounds
  st.prefetch(pre_rounds);
  moe_mark(a, 1);
  // the fold's buffers after the stream's (recomputed where used: nothing of the fold stays live in registers
  // across the stream)
  [[maybe_unused]] auto fs = [&] {
    return hc_fold_smem(reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(hs + (long)a.topk * a.inter) +
                                                 mma_stream_smem<FMT, U, W>()), tpb, fold.n, fold.mix);
  };
  if constexpr (FOLD) hc_fold_load_fn(fold, fs(), t0, nt, a.dim);  // a weight: before the wait
  const bool bulk_h = bulk_arch() && !AQ && (bulk & 1) != 0;
  constexpr bool h_first = DS4_DOWN_H_FIRST != 0;
  const bool bulk_add = bulk_h && (bulk & 2) != 0 && add != nullptr && nt <= 4 && (t0 + nt) * 16 <= a.dim;
  const int add_size = a.add_bf16 ? 2 : 4;
  auto stage_h_rows = [&](auto cg) {
    stage_mma_rows<FMT, decltype(cg)::value, AQ>(hs, [=](int u) { return h + (long)s_slot[u] * a.inter; }, nU,
                                                 a.inter);
  };
  // (not with bulk copies: their async writes into hs would race this staging's late stores)
  if constexpr (DS4_DOWN_STAGE_PROBE == 1)
    if (!bulk_h) stage_h_rows(std::false_type{});
  ds4_pdl::begin();  // h and add come from the previous kernels
  moe_mark(a, 2);
  if (bulk_h && threadIdx.x == 0) {
    const uint32_t hb = 2u * a.inter, ab = bulk_add ? 16u * nt * add_size : 0u;
    bulk_begin(&s_bar, nU * hb + ab);
    for (int u = 0; u < nU; ++u) bulk_copy(hs + (long)u * a.inter, h + (long)s_slot[u] * a.inter, hb, &s_bar);
    if (bulk_add) bulk_copy(s_add4, static_cast<const uint8_t*>(add) + (long)t0 * 16 * add_size, ab, &s_bar);
  }
  if constexpr (!h_first) st.prefetch_rest(pre_rounds);
  if constexpr (FOLD) hc_fold_load_act(fold, fs(), t0, nt, a.dim);
  if (bulk_h) {
    stage_mma_bulk_landed<FMT>(&s_bar, hs, nU * a.inter / 8);
  } else {
    stage_h_rows(std::false_type{});
  }
  if constexpr (DS4_DOWN_STAGE_PROBE == 2) {
    __syncthreads();
    moe_mark(a, 2);
    stage_h_rows(std::true_type{});
  }
  if constexpr (h_first) st.prefetch_rest(pre_rounds);
  mma_part_zero(part, nt, NW);
  __syncthreads();
  moe_mark(a, 3);
  st.run(part);
  __syncthreads();
  moe_mark(a, 4);
  for (int i = threadIdx.x; i < nt * 16; i += blockDim.x) {
    const int r = t0 * 16 + i;
    if (r < a.dim) {
      const float v = mma_part_sum<NW>(part, i >> 4, i & 15);
      const float y = bulk_add ? down_store_at<OUT_F32>(out, r, s_add4, i, a.add_bf16, v)
                               : down_store<OUT_F32>(out, r, add, a.add_bf16, v);
      if constexpr (FOLD) fs().ys[i] = y;
    }
  }
  moe_mark(a, 8);
#ifdef DS4_MOE_PROBE
  // the probe's split of the fold's epilogue: its copies landed (the epilogue's own wait and barrier then find
  // nothing to wait for; an extra barrier in this build only)
  if constexpr (FOLD) {
    cp_async_wait<0>();
    __syncthreads();
    moe_mark(a, 9);
  }
#endif
  if constexpr (FOLD) hc_fold_epilogue(fold, fs(), t0, nt, a.dim);
  moe_mark(a, 5);
  moe_probe_exit(a, 1, true);
}

static bool moe_mma_ok(const MoEArgs& a) {
  if ((!fmt_fp8(a.fmt) && !fmt_fp4(a.fmt)) || a.ptrs || a.n_tok != 1 || a.topk > 32) return false;
  if (!mma_shape_ok(a.fmt, a.dim) || !mma_shape_ok(a.fmt, a.inter)) return false;
  const long part = 4L * mma_part_floats(MMA_STREAM_MAX_TILES);  // (the downs': for their blocks' warps)
  return part + 2L * a.dim <= MOE_MMA_SMEM_CAP &&
         4L * mma_part_floats(MMA_STREAM_MAX_TILES, DS4_DOWN_WARPS) + 2L * a.topk * a.inter <= MOE_MMA_SMEM_CAP;
}

// 0: use the FMA kernels; 1: use the MMA kernels; -1: an explicit MMA request that does not apply
int moe_use_mma(const MoEArgs& a) {
  const bool ok = moe_mma_ok(a);
  if (a.kernel == KERNEL_MMA) return ok ? 1 : -1;
  // FP8 (the shared expert): rows of K = dim (gate+up) and inter (down) decide by the shorter, except that a
  // shared expert sliced over the ranks (parallel.shared_expert=tp: inter 1024 at tp=2) stays on the tensor
  // cores: on the FMA kernels the shorter rows chose it sat on the tp=2 step's critical path; DS4_MMA=all
  // (it and the other short FP8 rows on tensor cores) took 0.14 ms per token off, this rule alone as much
  // (experiments/decode_session18_h200.md)
  const int k_rule = fmt_fp8(a.fmt) && a.inter >= 1024 ? a.dim : std::min(a.dim, a.inter);
  return a.kernel == KERNEL_AUTO && ok && mma_auto(a.fmt, k_rule, a.dim) ? 1 : 0;
}

bool moe_route_ok(const MoEArgs& a) {
  // scratch: 2 n_experts floats in the gate+up kernel's partial sums (mma_part_floats(MAX_TILES)) and
  // in the down kernel's staged h (topk x inter bf16)
  return moe_use_mma(a) == 1 && a.n_tok == 1 && a.topk <= ROUTER_MAX_K && a.topk <= a.n_experts &&
         a.n_experts >= 1 && 2L * a.n_experts <= mma_part_floats(MMA_STREAM_MAX_TILES) &&
         4L * a.n_experts <= (long)a.topk * a.inter;
}

// Host: the blocks a tensor-core MoE launch may take out of one resident wave `wave` (default all of it).
// The shared expert (ids == nullptr) takes DS4_SHARED_WAVE percent of it (read at every launch, for the
// ablation): in the decode step it runs on a side stream beside the router's small kernels, and a whole
// wave of its blocks (2 per SM at depth 8 fill the register file) leaves them no slot until its blocks
// exit (experiments/decode_session8_h200.md). The routed experts' gate+up (ids or routing given) takes
// DS4_ROUTED_WAVE percent: at 50 it leaves each SM the registers of one block of the down kernel, whose
// blocks can then be resident under PDL while it runs (their prologue and first weight loads done when it
// ends) instead of only once its blocks exit; the routed down keeps the whole wave. Measured slower (H200:
// 130.1 against 127.1 us per layer at 50, experiments/decode_session16_h200.md), so an opt-in.
static int moe_wave(const MoEArgs& a, int wave, bool gate_up) {
  const bool routed = a.ids != nullptr || a.route_logits != nullptr;
  if (routed && !gate_up) return wave;
  const char* env = std::getenv(routed ? "DS4_ROUTED_WAVE" : "DS4_SHARED_WAVE");
  const int pct = env ? std::atoi(env) : 100;
  if (pct <= 0 || pct >= 100) return wave;
  return std::max(1, wave * pct / 100);
}

template <int FMT, int U, int W, bool AQ = false>
static cudaError_t gate_up_mma_go(const MoEArgs& a, const void* x, void* h, cudaStream_t st) {
  const long smem = 4L * mma_part_floats(MMA_STREAM_MAX_TILES) + 2L * a.dim + mma_stream_smem<FMT, U, W>();
  if constexpr (U == 0) {  // the shared-memory stream does not fit: registers
    if (smem > MOE_MMA_SMEM_CAP) return gate_up_mma_go<FMT, 8 / W, W, AQ>(a, x, h, st);
  }
  auto kern = moe_gate_up_mma_kernel<FMT, U, W, AQ>;
  int wave = 0;  // (an AQ instance: its plain twin's, twin_wave)
  cudaError_t e = twin_wave(kern, moe_gate_up_mma_kernel<FMT, U, W, false>, MMA_STREAM_THREADS, smem, wave);
  if (e != cudaSuccess) return e;
  // pairs for the most local slots (topk); at most MMA_STREAM_MAX_TILES / 2 per block
  const int pairs = a.topk * ((a.inter + 15) / 16);
  int grid = std::min(moe_wave(a, wave, true), pairs);
  const int floor_grid = (pairs + MMA_STREAM_MAX_TILES / 2 - 1) / (MMA_STREAM_MAX_TILES / 2);
  if (grid < floor_grid) grid = floor_grid;
  if ((e = launch_spacer_before('u', st)) != cudaSuccess) return e;
  return ds4_pdl::launch(kern, dim3(grid), dim3(MMA_STREAM_THREADS), smem, st, a,
                         reinterpret_cast<const __nv_bfloat16*>(x), reinterpret_cast<__nv_bfloat16*>(h),
                         !AQ && bulk_stage_site('u') && bulk_piece_ok(x, 2L * a.dim) ? 1 : 0);
}

template <int FMT, int U, int W, bool F32, bool FOLD = false, bool AQ = false>
static cudaError_t down_mma_go(const MoEArgs& a, const void* h, const void* add, void* out, cudaStream_t st,
                               const HcFold& fold = HcFold{}) {
  const int T = (a.dim + 15) / 16;
  constexpr int threads = 32 * down_warps<U>();
  auto kern = moe_down_mma_kernel<FMT, U, W, F32, FOLD, AQ>;
  auto smem_for = [&](int tpb) {
    return 4L * mma_part_floats(tpb, down_warps<U>()) + 2L * a.topk * a.inter + mma_stream_smem<FMT, U, W>() +
           (FOLD ? 4L * hc_fold_smem_floats(tpb, fold.n, fold.mix) : 0L);
  };
  if constexpr (U == 0) {  // the shared-memory stream does not fit: registers
    if (smem_for(1) > MOE_MMA_SMEM_CAP) return down_mma_go<FMT, 8 / W, W, F32, FOLD, AQ>(a, h, add, out, st, fold);
  }
  int wave = 0;  // (an AQ instance: its plain twin's, twin_wave)
  cudaError_t e = twin_wave(kern, moe_down_mma_kernel<FMT, U, W, F32, FOLD, false>, threads, smem_for(1), wave);
  if (e != cudaSuccess) return e;
  int tpb = mma_tiles_per_block(T, std::min(moe_wave(a, wave, false), T));
  while (FOLD && tpb > 1 && smem_for(tpb) > MOE_MMA_SMEM_CAP) tpb /= 2;
  const long smem = smem_for(tpb);
  if ((e = set_smem(kern, smem)) != cudaSuccess) return e;
  if ((e = launch_spacer_before('d', st)) != cudaSuccess) return e;
  // DS4_BULK_STAGE=d: h (rows of inter) and, where add's rows can be copied too, add by bulk copies
  int bulk = 0;
  if (!AQ && bulk_stage_site('d') && bulk_piece_ok(h, 2L * a.inter))
    bulk = 1 | (add != nullptr && bulk_piece_ok(add, 16L * (a.add_bf16 ? 2 : 4)) ? 2 : 0);
  return ds4_pdl::launch(kern, dim3((T + tpb - 1) / tpb), dim3(threads), smem, st, a,
                         reinterpret_cast<const __nv_bfloat16*>(h), add, out, tpb, fold, mma_prefetch_rounds(true),
                         bulk);
}

// A per-kernel depth knob (`name`, read at every launch) where set, else the per-shape rule for rows of K.
static int depth_knob_or_rule(const char* name, int K) {
  if (const int d = env_depth(name)) return d;
  return mma_depth(K, false);
}

// The routed experts' gate+up depth: DS4_ROUTED_DEPTH (8 / 4 / 2; read at every launch, for the ablation: bench
// tokens rdN) sets it there alone. Without it: depth 4 where the per-shape rule (mma_depth) says 8 and no global
// DS4_MMA_DEPTH is set, else that rule. The dense GEMVs keep mma_depth, the downs down_depth; the shared expert's
// gate+up takes DS4_SHARED_DEPTH (bench token shdN; for the ablation) where set, else mma_depth (the per-shape
// rule's 8 at V4's dim, or DS4_LONG_ROW_DEPTH's replacement of it).
// Why a rule of its own: the FP4 arithmetic alone ran faster at depth 2 than at 8 (scripts/probe_bulk.cu,
// experiments/decode_session22_h200.md). Session 23 measured depth 4 within the step's noise of 8 (0.0-1.3 us per
// layer below it, experiments/decode_session23_h200.md); once session 33 had cut the stream's per-round ALU work
// (MmaStream: shared-memory B addresses, scale conversion) depth 4 came out 2.0 / 1.8 us per layer below 8 in two
// same-process pairs (H200, experiments/decode_session33_h200.md), so it is the default since.
static int gate_up_depth(const MoEArgs& a) {
  const bool routed = a.ids != nullptr || a.route_logits != nullptr;
  if (!routed) return depth_knob_or_rule("DS4_SHARED_DEPTH", a.dim);
  if (const int d = env_depth("DS4_ROUTED_DEPTH")) return d;
  return mma_depth_for(a.dim, false, 4);  // 4 where the rule says 8 (DS4_LONG_ROW_DEPTH does not apply here)
}

// The down kernels' depth (routed and shared experts): DS4_DOWN_DEPTH (8 / 4 / 2; bench token dnN) sets it there
// alone, else the per-shape rule (2 at V4's inter of 2048). Measured on session 33's cheaper rounds, 4 and 8 were
// no faster (dn4 109.3 / 109.6, dn8 113.9 / 113.9 against 109.6 / 109.3 us per layer, H200,
// experiments/decode_session34_h200.md).
static int down_depth(const MoEArgs& a) { return depth_knob_or_rule("DS4_DOWN_DEPTH", a.inter); }

// numerics=qat's staged instances (the launches' aq) exist for the tiled layouts only: gate+up at every depth of the
// plain launch (with_tiled_shape), the downs at 2 alone (their rule's; a depth-0 request is 2 in the tiled layouts), to
// bound compile time. A staged launch takes the plain launch's depth and its twin's wave (gate_up_mma_go /
// down_mma_go), so that its warps sum in the plain kernel's order; where the down's depth is another (DS4_DOWN_DEPTH
// 4 or 8, inter > 2048's rule) the caller runs the act_quant_sim launch first.
bool moe_act_quant_ok(const MoEArgs& a, bool gate_up) {
  return a.n_tok == 1 && fmt_tiled(a.fmt) && moe_use_mma(a) == 1 && moe_layout_ok(a) &&
         (gate_up ? a.dim : a.inter) % 128 == 0 && (gate_up || down_depth(a) < 4);
}

cudaError_t launch_moe_gate_up_mma(const MoEArgs& a, const void* x, void* h, cudaStream_t st, bool aq) {
  if (aq && !moe_act_quant_ok(a, true)) return cudaErrorInvalidValue;
  if (fmt_tiled(a.fmt)) {
    if (!moe_layout_ok(a)) return cudaErrorInvalidValue;
    auto go = [&](auto aqc) {
      return with_tiled_shape(gate_up_depth(a), [&](auto, auto u) {
        constexpr int U = decltype(u)::value;
        constexpr bool AQ = decltype(aqc)::value;
        return a.fmt == FMT_FP8T ? gate_up_mma_go<FMT_FP8T, U, FP4T_W, AQ>(a, x, h, st)
                                 : gate_up_mma_go<FMT_FP4T, U, FP4T_W, AQ>(a, x, h, st);
      });
    };
    return aq ? go(std::true_type{}) : go(std::false_type{});
  }
  return with_mma_shape(mma_width(a.fmt, a.dim, mma_max_width()), gate_up_depth(a), [&](auto cw, auto u) {
    constexpr int CW = decltype(cw)::value, U = decltype(u)::value;
    if (a.fmt == FMT_FP8) return gate_up_mma_go<FMT_FP8, U, CW>(a, x, h, st);
    return a.fmt == FMT_FP4P ? gate_up_mma_go<FMT_FP4P, U, CW>(a, x, h, st)
                             : gate_up_mma_go<FMT_FP4, U, CW>(a, x, h, st);
  });
}

bool moe_down_fold_ok(int fmt, int topk, int dim, int inter, int n) {
  MoEArgs a;
  a.fmt = fmt;
  a.topk = topk;
  a.dim = dim;
  a.inter = inter;
  // at one tile per block, the partial sums for the register stream's warps (the most a down block has) and the
  // fold's buffers
  const long fold_smem = 4L * hc_fold_smem_floats(1, n, (2 + n) * n);
  return topk >= 1 && moe_use_mma(a) == 1 &&
         4L * mma_part_floats(1, DS4_DOWN_WARPS) + 2L * topk * inter + fold_smem <= MOE_MMA_SMEM_CAP;
}

// The one-token tensor-core down launch of a.fmt (the tiled layouts at their own run width), fp32 or bf16 out,
// with or without the hc fold.
template <bool F32, bool FOLD>
static cudaError_t down_mma(const MoEArgs& a, const void* h, const void* add, void* out, cudaStream_t st,
                            const HcFold& fold, bool aq) {
  if (aq) {  // (moe_act_quant_ok: the tiled layouts) at depth 2
    if (!moe_act_quant_ok(a, false)) return cudaErrorInvalidValue;
    constexpr int U = 2 / FP4T_W;
    return a.fmt == FMT_FP8T ? down_mma_go<FMT_FP8T, U, FP4T_W, F32, FOLD, true>(a, h, add, out, st, fold)
                             : down_mma_go<FMT_FP4T, U, FP4T_W, F32, FOLD, true>(a, h, add, out, st, fold);
  }
  if (fmt_tiled(a.fmt)) {
    if (!moe_layout_ok(a)) return cudaErrorInvalidValue;
    return with_tiled_shape(down_depth(a), [&](auto, auto u) {
      constexpr int U = decltype(u)::value;
      return a.fmt == FMT_FP8T ? down_mma_go<FMT_FP8T, U, FP4T_W, F32, FOLD>(a, h, add, out, st, fold)
                               : down_mma_go<FMT_FP4T, U, FP4T_W, F32, FOLD>(a, h, add, out, st, fold);
    });
  }
  return with_mma_shape(mma_width(a.fmt, a.inter, mma_max_width()), down_depth(a), [&](auto cw, auto u) {
    constexpr int CW = decltype(cw)::value, U = decltype(u)::value;
    if (a.fmt == FMT_FP8) return down_mma_go<FMT_FP8, U, CW, F32, FOLD>(a, h, add, out, st, fold);
    if (a.fmt == FMT_FP4P) return down_mma_go<FMT_FP4P, U, CW, F32, FOLD>(a, h, add, out, st, fold);
    return down_mma_go<FMT_FP4, U, CW, F32, FOLD>(a, h, add, out, st, fold);
  });
}

cudaError_t launch_moe_down_mma(const MoEArgs& a, const void* h, const void* add, void* out, bool out_f32,
                                cudaStream_t st, const HcFold* fold, bool aq) {
  if (fold != nullptr) return down_mma<false, true>(a, h, add, out, st, *fold, aq);
  return out_f32 ? down_mma<true, false>(a, h, add, out, st, HcFold{}, aq)
                 : down_mma<false, false>(a, h, add, out, st, HcFold{}, aq);
}

}  // namespace ds4
