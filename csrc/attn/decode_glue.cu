// The small per-token steps between the big decode kernels, one launch each (spec §5.1-§5.4, §5.8):
//   rms_norm_kernel      weighted RMSNorm of bf16 rows (fp32 math, the reference's F.rms_norm).
//   head_rope_kernel     per-head unweighted RMSNorm (optional) + interleaved RoPE of the last R dims
//                        at the row's device position: the query path and the indexer query.
//   kv_store_kernel      window KV: kv_norm, RoPE, (qat) FP8 simulation of the nope dims, write into
//                        the ring slot pos % W.
//   compress_step_kernel compressor decode step: write the token's kv / gate score (+ape) into the
//                        state; on the step that completes an entry ((pos+1) % m == 0, decided per row
//                        on the device) pool it (per-channel softmax over the window's slots), norm,
//                        RoPE at the entry's first position, (qat) FP8 nope, write cache[pos // m], and
//                        for the overlapped CSA compressor move the current slots to "previous".
//                        With deferred projections (tokens > 1) it writes the group's tokens on the step
//                        that completes the group, and does nothing on the others. A thread per column;
//                        what does not need the projection is loaded before the PDL wait (see the kernel).
// Positions are int64 device tensors; angles are fp32 pos * f as torch.polar's, with accurate
// sincosf (no fast-math anywhere). Values are rounded to bf16 where the reference rounds.

#include "../act_quant.cuh"  // the entries' FP8 simulation: numerics=qat's act_quant_sim arithmetic
#include "../rmsnorm_dev.cuh"
#include "attn_common.cuh"
#include "attn_launch.h"

