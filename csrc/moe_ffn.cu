// The whole one-token MoE FFN of a layer in one launch (decode, one GPU): the routed experts (FMT_FP4T) and the
// shared expert (FP8), gate+up then down, plus the hc fold, where the separate path takes four launches
// (shared gate+up and down on a side stream, routed gate+up, routed down with the shared output added).
//
// Why: at batch 1 every one of those launches is a short stream of weights with a ramp and a tail (H200, the
// 8-layer step's critical path: routed gate+up 18-22 us for 53.5 MB, routed down 17.5 us for 26.8 MB, about
// a third of copy bandwidth), and the down launch's blocks cannot be resident while gate+up's wave holds the
// registers, so its first loads wait for gate+up's last block. Here one resident wave does both phases and
// meets at a grid barrier; a block that finishes its phase-1 tiles issues its phase-2 weight loads (they do
// not depend on h) before it arrives, so the down weights stream while the slowest gate+up blocks finish.
// Measured (H200, experiments/decode_session20_h200.md): alone 48-49 us against 59 us for the four launches in
// line, but slower in the decode step (132-139 against 127 us per layer: there the separate path hides the
// shared expert behind the router), so it is an opt-in (ds4.ops.moe_cuda, DS4_MOE_FFN).
//
// Phase 1 (gate+up): blocks [0, sh_blocks) take the shared expert's (w1, w3) 16-row tile pairs, sh_ppb each
//   (FP8, register stream); the other blocks split the routed (w1, w3) tile pairs of the local slots evenly
//   (FMT_FP4T, register stream), as moe_gate_up_mma_kernel does. h rows go to a global workspace:
//   hbuf[slot * inter + row] (route weight applied), the shared expert's row after the topk routed ones.
// Grid barrier (ffn_grid_barrier): every block of the launch arrives once. The grid is at most one resident
//   wave (the launcher's occupancy query), so every block is resident once the kernels before it have left.
// Phase 2 (down): block b takes output tiles [b tpb, (b + 1) tpb): the routed slots as segments (FMT_FP4T,
//   register stream, its first rounds loaded before the barrier) and the shared expert's one segment (FP8,
//   shared-memory stream: cp.async stages issued before the barrier, holding no registers). Epilogue:
//   out = bf16(bf16(shared sum) + routed sum) — the separate path's rounding (the shared expert's bf16 output
//   added by the routed down's epilogue, down_store's add_bf16) — and, with FOLD, the hc fold.
// Shared h given (sh_h: the shared expert's gate+up run by its own launch, e.g. on a side stream beside the
// router): phase 1 streams the routed pairs alone over every block, phase 2 reads the given row.
// The sums are the separate kernels' per-tile sums except for the warp split of the rounds (fp32 order), so
// the output agrees with the separate path to fp32 rounding, not bit for bit.
#include "ds4_common.cuh"
#include "ds4_launch.h"
#include "hc_fold.cuh"
#include "mma_dot.cuh"
#include "moe_dev.cuh"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace ds4 {

constexpr int FFN_RU = 8 / FP4T_W;  // routed rounds in flight per warp (depth 8), both phases
constexpr int FFN_SW = 4;           // shared gate+up (FP8, K = dim): run width
constexpr int FFN_SU = 2;           //   rounds in flight (depth 8)
constexpr int FFN_DW = 2;           // shared down (FP8, K = inter): the shared-memory stream's run width
constexpr int FFN_SDW = 4;          //   or the register stream's (DS4_FFN_SH_DOWN=reg)
constexpr int FFN_SDU = 2;          //   and its rounds in flight
constexpr long FFN_SMEM_CAP = 200 * 1024;

// Arrivals [0] and generation [1] of the grid barrier, per device. One moe_ffn launch runs at a time on a
// device (they are ordered on the decode step's stream); the barrier leaves the arrivals at 0 for the next.
__device__ unsigned int g_ffn_bar[2];

