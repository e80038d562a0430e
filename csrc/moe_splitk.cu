// The routed experts' one-token MoE as a split-K pair (kernel SPLITK of launch_moe_gate_up / launch_moe_down;
// ds4.kernels.moe_splitk_up / moe_splitk_down; opt-in DS4_MOE_SPLITK=1, bench token splitk):
//   up:   each block of the routed gate+up's resident wave forms its own pairs' values of h (as
//         moe_gate_up_mma_kernel does, into shared memory instead of global) and then multiplies them by the
//         matching columns of w2 over all `dim` rows: its fp32 partial sums of the whole output row, parts[block];
//   down: one 16-row tile per block sums the partial rows in a fixed order (deterministic) and runs the routed
//         down's epilogue (the shared expert's output added, bf16 or fp32 out, the hc fold).
// Why: in the separate pair the down's blocks stage h only after a launch boundary, behind the memory system's queue
// of weight rounds (3.3-4.0 us of the down block's life in the step on an H100, sessions 78-84), and the down streams
// its 25 MB as a launch of its own with its own ramp and tail. Here w2 streams in the gate+up's launch right after
// each block's w1 / w3, and no block waits for another before it: the only boundary left is the reduction's, whose
// reads come from L2 (experiments/session83.md: a PDL pair that reduces 3-6 MB of partials costs about what an
// empty pair costs).
//
// The down phase's MMAs (m16n8k16, the mma_dot.cuh fragments): a block's pairs cover whole 32-value chunks of one
// expert's inter where its pair count is even (V4 on a 132-SM GPU: 768 pairs over 384 blocks, one chunk each), else
// a chunk is shared with the neighbouring block and each stages only its own half (the other half zero). An
// "item" is an (expert, chunk) the block covers. Lane (g, t) feeds the A fragment from tile 4 q + t's rows g and
// g + 8 at the item's chunk, and B (the item's 32 values of h, staged as mma_stage_vec stages activations) sits in
// lanes g == t only, so C column n (< 4) is tile 4 q + n's partial for rows g / g + 8: one MMA group covers four
// row tiles of one chunk, every lane's 16 bytes used, and each C value goes to one output row. In the fp4t layout a
// chunk's 16-byte piece of a row shares its 32-byte sector with the neighbouring chunk's (another block's): written
// in the hope that L2 would serve the second read, which the measurement below did not bear out.
// The sums differ from the separate pair's in fp32 order only (per chunk and tile here, per round and warp there):
// the outputs agree to fp32 rounding, not bit for bit.
// Measured slower (H100, experiments/session84.md): alone (bench_kernels.py --moe-bound) 43.4-44.0 us against the
// separate pair's 38.9-39.0; in the decode step 121.2-121.7 against 113.8-114.3 us per layer. With w2 in the
// chunk-major fp4k layout (kernel SPLITK_K; every warp load 512 contiguous bytes) 38.2 us alone: the fp4t reads were
// most of the loss, and what is left is within 1 us of the separate pair, 6 us above one launch streaming the same
// bytes (31.8). So an opt-in, and fp4k a kernel-level form only (no load-time layout: prefill reads w2 in fp4t).
#include "ds4_common.cuh"
#include "ds4_launch.h"
#include "hc_fold.cuh"
#include "mma_dot.cuh"
#include "moe_dev.cuh"

#include <algorithm>

namespace ds4 {

constexpr int SPLITK_MAX_ITEMS = MMA_STREAM_MAX_TILES / 2;  // at most one item per pair of a block
constexpr int SPLITK_D = 4;                                 // down units (4 tiles x one item) in flight per warp
constexpr int SPLITK_U = 4 / FP4T_W;                        // the gate+up phase at depth 4 (gate_up_depth's default)
constexpr int SPLITK_REDUCE_THREADS = 256;                  // 16 rows x 16 partial-row lanes

// The down phase of one warp: groups [q0, q0 + nq) of 4 row tiles, each times the block's items, as units
// u = (group, item) in that order; SPLITK_D units' loads in flight, in a ring of registers. KMAJOR: w2 and its scales
// in the chunk-major fp4k layout (ds4.quant.chunk_fp4_splitk), else fp4t's tiles and row-major scales.
template <bool KMAJOR>
struct SplitkDown {
  // per item: fp4t: the expert's w2 + the chunk's place in a 16-row tile (lane column t), its scales + the chunk's
  // byte; fp4k: the chunk's run of w2 and of its scales
  const uint8_t* const* iw;
  const uint8_t* const* is;
  long tile_bytes;           // 16 rows of w2
  int s_ld, nitems, q0, n, next;
  uint4 wa[SPLITK_D], wb[SPLITK_D];
  uint32_t sc[SPLITK_D];  // scale bytes (j, h) at 2 h + j: tile 4 q + 2 t + j, row g + 8 h (lanes t < 2)

