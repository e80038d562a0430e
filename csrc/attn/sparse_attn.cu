// Sparse MQA attention for decode (spec §5.7), flash-decoding style:
//   sparse_chunk_kernel: block (split, head tile, row) loads KC = 32 key rows (window/HCA keys then the
//     row's selected keys) into shared memory (invalid keys zeroed) with its 16 heads' queries, and
//     uses BF16 mma.sync m16n8k16. 8 warps: for S = q K^T each warp takes a slice of the D dims
//     (partial S through shared memory, summed in a fixed order: deterministic); every warp then
//     holds the whole 16 x 32 S and does scale, mask, chunk max, p = exp(s - max) (fp32 sum for the
//     denominator, p rounded to bf16 for P.V like the reference) itself, and O_c = P V for its own
//     slice of the output dims (fp32), with (max, sum) per head. A block takes the chunks split, split +
//     nsplit, ... (sparse_nsplit: one chunk per block up to 64 splits, i.e. 2048 keys) with a running max
//     (flash attention's rescaling; the rows in registers at D = 512) -> workspace. A block with no valid
//     key in its chunks writes max = -inf and nothing else.
//     H200, one call at context 64 (3 busy chunks): 6.9 us like this (scripts/probe_phases.cu); 16.8 us
//     when one block served all 64 heads with 16 warps recomputing S per output slice (14.5 us of
//     block life: 3.4 loads, 3.9 S, 6.3 P.V).
//   sparse_combine_kernel: per (row, head): M = max(sink, max_c), L = exp(sink - M) + sum_c l_c
//     exp(m_c - M), o = sum_c exp(m_c - M) O_c / L  -> bf16. The sink enters only the denominator.
//   Decode mode (SparseArgs.pos): key validity from the row's position (window ring, visible compressed
//   entries), selected entries gathered by index straight from the compressed cache, and the output's
//   RoPE dims de-rotated in the combine - no mask, gather or de-rotation ops around the kernel.
#include <algorithm>
#include <cstdlib>

#include "../sinkhorn_dev.cuh"
#include "attn_common.cuh"
#include "attn_launch.h"