// Phase probe (FfnPlan::probe, DS4_FFN_PROBE=1; scripts/bench_ffn.py): thread 0 of block b writes %globaltimer at
// the PDL wait's end, phase 1's end, the barrier's exit and the block's end to g_ffn_probe[b].
constexpr int FFN_PROBE_BLOCKS = 1024;
__device__ unsigned long long g_ffn_probe[FFN_PROBE_BLOCKS][4];
__device__ __forceinline__ void ffn_mark(bool on, int i) {
  if (!on || threadIdx.x != 0 || blockIdx.x >= FFN_PROBE_BLOCKS) return;
  g_ffn_probe[blockIdx.x][i] = ds4_pdl::globaltimer();
}

__device__ __forceinline__ void ffn_grid_barrier() {
  __syncthreads();  // the block's h stores are done
  if (threadIdx.x == 0) {
    volatile unsigned int* gen = &g_ffn_bar[1];
    const unsigned int g0 = *gen;  // read before arriving: it cannot move until every block has arrived
    __threadfence();               // the block's stores (ordered by the barrier above) before the arrival
    if (atomicAdd(&g_ffn_bar[0], 1u) == gridDim.x - 1) {
      atomicExch(&g_ffn_bar[0], 0u);
      __threadfence();
      atomicAdd(&g_ffn_bar[1], 1u);
    } else {
      while (*gen == g0) __nanosleep(32);
    }
    __threadfence();
  }
  __syncthreads();
}

// Host and device: bytes of the dynamic shared memory's first region, used by phase 1 (partial sums of up to
// MMA_STREAM_MAX_TILES tiles + the staged x) and then by phase 2 (two tpb-tile partial sums + the staged h
// rows: topk routed, one shared).
__host__ __device__ inline long ffn_region_bytes(const MoEArgs& r, const MoEArgs& s, int tpb) {
  const long p1 = 4L * mma_part_floats(MMA_STREAM_MAX_TILES) + 2L * r.dim;
  const long p2 = 8L * mma_part_floats(tpb) + 2L * ((long)r.topk * r.inter + s.inter);
  return ((p1 > p2 ? p1 : p2) + 15) / 16 * 16;
}

struct FfnPlan {
  int sh_blocks, sh_ppb;  // phase 1: blocks [0, sh_blocks) take sh_ppb shared tile pairs each (shared h given:
                          // 0 blocks, sh_ppb 0, or -1 where the routed pairs do not fit the blocks' tile buffers)
  int tpb;                // phase 2: output tiles per block
  int probe;              // write the phase probe (g_ffn_probe)
};

