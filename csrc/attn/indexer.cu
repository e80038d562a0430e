// Lightning-indexer scores for decode (spec §5.5): out[r, t] = sum_h w[r, h] ReLU(q[r, h] . k[t]), with
// w[r, h] = w_scale * (fp32 or bf16 head weights): the bf16 form takes weights_proj's bf16 output as it
// is, so the scale (d^-0.5 H^-0.5) is applied here and not by two elementwise launches before.
// Chunks of IX_KC = 64 keys: a chunk's keys are loaded once into shared memory and serve all H heads through
// BF16 mma.sync m16n8k16 (one warp per 16-head tile, fp32 accumulation); ReLU, the head weight and the sum over
// the tile's 16 heads happen in registers + quad shuffles, the sum over tiles in a fixed order through shared
// memory (deterministic). Keys are split over blocks so a long cache spreads over the whole GPU: one chunk per
// block up to IX_BLOCKS_PER_SM blocks per SM, beyond that each block loops over chunks (keys double-buffered, q
// staged once). With decode positions, entries not yet visible score -inf inside the kernel (no mask ops before
// the top-k) and their chunks are skipped.
// DS4_MARKs (scripts/probe_phases.cu indexer): 0 start, 1 thread 0's first key copies issued, 2 q copies issued +
// RoPE table, 3 q rotated in place, 4 a chunk's keys landed, 5 its scores done, 6 written (the last chunk's).
// With rope_freqs (decode): q arrives before its RoPE; each block stages the row's q in shared memory
// with the interleaved RoPE of its last R dims at pos applied as head_rope (norm off) applies it, and with q_fp4
// (numerics=qat) the reference's Hadamard + FP4 simulation after it, so the indexer query needs no launch of its own
// between its projection and this kernel.
#include <algorithm>
#include <cstdlib>

#include "attn_common.cuh"
#include "attn_launch.h"

