// Device helpers of the MoE kernels shared by moe.cu / moe_mma.cu (gate+up / down launches: FMA and tensor-core
// kernels) and moe_ffn.cu (the whole one-token FFN in one launch): expert weight bases, the limited SwiGLU, a block's
// slots of its token, the down projections' store; and the two MoE files' interface.
#pragma once
#include "ds4_common.cuh"
#include "ds4_launch.h"
#include "mma_dot.cuh"
#include "route_dev.cuh"

namespace ds4 {

template <int FMT>
__device__ __forceinline__ void expert_base(const MoEArgs& a, int e, int which, const uint8_t*& W,
                                            const uint8_t*& S) {
  // which: 0 = w1, 1 = w3, 2 = w2
  if (a.ptrs) {
    W = reinterpret_cast<const uint8_t*>(a.ptrs[3 * e + which]);
    S = nullptr;
    return;
  }
  if (which == 2) {
    W = reinterpret_cast<const uint8_t*>(a.W2) + (long)e * a.w2_estride;
    S = a.S2 ? reinterpret_cast<const uint8_t*>(a.S2) + (long)e * a.s2_estride : nullptr;
  } else {
    W = reinterpret_cast<const uint8_t*>(which ? a.W3 : a.W1) + (long)e * a.w13_estride;
    const void* s = which ? a.S3 : a.S1;
    S = s ? reinterpret_cast<const uint8_t*>(s) + (long)e * a.s13_estride : nullptr;
  }
}

// h = bf16(silu(min(g, lim)) * clamp(up, +-lim) * w): the reference's limited SwiGLU, route weight w.
__device__ __forceinline__ __nv_bfloat16 swiglu_h(float g, float up, float lim, float w) {
  g = fminf(g, lim);
  up = fminf(fmaxf(up, -lim), lim);
  return __float2bfloat16(g / (1.0f + expf(-g)) * up * w);
}

// The block's slots of its one token: global expert id and route weight per slot (s_ids / s_rw, shared),
// read from ids / rw (ids == nullptr: the one shared expert, weight 1), or routed here from
// a.route_logits by warp 0 (scratch: 2 n_experts floats of shared memory), block 0 of the launch then
// writing them to ids_out / rw_out when write_out. Ends with __syncthreads.
__device__ __forceinline__ void moe_slots(const MoEArgs& a, float* scratch, int* s_ids, float* s_rw, bool write_out) {
  if (a.route_logits) {
    if (threadIdx.x < 32)
      route_token_warp(a.route_logits, a.n_experts, a.route_bias, a.tid2eid, a.tid64, a.token_ids, 0, a.topk,
                       a.route_scale, scratch, reinterpret_cast<unsigned*>(scratch + a.n_experts), s_ids, s_rw);
    __syncthreads();
    if (write_out && blockIdx.x == 0 && threadIdx.x < a.topk) {
      a.ids_out[threadIdx.x] = s_ids[threadIdx.x];
      a.rw_out[threadIdx.x] = s_rw[threadIdx.x];
    }
    return;
  }
  if (threadIdx.x < a.topk) {
    s_ids[threadIdx.x] = a.ids ? (int)a.ids[threadIdx.x] : a.expert_offset;
    s_rw[threadIdx.x] = a.rw ? a.rw[threadIdx.x] : 1.f;
  }
  __syncthreads();
}

// Bit j set = slot j (< topk <= 32) holds a local expert.
__device__ __forceinline__ unsigned moe_local_slots(const MoEArgs& a, const int* s_ids) {
  const int lane = threadIdx.x & 31;
  bool loc = false;
  if (lane < a.topk) {
    const int e = s_ids[lane] - a.expert_offset;
    loc = e >= 0 && e < a.n_local;
  }
  return __ballot_sync(0xffffffffu, loc);
}

__device__ __forceinline__ int nth_bit(unsigned m, int n) {
  for (int i = 0; i < n; ++i) m &= m - 1;
  return __ffs(m) - 1;  // -1 when m has <= n bits
}

// A block's routed (w1, w3) tile tables in shared memory, and its token's slots (moe_slots' s_ids / s_rw): the
// one-token gate+up launches (moe_gate_up_mma_kernel, moe_ffn_kernel, moe_splitk_kernel) each declare one.
struct PairTables {
  const uint8_t* tw[MMA_STREAM_MAX_TILES];  // a tile's weight rows
  const uint8_t* ts[MMA_STREAM_MAX_TILES];  // its scales
  int row0[MMA_STREAM_MAX_TILES];           // its first row of `inter`
  int slot[MMA_STREAM_MAX_TILES / 2];       // a pair's slot
  int ids[32];
  float rw[32];
};

// The tiles of routed (w1, w3) pairs [p0, p0 + np) (pair p = u * RT + rt: local slot u, the u-th set bit of m,
// row tile rt of `inter`): local tiles 2 pl (w1) and 2 pl + 1 (w3) into t.tw / t.ts / t.row0, the pair's slot
// into t.slot; t.ids as moe_slots left them. Threads < 2 np write; the caller synchronises.
template <int FMT>
__device__ __forceinline__ void routed_pair_tiles(const MoEArgs& a, unsigned m, int p0, int np, int RT,
                                                  PairTables& t) {
  if (threadIdx.x < 2 * np) {
    const int pl = threadIdx.x >> 1, which = threadIdx.x & 1, u = (p0 + pl) / RT;
    const int slot = nth_bit(m, u);
    expert_base<FMT>(a, t.ids[slot] - a.expert_offset, which, t.tw[threadIdx.x], t.ts[threadIdx.x]);
    t.row0[threadIdx.x] = (p0 + pl - u * RT) * 16;
    if (which == 0) t.slot[pl] = slot;
  }
}

struct NoHook {
  __device__ __forceinline__ void operator()() const {}
};

// A block's one-token gate+up over np (w1, w3) tile pairs (local tiles 2 pl and 2 pl + 1, first rows row0[2 pl]) on
// stream st, its first rounds already requested: x staged for FMT, the stream run, then
// out(pl, row) = swiglu(gate, up) * weight(pl) for the rows < inter. Every thread of the block calls it. AQ: x staged
// FP8-simulated (stage_mma_rows' AQ). bulk_bar (not AQ): x already requested by a bulk copy completing on it
// (bulk_stage.cuh; thread 0 waits, then each thread converts its vectors). after_run: called by every thread right
// after its warp's share of the stream, before the epilogue's barrier (the split-K kernel's first down loads).
template <int FMT, bool AQ = false, typename Stream, typename WeightFn, typename OutFn, typename AfterRun = NoHook>
__device__ __forceinline__ void gate_up_pairs(Stream& st, const __nv_bfloat16* x, int dim, __nv_bfloat16* xs,
                                              float* part, int np, const int* row0, int inter, float limit,
                                              WeightFn weight, OutFn out, uint64_t* bulk_bar = nullptr,
                                              AfterRun after_run = AfterRun{}) {
  if (!AQ && bulk_bar != nullptr) {
    stage_mma_bulk_landed<FMT>(bulk_bar, xs, dim / 8);
  } else {
    stage_mma_rows<FMT, false, AQ>(xs, [=](int) { return x; }, 1, dim);
  }
  mma_part_zero(part, 2 * np);
  __syncthreads();
  st.run(part);
  after_run();
  __syncthreads();
  for (int i = threadIdx.x; i < np * 16; i += blockDim.x) {
    const int pl = i >> 4, row = row0[2 * pl] + (i & 15);
    if (row < inter)
      out(pl, row) = swiglu_h(mma_part_sum(part, 2 * pl, i & 15), mma_part_sum(part, 2 * pl + 1, i & 15), limit,
                              weight(pl));
  }
}

// out[o] of a down projection v:
//   fp32 add: fp32 out = add + v (accumulation); bf16 out = bf16(add + bf16(v)), the reference's order
//     when the shared expert's output (v, rounded to bf16) is added to the fp32 routed sum (add);
//   bf16 add (a.add_bf16: the shared expert's output, already rounded): out = add + v, v the fp32 routed
//     sum — the same sum, for when the shared expert ran first.
// Returns the value as stored. down_store_at reads the add at add[ao] (a copy of add's rows elsewhere: the routed
// down's bulk staging puts its rows in shared memory).
template <bool OUT_F32>
__device__ __forceinline__ float down_store_at(void* out, long o, const void* add, long ao, bool add_bf16, float v) {
  float y = v;
  if (add != nullptr)
    y = add_bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(add)[ao]) + v
                 : static_cast<const float*>(add)[ao] + (OUT_F32 ? v : __bfloat162float(__float2bfloat16(v)));
  if (OUT_F32) {
    reinterpret_cast<float*>(out)[o] = y;
    return y;
  }
  const __nv_bfloat16 b = __float2bfloat16(y);
  reinterpret_cast<__nv_bfloat16*>(out)[o] = b;
  return __bfloat162float(b);
}
template <bool OUT_F32>
__device__ __forceinline__ float down_store(void* out, long o, const void* add, bool add_bf16, float v) {
  return down_store_at<OUT_F32>(out, o, add, o, add_bf16, v);
}