template <bool FOLD, bool SMEM_SH>
__global__ void __launch_bounds__(MMA_STREAM_THREADS, 2)
moe_ffn_kernel(const MoEArgs r, const MoEArgs s, const __nv_bfloat16* __restrict__ x, __nv_bfloat16* hbuf,
               const __nv_bfloat16* sh_given, __nv_bfloat16* __restrict__ out, const FfnPlan p, const HcFold fold) {
  extern __shared__ float4 smem4[];
  uint8_t* base = reinterpret_cast<uint8_t*>(smem4);
  uint8_t* sbuf = base + ffn_region_bytes(r, s, p.tpb);
  __shared__ PairTables t;
  const int lane = threadIdx.x & 31;
  float* part1 = reinterpret_cast<float*>(base);
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(part1 + mma_part_floats(MMA_STREAM_MAX_TILES));
  __nv_bfloat16* h_sh = hbuf + (long)r.topk * r.inter;  // the shared expert's h row (phase 1's, unless given)

  // ---------------------------------------------------------------- phase 1: gate+up
  if ((int)blockIdx.x < p.sh_blocks) {  // the shared expert (block-uniform branch)
    const int RT = (s.inter + 15) / 16, p0 = blockIdx.x * p.sh_ppb, np = max(0, min(p.sh_ppb, RT - p0));
    if (threadIdx.x < 2 * np) {
      const int pl = threadIdx.x >> 1, which = threadIdx.x & 1;
      expert_base<FMT_FP8>(s, 0, which, t.tw[threadIdx.x], t.ts[threadIdx.x]);
      t.row0[threadIdx.x] = (p0 + pl) * 16;
    }
    __syncthreads();
    auto tile = [=](int tl, int) { return MmaTile{t.tw[tl], t.ts[tl], xs, t.row0[tl], s.inter}; };
    auto st = mma_stream<FMT_FP8, FFN_SU, FFN_SW>(tile, xs, 2 * np, 1, s.dim / mma_round_vals<FMT_FP8, FFN_SW>(),
                                                  row_bytes<FMT_FP8>(s.dim), s.s13_ld, nullptr);
    st.prefetch();     // weights: before the PDL wait
    ds4_pdl::begin();  // x and the expert ids come from the previous kernels
    ffn_mark(p.probe, 0);
    moe_slots(r, part1, t.ids, t.rw, false);
    if (np > 0)
      gate_up_pairs<FMT_FP8>(st, x, s.dim, xs, part1, np, t.row0, s.inter, s.limit, [](int) { return 1.f; },
                             [&](int, int row) -> __nv_bfloat16& { return h_sh[row]; });
  } else {  // the routed experts: pairs p = u * RT + rt (local slot u, row tile rt), as moe_gate_up_mma_kernel
    ds4_pdl::begin();
    ffn_mark(p.probe, 0);
    moe_slots(r, part1, t.ids, t.rw, false);
    const unsigned m = moe_local_slots(r, t.ids);
    const int RT = (r.inter + 15) / 16, total = __popc(m) * RT, nb = gridDim.x - p.sh_blocks;
    const int ppb = (total + nb - 1) / nb, p0 = (blockIdx.x - p.sh_blocks) * ppb;
    const int np = max(0, min(ppb, total - p0));
    routed_pair_tiles<FMT_FP4T>(r, m, p0, np, RT, t);
    __syncthreads();
    if (np > 0) {
      auto tile = [=](int tl, int) { return MmaTile{t.tw[tl], t.ts[tl], xs, t.row0[tl], r.inter}; };
      auto st = mma_stream<FMT_FP4T, FFN_RU, FP4T_W>(tile, xs, 2 * np, 1, r.dim / mma_round_vals<FMT_FP4T, FP4T_W>(),
                                                     row_bytes<FMT_FP4T>(r.dim), r.s13_ld, nullptr);
      st.prefetch();
      gate_up_pairs<FMT_FP4T>(st, x, r.dim, xs, part1, np, t.row0, r.inter, r.limit,
                              [&](int pl) { return t.rw[t.slot[pl]]; },
                              [&](int pl, int row) -> __nv_bfloat16& {
                                return hbuf[(long)t.slot[pl] * r.inter + row];
                              });
    }
  }

  // ---------------------------------------------------------------- phase 2: down (+ the shared add, the fold)
  __shared__ const uint8_t* s_w2[32];
  __shared__ const uint8_t* s_s2[32];
  __shared__ int s_dslot[32];
  const unsigned m = moe_local_slots(r, t.ids);
  const int nU = __popc(m);
  if (threadIdx.x < 32 && ((m >> lane) & 1u)) {
    const int u = __popc(m & ((1u << lane) - 1u));
    expert_base<FMT_FP4T>(r, t.ids[lane] - r.expert_offset, 2, s_w2[u], s_s2[u]);
    s_dslot[u] = lane;
  }
  __syncthreads();  // also: phase 1 no longer reads the first region, which phase 2 reuses
  const int T = (r.dim + 15) / 16, t0 = blockIdx.x * p.tpb, nt = max(0, min(p.tpb, T - t0));
  float* part_r = reinterpret_cast<float*>(base);
  float* part_s = part_r + mma_part_floats(p.tpb);
  __nv_bfloat16* hs = reinterpret_cast<__nv_bfloat16*>(part_s + mma_part_floats(p.tpb));
  __nv_bfloat16* hs_sh = hs + (long)r.topk * r.inter;
  const uint8_t *sw2, *ss2;
  expert_base<FMT_FP8>(s, 0, 2, sw2, ss2);
  auto rtile = [=](int tl, int u) { return MmaTile{s_w2[u], s_s2[u], hs + (long)u * r.inter, (t0 + tl) * 16, r.dim}; };
  auto rst = mma_stream<FMT_FP4T, FFN_RU, FP4T_W>(rtile, hs, nt, nU, r.inter / mma_round_vals<FMT_FP4T, FP4T_W>(),
                                                  row_bytes<FMT_FP4T>(r.inter), r.s2_ld, nullptr);
  auto stile = [=](int tl, int) { return MmaTile{sw2, ss2, hs_sh, (t0 + tl) * 16, s.dim}; };
  // the shared expert's down: the shared-memory stream, its stages issued before the barrier (SMEM_SH), or the
  // register stream, its loads issued once the routed segments are done (DS4_FFN_SH_DOWN=reg: no stage buffers,
  // so more of the SM's shared memory stays L1)
  constexpr int SW = SMEM_SH ? FFN_DW : FFN_SDW, SU = SMEM_SH ? 0 : FFN_SDU;
  auto make_sst = [&] {
    return mma_stream<FMT_FP8, SU, SW>(stile, hs_sh, nt, 1, s.inter / mma_round_vals<FMT_FP8, SW>(),
                                       row_bytes<FMT_FP8>(s.inter), s.s2_ld, sbuf);
  };
  [[maybe_unused]] auto fs = [&] {
    return hc_fold_smem(reinterpret_cast<float*>(sbuf + mma_stream_smem<FMT_FP8, SU, SW>()), p.tpb, fold.n, fold.mix);
  };
  auto before_barrier = [&] {  // weights (and the fold's inputs, final since the PDL wait)
    rst.prefetch();
    if constexpr (FOLD) {
      hc_fold_load_fn(fold, fs(), t0, nt, r.dim);
      hc_fold_load_act(fold, fs(), t0, nt, r.dim);
    }
  };
  auto after_barrier = [&] {  // the h rows (written by other blocks: through L2), zeroed partial sums
    stage_mma_rows<FMT_FP4T, true>(hs, [=](int u) { return hbuf + (long)s_dslot[u] * r.inter; }, nU, r.inter);
    const __nv_bfloat16* sh_src = sh_given ? sh_given : h_sh;
    stage_mma_rows<FMT_FP8, true>(hs_sh, [=](int) { return sh_src; }, 1, s.inter);
    mma_part_zero(part_r, nt);
    mma_part_zero(part_s, nt);
    __syncthreads();
  };
  if constexpr (SMEM_SH) {
    auto sst = make_sst();
    if (nt > 0) {
      before_barrier();
      sst.prefetch();
    }
    ffn_mark(p.probe, 1);
    ffn_grid_barrier();
    ffn_mark(p.probe, 2);
    if (nt == 0) return;  // block-uniform; after the barrier, which every block must reach
    after_barrier();
    rst.run(part_r);
    sst.run(part_s);
  } else {
    if (nt > 0) before_barrier();
    ffn_mark(p.probe, 1);
    ffn_grid_barrier();
    ffn_mark(p.probe, 2);
    if (nt == 0) return;
    after_barrier();
    rst.run(part_r);
    auto sst = make_sst();
    sst.prefetch();
    sst.run(part_s);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nt * 16; i += blockDim.x) {
    const int row = t0 * 16 + i;
    if (row >= r.dim) continue;
    const float shared = __bfloat162float(__float2bfloat16(mma_part_sum(part_s, i >> 4, i & 15)));
    const __nv_bfloat16 y = __float2bfloat16(shared + mma_part_sum(part_r, i >> 4, i & 15));
    out[row] = y;
    if constexpr (FOLD) fs().ys[i] = __bfloat162float(y);
  }
  if constexpr (FOLD) hc_fold_epilogue(fold, fs(), t0, nt, r.dim);
  ffn_mark(p.probe, 3);
}

