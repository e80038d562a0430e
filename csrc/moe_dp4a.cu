// The routed experts' one-token gate+up on the integer pipe (moe=fp4_dp4a; kernel "dp4a" of launch_moe_gate_up):
// the stored E2M1 nibbles are never decoded to floats. PRMT looks four nibbles up as bytes 2 x |E2M1| (0..12) in one
// instruction, and a nibble's sign bit makes PRMT write 0 instead (the table's top bits are 0), so one lookup gives
// a word's positive weights and a second, of the word with its sign bits flipped, its negative ones. DP4A multiplies
// those bytes with the activations, quantized per 32 values to 16 bits (q = 256 hi + lo: a signed and an unsigned
// byte), and the integer sums are exact. Per 32-value block: (dot+ - dot-) x (x's scale x the weight's E8M0 scale).
//
// Why: the tensor-core kernels decode every E2M1 nibble to BF16 (5 LOP3 + 2 SHF per word), and that decode, not the
// weight stream, bounds them (experiments/decode_session22_h200.md: the FP4 loop is ALU-bound). The probe of this form
// (scripts/probe_dp4a_moe.cu, resident, 16-bit) took 21.93 us for six 2048 x 4096 expert pairs of 256. Measured
// (experiments/session64.md, run 6, one H100): this kernel 21.82 us against fp4_topk's tensor-core gate+up 23.32 us
// alone (bench_kernels.py), but the step 123.3 / 123.4 against 121.7 / 121.6 us per layer: slower where it counts,
// so an opt-in (moe=fp4_dp4a), not auto's choice. Items claimed from device counters instead of each warp's fixed
// share (session 65: one counter, or 16 ranges with most items still fixed) were slower alone (30.4 / 23.7 us against
// 21.4 / 21.5) and in the step (experiments/session65.md, experiments/s65_attempts/), so the shares stay fixed.
//
// Numerics: the 16-bit activations hold bf16 x exactly wherever a value is within 2^7 of its block's largest; below
// that they keep 15 bits of the block's scale (the product within 3e-5 of bf16 x's: session 63's probe). h is
// rounded to bf16 as the other kernels round it.
//
// Layout: the checkpoint's (FMT_FP4: [experts, inter, dim / 2] bytes, element 2k in the low nibble of byte k;
// E8M0 scales [experts, inter, dim / 32]). A warp takes one (slot, row) item at a time: lane l reads the 16-byte
// chunks l, l + 32, ... of the w1 and w3 rows (one 512-byte run per warp load) and their scale bytes (one word per
// lane, handed out by shuffles, where the rows hold whole words), and the next item's loads are issued before this
// item's arithmetic. A resident wave of blocks stages x once each.
#include "ds4_common.cuh"
#include "ds4_launch.h"
#include "moe_dev.cuh"

#include <algorithm>

// DS4_DP4A_SCALE_LANE=1 (a build-time timing diagnostic, dim 4096 only; session 64, run 3): the scale bytes read as
// if laid out in lane order (row byte 4 lane + i = the scale of lane `lane`'s chunk i: one word per lane and row and
// no shuffles, the layout of scripts/probe_dp4a_moe.cu). On the stored layout its outputs are wrong.
#ifndef DS4_DP4A_SCALE_LANE
#define DS4_DP4A_SCALE_LANE 0
#endif

namespace ds4 {
namespace {

constexpr int DP4A_THREADS = 256, DP4A_WARPS = DP4A_THREADS / 32;
constexpr int DP4A_MAX_KB = 4;                                     // dim <= 4096: up to 4 chunks per lane and row
constexpr uint32_t E2M1X2_LO = 0x03020100u, E2M1X2_HI = 0x0C080604u;  // 2 x |E2M1| of codes 0..7

// PRMT with the selector's sign bits honoured (__byte_perm drops them): a selector nibble with bit 3 set writes
// the looked-up byte's top bit replicated, 0 for this table.
__device__ __forceinline__ uint32_t prmt(uint32_t c) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(E2M1X2_LO), "r"(E2M1X2_HI), "r"(c));
  return d;
}