  __device__ __forceinline__ void load(int k) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int q = q0 + next / nitems, i = next % nitems;
    ++next;
    const uint8_t* p = KMAJOR ? iw[i] + (long)q * 1024 + lane * 16
                              : iw[i] + (long)(4 * q + t) * tile_bytes + g * 64;  // row g's piece (g + 8: 512 on)
    wa[k] = ld_stream16(p);
    wb[k] = ld_stream16(p + 512);
    sc[k] = 0u;  // (lanes t >= 2 hold C columns 4-7: zeros)
    if (KMAJOR) {
      if (t < 2) sc[k] = __ldg(reinterpret_cast<const unsigned*>(is[i] + (long)q * 64 + (8 * t + g) * 4));
    } else if (t < 2) {
      const uint8_t* s = is[i] + (long)((4 * q + 2 * t) * 16 + g) * s_ld;
      sc[k] = (uint32_t)__ldg(s) | (uint32_t)__ldg(s + 16L * s_ld) << 8 | (uint32_t)__ldg(s + 8L * s_ld) << 16 |
              (uint32_t)__ldg(s + 24L * s_ld) << 24;
    }
  }
  // the warp's share: groups of 4 row tiles split evenly over the block's warps
  __device__ __forceinline__ void init(const MoEArgs& a, const uint8_t* const* iw_, const uint8_t* const* is_,
                                       int nitems_) {
    const int warp = threadIdx.x >> 5, G = a.dim / 64;
    iw = iw_;
    is = is_;
    tile_bytes = 16L * row_bytes<FMT_FP4T>(a.inter);
    s_ld = a.s2_ld;
    nitems = nitems_;
    q0 = G * warp / MMA_STREAM_WARPS;
    n = (G * (warp + 1) / MMA_STREAM_WARPS - q0) * nitems;
    next = 0;
  }
  __device__ __forceinline__ void prefetch() {
#pragma unroll
    for (int k = 0; k < SPLITK_D; ++k)
      if (next < n) load(k);
  }
  // hb: the items' staged h (4 uint4 each); dst: the block's partial row of dim floats
  __device__ __forceinline__ void run(const uint4* hb, float* dst) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int u0 = 0; u0 < n; u0 += SPLITK_D) {
#pragma unroll
      for (int k = 0; k < SPLITK_D; ++k) {
        const int u = u0 + k;
        if (u < n) {
          const int i = u % nitems;
          uint4 xb[4];
#pragma unroll
          for (int w = 0; w < 4; ++w) xb[w] = g == t ? hb[4 * i + w] : make_uint4(0u, 0u, 0u, 0u);
          float d[4] = {0.f, 0.f, 0.f, 0.f};
          mma_chunk<FMT_FP4T>(wa[k], wb[k], xb, d);
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[c] = fmaf(d[c], e8m0_mma_scale(sc[k], c), acc[c]);  // d[c]: (j, h) at c
          if (i == nitems - 1) {  // the group's last item: its four tiles' rows are done (lanes t < 2 hold them)
            if (t < 2) {
              float* o = dst + (long)(4 * (q0 + u / nitems) + 2 * t) * 16 + g;
              o[0] = acc[0] * Mma<FMT_FP4T>::POST;
              o[16] = acc[1] * Mma<FMT_FP4T>::POST;
              o[8] = acc[2] * Mma<FMT_FP4T>::POST;
              o[24] = acc[3] * Mma<FMT_FP4T>::POST;
            }
            acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
          }
          if (next < n) load(k);
        }
      }
    }
  }
};