namespace ds4_attn {

constexpr int GLUE_THREADS = 256;
constexpr int GLUE_WARPS = GLUE_THREADS / 32;

__device__ __forceinline__ float block_sum(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  __syncthreads();  // red may still be read by a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = 0.f;
  for (int w = 0; w < nw; ++w) t += red[w];  // fixed order: same value in every thread
  return t;
}

__device__ __forceinline__ float wload(const void* w, bool w_f32, int i) { return ld_as_float(w, i, w_f32); }

// The constants of finish_entry, formed before the PDL wait (weights, and positions: see compress_step_kernel):
// wt[c] = the norm weight as fp32, trig[2i], trig[2i + 1] = cos, sin of position * freqs[i] (the last R dims). The
// block's later __syncthreads (finish_entry's block_sum) publishes them. Off the chain after the wait, where each
// dependent load is an L2 round trip (long beside a weight stream).
__device__ void prep_entry(float* wt, float* trig, int w, const void* weight, bool w_f32, long position,
                           const float* freqs, int R) {
  for (int c = threadIdx.x; c < w; c += blockDim.x) wt[c] = wload(weight, w_f32, c);
  const float fpos = (float)position;
  for (int i = threadIdx.x; i < R / 2; i += blockDim.x) {
    float sn, cs;
    sincosf(fpos * freqs[i], &sn, &cs);
    trig[2 * i] = cs;
    trig[2 * i + 1] = sn;
  }
}

// finish_entry's qat simulation (ds4.model.compressor.finish_entry's quant): none, FP8 of the nope dims (the
// attention's window and compressed entries), or Hadamard + FP4 of the whole entry (the indexer's keys)
enum EntryQuant : int { QUANT_NONE = 0, QUANT_FP8_NOPE = 1, QUANT_HADAMARD_FP4 = 2 };

// Finish one cache / window entry held in shared memory (v[0..w), fp32 values of bf16 numbers), with wt / trig
// from prep_entry: y = bf16(rms_norm(v) * weight); RoPE the last R dims; then quant: FP8-simulate dims [0, w-R) in
// blocks of 64, or the Hadamard + FP4 simulation of all w (hadamard_fp4_ok(w): one warp); write bf16 to dst. Whole
// block; v is overwritten.
__device__ void finish_entry(float* v, int w, const float* wt, const float* trig, float eps, int R, int quant,
                             __nv_bfloat16* dst, float* red) {
  float ss = 0.f;
  for (int c = threadIdx.x; c < w; c += blockDim.x) ss += v[c] * v[c];
  const float r = rsqrtf(block_sum(ss, red) / (float)w + eps);
  for (int c = threadIdx.x; c < w; c += blockDim.x) v[c] = bf16r(v[c] * r * wt[c]);
  __syncthreads();
  for (int i = threadIdx.x; i < R / 2; i += blockDim.x) {
    const int j = w - R + 2 * i;
    const float cs = trig[2 * i], sn = trig[2 * i + 1];
    const float a = v[j], b = v[j + 1];
    v[j] = bf16r(a * cs - b * sn);
    v[j + 1] = bf16r(a * sn + b * cs);
  }
  __syncthreads();
  if (quant == QUANT_HADAMARD_FP4) {  // fp4_act_quant_sim(hadamard(c), 32): the entry is one row of one warp
    if (threadIdx.x < 32) hadamard_fp4_row(v, v, w, threadIdx.x);
    __syncthreads();
  }
  if (quant == QUANT_FP8_NOPE) {  // act_quant_sim(c[..., :w-R], 64): one warp per block of 64 dims
    const int nope = w - R, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (int blk = threadIdx.x >> 5; blk * 64 < nope; blk += nw) {
      const int c0 = blk * 64 + lane, c1 = c0 + 32;
      const float a0 = c0 < nope ? v[c0] : 0.f, a1 = c1 < nope ? v[c1] : 0.f;
      float amax = fmaxf(fabsf(a0), fabsf(a1));
      for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      const ds4::Pow2Scale s = ds4::pow2_scale_of_exp(ds4::act_quant_exp(amax));  // act_quant_sim's (act_quant.cuh)
      if (c0 < nope) v[c0] = bf16r(ds4::act_quant_value(a0, s));
      if (c1 < nope) v[c1] = bf16r(ds4::act_quant_value(a1, s));
    }
    __syncthreads();
  }
  for (int c = threadIdx.x; c < w; c += blockDim.x) dst[c] = __float2bfloat16(v[c]);
}

// 8 bf16 per 16-byte vector, up to NORM_VPT vectors per thread held in registers between the two passes
constexpr int NORM_VPT = 4;

// D % 8 == 0 and D <= 8 * GLUE_THREADS * NORM_VPT: one pass of 16-byte loads, values kept in registers.
__global__ void __launch_bounds__(GLUE_THREADS) rms_norm_vec_kernel(const uint4* __restrict__ x,
                                                                    const void* __restrict__ weight, bool w_f32,
                                                                    int D, float eps, uint4* __restrict__ out) {
  ds4_pdl::begin();
  __shared__ float red[GLUE_WARPS];
  const int nvec = D / 8;
  const long base = (long)blockIdx.x * nvec;
  uint4 v[NORM_VPT];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < NORM_VPT; ++i) {
    const int j = threadIdx.x + i * GLUE_THREADS;
    if (j < nvec) {
      v[i] = x[base + j];
      ss = ds4_norm::sumsq8(v[i], ss);
    }
  }
  const float r = rsqrtf(block_sum(ss, red) / (float)D + eps);
#pragma unroll
  for (int i = 0; i < NORM_VPT; ++i) {
    const int j = threadIdx.x + i * GLUE_THREADS;
    if (j < nvec) {
      float w[8];
      ds4_norm::load8_weight(weight, w_f32, j * 8, w);
      out[base + j] = ds4_norm::scale8(v[i], r, w);
    }
  }
}

__global__ void __launch_bounds__(GLUE_THREADS) rms_norm_kernel(const __nv_bfloat16* __restrict__ x,
                                                                const void* __restrict__ weight, bool w_f32, int D,
                                                                float eps, __nv_bfloat16* __restrict__ out) {
  ds4_pdl::begin();
  __shared__ float red[GLUE_WARPS];
  const long base = (long)blockIdx.x * D;
  float ss = 0.f;
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    const float v = __bfloat162float(x[base + c]);
    ss += v * v;
  }
  const float r = rsqrtf(block_sum(ss, red) / (float)D + eps);
  for (int c = threadIdx.x; c < D; c += blockDim.x)
    out[base + c] = __float2bfloat16(__bfloat162float(x[base + c]) * r * wload(weight, w_f32, c));
}