namespace ds4_attn {

// Keys per chunk (one block's step). DS4_SP_KC=16 (an alt build; session 57's A/B) halves a block's loads, S and
// P.V at a short context, where only ceil(visible keys / KC) blocks per head tile have work, at the cost of twice the
// splits for the combine to merge on a long one. Session 59 (one H100): the same step time as 32, not kept
// (experiments/decode_session59_h100.md).
#ifndef DS4_SP_KC
#define DS4_SP_KC 32
#endif
constexpr int SP_KC = DS4_SP_KC;  // keys per block
constexpr int SP_WARPS = 8;
constexpr int SP_THREADS = SP_WARPS * 32;
constexpr int SP_ROWS_PER_WARP = SP_KC / SP_WARPS;
constexpr int SP_MAX_ROPE = 512;  // RoPE dims the q_prep table holds
constexpr int SP_MAX_SPLITS = 64;  // sparse_nsplit's default cap
static_assert(SP_KC % 16 == 0 && SP_KC % SP_WARPS == 0 && SP_KC <= 64, "DS4_SP_KC: 16, 32, 48 or 64");

// Splits of a row's keys (blocks per head tile): one per SP_KC keys up to SP_MAX_SPLITS, beyond that each block takes
// several chunks (split, split + nsplit, ...). DS4_SPARSE_MAX_SPLITS (read per call; the ablation) sets the cap.
// Session 44 (H200, 8-layer step at position 1048000): an HCA row's 8320 keys in 260 one-chunk splits charged the
// combine about 45 us per layer (its fp32 partial outputs, 34 MB, written and read back).
int sparse_nsplit(int keys) {
  int cap = SP_MAX_SPLITS;
  if (const char* env = std::getenv("DS4_SPARSE_MAX_SPLITS")) cap = std::max(1, std::atoi(env));
  return std::max(1, std::min((keys + SP_KC - 1) / SP_KC, cap));
}

// S as float4 fragment pieces: (n-tile, lane) -> the lane's 4 accumulators of that n-tile
constexpr int SP_SFRAG = SP_KC / 8 * 32;

// keys [KC][D + 8] + q [16][D + 8] bf16, then fp32 S: the warps' partials [warps][SP_SFRAG] and their sum
// [SP_SFRAG], as float4
static size_t sparse_smem(int D) {
  return (size_t)(SP_KC + 16) * (D + 8) * sizeof(uint16_t) + (size_t)(SP_WARPS + 1) * SP_SFRAG * sizeof(float4);
}

// early (decode mode; DS4_ATTN_EARLY=1, opt-in, read per launch): the position, the RoPE table and the first chunk's
// rows that no launch of this step writes are taken BEFORE the PDL wait - every window slot but pos % K (the window
// write's) and every visible compressed entry but the newest (the compressor step's), not the selected entries (their
// indices come from the top-k). Safe whether the step's branches join the attention core by events (done before
// this launch) or by programmatic edges (DS4_PJOIN=attn: still running, writing only those two rows); the position is
// an input of the step (written at its start). Worth something only where the blocks are resident before the wait
// returns (pja: launched while wq_b runs). Session 31's form (every row but the selected before the wait, events
// only) measured no gain.
template <bool SLICE>  // D == SP_WARPS * 64 (V4's 512): each warp's output slice stays in registers
__global__ void __launch_bounds__(SP_THREADS) sparse_chunk_kernel(SparseArgs a, int nsplit, float* __restrict__ opart,
                                                                  float* __restrict__ ml, bool early) {
  DS4_MARK(0);
  extern __shared__ __align__(16) uint16_t ks[];   // [SP_KC][D + 8] keys (= values), [16][D + 8] q, S partials
  __shared__ uint8_t kval[SP_KC];
  const int split = blockIdx.x, mt = blockIdx.y, r = blockIdx.z;
  const int b = r / a.S, s = r % a.S;
  const int D = a.D, H = a.H, LD = D + 8;
  const int total = a.K + a.P;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  uint16_t* qs = ks + SP_KC * LD;
  float* spart = reinterpret_cast<float*>(qs + 16 * LD);

  const int vec_per_row = D / 8;
  __shared__ float2 s_rot[SP_MAX_ROPE / 2];  // q_prep: (cos, sin) of the RoPE pairs at pos_b, same for all heads
  auto rope_table = [&](long p) {
    if (a.q_prep)
      for (int i = threadIdx.x; i < a.R / 2; i += SP_THREADS) {
        float sn, cs;
        sincosf((float)p * a.freqs[i], &sn, &cs);
        s_rot[i] = make_float2(cs, sn);
      }
  };
  long pos_b = 0;
  bool pre[SP_ROWS_PER_WARP];  // early: the first chunk's rows copied before the wait
#pragma unroll
  for (int i = 0; i < SP_ROWS_PER_WARP; ++i) pre[i] = false;
  if (early) {
    pos_b = a.pos[b];
    const long vis = (pos_b + 1) / a.ratio;
#pragma unroll
    for (int i = 0; i < SP_ROWS_PER_WARP; ++i) {
      const int idx = split * SP_KC + warp + SP_WARPS * i, j = warp + SP_WARPS * i;
      const uint16_t* row = nullptr;
      if (idx < a.K && idx <= pos_b && idx != pos_b % a.K)
        row = static_cast<const uint16_t*>(a.kv) + (long)b * a.kv_b + (long)idx * a.kv_r;
      else if (idx >= a.K && idx < total && a.sel_idx == nullptr && idx - a.K < vis - 1)
        row = static_cast<const uint16_t*>(a.sel) + (long)b * a.sel_b + (long)(idx - a.K) * a.sel_r;
      pre[i] = row != nullptr;
      if (pre[i])
        for (int v = lane; v < vec_per_row; v += 32) cp_async16_zfill(ks + j * LD + v * 8, row + v * 8, true);
    }
    rope_table(pos_b);
  }
  ds4_pdl::begin();
  // ---- the tile's 16 query heads (rows >= H zeroed): their copies go out first (cp.async, no registers), and land
  // with the first chunk's keys
  const uint16_t* q = static_cast<const uint16_t*>(a.q) + ((long)r * H + mt * 16) * D;
  for (int i = threadIdx.x; i < 16 * vec_per_row; i += SP_THREADS) {
    const int h = i / vec_per_row, v = i % vec_per_row;
    const bool okq = mt * 16 + h < H;
    cp_async16_zfill(qs + h * LD + v * 8, q + (okq ? (long)h * D + v * 8 : 0), okq);
  }
  if (!early) {
    pos_b = a.pos ? a.pos[b] : 0;
    rope_table(pos_b);
  }
  const long n_vis = a.pos ? (pos_b + 1) / a.ratio : 0;
  const int h0 = mt * 16 + g, h1 = h0 + 8;
  const long mlbase = ((long)r * nsplit + split) * H;
  float* orow0 = opart + (mlbase + h0) * D;  // the block's partial output rows (h0 / h1 < H)
  float* orow1 = opart + (mlbase + h1) * D;
  // The block's chunks: split, split + nsplit, ... (one at a short context; sparse_nsplit caps the splits on a long
  // one), merged as flash attention does: M = the running max; at each chunk L and the output rows so far are
  // rescaled by exp(old M - new M) and the chunk's p = exp(s - new M) are added.
  float M0 = -INFINITY, M1 = -INFINITY, L0 = 0.f, L1 = 0.f;
  float acc[8][4];  // this warp's 64 output dims (D = 512: its whole slice) of rows h0 / h1, fp32
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  bool q_ready = false;  // q normalised and rotated (q_prep), at the first chunk with a valid key
  for (int key0 = split * SP_KC; key0 < total; key0 += nsplit * SP_KC) {
    // ---- keys: warp w loads rows w, w + 8, ... (row sources first, so the index loads overlap), 16 B per lane
    const uint16_t* src[SP_ROWS_PER_WARP];
    bool ok[SP_ROWS_PER_WARP];
#pragma unroll
    for (int i = 0; i < SP_ROWS_PER_WARP; ++i) {
      const int idx = key0 + warp + SP_WARPS * i;
      src[i] = nullptr;
      ok[i] = false;
      if (idx < a.K) {
        ok[i] = a.pos ? idx <= pos_b : a.valid[(long)b * a.valid_b + (long)s * a.valid_s + idx] != 0;
        src[i] = static_cast<const uint16_t*>(a.kv) + (long)b * a.kv_b + (long)idx * a.kv_r;
      } else if (idx < total) {
        const int p = idx - a.K;
        if (a.pos) {
          const long e = a.sel_idx ? a.sel_idx[(long)b * a.si_b + p] : p;
          ok[i] = e >= 0 && e < n_vis;
          src[i] = static_cast<const uint16_t*>(a.sel) + (long)b * a.sel_b + (ok[i] ? e : 0) * a.sel_r;
        } else {
          ok[i] = a.sel_valid[(long)b * a.sv_b + (long)s * a.sv_s + p] != 0;
          src[i] = static_cast<const uint16_t*>(a.sel) + (long)b * a.sel_b + (long)s * a.sel_s + (long)p * a.sel_r;
        }
      }
    }
    // the rows' copies all go out before any lands (cp.async: no register per copy; invalid rows zero-filled)
    int any = 0;
    const uint16_t* valid_src = static_cast<const uint16_t*>(a.kv);
#pragma unroll
    for (int i = 0; i < SP_ROWS_PER_WARP; ++i) {
      const int j = warp + SP_WARPS * i;
      if (!(pre[i] && key0 == split * SP_KC))  // (a row copied before the wait: valid, its copy in flight)
        for (int v = lane; v < vec_per_row; v += 32)
          cp_async16_zfill(ks + j * LD + v * 8, ok[i] ? src[i] + v * 8 : valid_src, ok[i]);
      if (lane == 0) kval[j] = ok[i] ? 1 : 0;
      any |= ok[i] ? 1 : 0;
    }
    cp_async_wait_all();
    any = __syncthreads_or(any);
    if (!any) continue;  // nothing read this chunk's rows; the barrier above ordered every thread's use of them
    if (a.q_prep && !q_ready) {  // head_rope on the block's 16 heads, in shared memory (warp per head), once
      for (int hh = warp; hh < 16; hh += SP_WARPS) {
        __nv_bfloat162* qh = reinterpret_cast<__nv_bfloat162*>(qs + hh * LD);
        float ss = 0.f;
        for (int d = 2 * lane; d < D; d += 64) {
          const float2 f = __bfloat1622float2(qh[d / 2]);
          ss += f.x * f.x + f.y * f.y;
        }
#pragma unroll
        for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float rb = bf16r(rsqrtf(ss / (float)D + a.qnorm_eps));
        for (int d = 2 * lane; d < D; d += 64) {
          const float2 f = __bfloat1622float2(qh[d / 2]);
          float x0 = bf16r(f.x * rb), x1 = bf16r(f.y * rb);
          if (d >= D - a.R) {  // RoPE pair (d, d + 1)
            const float2 rr = s_rot[(d - (D - a.R)) / 2];
            const float y0 = x0 * rr.x - x1 * rr.y, y1 = x0 * rr.y + x1 * rr.x;
            x0 = y0;
            x1 = y1;
          }
          qh[d / 2] = __floats2bfloat162_rn(x0, x1);
        }
      }
      __syncthreads();
    }
    q_ready = true;
    DS4_MARK(1);

    // ---- partial S = q K^T over this warp's 64-dim slices (16 heads x 32 keys), to shared memory
    float sc[SP_KC / 8][4];
#pragma unroll
    for (int nt = 0; nt < SP_KC / 8; ++nt) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
    for (int k0 = warp * 64; k0 < D; k0 += SP_WARPS * 64) {  // D % 64 == 0
      uint32_t af[4][4];
#pragma unroll
      for (int u = 0; u < 4; ++u) load_a_rows<false>(af[u], qs, LD, 0, 16, k0 + 16 * u, lane);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
#pragma unroll
        for (int nt = 0; nt < SP_KC / 8; ++nt) {
          const uint16_t* kr = ks + (nt * 8 + g) * LD + k0 + 16 * u + 2 * c;
          const uint32_t b0 = *reinterpret_cast<const uint32_t*>(kr);
          const uint32_t b1 = *reinterpret_cast<const uint32_t*>(kr + 8);
          mma16816(sc[nt], af[u], b0, b1);
        }
      }
    }
    // The sum over the warps, once per fragment piece (thread i < SP_SFRAG owns piece i), in warp order
    // (deterministic), then every warp reads the whole S back. Each access of a warp is 32 consecutive
    // float4: 4 shared-memory wavefronts, the least for 512 bytes. Before, every warp summed all eight warps'
    // partials itself from a lane-strided layout (64-byte stride, 4-way bank conflicts): 4608 wavefronts per
    // block where this takes about 400. H200 (scripts/probe_phases.cu indexer, experiments/decode_session23_h200.md):
    // this phase 2.70 -> 0.60 us, the kernel 8.95 -> 6.89 us for one launch.
    float4* s_part = reinterpret_cast<float4*>(spart);  // [warp][SP_SFRAG]
    float4* s_sum = s_part + SP_WARPS * SP_SFRAG;        // [SP_SFRAG]
#pragma unroll
    for (int nt = 0; nt < SP_KC / 8; ++nt)
      s_part[warp * SP_SFRAG + nt * 32 + lane] = make_float4(sc[nt][0], sc[nt][1], sc[nt][2], sc[nt][3]);
    __syncthreads();
    for (int i = threadIdx.x; i < SP_SFRAG; i += SP_THREADS) {
      float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int w = 0; w < SP_WARPS; ++w) {
        const float4 v = s_part[w * SP_SFRAG + i];
        sum.x += v.x; sum.y += v.y; sum.z += v.z; sum.w += v.w;
      }
      s_sum[i] = sum;
    }
    __syncthreads();
#pragma unroll
    for (int nt = 0; nt < SP_KC / 8; ++nt) {
      const float4 v = s_sum[nt * 32 + lane];
      sc[nt][0] = v.x; sc[nt][1] = v.y; sc[nt][2] = v.z; sc[nt][3] = v.w;
    }
    DS4_MARK(2);
    // ---- scale, mask, chunk max / sum per head row (g and g + 8)
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < SP_KC / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = nt * 8 + 2 * c + (e & 1);
        const float v = kval[j] ? sc[nt][e] * a.scale : -INFINITY;
        sc[nt][e] = v;
        if (e < 2) mx0 = fmaxf(mx0, v); else mx1 = fmaxf(mx1, v);
      }
    }
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
    }
    // the chunk has a valid key, so mx0, mx1 are finite. The block's running max M' = max(M, mx): the rows so far
    // are rescaled by exp(M - M') (0 at the first chunk, M = -inf), p = exp(s - M') (at one chunk per block, i.e.
    // a short context, exp(s - mx) as the one-chunk kernel had it)
    const float n0 = fmaxf(M0, mx0), n1 = fmaxf(M1, mx1);
    const float a0 = expf(M0 - n0), a1 = expf(M1 - n1);
    const bool fresh = M0 == -INFINITY;  // the block's first chunk with a valid key (M1 likewise)
    M0 = n0;
    M1 = n1;
    float l0 = 0.f, l1 = 0.f;