// Host: the plan for a grid of `grid` blocks: phase 1 splits the shared pairs over sh_blocks blocks and the
// routed pairs (topk slots, all local at one GPU) over the rest so that the most bytes any block streams is
// smallest; phase 2 gives each block tpb output tiles.
static FfnPlan ffn_plan(const MoEArgs& r, const MoEArgs& s, int grid, bool sh_given) {
  FfnPlan p{0, 0, 0, 0};
  const char* probe = std::getenv("DS4_FFN_PROBE");
  p.probe = probe && probe[0] == '1';
  const int T = (r.dim + 15) / 16;
  p.tpb = (T + grid - 1) / grid;
  const long rp = (long)r.topk * ((r.inter + 15) / 16);
  if (sh_given) {  // every block streams routed pairs; the plan is valid when they fit the blocks' tile buffers
    p.sh_ppb = (rp + grid - 1) / grid <= MMA_STREAM_MAX_TILES / 2 ? 0 : -1;
    return p;
  }
  const char* force = std::getenv("DS4_FFN_SHARED_PPB");  // the ablation: shared pairs per block (else balanced)
  const int force_ppb = force ? std::atoi(force) : 0;
  const long sp = (s.inter + 15) / 16;
  const long sb = 2L * 16 * row_bytes<FMT_FP8>(s.dim), rb = 2L * 16 * (row_bytes<FMT_FP4T>(r.dim) + r.dim / 32);
  long best = -1;
  for (int ppb = 1; ppb <= MMA_STREAM_MAX_TILES / 2; ++ppb) {
    if (force_ppb > 0 && ppb != force_ppb) continue;
    const int shb = (int)((sp + ppb - 1) / ppb), nb = grid - shb;
    if (nb < 1) continue;
    const long rppb = (rp + nb - 1) / nb;
    if (rppb > MMA_STREAM_MAX_TILES / 2) continue;
    const long cost = std::max(ppb * sb, rppb * rb);
    if (best < 0 || cost < best) {
      best = cost;
      p.sh_blocks = shb;
      p.sh_ppb = ppb;
    }
  }
  return p;
}