// Block (head, row): optional unweighted RMS (x * bf16(rsqrt(mean(x^2) + eps)), rounded to bf16), then RoPE.
__global__ void __launch_bounds__(128) head_rope_kernel(const __nv_bfloat16* __restrict__ x, const int64_t* __restrict__ pos,
                                                        const float* __restrict__ freqs, int H, int D, int R, bool norm,
                                                        float eps, __nv_bfloat16* __restrict__ out) {
  ds4_pdl::begin();
  extern __shared__ float hv[];  // [D]
  __shared__ float red[4];
  const int h = blockIdx.x, r = blockIdx.y;
  const long base = ((long)r * H + h) * D;
  float ss = 0.f;
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    const float v = __bfloat162float(x[base + c]);
    hv[c] = v;
    ss += v * v;
  }
  if (norm) {
    const float rb = bf16r(rsqrtf(block_sum(ss, red) / (float)D + eps));
    for (int c = threadIdx.x; c < D; c += blockDim.x) hv[c] = bf16r(hv[c] * rb);
  }
  __syncthreads();
  const float fpos = (float)pos[r];
  for (int i = threadIdx.x; i < R / 2; i += blockDim.x) {
    const int j = D - R + 2 * i;
    float sn, cs;
    sincosf(fpos * freqs[i], &sn, &cs);
    const float a = hv[j], b = hv[j + 1];
    hv[j] = a * cs - b * sn;
    hv[j + 1] = a * sn + b * cs;
  }
  __syncthreads();
  for (int c = threadIdx.x; c < D; c += blockDim.x) out[base + c] = __float2bfloat16(hv[c]);
}

// numerics=qat's Hadamard + FP4 simulation of rows of d values (attn_common.cuh hadamard_fp4_row): a warp per row.
// The indexer's prompt query (its decode query gets it in the scores kernel's q staging).
constexpr int HFP4_THREADS = 128;

__global__ void __launch_bounds__(HFP4_THREADS) hadamard_fp4_kernel(const uint16_t* __restrict__ x,
                                                                   uint16_t* __restrict__ out, long N, int d) {
  ds4_pdl::begin();
  const long r = (long)blockIdx.x * (HFP4_THREADS / 32) + (threadIdx.x >> 5);
  if (r >= N) return;  // (a whole warp: the butterfly's shuffles need all 32 lanes)
  hadamard_fp4_row(x + r * d, out + r * d, d, threadIdx.x & 31);
}

__global__ void __launch_bounds__(GLUE_THREADS) kv_store_kernel(const __nv_bfloat16* __restrict__ kv,
                                                                const void* __restrict__ weight, bool w_f32,
                                                                const int64_t* __restrict__ pos,
                                                                const float* __restrict__ freqs, int D, int R,
                                                                float eps, bool fp8_nope, __nv_bfloat16* win,
                                                                long win_b, int W) {
  extern __shared__ float ev[];  // [D] entry, [D] norm weight, [R] RoPE cos / sin
  __shared__ float red[GLUE_WARPS];
  const int r = blockIdx.x;
  const long p = pos[r];  // before the wait, as compress_step_kernel's
  prep_entry(ev + D, ev + 2 * D, D, weight, w_f32, p, freqs, R);
  ds4_pdl::begin();
  for (int c = threadIdx.x; c < D; c += blockDim.x) ev[c] = __bfloat162float(kv[(long)r * D + c]);
  __syncthreads();
  finish_entry(ev, D, ev + D, ev + 2 * D, eps, R, fp8_nope ? QUANT_FP8_NOPE : QUANT_NONE, win + r * win_b + (p % W) * D,
               red);
}

// compress_step_kernel: thread c owns column c of the entry (and, overlapped, state column w + c: the projection's
// second half), for every slot, so it reads only state it wrote itself (no block barrier before the pool). Where a
// window fits in registers (m <= CS_M, w <= COMPRESS_THREADS) every load that does not need the projection is issued
// before the PDL wait: the state slots this step does not write (written by an earlier step's launch), ape, the norm
// weight, the RoPE angles and the position (written at the decode step's start, as gemv_deferred_kernel reads it;
// each kernel waits for its predecessor before it lets its successor launch, so everything before has completed).
// After the wait only the projection's values are loaded: one round of loads, where the former form (256 threads
// striding the values, a barrier, the pool reading the state back) took several dependent L2 round trips beside
// wq_b's weight stream (14-17 us for a deferred step of 4 tokens, 3.4-3.7 us for one token: H200, sessions 37-38).
// Longer windows (HCA) and wider entries loop over columns after the wait.
// CS_M (4 or 8): the register form for windows of at most CS_M slots (m <= CS_M, w <= COMPRESS_THREADS: launch
// picks it); 0: the loop. A kernel per form, so the short windows' registers are not the longer ones'.
constexpr int COMPRESS_THREADS = 512;