// 16 weight bytes, read once: not kept in L1
__device__ __forceinline__ uint4 ld_stream16(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// A 32-value block's 16-bit code (host-callable: tests/test_moe_dp4a_cpu.py): q = rint(v x pre x inv), clamped to
// +-32767, and the block's scale xs (v ~ q xs). 32767 / amax overflows to inf under amax ~ 9.6e-35 (every value of the
// block, zeros too, would then take +-32767), so a block under 2^-64 is scaled by 2^64 first (exact) and its scale
// takes the 2^-64 back; every other block's q and xs are the bits of rint(v x (32767 / amax)) and amax / 32767.
struct Q16 {
  float pre, inv, xs;
};
__host__ __device__ __forceinline__ Q16 q16_of(float amax) {
  const bool tiny = amax < 0x1p-64f;
  const float pre = tiny ? 0x1p64f : 1.f, a = amax * pre;
  return {pre, a > 0.f ? 32767.f / a : 0.f, a / 32767.f * (tiny ? 0x1p-64f : 1.f)};
}
__host__ __device__ __forceinline__ int q16(float v, const Q16& s) {
  return (int)fminf(fmaxf(rintf(v * s.pre * s.inv), -32767.f), 32767.f);
}

// x [n] (bf16) -> per 32-value block b: scale xs[b] = amax / 32767 and q = rint(v / xs[b]) = 256 xh + xl (xh int8,
// xl uint8). Eight threads per block, four values each (DP4A_THREADS threads: 1024 values a round, KB rounds); n a
// multiple of 32. Every round's load is issued before the first is used: one round trip to x instead of KB (x sits in
// L2, and every block waits for its staging before its first item's arithmetic). Threads past n carry zeros, so
// every lane of a warp takes part in the shuffles.
template <int KB>
__device__ __forceinline__ void stage_x16(const __nv_bfloat16* __restrict__ x, int n, int8_t* xh, uint8_t* xl,
                                          float* xs) {
  uint2 w[KB];
#pragma unroll
  for (int it = 0; it < KB; ++it) {
    const int i0 = it * DP4A_THREADS * 4 + threadIdx.x * 4;
    w[it] = i0 < n ? *reinterpret_cast<const uint2*>(x + i0) : make_uint2(0u, 0u);
  }
#pragma unroll
  for (int it = 0; it < KB; ++it) {
    const int i0 = it * DP4A_THREADS * 4 + threadIdx.x * 4;
    const float f[4] = {__uint_as_float(w[it].x << 16), __uint_as_float(w[it].x & 0xffff0000u),
                        __uint_as_float(w[it].y << 16), __uint_as_float(w[it].y & 0xffff0000u)};
    float amax = fmaxf(fmaxf(fabsf(f[0]), fabsf(f[1])), fmaxf(fabsf(f[2]), fabsf(f[3])));
#pragma unroll
    for (int d = 1; d < 8; d <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, d));
    if (i0 >= n) continue;
    const Q16 s = q16_of(amax);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int q = q16(f[k], s);
      xh[i0 + k] = (int8_t)(q >> 8);
      xl[i0 + k] = (uint8_t)(q & 255);
    }
    if ((threadIdx.x & 7) == 0) xs[i0 / 32] = s.xs;
  }
}