// Both matrices of an expert ([inter, dim] w1 / w3, [dim, inter] w2) in layout a.fmt (layout_shape_ok). FMT_FP4T /
// FMT_FP8T (the routed experts' and the shared expert's tiled layouts): the tensor-core kernels take them at the
// layout's run width FP4T_W on the register stream (with_tiled_shape); the FMA kernels through chunk_ptr.
inline bool moe_layout_ok(const MoEArgs& a) {
  return layout_shape_ok(a.fmt, a.inter, a.dim) && layout_shape_ok(a.fmt, a.dim, a.inter);
}

// The tensor-core half of launch_moe_gate_up / launch_moe_down (moe_mma.cu). moe_use_mma: 0 = the FMA kernels,
// 1 = the tensor-core ones, -1 = an explicit tensor-core request (a.kernel) that does not apply.
int moe_use_mma(const MoEArgs& a);
cudaError_t launch_moe_gate_up_mma(const MoEArgs& a, const void* x, void* h, cudaStream_t st, bool aq);
// The integer-pipe gate+up (moe_dp4a.cu), launch_moe_gate_up's kernel DP4A.
cudaError_t launch_moe_gate_up_dp4a(const MoEArgs& a, const void* x, void* h, cudaStream_t st);
cudaError_t launch_moe_down_mma(const MoEArgs& a, const void* h, const void* add, void* out, bool out_f32,
                                cudaStream_t st, const HcFold* fold, bool aq);

}  // namespace ds4