// Grid: the routed (w1, w3) pairs of the local slots split evenly (the gate+up's rule, routed_pair_tiles); parts:
// [gridDim.x, dim] fp32, block b's row its partial sums (zeros for a block without pairs). KMAJOR: w2 in fp4k.
template <int U, bool KMAJOR>
__global__ void __launch_bounds__(MMA_STREAM_THREADS, (mma_min_blocks<U, FP4T_W>()))
moe_splitk_kernel(const MoEArgs a, const __nv_bfloat16* __restrict__ x, float* __restrict__ parts) {
  constexpr int FMT = FMT_FP4T, W = FP4T_W;
  ds4_pdl::begin();  // ids, route weights and x come from the previous kernels
  extern __shared__ float4 smem4[];
  float* part = reinterpret_cast<float*>(smem4);
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(part + mma_part_floats(MMA_STREAM_MAX_TILES));
  __shared__ PairTables t;
  __shared__ __align__(16) __nv_bfloat16 s_h[MMA_STREAM_MAX_TILES / 2 * 16];  // h of the block's pairs
  __shared__ uint4 s_hb[SPLITK_MAX_ITEMS * 4];                                 // the items' chunks of h, staged
  __shared__ const uint8_t* s_iw[SPLITK_MAX_ITEMS];
  __shared__ const uint8_t* s_is[SPLITK_MAX_ITEMS];
  __shared__ int s_ipair[SPLITK_MAX_ITEMS], s_nitems;  // an item's first value of inter as a pair index (p0 units)
  float* dst = parts + (long)blockIdx.x * a.dim;
  moe_slots(a, part, t.ids, t.rw, true);
  const unsigned m = moe_local_slots(a, t.ids);
  const int RT = a.inter / 16, total = __popc(m) * RT;
  const int ppb = (total + gridDim.x - 1) / gridDim.x;
  const int p0 = blockIdx.x * ppb, np = min(ppb, total - p0);
  if (np <= 0) {  // block-uniform: a partial row of zeros
    for (int i = threadIdx.x; i < a.dim; i += blockDim.x) dst[i] = 0.f;
    return;
  }
  routed_pair_tiles<FMT>(a, m, p0, np, RT, t);
  if (threadIdx.x == 0) {  // the items: the distinct (expert, 32-value chunk) of pairs p0 .. p0 + np - 1, in order
    int n = 0, last = -1;
    for (int pl = 0; pl < np; ++pl) {
      const int p = p0 + pl, u = p / RT, c = (p - u * RT) >> 1, key = u * RT + 2 * c;  // key: the chunk's first pair
      if (key == last) continue;
      last = key;
      const int slot = nth_bit(m, u);
      const uint8_t *w2, *s2;
      expert_base<FMT>(a, t.ids[slot] - a.expert_offset, 2, w2, s2);
      if (KMAJOR) {  // chunk c's runs: dim / 64 groups of 1024 bytes of w2 and of 64 scale bytes
        s_iw[n] = w2 + (long)c * (a.dim / 64) * 1024;
        s_is[n] = s2 + (long)c * (a.dim / 64) * 64;
      } else {
        // chunk c of a 16-row tile (fp4t, MmaStream): round c / 4W, lane column t = (c mod 4W) / W, chunk w = c mod W
        // at ((round W + w) 2 + half) 512 + (4 g + t) 16
        s_iw[n] = w2 + (long)((c / (4 * W)) * W + c % W) * 1024 + ((c % (4 * W)) / W) * 16;
        s_is[n] = s2 + c;
      }
      s_ipair[n] = key;
      ++n;
    }
    s_nitems = n;
  }
  __syncthreads();
  auto tile = [=](int tl, int) { return MmaTile{t.tw[tl], t.ts[tl], xs, t.row0[tl], a.inter}; };
  auto st = mma_stream<FMT, U, W>(tile, xs, 2 * np, 1, a.dim / mma_round_vals<FMT, W>(), row_bytes<FMT>(a.dim),
                                  a.s13_ld, reinterpret_cast<uint8_t*>(xs + a.dim));
  st.prefetch();
  // the down phase's first loads right after the warp's gate+up rounds (w2 does not depend on h); set up only there,
  // so that nothing of it stays live across the gate+up stream
  SplitkDown<KMAJOR> dn;
  gate_up_pairs<FMT>(st, x, a.dim, xs, part, np, t.row0, a.inter, a.limit, [&](int pl) { return t.rw[t.slot[pl]]; },
                     [&](int pl, int row) -> __nv_bfloat16& { return s_h[pl * 16 + (row & 15)]; }, nullptr, [&] {
                       dn.init(a, s_iw, s_is, s_nitems);
                       dn.prefetch();
                     });
  __syncthreads();  // s_h
  // the items' chunks of h, staged as the MMA B operand (mma_stage_vec); values of pairs outside the block zero
  for (int v = threadIdx.x; v < s_nitems * 4; v += blockDim.x) {
    const int i = v >> 2, j = v & 3, pl = s_ipair[i] + (j >> 1) - p0;
    uint4 h8 = make_uint4(0u, 0u, 0u, 0u);
    if (pl >= 0 && pl < np) h8 = *reinterpret_cast<const uint4*>(s_h + pl * 16 + (j & 1) * 8);
    s_hb[v] = mma_stage_vec<FMT>(h8);
  }
  __syncthreads();
  dn.run(s_hb, dst);
}