// One 32-value block of a row: its 16 weight bytes against the staged block -> the exact integer dot product times 2
// (the table holds 2 x |E2M1|), as a float (|value| < 2^24: 32 x 12 x 32767).
__device__ __forceinline__ float block_dot(const uint4& w, const int8_t* xh, const uint8_t* xl) {
  const uint4 h0 = reinterpret_cast<const uint4*>(xh)[0], h1 = reinterpret_cast<const uint4*>(xh)[1];
  const uint4 l0 = reinterpret_cast<const uint4*>(xl)[0], l1 = reinterpret_cast<const uint4*>(xl)[1];
  const uint32_t hx[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
  const uint32_t lx[8] = {l0.x, l0.y, l0.z, l0.w, l1.x, l1.y, l1.z, l1.w};
  const uint32_t ww[4] = {w.x, w.y, w.z, w.w};
  int hp = 0, hn = 0;
  unsigned lp = 0, ln = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    // word j holds elements 8j .. 8j + 7; its low half the first four (x word 2j), its high half the next four
    const uint32_t p0 = prmt(ww[j]), p1 = prmt(ww[j] >> 16);
    const uint32_t wn = ww[j] ^ 0x88888888u;
    const uint32_t n0 = prmt(wn), n1 = prmt(wn >> 16);
    hp = __dp4a((int)p0, (int)hx[2 * j], hp);
    hp = __dp4a((int)p1, (int)hx[2 * j + 1], hp);
    hn = __dp4a((int)n0, (int)hx[2 * j], hn);
    hn = __dp4a((int)n1, (int)hx[2 * j + 1], hn);
    lp = __dp4a(p0, lx[2 * j], lp);
    lp = __dp4a(p1, lx[2 * j + 1], lp);
    ln = __dp4a(n0, lx[2 * j], ln);
    ln = __dp4a(n1, lx[2 * j + 1], ln);
  }
  return fmaf((float)(hp - hn), 256.f, (float)((int)lp - (int)ln));
}

__device__ __forceinline__ float e8m0f(uint32_t b) { return __uint_as_float(b << 23); }  // byte 0: 0 (the block drops)

// A warp's (slot, row) item: the w1 and w3 rows' chunks and scale bytes of its lane.
template <int KB>
struct ItemRegs {
  uint4 g[KB], u[KB];
  uint32_t sg, su;  // SHFL: the row's scale bytes 4 lane .. 4 lane + 3; else byte i: the scale of chunk i
};

// The (slot, row) of a warp's item, carried from item to item (no division per item); slot >= topk: past the end.
struct Cursor {
  int slot, row;
  __device__ __forceinline__ void advance(int by, int inter) {
    row += by;
    while (row >= inter) row -= inter, ++slot;
  }
};

// SHFL: whether lane `lane` loads its scale word of a row of nb bytes (host-callable: tests/test_moe_dp4a_cpu.py): the
// words inside the row only (FULL: nb = 32 KB, every lane at KB 4; at KB < 4 the lanes past it would read up to 96
// bytes past the row, and past the scale tensor's end at its last row).
template <int KB, bool FULL>
__host__ __device__ constexpr bool scale_word_lane(int lane, int nb) {
  return 4 * lane < (FULL ? 32 * KB : nb);
}

// Lane `lane`'s i-th chunk is the row's 32-value block i * 32 + lane. FULL: dim = 1024 KB (no lane idle). SHFL: a
// lane loads the row's scale bytes 4 lane .. 4 lane + 3 (one aligned word) and finish_item takes its chunks' bytes
// from their lanes by shuffles — measured faster than a byte load per chunk (session 64, run 2: 25.8 against 28.4 us
// on an H100 in the probe's harness); it needs the row's scale bytes in whole words (dim a multiple of 128).
template <int KB, bool FULL, bool SHFL>
__device__ __forceinline__ bool load_item(const MoEArgs& a, const Cursor& c, int lane, int nb, const int* s_ids,
                                          unsigned m, ItemRegs<KB>& r) {
  if (c.slot >= a.topk || !((m >> c.slot) & 1u)) return false;  // warp-uniform
  const uint8_t *w1, *s1, *w3, *s3;
  expert_base<FMT_FP4>(a, s_ids[c.slot] - a.expert_offset, 0, w1, s1);
  expert_base<FMT_FP4>(a, s_ids[c.slot] - a.expert_offset, 1, w3, s3);
  const long wrow = (long)c.row * (a.dim / 2), srow = (long)c.row * a.s13_ld;
  r.sg = r.su = 0;
#if DS4_DP4A_SCALE_LANE
  if (KB == 4 && FULL) {
    r.sg = *reinterpret_cast<const uint32_t*>(s1 + srow + 4 * lane);
    r.su = *reinterpret_cast<const uint32_t*>(s3 + srow + 4 * lane);
  }
#else
  if (SHFL && scale_word_lane<KB, FULL>(lane, nb)) {
    r.sg = *reinterpret_cast<const uint32_t*>(s1 + srow + 4 * lane);
    r.su = *reinterpret_cast<const uint32_t*>(s3 + srow + 4 * lane);
  }
#endif
#pragma unroll
  for (int i = 0; i < KB; ++i) {
    const int b = i * 32 + lane;
    if (FULL || b < nb) {
      r.g[i] = ld_stream16(w1 + wrow + (long)b * 16);
      r.u[i] = ld_stream16(w3 + wrow + (long)b * 16);
      if (!SHFL && !DS4_DP4A_SCALE_LANE) {
        r.sg |= (uint32_t)s1[srow + b] << (8 * i);
        r.su |= (uint32_t)s3[srow + b] << (8 * i);
      }
    } else {
      r.g[i] = r.u[i] = make_uint4(0, 0, 0, 0);
    }
  }
  return true;
}