#pragma unroll
    for (int nt = 0; nt < SP_KC / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = expf(sc[nt][e] - (e < 2 ? n0 : n1));
        sc[nt][e] = p;
        if (e < 2) l0 += p; else l1 += p;
      }
    }
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
      l0 += __shfl_xor_sync(0xffffffffu, l0, o);
      l1 += __shfl_xor_sync(0xffffffffu, l1, o);
    }
    // ---- P (bf16) as A fragments: k-step kk covers keys 16kk .. 16kk+15 = n-tiles 2kk, 2kk+1
    uint32_t pa[SP_KC / 16][4];
#pragma unroll
    for (int kk = 0; kk < SP_KC / 16; ++kk) {
      pa[kk][0] = pack_bf16(sc[2 * kk][0], sc[2 * kk][1]);
      pa[kk][1] = pack_bf16(sc[2 * kk][2], sc[2 * kk][3]);
      pa[kk][2] = pack_bf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
      pa[kk][3] = pack_bf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
    }
    L0 = L0 * a0 + l0;
    L1 = L1 * a1 + l1;
    // ---- O += P V for this warp's 64-dim slices of the output, the block's rows rescaled first
    for (int db = warp * 64; db < D; db += SP_WARPS * 64) {
      float oc[8][4];  // SLICE (D = 512, one slice per warp): the block's rows, in registers across the chunks
      if constexpr (SLICE) {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          acc[nt][0] *= a0; acc[nt][1] *= a0; acc[nt][2] *= a1; acc[nt][3] *= a1;
        }
      } else {  // other D: the block's rows in its own opart slot (each thread reads back only what it wrote)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const int d = db + nt * 8 + 2 * c;
          const float2 o0 = fresh || h0 >= H ? make_float2(0.f, 0.f) : *reinterpret_cast<float2*>(orow0 + d);
          const float2 o1 = fresh || h1 >= H ? make_float2(0.f, 0.f) : *reinterpret_cast<float2*>(orow1 + d);
          oc[nt][0] = o0.x * a0; oc[nt][1] = o0.y * a0; oc[nt][2] = o1.x * a1; oc[nt][3] = o1.y * a1;
        }
      }
      float (&o)[8][4] = SLICE ? acc : oc;