template <int CS_M>
__global__ void __launch_bounds__(COMPRESS_THREADS) compress_step_kernel(CompressArgs a) {
  extern __shared__ float pv[];  // [w] pooled entry, [w] norm weight, [R] RoPE cos / sin
  __shared__ float red[32];
  const int r = blockIdx.x;
  const long p = a.pos[r];  // before the wait (above)
  const int m = a.m, w = a.w, cw = a.overlap ? 2 * w : w;  // cw: state / projection width
  const int nt = a.tokens;
  // deferred projections (tokens > 1): they exist only on the step that completes their group (the others wrote
  // nothing); a group never spans two windows (tokens divides m), so no slot is read before it is written
  if (nt > 1 && (p + 1) % nt != 0) {
    ds4_pdl::begin();
    return;
  }
  const bool complete = (p + 1) % m == 0;  // else the entry stays invisible to every reader until it completes
  float* skv = a.skv + (long)r * a.state_b;  // [slots, cw]
  float* ssc = a.ssc + (long)r * a.state_b;
  // Token i (position p - nt + 1 + i, phase ph0 + i) is kvz row r * nt + i = [kv (cw) | z (cw)]; its state slot is
  // off + ph0 + i. ph0 >= 0: the group ends at p, inside its window.
  const float* kvz = a.kvz + (long)r * nt * 2 * cw;
  const int ph0 = (int)(p % m) - nt + 1;
  const int off = a.overlap ? m : 0;
  float* wt = pv + w;
  float* trig = wt + w;
  if (complete) prep_entry(wt, trig, w, a.norm, a.norm_f32, (p / m) * m, a.freqs, a.R);
  // the pool: one softmax over the window's slots (2m when overlapped: the previous window's lower half, then this
  // window's upper half), max first, then sum exp * kv, like torch's softmax then (kv * p).sum
  if constexpr (CS_M > 0) {
    const int c = threadIdx.x;
    const bool on = c < w;
    // slot j of this window: a = column c, b = column w + c (overlapped); prev = the previous window, column c
    float akv[CS_M], asc[CS_M], bkv[CS_M], bsc[CS_M], pkv[CS_M], psc[CS_M];
#pragma unroll
    for (int j = 0; j < CS_M; ++j) {
      if (!on || j >= m) continue;
      const long s = (long)(off + j) * cw + c;
      if (j >= ph0 && j < ph0 + nt) {  // a token of this step: its ape now, its projection after the wait
        asc[j] = a.ape[(long)j * cw + c];
        if (a.overlap) bsc[j] = a.ape[(long)j * cw + w + c];
      } else if (complete) {
        akv[j] = skv[s], asc[j] = ssc[s];
        if (a.overlap) bkv[j] = skv[s + w], bsc[j] = ssc[s + w];
      }
      if (complete && a.overlap) pkv[j] = skv[(long)j * cw + c], psc[j] = ssc[(long)j * cw + c];
    }
    ds4_pdl::begin();
#pragma unroll
    for (int j = 0; j < CS_M; ++j) {
      if (!on || j < ph0 || j >= ph0 + nt) continue;
      const float* t = kvz + (long)(j - ph0) * 2 * cw;
      akv[j] = t[c], asc[j] = t[cw + c] + asc[j];
      if (a.overlap) bkv[j] = t[w + c], bsc[j] = t[cw + w + c] + bsc[j];
    }
#pragma unroll
    for (int j = 0; j < CS_M; ++j) {
      if (!on || j < ph0 || j >= ph0 + nt) continue;
      const long s = (long)(off + j) * cw + c;
      skv[s] = akv[j], ssc[s] = asc[j];
      if (a.overlap) skv[s + w] = bkv[j], ssc[s + w] = bsc[j];
    }
    if (!complete) return;
    if (on) {
      float mx = -INFINITY, den = 0.f, num = 0.f;
#pragma unroll
      for (int j = 0; j < CS_M; ++j)
        if (j < m) mx = a.overlap ? fmaxf(mx, psc[j]) : fmaxf(mx, asc[j]);
      if (a.overlap) {
#pragma unroll
        for (int j = 0; j < CS_M; ++j)
          if (j < m) mx = fmaxf(mx, bsc[j]);
      }
#pragma unroll
      for (int j = 0; j < CS_M; ++j)
        if (j < m) {
          const float e = expf((a.overlap ? psc[j] : asc[j]) - mx);
          den += e;
          num += (a.overlap ? pkv[j] : akv[j]) * e;
        }
      if (a.overlap) {
#pragma unroll
        for (int j = 0; j < CS_M; ++j)
          if (j < m) {
            const float e = expf(bsc[j] - mx);
            den += e;
            num += bkv[j] * e;
          }
      }
      pv[c] = bf16r(num / den);
      if (a.overlap) {  // window complete: this window's slots become the previous window (both column halves)
#pragma unroll
        for (int j = 0; j < CS_M; ++j)
          if (j < m) {
            const long d = (long)j * cw + c;
            skv[d] = akv[j], skv[d + w] = bkv[j], ssc[d] = asc[j], ssc[d + w] = bsc[j];
          }
      }
    }
  } else {
    ds4_pdl::begin();
    constexpr int WU = 8;  // a loop's loads issued together before any is used
    for (int c = threadIdx.x; c < w; c += blockDim.x) {
      for (int i0 = 0; i0 < nt; i0 += WU) {
        float k0[WU], z0[WU], k1[WU], z1[WU];
#pragma unroll
        for (int u = 0; u < WU; ++u) {
          const int i = i0 + u;
          if (i >= nt) continue;
          const float* t = kvz + (long)i * 2 * cw;
          const float* ap = a.ape + (long)(ph0 + i) * cw;
          k0[u] = t[c], z0[u] = t[cw + c] + ap[c];
          if (a.overlap) k1[u] = t[w + c], z1[u] = t[cw + w + c] + ap[w + c];
        }
#pragma unroll
        for (int u = 0; u < WU; ++u) {
          const int i = i0 + u;
          if (i >= nt) continue;
          const long s = (long)(off + ph0 + i) * cw + c;
          skv[s] = k0[u], ssc[s] = z0[u];
          if (a.overlap) skv[s + w] = k1[u], ssc[s + w] = z1[u];
        }
      }
      if (!complete) continue;
      const int nslots = a.overlap ? 2 * m : m;
      auto col = [&](int j) { return (long)j * cw + ((a.overlap && j >= m) ? w + c : c); };
      float mx = -INFINITY, den = 0.f, num = 0.f;
#pragma unroll WU
      for (int j = 0; j < nslots; ++j) mx = fmaxf(mx, ssc[col(j)]);
#pragma unroll WU
      for (int j = 0; j < nslots; ++j) {
        const float e = expf(ssc[col(j)] - mx);
        den += e;
        num += skv[col(j)] * e;
      }
      pv[c] = bf16r(num / den);
      if (a.overlap) {
        for (int j0 = 0; j0 < m; j0 += WU) {
          float k0[WU], k1[WU], s0[WU], s1[WU];
#pragma unroll
          for (int u = 0; u < WU; ++u) {
            const long src = (long)(m + j0 + u) * cw + c;
            if (j0 + u < m) k0[u] = skv[src], k1[u] = skv[src + w], s0[u] = ssc[src], s1[u] = ssc[src + w];
          }
#pragma unroll
          for (int u = 0; u < WU; ++u) {
            const long d = (long)(j0 + u) * cw + c;
            if (j0 + u < m) skv[d] = k0[u], skv[d + w] = k1[u], ssc[d] = s0[u], ssc[d + w] = s1[u];
          }
        }
      }
    }
    if (!complete) return;
  }
  __syncthreads();
  finish_entry(pv, w, wt, trig, a.eps, a.R, a.fp4 ? QUANT_HADAMARD_FP4 : a.fp8_nope ? QUANT_FP8_NOPE : QUANT_NONE,
               static_cast<__nv_bfloat16*>(a.cache) + r * a.cache_b + (p / m) * w, red);
}