// One 16-row tile per block: out rows = the epilogue of the routed down (down_store: add, rounding, bf16 / fp32 out)
// on the sum over the nparts partial rows, added in a fixed order (thread (j, r) sums rows j, j + 16, ... of row r's
// column, then thread r adds the 16 sums in order); FOLD: the hc fold's streams and partials too.
template <bool OUT_F32, bool FOLD>
__global__ void __launch_bounds__(SPLITK_REDUCE_THREADS)
moe_splitk_reduce_kernel(const MoEArgs a, const float* __restrict__ parts, int nparts, const void* __restrict__ add,
                         void* __restrict__ out, const HcFold fold) {
  extern __shared__ float4 smem4[];
  __shared__ float s_red[16][17];
  const int t0 = blockIdx.x;
  [[maybe_unused]] auto fs = [&] { return hc_fold_smem(reinterpret_cast<float*>(smem4), 1, fold.n, fold.mix); };
  if constexpr (FOLD) hc_fold_load_fn(fold, fs(), t0, 1, a.dim);  // a weight: before the wait
  ds4_pdl::begin();  // the partial rows, add and the fold's streams come from the previous kernels
  if constexpr (FOLD) hc_fold_load_act(fold, fs(), t0, 1, a.dim);
  const int r = threadIdx.x & 15, j = threadIdx.x >> 4;
  const float* col = parts + (long)t0 * 16 + r;
  float s = 0.f;
#pragma unroll 8
  for (int p = j; p < nparts; p += 16) s += __ldcg(col + (long)p * a.dim);
  s_red[j][r] = s;
  __syncthreads();
  if (threadIdx.x < 16) {
    float v = 0.f;
#pragma unroll
    for (int q = 0; q < 16; ++q) v += s_red[q][threadIdx.x];
    const float y = down_store<OUT_F32>(out, (long)t0 * 16 + threadIdx.x, add, a.add_bf16, v);
    if constexpr (FOLD) fs().ys[threadIdx.x] = y;
  }
  if constexpr (FOLD) hc_fold_epilogue(fold, fs(), t0, 1, a.dim);  // (its barrier orders the ys stores)
}

static long splitk_smem(const MoEArgs& a) { return 4L * mma_part_floats(MMA_STREAM_MAX_TILES) + 2L * a.dim; }

// The shapes the pair takes (ids given: the routed experts of one token, no routing inside the kernels, no bf16
// pointers; fp4t at its run width; dim whole groups of 4 tiles; topk within a block's slot tables).
static bool splitk_shape_ok(const MoEArgs& a) {
  return a.fmt == FMT_FP4T && a.n_tok == 1 && a.ptrs == nullptr && a.route_logits == nullptr && a.topk >= 1 &&
         a.topk <= 32 && a.dim % 64 == 0 && a.inter % 32 == 0 && mma_shape_ok(a.fmt, a.dim) &&
         mma_shape_ok(a.fmt, a.inter) && moe_layout_ok(a) && splitk_smem(a) <= 48 * 1024;
}

int moe_splitk_rows(const MoEArgs& a) {
  if (!splitk_shape_ok(a)) return -1;
  // (both forms' wave: the same registers, checked by the ptxas report)
  const int wave = resident_wave(moe_splitk_kernel<SPLITK_U, false>, MMA_STREAM_THREADS, splitk_smem(a));
  const int pairs = a.topk * (a.inter / 16);  // (every slot local: the most the launch can have)
  const int ppb = (pairs + std::min(wave, pairs) - 1) / std::min(wave, pairs);
  if (ppb > MMA_STREAM_MAX_TILES / 2) return -1;
  return (pairs + ppb - 1) / ppb;
}

cudaError_t launch_moe_splitk(const MoEArgs& a, const void* x, float* parts, cudaStream_t st) {
  const int rows = moe_splitk_rows(a);
  if (rows < 1 || a.ids == nullptr) return cudaErrorInvalidValue;
  auto kern = a.kernel == KERNEL_SPLITK_K ? moe_splitk_kernel<SPLITK_U, true> : moe_splitk_kernel<SPLITK_U, false>;
  return ds4_pdl::launch(kern, dim3(rows), dim3(MMA_STREAM_THREADS), splitk_smem(a), st, a,
                         reinterpret_cast<const __nv_bfloat16*>(x), parts);
}

cudaError_t launch_moe_splitk_reduce(const MoEArgs& a, const float* parts, const void* add, void* out, bool out_f32,
                                     cudaStream_t st, const HcFold* fold) {
  const int nparts = moe_splitk_rows(a);
  if (nparts < 1 || (fold != nullptr && out_f32)) return cudaErrorInvalidValue;
  const dim3 grid(a.dim / 16), block(SPLITK_REDUCE_THREADS);
  if (fold != nullptr) {
    const long smem = 4L * hc_fold_smem_floats(1, fold->n, fold->mix);
    auto kern = moe_splitk_reduce_kernel<false, true>;
    cudaError_t e = set_smem(kern, smem);
    if (e != cudaSuccess) return e;
    return ds4_pdl::launch(kern, grid, block, smem, st, a, parts, nparts, add, out, *fold);
  }
  auto kern = out_f32 ? moe_splitk_reduce_kernel<true, false> : moe_splitk_reduce_kernel<false, false>;
  return ds4_pdl::launch(kern, grid, block, 0, st, a, parts, nparts, add, out, HcFold{});
}

}  // namespace ds4