namespace ds4_attn {

constexpr int IX_KC = 64;
constexpr int IX_WARPS = 4;
constexpr int IX_THREADS = IX_WARPS * 32;
constexpr int IX_MAX_ROPE = 256;  // RoPE dims the in-kernel q staging takes
constexpr int IX_BLOCKS_PER_SM = 4;  // the grid's cap (per row: / rows): 4 blocks of <= 52 KB fit an SM at d = 128

// Scores of one 64-key chunk from the keys staged at ks (rows t0 .. t0 + 63; rows past tlim score -inf), q at qr
// (ld qld; GQ: read from global memory) -> out. red: [IX_WARPS][IX_KC] partial sums.
template <bool GQ>
__device__ __forceinline__ void indexer_chunk(const uint16_t* ks, int LD, const uint16_t* qr, int qld, int H, int d,
                                              int T, int tlim, int t0, long r, const void* w, bool w_bf16,
                                              float w_scale, bool bf16, bool out_f32, float (&red)[IX_WARPS][IX_KC],
                                              void* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  auto head_w = [&](int h) {  // the reference's order: fp32 of the (bf16) weight, times the scale
    if (h >= H) return 0.f;
    const long i = r * H + h;
    return (w_bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(w)[i]) : static_cast<const float*>(w)[i]) *
           w_scale;
  };
  const int mtiles = (H + 15) / 16;
  float part[IX_KC / 8][2];
#pragma unroll
  for (int nt = 0; nt < IX_KC / 8; ++nt) part[nt][0] = part[nt][1] = 0.f;
  for (int mt = warp; mt < mtiles; mt += IX_WARPS) {
    float sc[IX_KC / 8][4];
#pragma unroll
    for (int nt = 0; nt < IX_KC / 8; ++nt) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
    for (int k0 = 0; k0 < d; k0 += 16) {
      uint32_t af[4];
      load_a_rows<GQ>(af, qr, qld, mt * 16, H, k0, lane);
#pragma unroll
      for (int nt = 0; nt < IX_KC / 8; ++nt) {
        const uint16_t* kr = ks + (nt * 8 + g) * LD + k0 + 2 * c;
        mma16816(sc[nt], af, *reinterpret_cast<const uint32_t*>(kr), *reinterpret_cast<const uint32_t*>(kr + 8));
      }
    }
    const int h0 = mt * 16 + g, h1 = h0 + 8;
    float w0 = head_w(h0), w1 = head_w(h1);
    if (bf16) { w0 = bf16r(w0); w1 = bf16r(w1); }
#pragma unroll
    for (int nt = 0; nt < IX_KC / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float s0 = sc[nt][e], s1 = sc[nt][2 + e];
        float v;
        if (bf16)
          v = bf16r(fmaxf(bf16r(s0), 0.f) * w0) + bf16r(fmaxf(bf16r(s1), 0.f) * w1);
        else
          v = fmaxf(s0, 0.f) * w0 + fmaxf(s1, 0.f) * w1;
        // sum over the 8 row groups g (lanes c, c+4, ..., c+28)
        v += __shfl_xor_sync(0xffffffffu, v, 4);
        v += __shfl_xor_sync(0xffffffffu, v, 8);
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        part[nt][e] += v;
      }
    }
  }
  DS4_MARK(5);
  if (g == 0) {  // every warp writes its 64 sums (zeros for a warp without a head tile)
#pragma unroll
    for (int nt = 0; nt < IX_KC / 8; ++nt) {
      red[warp][nt * 8 + 2 * c] = part[nt][0];
      red[warp][nt * 8 + 2 * c + 1] = part[nt][1];
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < IX_KC; j += IX_THREADS) {
    if (t0 + j >= T) continue;
    float v = 0.f;
#pragma unroll
    for (int w2 = 0; w2 < IX_WARPS; ++w2) v += red[w2][j];
    if (t0 + j >= tlim) v = -INFINITY;
    const long o = r * T + t0 + j;
    if (bf16 && !out_f32)
      static_cast<__nv_bfloat16*>(out)[o] = __float2bfloat16(v);
    else
      static_cast<float*>(out)[o] = bf16 ? bf16r(v) : v;  // (out_f32: the bf16 score's value, as its cast gives)
  }
  DS4_MARK(6);
}