#pragma unroll
      for (int kk = 0; kk < SP_KC / 16; ++kk) {
        const uint16_t* v0 = ks + (kk * 16 + 2 * c) * LD + db + g;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const uint16_t* vp = v0 + nt * 8;
          const uint32_t vb0 = pack_u16(vp[0], vp[LD]);
          const uint32_t vb1 = pack_u16(vp[8 * LD], vp[9 * LD]);
          mma16816(o[nt], pa[kk], vb0, vb1);
        }
      }
      if constexpr (!SLICE) {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const int d = db + nt * 8 + 2 * c;
          if (h0 < H) *reinterpret_cast<float2*>(orow0 + d) = make_float2(oc[nt][0], oc[nt][1]);
          if (h1 < H) *reinterpret_cast<float2*>(orow1 + d) = make_float2(oc[nt][2], oc[nt][3]);
        }
      }
    }
    __syncthreads();  // the next chunk's copies overwrite the keys and kval; S partials are reused
  }
  DS4_MARK(3);
  if (M0 == -INFINITY) {  // no valid key in any of the block's chunks: max = -inf and nothing else
    if (threadIdx.x < 16 && mt * 16 + threadIdx.x < H) {
      ml[(mlbase + mt * 16 + threadIdx.x) * 2 + 0] = -INFINITY;
      ml[(mlbase + mt * 16 + threadIdx.x) * 2 + 1] = 0.f;
    }
    return;
  }
  if (c == 0 && warp == 0) {
    if (h0 < H) { ml[(mlbase + h0) * 2] = M0; ml[(mlbase + h0) * 2 + 1] = L0; }
    if (h1 < H) { ml[(mlbase + h1) * 2] = M1; ml[(mlbase + h1) * 2 + 1] = L1; }
  }
  if constexpr (SLICE) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int d = warp * 64 + nt * 8 + 2 * c;
      if (h0 < H) *reinterpret_cast<float2*>(orow0 + d) = make_float2(acc[nt][0], acc[nt][1]);
      if (h1 < H) *reinterpret_cast<float2*>(orow1 + d) = make_float2(acc[nt][2], acc[nt][3]);
    }
  }
}