template <int KB, bool FULL, bool SHFL>
__device__ __forceinline__ void finish_item(const MoEArgs& a, const Cursor& c, const ItemRegs<KB>& r, int lane, int nb,
                                            const int8_t* sxh, const uint8_t* sxl, const float* sxs, const float* s_rw,
                                            __nv_bfloat16* __restrict__ h) {
  float ag = 0.f, au = 0.f;
#pragma unroll
  for (int i = 0; i < KB; ++i) {
    const int b = i * 32 + lane;
    uint32_t sg = (r.sg >> (8 * i)) & 0xffu, su = (r.su >> (8 * i)) & 0xffu;
    if (SHFL && !DS4_DP4A_SCALE_LANE) {  // block b's scale byte is byte b % 4 of lane b / 4's word
      sg = (__shfl_sync(0xffffffffu, r.sg, b >> 2) >> (8 * (lane & 3))) & 0xffu;
      su = (__shfl_sync(0xffffffffu, r.su, b >> 2) >> (8 * (lane & 3))) & 0xffu;
    }
    if (FULL || b < nb) {
      const float xs = sxs[b];
      ag = fmaf(block_dot(r.g[i], sxh + b * 32, sxl + b * 32), xs * e8m0f(sg), ag);
      au = fmaf(block_dot(r.u[i], sxh + b * 32, sxl + b * 32), xs * e8m0f(su), au);
    }
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    ag += __shfl_xor_sync(0xffffffffu, ag, d);
    au += __shfl_xor_sync(0xffffffffu, au, d);
  }
  if (lane == 0) h[(long)c.slot * a.inter + c.row] = swiglu_h(0.5f * ag, 0.5f * au, a.limit, s_rw[c.slot]);
}

// h[slot, row] = swiglu(x . w1[e][row], x . w3[e][row]) x route weight, e = ids[slot] (one token); slots whose expert
// is not held here are left unwritten (the down kernel skips them). Warp w of block b takes item w + 8 b of the
// topk x inter (slot-major), then every 8 gridDim.x-th after it, two register sets in turn (no dynamic indexing), each
// item's loads issued before the previous item's arithmetic.
template <int KB, bool FULL, bool SHFL>
__global__ void __launch_bounds__(DP4A_THREADS) moe_gate_up_dp4a_kernel(const MoEArgs a,
                                                                        const __nv_bfloat16* __restrict__ x,
                                                                        __nv_bfloat16* __restrict__ h) {
  __shared__ __align__(16) int8_t sxh[KB * 1024];
  __shared__ __align__(16) uint8_t sxl[KB * 1024];
  __shared__ float sxs[KB * 32];
  __shared__ int s_ids[32];
  __shared__ float s_rw[32];
  ds4_pdl::begin();  // the expert ids, route weights and x come from the previous kernels
  moe_slots(a, nullptr, s_ids, s_rw, false);
  const unsigned m = moe_local_slots(a, s_ids);
  const int lane = threadIdx.x & 31, nb = a.dim / 32, stride = gridDim.x * DP4A_WARPS;
  const int item0 = blockIdx.x * DP4A_WARPS + (threadIdx.x >> 5);
  Cursor ca{item0 / a.inter, item0 % a.inter};  // (the one division)
  ItemRegs<KB> ra, rb;
  bool va = load_item<KB, FULL, SHFL>(a, ca, lane, nb, s_ids, m, ra);  // out before the staging
  stage_x16<KB>(x, a.dim, sxh, sxl, sxs);
  __syncthreads();
  while (ca.slot < a.topk) {
    Cursor cb = ca;
    cb.advance(stride, a.inter);
    const bool vb = load_item<KB, FULL, SHFL>(a, cb, lane, nb, s_ids, m, rb);
    if (va) finish_item<KB, FULL, SHFL>(a, ca, ra, lane, nb, sxh, sxl, sxs, s_rw, h);
    if (cb.slot >= a.topk) break;
    ca = cb;
    ca.advance(stride, a.inter);
    va = load_item<KB, FULL, SHFL>(a, ca, lane, nb, s_ids, m, ra);
    if (vb) finish_item<KB, FULL, SHFL>(a, cb, rb, lane, nb, sxh, sxl, sxs, s_rw, h);
  }
}