static long ffn_smem(const MoEArgs& r, const MoEArgs& s, int tpb, const HcFold* fold, bool smem_sh = true) {
  return ffn_region_bytes(r, s, tpb) + (smem_sh ? mma_stream_smem<FMT_FP8, 0, FFN_DW>() : 0L) +
         (fold ? 4L * hc_fold_smem_floats(tpb, fold->n, fold->mix) : 0L);
}

// The shapes the kernel takes (see ds4_launch.h: moe_ffn_ok).
static bool ffn_shape_ok(const MoEArgs& r, const MoEArgs& s) {
  constexpr int RROUND = 4 * FP4T_W * 32, SROUND = 4 * FFN_SW * 16, DROUND = 4 * FFN_SDW * 16;  // (>= FFN_DW's)
  return r.fmt == FMT_FP4T && s.fmt == FMT_FP8 && r.n_tok == 1 && r.topk >= 1 && r.topk <= 32 && !r.ptrs &&
         !s.ptrs && !r.route_logits && r.dim == s.dim && r.dim % 16 == 0 && r.inter % 16 == 0 &&
         s.inter % 16 == 0 && r.dim % RROUND == 0 && r.inter % RROUND == 0 && s.dim % SROUND == 0 &&
         s.inter % DROUND == 0 &&
         (long)r.topk * r.inter + s.inter <= (1L << 16);  // staged h offsets within MmaStream's 17-bit field
}