cudaError_t launch_rms_norm(const void* x, const void* weight, bool w_f32, int N, int D, float eps, void* out,
                            cudaStream_t st) {
  if (N < 1 || D < 1) return N == 0 ? cudaSuccess : cudaErrorInvalidValue;
  const bool aligned = ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(out) |
                         reinterpret_cast<uintptr_t>(weight)) & 15) == 0;
  if (D % 8 == 0 && D <= 8 * GLUE_THREADS * NORM_VPT && aligned)
    return ds4_pdl::launch(rms_norm_vec_kernel, dim3(N), dim3(GLUE_THREADS), 0, st, static_cast<const uint4*>(x),
                           weight, w_f32, D, eps, static_cast<uint4*>(out));
  return ds4_pdl::launch(rms_norm_kernel, dim3(N), dim3(GLUE_THREADS), 0, st, static_cast<const __nv_bfloat16*>(x),
                         weight, w_f32, D, eps, static_cast<__nv_bfloat16*>(out));
}

cudaError_t launch_head_rope(const void* x, const int64_t* pos, const float* freqs, int N, int H, int D, int R,
                             bool norm, float eps, void* out, cudaStream_t st) {
  if (N < 1 || H < 1 || R % 2 || R > D || N > 65535 || D * 4 > 48 * 1024) return cudaErrorInvalidValue;
  return ds4_pdl::launch(head_rope_kernel, dim3(H, N), dim3(128), D * sizeof(float), st,
                         static_cast<const __nv_bfloat16*>(x), pos, freqs, H, D, R, norm, eps,
                         static_cast<__nv_bfloat16*>(out));
}