// Block (x, row r) scores the chunks x, x + gridDim.x, ... of row r (gridDim.x = the chunks, or fewer on a long
// cache: launch_indexer_scores). The row's q is staged once per block (with its RoPE), the chunks' keys double-
// buffered: chunk i + 1's copies fly while chunk i is scored. Chunks past the visible entries are written -inf
// without loading anything.
__global__ void __launch_bounds__(IX_THREADS) indexer_kernel(const uint16_t* __restrict__ q,
                                                             const void* __restrict__ w, bool w_bf16, float w_scale,
                                                             const uint16_t* __restrict__ keys, long k_b, long k_r,
                                                             int S, int H, int d, int T, bool bf16, bool out_f32,
                                                             const int64_t* __restrict__ pos, int ratio,
                                                             const float* __restrict__ rope_freqs, int R, void* out,
                                                             int skip_k, bool q_fp4) {
  DS4_MARK(0);
  ds4_pdl::begin();
  extern __shared__ __align__(16) uint16_t ks[];   // [2][IX_KC][d + 8] keys, then (rope_freqs) [H][d + 8] q
  __shared__ float red[IX_WARPS][IX_KC];
  __shared__ float2 s_rot[IX_MAX_ROPE / 2];
  const int r = blockIdx.y;
  const int b = r / S;
  const int LD = d + 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int vpr = d / 8;
  // visible keys: all T, or with positions the complete entries t < (pos + 1) / ratio; invisible ones
  // score -inf (and are never loaded: a long preallocated cache costs nothing beyond the context)
  const long tl = pos ? (pos[b] + 1) / ratio : (long)T;
  // skip_k (indexer_select): this row's scores are read by a top-k of skip_k that, while at most skip_k entries
  // are visible, selects all of them without reading a score (topk.cu: n = max(k, visible) == k); they are then
  // left unwritten
  if (skip_k > 0 && pos != nullptr && T >= skip_k && tl <= skip_k) return;
  const int tlim = tl < T ? (int)tl : T;
  const int nch = (T + IX_KC - 1) / IX_KC, nvis = (tlim + IX_KC - 1) / IX_KC;  // chunks, chunks with a visible key
  for (int ch = blockIdx.x + (nvis - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x * (int)gridDim.x;
       ch < nch; ch += gridDim.x) {  // this block's invisible chunks (the first one at or past nvis)
    const int t0 = ch * IX_KC;
    for (int j = threadIdx.x; j < IX_KC && t0 + j < T; j += IX_THREADS) {
      const long o = (long)r * T + t0 + j;
      if (bf16 && !out_f32)
        static_cast<__nv_bfloat16*>(out)[o] = __float2bfloat16(-INFINITY);
      else
        static_cast<float*>(out)[o] = -INFINITY;
    }
  }
  if ((int)blockIdx.x >= nvis) return;
  // every copy of a chunk's keys goes out before any lands (cp.async: no register per copy; keys past the visible
  // ones zero-filled): a load-then-store loop waited one round trip per trip
  auto issue = [&](int ch, uint16_t* buf) {
    const int t0 = ch * IX_KC;
    for (int i = threadIdx.x; i < IX_KC * vpr; i += IX_THREADS) {
      const int j = i / vpr, v = i % vpr;
      const bool ok = t0 + j < tlim;
      cp_async16_zfill(buf + j * LD + v * 8, keys + (long)b * k_b + (long)(ok ? t0 + j : t0) * k_r + v * 8, ok);
    }
  };
  auto kbuf = [&](int i) { return ks + (i & 1) * IX_KC * LD; };  // (an array of the two indexed by i: a stack frame)
  issue(blockIdx.x, kbuf(0));
  cp_async_commit();
  DS4_MARK(1);
  const uint16_t* qr = q + (long)r * H * d;
  int qld = d;
  if (rope_freqs) {  // q [H][d] -> shared memory with RoPE at pos[b] (fp32 rotation of the bf16 values, rounded)
    // q's copies go out beside the keys' (cp.async), the RoPE table is computed while they fly, then
    // each warp rotates its heads' last R dims in place, a lane per pair. (Staging through registers
    // with per-chunk index arithmetic took ~3 us: one block per SM hides no latency.)
    uint16_t* qs = ks + 2 * IX_KC * LD;
    for (int i = threadIdx.x; i < H * vpr; i += IX_THREADS) {
      const int h = i / vpr, v = i - h * vpr;
      cp_async16_zfill(qs + h * LD + v * 8, qr + (long)h * d + v * 8, true);
    }
    cp_async_commit();
    const float fpos = (float)pos[b];
    for (int i = threadIdx.x; i < R / 2; i += IX_THREADS) {
      float sn, cs;
      sincosf(fpos * rope_freqs[i], &sn, &cs);
      s_rot[i] = make_float2(cs, sn);
    }
    DS4_MARK(2);
    cp_async_wait_all();
    __syncthreads();
    for (int h = warp; h < H; h += IX_WARPS) {
      uint32_t* qh = reinterpret_cast<uint32_t*>(qs + h * LD + (d - R));
      for (int i = lane; i < R / 2; i += 32) {
        const float2 rt = s_rot[i];
        const uint32_t wv = qh[i];
        const float a = __uint_as_float(wv << 16), bb = __uint_as_float(wv & 0xffff0000u);
        const __nv_bfloat162 y = __floats2bfloat162_rn(a * rt.x - bb * rt.y, a * rt.y + bb * rt.x);
        qh[i] = *reinterpret_cast<const uint32_t*>(&y);
      }
      if (q_fp4) {  // numerics=qat: the reference's Hadamard + FP4 of the rotated head (its lanes read other lanes' pairs)
        __syncwarp();
        hadamard_fp4_row(qs + h * LD, qs + h * LD, d, lane);
      }
    }
    qr = qs;
    qld = LD;
    DS4_MARK(3);
  } else {
    DS4_MARK(2);
    DS4_MARK(3);
  }
  int i = 0;
  for (int ch = blockIdx.x; ch < nvis; ch += gridDim.x, ++i) {
    const int next = ch + gridDim.x;
    if (next < nvis) issue(next, kbuf(i + 1));  // into the buffer the previous chunk left (barrier below)
    cp_async_commit();                                 // (an empty group at the last chunk)
    cp_async_wait<1>();                          // this chunk's keys (and q) landed
    __syncthreads();
    DS4_MARK(4);
    if (rope_freqs)
      indexer_chunk<false>(kbuf(i), LD, qr, qld, H, d, T, tlim, ch * IX_KC, r, w, w_bf16, w_scale, bf16, out_f32, red,
                            out);
    else
      indexer_chunk<true>(kbuf(i), LD, qr, qld, H, d, T, tlim, ch * IX_KC, r, w, w_bf16, w_scale, bf16, out_f32, red,
                            out);
    __syncthreads();  // red and this chunk's buffer are free again
  }
}

cudaError_t launch_indexer_scores(const void* q, const void* w, bool w_bf16, float w_scale, const void* keys, long k_b,
                                  long k_r, int B, int S, int H, int d, int T, bool bf16, const int64_t* pos, int ratio,
                                  const float* rope_freqs, int R, void* out, cudaStream_t st, int skip_k,
                                  bool q_fp4, bool out_f32) {
  if (out_f32 && !bf16) return cudaErrorInvalidValue;
  if (skip_k < 0 || (skip_k > 0 && pos == nullptr)) return cudaErrorInvalidValue;
  if (q_fp4 && (rope_freqs == nullptr || !hadamard_fp4_ok(d))) return cudaErrorInvalidValue;
  if (d < 16 || d % 16 || H < 1 || B < 1 || S < 1 || (long)B * S > 65535) return cudaErrorInvalidValue;
  if (pos != nullptr && (S != 1 || ratio < 1)) return cudaErrorInvalidValue;
  if (rope_freqs != nullptr && (pos == nullptr || R < 2 || R % 2 || R > d || R > IX_MAX_ROPE))
    return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  const size_t smem = (size_t)(2 * IX_KC + (rope_freqs ? H : 0)) * (d + 8) * sizeof(uint16_t);
  if (smem > 200 * 1024) return cudaErrorInvalidValue;
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(indexer_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
  }
  // One chunk per block up to IX_BLOCKS_PER_SM blocks per SM over the rows; longer caches loop over chunks in those
  // blocks, which stage q once. Session 44 (H200, 8-layer step at position 1048000): one block per chunk (4096 per
  // row) charged the kernel 63 us per CSA layer for its 67 MB of keys, each block also loading and rotating q.
  // DS4_INDEXER_BLOCKS_PER_SM (read per launch; the ablation) replaces IX_BLOCKS_PER_SM.
  const int chunks = (T + IX_KC - 1) / IX_KC, rows = B * S;
  const char* env = std::getenv("DS4_INDEXER_BLOCKS_PER_SM");
  const int per_sm = env ? std::max(1, std::atoi(env)) : IX_BLOCKS_PER_SM;
  const int cap = std::max(1, per_sm * attn_sm_count() / rows);
  dim3 grid(std::min(chunks, cap), rows);
  return ds4_pdl::launch(indexer_kernel, grid, dim3(IX_THREADS), smem, st, static_cast<const uint16_t*>(q), w, w_bf16,
                         w_scale, static_cast<const uint16_t*>(keys), k_b, k_r, S, H, d, T, bf16, out_f32, pos, ratio,
                         rope_freqs, R, out, skip_k, q_fp4);
}

}  // namespace ds4_attn