template <int KB, bool FULL, bool SHFL>
cudaError_t gate_up_dp4a_go(const MoEArgs& a, const void* x, void* h, cudaStream_t st) {
  auto kern = moe_gate_up_dp4a_kernel<KB, FULL, SHFL>;
  const int items = a.topk * a.inter;  // one resident wave, or fewer blocks where the items do not fill it
  const int grid = std::max(1, std::min((items + DP4A_WARPS - 1) / DP4A_WARPS, resident_wave(kern, DP4A_THREADS, 0)));
  return ds4_pdl::launch(kern, dim3(grid), dim3(DP4A_THREADS), 0, st, a,
                         reinterpret_cast<const __nv_bfloat16*>(x), reinterpret_cast<__nv_bfloat16*>(h));
}

template <int KB>
cudaError_t gate_up_dp4a_kb(const MoEArgs& a, const void* x, void* h, cudaStream_t st) {
  // scale words: every row's bytes in whole aligned words (row length, expert stride and bases)
  const bool words = a.s13_ld % 4 == 0 && a.s13_estride % 4 == 0 && (a.dim / 32) % 4 == 0 &&
                     reinterpret_cast<uintptr_t>(a.S1) % 4 == 0 && reinterpret_cast<uintptr_t>(a.S3) % 4 == 0;
  if (a.dim == KB * 1024) return words ? gate_up_dp4a_go<KB, true, true>(a, x, h, st)
                                       : gate_up_dp4a_go<KB, true, false>(a, x, h, st);
  return words ? gate_up_dp4a_go<KB, false, true>(a, x, h, st) : gate_up_dp4a_go<KB, false, false>(a, x, h, st);
}

}  // namespace

bool moe_dp4a_ok(const MoEArgs& a) {
  return a.fmt == FMT_FP4 && a.n_tok == 1 && a.ids != nullptr && !a.ptrs && !a.route_logits && a.S1 && a.S3 &&
         a.topk >= 1 && a.topk <= 32 && a.dim % 32 == 0 && a.dim >= 32 && a.dim <= DP4A_MAX_KB * 1024 &&
         a.inter >= 1 && a.s13_ld >= a.dim / 32;
}

cudaError_t launch_moe_gate_up_dp4a(const MoEArgs& a, const void* x, void* h, cudaStream_t st) {
  if (!moe_dp4a_ok(a)) return cudaErrorInvalidValue;
  switch ((a.dim + 1023) / 1024) {
    case 1: return gate_up_dp4a_kb<1>(a, x, h, st);
    case 2: return gate_up_dp4a_kb<2>(a, x, h, st);
    case 3: return gate_up_dp4a_kb<3>(a, x, h, st);
    default: return gate_up_dp4a_kb<4>(a, x, h, st);
  }
}

}  // namespace ds4