cudaError_t launch_hadamard_fp4(const void* x, void* out, long N, int d, cudaStream_t st) {
  if (N < 0 || !hadamard_fp4_ok(d)) return cudaErrorInvalidValue;
  if (N == 0) return cudaSuccess;
  const long blocks = (N + HFP4_THREADS / 32 - 1) / (HFP4_THREADS / 32);
  if (blocks > 0x7fffffffL) return cudaErrorInvalidValue;
  return ds4_pdl::launch(hadamard_fp4_kernel, dim3((unsigned)blocks), dim3(HFP4_THREADS), 0, st,
                         static_cast<const uint16_t*>(x), static_cast<uint16_t*>(out), N, d);
}

cudaError_t launch_kv_store(const void* kv, const void* weight, bool w_f32, const int64_t* pos, const float* freqs,
                            int N, int D, int R, float eps, bool fp8_nope, void* win, long win_b, int W,
                            cudaStream_t st) {
  if (N < 1 || R % 2 || R > D || W < 1 || (2 * D + R) * 4 > 48 * 1024) return cudaErrorInvalidValue;
  return ds4_pdl::launch(kv_store_kernel, dim3(N), dim3(GLUE_THREADS), (2 * D + R) * sizeof(float), st,
                         static_cast<const __nv_bfloat16*>(kv), weight, w_f32, pos, freqs, D, R, eps, fp8_nope,
                         static_cast<__nv_bfloat16*>(win), win_b, W);
}

cudaError_t launch_compress_step(const CompressArgs& a, int N, cudaStream_t st) {
  if (N < 1 || a.m < 1 || a.w < 1 || a.tokens < 1 || a.m % a.tokens || a.R % 2 || a.R > a.w ||
      (2 * a.w + a.R) * 4 > 48 * 1024 || (a.fp4 && (a.fp8_nope || !hadamard_fp4_ok(a.w))))
    return cudaErrorInvalidValue;
  const int threads = a.w < COMPRESS_THREADS ? (a.w + 31) / 32 * 32 : COMPRESS_THREADS;  // a column per thread
  const bool regs = a.w <= COMPRESS_THREADS;
  auto kern = regs && a.m <= 4 ? compress_step_kernel<4> : regs && a.m <= 8 ? compress_step_kernel<8>
                                                                           : compress_step_kernel<0>;
  return ds4_pdl::launch(kern, dim3(N), dim3(threads), (2 * a.w + a.R) * sizeof(float), st, a);
}

}  // namespace ds4_attn