// One block per (head, row). Two dependent rounds of global loads, not one per split: every split's (max, sum)
// pair at once into shared memory (with the sink, the position and the RoPE frequency, which need nothing from
// it), then the partial outputs of the valid splits (max > -inf) together, CU per batch. Before, the splits'
// pairs were read in a loop (for M, then again beside each batch of partial outputs): at ~20 splits about 7
// dependent L2 round trips (H200, one launch at 20 valid splits: 7.86 -> 5.57 us, scripts/probe_phases.cu;
// experiments/decode_session24_h200.md). The arithmetic is the same, in the same order (splits in increasing
// order; an invalid split adds nothing), so the same bits.
// Shared memory: nsplit float2 pairs, then the valid splits' indices (sparse_combine_smem).
// ride (decode, one row per token): block (0, r)'s thread 0 finishes token r's mHC Sinkhorn (sinkhorn_dev.cuh)
// BEFORE the PDL wait, while the chunk kernel runs: comb was written by the attention site's hc finish, which
// has completed by then (this launch starts only after every chunk block passed its own wait, i.e. after the
// launch before the chunk kernel completed, and the finish comes earlier still), and comb is read only at the
// site's end (wo_b's hc fold epilogue or hc.post, launches after this one's completion).
__global__ void sparse_combine_kernel(const float* __restrict__ opart, const float* __restrict__ ml,
                                      const float* __restrict__ sink, int nsplit, int H, int D,
                                      const int64_t* __restrict__ pos, const float* __restrict__ freqs, int R,
                                      __nv_bfloat16* __restrict__ out, const ds4::SinkhornRide ride,
                                      bool early_trigger) {
  extern __shared__ float2 s_ml[];  // [nsplit] (max, sum) of each split, then int [nsplit]: the valid splits
  int* s_valid = reinterpret_cast<int*>(s_ml + nsplit);
  __shared__ int s_nvalid;
  ds4_pdl::release_early(early_trigger);  // (combine_trigger_early)
  if (ride.comb != nullptr && blockIdx.x == 0 && threadIdx.x == 0) ds4::sinkhorn_ride(ride, blockIdx.y);
  ds4_pdl::begin(early_trigger);
  const int h = blockIdx.x, r = blockIdx.y, lane = threadIdx.x & 31;
  const float2* mlh = reinterpret_cast<const float2*>(ml) + (long)r * nsplit * H + h;  // split c at mlh[c * H]
  for (int c = threadIdx.x; c < nsplit; c += blockDim.x) s_ml[c] = mlh[(long)c * H];
  const float sk = sink[h];
  const int d0 = threadIdx.x * 4;  // this thread's first 4 output dims
  const bool rot = R > 0 && d0 < D && d0 >= D - R;
  const float fpos = R > 0 ? (float)pos[r] : 0.f;  // for every thread: a later pass of d may reach the RoPE dims
  float fr[2] = {0.f, 0.f};
  if (rot) { fr[0] = freqs[(d0 - (D - R)) / 2]; fr[1] = freqs[(d0 + 2 - (D - R)) / 2]; }
  __syncthreads();
  if (threadIdx.x < 32) {  // the valid splits in increasing order (warp 0: a ballot per 32 splits)
    int n = 0;
    for (int c0 = 0; c0 < nsplit; c0 += 32) {
      const int c = c0 + lane;
      const bool v = c < nsplit && s_ml[c].x != -INFINITY;
      const unsigned b = __ballot_sync(0xffffffffu, v);
      if (v) s_valid[n + __popc(b & ((1u << lane) - 1u))] = c;
      n += __popc(b);
    }
    if (lane == 0) s_nvalid = n;
  }
  __syncthreads();
  const int nv = s_nvalid;
  float M = sk;
  for (int i = 0; i < nv; ++i) M = fmaxf(M, s_ml[s_valid[i]].x);
  float L = expf(sk - M);
  for (int i = 0; i < nv; ++i) {
    const float2 p = s_ml[s_valid[i]];
    L += p.y * expf(p.x - M);
  }
  const float inv = 1.f / L;
  constexpr int CU = 8;  // valid splits whose partial outputs are loaded together (one L2 round trip)
  for (int d = d0; d < D; d += blockDim.x * 4) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int i0 = 0; i0 < nv; i0 += CU) {
      float4 v[CU];
      float w[CU];
#pragma unroll
      for (int u = 0; u < CU; ++u) {
        w[u] = 0.f;
        v[u] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (i0 + u < nv) {
          const int c = s_valid[i0 + u];
          w[u] = expf(s_ml[c].x - M);
          v[u] = *reinterpret_cast<const float4*>(opart + (((long)r * nsplit + c) * H + h) * D + d);
        }
      }
#pragma unroll
      for (int u = 0; u < CU; ++u) {  // in split order, as one split at a time
        if (i0 + u >= nv) continue;
        acc.x += w[u] * v[u].x; acc.y += w[u] * v[u].y; acc.z += w[u] * v[u].z; acc.w += w[u] * v[u].w;
      }
    }
    float o4[4] = {bf16r(acc.x * inv), bf16r(acc.y * inv), bf16r(acc.z * inv), bf16r(acc.w * inv)};
    if (R > 0 && d >= D - R) {  // output de-rotation (spec §5.8): the bf16 output rotated by -angle
      const bool first = d == d0;  // the frequencies were loaded up front for the first dims
#pragma unroll
      for (int k = 0; k < 4; k += 2) {
        float sn, cs;
        sincosf(fpos * (first ? fr[k / 2] : freqs[(d + k - (D - R)) / 2]), &sn, &cs);
        const float x0 = o4[k], x1 = o4[k + 1];
        o4[k] = x0 * cs + x1 * sn;
        o4[k + 1] = x1 * cs - x0 * sn;
      }
    }
    __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(out + ((long)r * H + h) * D + d);
    o[0] = __floats2bfloat162_rn(o4[0], o4[1]);
    o[1] = __floats2bfloat162_rn(o4[2], o4[3]);
  }
}