static bool ffn_plan_ok(const FfnPlan& p, bool sh_given) {
  return (sh_given ? p.sh_ppb == 0 : p.sh_blocks > 0) && p.tpb <= MMA_STREAM_MAX_TILES;
}

bool moe_ffn_ok(const MoEArgs& r, const MoEArgs& s, const HcFold* fold) {
  if (!ffn_shape_ok(r, s)) return false;
  if (fold && (fold->n != 1 && fold->n != 2 && fold->n != 4)) return false;
  for (bool given : {false, true}) {  // one wave at the launch bounds' 2 blocks per SM, either phase-1 form
    const FfnPlan p = ffn_plan(r, s, 2 * sm_count(), given);
    if (!ffn_plan_ok(p, given) || ffn_smem(r, s, p.tpb, fold) > FFN_SMEM_CAP) return false;
  }
  return true;
}

template <bool FOLD, bool SMEM_SH>
static cudaError_t ffn_go(const MoEArgs& r, const MoEArgs& s, const void* x, void* hbuf, const void* sh_h, void* out,
                          const HcFold& fold, cudaStream_t st) {
  auto kern = moe_ffn_kernel<FOLD, SMEM_SH>;
  // The grid barrier needs every block resident at once: the grid is one wave of the kernel at the plan's shared
  // memory (2 blocks per SM on an H200; fewer where they do not fit, with a plan for that grid).
  int grid = 2 * sm_count();
  FfnPlan p{};
  long smem = 0;
  for (int i = 0; i < 3; ++i) {
    p = ffn_plan(r, s, grid, sh_h != nullptr);
    if (!ffn_plan_ok(p, sh_h != nullptr)) return cudaErrorInvalidValue;
    smem = ffn_smem(r, s, p.tpb, FOLD ? &fold : nullptr, SMEM_SH);
    cudaError_t e = set_smem(kern, smem);
    if (e != cudaSuccess) return e;
    const int wave = resident_wave(kern, MMA_STREAM_THREADS, smem);
    if (wave >= grid) break;
    if (i == 2) return cudaErrorInvalidValue;
    grid = wave;
  }
  return ds4_pdl::launch(kern, dim3(grid), dim3(MMA_STREAM_THREADS), smem, st, r, s,
                         reinterpret_cast<const __nv_bfloat16*>(x), reinterpret_cast<__nv_bfloat16*>(hbuf),
                         reinterpret_cast<const __nv_bfloat16*>(sh_h), reinterpret_cast<__nv_bfloat16*>(out), p, fold);
}

cudaError_t moe_ffn_probe_read(unsigned long long* host, int blocks) {
  if (blocks < 1 || blocks > FFN_PROBE_BLOCKS) return cudaErrorInvalidValue;
  return cudaMemcpyFromSymbol(host, g_ffn_probe, sizeof(unsigned long long) * 4 * blocks);
}

cudaError_t launch_moe_ffn(const MoEArgs& r, const MoEArgs& s, const void* x, void* hbuf, const void* sh_h, void* out,
                           const HcFold* fold, cudaStream_t st) {
  if (!moe_ffn_ok(r, s, fold) || r.ids == nullptr) return cudaErrorInvalidValue;
  const char* env = std::getenv("DS4_FFN_SH_DOWN");  // the shared expert's down stream (read per launch)
  const bool reg = env && std::strcmp(env, "reg") == 0;
  if (fold) {
    if (fold->mix != (2 + fold->n) * fold->n) return cudaErrorInvalidValue;
    return reg ? ffn_go<true, false>(r, s, x, hbuf, sh_h, out, *fold, st)
               : ffn_go<true, true>(r, s, x, hbuf, sh_h, out, *fold, st);
  }
  return reg ? ffn_go<false, false>(r, s, x, hbuf, sh_h, out, HcFold{}, st)
             : ffn_go<false, true>(r, s, x, hbuf, sh_h, out, HcFold{}, st);
}

}  // namespace ds4