// DS4_X_COMBINE's stand-in for the combine launch (launch_sparse_attn): the combine's grid, no loads and no
// arithmetic; each block zeroes its head's output row. Zeros, not nothing: an output left unwritten holds
// whatever the graph pool had there (NaN, e.g.), the decode's state turns NaN, the router's top-k then picks
// degenerate experts and the MoE's work changes with it (session 32: the earlier no-write form's tokens were all
// 0 after the first, and its timings moved by 10 us per layer from one process to the next).
__global__ void combine_zero_kernel(__nv_bfloat16* __restrict__ out, int H, int D) {
  ds4_pdl::begin();
  __nv_bfloat16* o = out + ((long)blockIdx.y * H + blockIdx.x) * D;
  for (int d = threadIdx.x * 8; d < D; d += blockDim.x * 8)
    *reinterpret_cast<uint4*>(o + d) = make_uint4(0u, 0u, 0u, 0u);
}

static size_t sparse_combine_smem(int nsplit) { return (size_t)nsplit * (sizeof(float2) + sizeof(int)); }

// A decode row's combine lets the next launch (the grouped wo_a GEMV) launch at its start, before its own PDL wait,
// instead of after it: wo_a's blocks then become resident, and load their first weight rounds, while the chunk kernel
// still runs (it holds a few SMs at a short context) rather than from the chunk kernel's end. Safe for any next launch
// that waits (PDL) before it reads: the combine's completion still implies the chunk kernel's (it waits for it before
// it exits). One H100, 7 interleaved pairs in two processes: 0.6-1.0 us per layer faster (120.9-121.5 against
// 121.8-122.3, experiments/session74.md). DS4_COMBINE_TRIGGER=wait (read per launch; the ablation, bench token noctrig)
// keeps the trigger after the wait.
static bool combine_trigger_early(const SparseArgs& a) {
  return a.pos != nullptr && a.S == 1 && ds4_pdl::trigger_early("DS4_COMBINE_TRIGGER", true);
}

cudaError_t launch_sparse_attn(const SparseArgs& a, int nsplit, float* opart, float* ml, void* out, cudaStream_t st,
                               const ds4::SinkhornRide& ride) {
  // DS4_X_COMBINE=1 (read per launch): the removal diagnostic xcombine of scripts/bench_decode.py, timing only
  // (WRONG outputs: zeros; no ride, which only the combine launch could take along): combine_zero_kernel in the
  // combine's place, so what the step loses is the combine's loads and arithmetic
  const char* xc = std::getenv("DS4_X_COMBINE");
  const bool xcombine = xc && xc[0] == '1';
  if (!ds4::sinkhorn_ride_ok(ride, a.B) || (ride.comb != nullptr && (a.pos == nullptr || a.S != 1 || xcombine)))
    return cudaErrorInvalidValue;
  if (a.D < 64 || a.D % 64 || a.H < 1 || a.B < 1 || a.S < 1 || nsplit < 1) return cudaErrorInvalidValue;
  if ((long)a.B * a.S > 65535 || a.H > 65535) return cudaErrorInvalidValue;
  if (a.P > 0 && (a.sel == nullptr || (a.pos == nullptr && a.sel_valid == nullptr))) return cudaErrorInvalidValue;
  if (a.pos != nullptr && (a.S != 1 || a.ratio < 1)) return cudaErrorInvalidValue;
  if (a.R < 0 || a.R % 4 || a.R > a.D || (a.R > 0 && (a.pos == nullptr || a.freqs == nullptr)))
    return cudaErrorInvalidValue;
  if (a.q_prep && (a.pos == nullptr || a.R > SP_MAX_ROPE)) return cudaErrorInvalidValue;
  const size_t smem = sparse_smem(a.D);
  if (smem > 200 * 1024) return cudaErrorInvalidValue;
  auto chunk = a.D == SP_WARPS * 64 ? sparse_chunk_kernel<true> : sparse_chunk_kernel<false>;
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(chunk, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
  }
  const char* ea = std::getenv("DS4_ATTN_EARLY");  // (the kernel's `early`; read per launch, opt-in)
  const bool early = a.pos != nullptr && a.S == 1 && ea && ea[0] == '1';
  cudaError_t e = ds4_pdl::launch(chunk, dim3(nsplit, (a.H + 15) / 16, a.B * a.S), dim3(SP_THREADS), smem, st, a,
                                  nsplit, opart, ml, early);
  if (e != cudaSuccess) return e;
  const int threads = a.D / 4 < 32 ? 32 : (a.D / 4 < 128 ? a.D / 4 : 128);  // warp 0 whole (its ballots)
  if (xcombine)
    return ds4_pdl::launch(combine_zero_kernel, dim3(a.H, a.B * a.S), dim3(threads), 0, st,
                           static_cast<__nv_bfloat16*>(out), a.H, a.D);
  const size_t csmem = sparse_combine_smem(nsplit);
  if (csmem > 200 * 1024) return cudaErrorInvalidValue;
  if (csmem > 48 * 1024) {
    e = cudaFuncSetAttribute(sparse_combine_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)csmem);
    if (e != cudaSuccess) return e;
  }
  return ds4_pdl::launch(sparse_combine_kernel, dim3(a.H, a.B * a.S), dim3(threads), csmem, st,
                         static_cast<const float*>(opart), static_cast<const float*>(ml), a.sink, nsplit, a.H, a.D,
                         a.pos, a.freqs, a.R, static_cast<__nv_bfloat16*>(out), ride, combine_trigger_early(a));
}

}  // namespace ds4_attn
