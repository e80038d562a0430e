// Weight dequantisation on the device, for prefill: a matrix (or a stack of experts) in any stored layout (fp8,
// fp8t, fp4, fp4p, fp4t) -> BF16 or fp32 [E, O, K] (each expert's [O, K] contiguous, the experts o_es values
// apart), the values QWeight.dequant computes with torch: the E4M3 / E2M1 value times 2^(b - 127) in fp32, then one
// rounding to the output type (E8M0 byte 255 and the E4M3 NaN codes give NaN as there). One thread per 16-byte chunk
// of the stored bytes: it finds the chunk where its layout put it (chunk_ptr) and decodes it with the decode kernels'
// own word decoders (Dec<FMT>); a warp's 32 chunks are one contiguous run of the output (within a matrix), which it
// writes through shared memory in 512-byte store instructions (dequant_staged).
// Why: a prefill GEMM (cuBLAS) needs the dense weight, and torch's dequantisation makes a dozen fp32 passes over it
// (for the tiled layouts the untiling first: 82 torch ops a matrix). H200: one V4-Flash layer's 256 experts in 4.27 ms
// (3819 GB/s; experiments/decode_session48_h200.md).
#include <algorithm>
#include <cstdlib>
#include <type_traits>

#include "ds4_common.cuh"
#include "ds4_launch.h"

namespace ds4 {

constexpr int DQ_THREADS = 256;

__device__ __forceinline__ void dq_store(__nv_bfloat16* o, const float* v, int n) {
  for (int i = 0; i < n; i += 8) {
    uint4 u;
    __nv_bfloat162 p[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) p[k] = __floats2bfloat162_rn(v[i + 2 * k], v[i + 2 * k + 1]);
    u.x = *reinterpret_cast<uint32_t*>(&p[0]);
    u.y = *reinterpret_cast<uint32_t*>(&p[1]);
    u.z = *reinterpret_cast<uint32_t*>(&p[2]);
    u.w = *reinterpret_cast<uint32_t*>(&p[3]);
    *reinterpret_cast<uint4*>(o + i) = u;
  }
}

__device__ __forceinline__ void dq_store(float* o, const float* v, int n) {
  for (int i = 0; i < n; i += 4) *reinterpret_cast<float4*>(o + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
}

// E8M0 byte -> 2^(b - 127) as ds4.quant.e8m0_to_float gives it (0 -> 2^-127, 255 -> NaN)
__device__ __forceinline__ float dq_scale(uint32_t b) {
  return b == 255u ? __uint_as_float(0x7fc00000u) : e8m0_to_f32(b);
}

// Chunk i of the stack (expert-major, then row, then chunk in the row): its VALS values in v, and where they go in
// out (elements).
template <int FMT>
__device__ __forceinline__ long dq_chunk(const uint8_t* __restrict__ W, const uint8_t* __restrict__ S, long w_es,
                                         long s_es, int O, int K, int s_ld, long o_es, long i, float* v) {
  constexpr int VALS = FmtInfo<FMT>::VALS, PW = Dec<FMT>::PER_WORD;
  // the decoders' values are the true element x 2^-120 (E4M3) / 2^-126 (E2M1), exact; x 2^120 / 2^126 is exact too
  constexpr float UNDO = fmt_fp8(FMT) ? pow2f(120) : pow2f(126);
  const int cpr = K / VALS;  // chunks per row
  const long er = i / cpr;   // expert * O + row
  const int c = (int)(i - er * cpr), e = (int)(er / O), r = (int)(er - (long)e * O);
  const uint8_t* We = W + e * w_es;
  const uint8_t* Se = S + e * s_es;
  const uint4 q = ld_stream16(chunk_ptr<FMT>(We, r, row_bytes<FMT>(K), c));
  const uint32_t b = fmt_fp8(FMT) ? __ldg(Se + (long)(r >> 7) * s_ld + (c >> 3)) : __ldg(Se + (long)r * s_ld + c);
  const float s = dq_scale(b);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t w = k == 0 ? q.x : (k == 1 ? q.y : (k == 2 ? q.z : q.w));
    Dec<FMT>::word(w, v + k * PW);
  }
#pragma unroll
  for (int j = 0; j < VALS; ++j) {
    // E4M3's NaN codes (s 1111 111) decode to a finite raw value: bits 26..20 all set
    const bool nan = fmt_fp8(FMT) && (__float_as_uint(v[j]) & 0x7ff00000u) == 0x07f00000u;
    v[j] = nan ? __uint_as_float(0x7fc00000u) : (v[j] * UNDO) * s;
  }
  return e * o_es + (long)r * K + (long)c * VALS;
}

// One thread a chunk, its values stored straight from registers: a warp's store instruction writes 16 bytes every 32
// or 64 (128) bytes, the rest by its next ones (DS4_DEQUANT_STAGE=0).
template <int FMT, typename T>
__global__ void __launch_bounds__(DQ_THREADS)
    dequant_kernel(const uint8_t* __restrict__ W, const uint8_t* __restrict__ S, long w_es, long s_es, int O, int K,
                   int s_ld, T* __restrict__ out, long o_es, long chunks) {
  float v[FmtInfo<FMT>::VALS];
  for (long i = (long)blockIdx.x * DQ_THREADS + threadIdx.x; i < chunks; i += (long)gridDim.x * DQ_THREADS)
    dq_store(out + dq_chunk<FMT>(W, S, w_es, s_es, O, K, s_ld, o_es, i, v), v, FmtInfo<FMT>::VALS);
}

__device__ __forceinline__ uint4 dq_piece(const float* v, __nv_bfloat16*) {
  __nv_bfloat162 p[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) p[k] = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
  return make_uint4(*reinterpret_cast<uint32_t*>(&p[0]), *reinterpret_cast<uint32_t*>(&p[1]),
                    *reinterpret_cast<uint32_t*>(&p[2]), *reinterpret_cast<uint32_t*>(&p[3]));
}

__device__ __forceinline__ uint4 dq_piece(const float* v, float*) {
  return make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
}

// The same values, staged through shared memory so that each store instruction of a warp writes 512 contiguous bytes
// (where its 32 chunks' runs are contiguous: within an expert's matrix) — the default. A warp takes 32 consecutive
// chunks; chunk T's P 16-byte pieces sit in the warp's buffer rotated by T / (8 / P), so that both the writes (8
// chunks' piece j) and the reads (8 consecutive pieces) of a phase fall on 8 different 16-byte bank groups.
template <int FMT, typename T>
__global__ void __launch_bounds__(DQ_THREADS)
    dequant_staged(const uint8_t* __restrict__ W, const uint8_t* __restrict__ S, long w_es, long s_es, int O, int K,
                   int s_ld, T* __restrict__ out, long o_es, long chunks) {
  constexpr int VALS = FmtInfo<FMT>::VALS, PV = 16 / (int)sizeof(T), P = VALS / PV, ROT = 8 / P;  // P: 2, 4 or 8
  __shared__ uint4 buf[DQ_THREADS / 32][32 * P];
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
  uint4* wb = buf[wib];
  const long stride = (long)gridDim.x * DQ_THREADS;
  for (long base = (long)blockIdx.x * DQ_THREADS + wib * 32; base < chunks; base += stride) {
    const long i = base + lane;
    long dst = 0;
    if (i < chunks) {
      float v[VALS];
      dst = dq_chunk<FMT>(W, S, w_es, s_es, O, K, s_ld, o_es, i, v);
#pragma unroll
      for (int j = 0; j < P; ++j) wb[lane * P + (j + lane / ROT) % P] = dq_piece(v + j * PV, out);
    }
    __syncwarp();
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int L = k * 32 + lane, t = L / P, j = L % P;  // piece j of chunk t
      const long d = __shfl_sync(0xffffffffu, dst, t);
      if (base + t < chunks) *reinterpret_cast<uint4*>(out + d + j * PV) = wb[t * P + (j + t / ROT) % P];
    }
    __syncwarp();
  }
}

template <int FMT, typename T>
static cudaError_t dequant_go(const uint8_t* W, const uint8_t* S, int E, long w_es, long s_es, int O, int K, int s_ld,
                              T* out, long o_es, cudaStream_t st) {
  const long chunks = (long)E * O * (K / FmtInfo<FMT>::VALS);
  if (chunks == 0) return cudaSuccess;
  const long blocks = std::min((chunks + DQ_THREADS - 1) / DQ_THREADS, 1L << 20);  // grid-stride beyond
  const char* env = std::getenv("DS4_DEQUANT_STAGE");  // read per call: the A/B of the two store forms
  if (env && env[0] == '0')
    dequant_kernel<FMT, T><<<(unsigned)blocks, DQ_THREADS, 0, st>>>(W, S, w_es, s_es, O, K, s_ld, out, o_es, chunks);
  else
    dequant_staged<FMT, T><<<(unsigned)blocks, DQ_THREADS, 0, st>>>(W, S, w_es, s_es, O, K, s_ld, out, o_es, chunks);
  return cudaGetLastError();
}

bool dequant_ok(int fmt, int O, int K) {
  if (fmt != FMT_FP8 && fmt != FMT_FP8T && !fmt_fp4(fmt)) return false;
  const int vals = fmt_fp8(fmt) ? 16 : 32;
  return O >= 1 && K >= vals && K % vals == 0 && layout_shape_ok(fmt, O, K);
}

cudaError_t launch_dequant(int fmt, const void* W, const void* S, int E, long w_es, long s_es, int O, int K, int s_ld,
                           void* out, long o_es, bool out_f32, cudaStream_t st) {
  if (!dequant_ok(fmt, O, K) || E < 1 || o_es < (long)O * K) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(W) % 16 || w_es % 16 || reinterpret_cast<uintptr_t>(out) % 16 ||
      (o_es * (out_f32 ? 4 : 2)) % 16)
    return cudaErrorInvalidValue;
  const auto* w = static_cast<const uint8_t*>(W);
  const auto* s = static_cast<const uint8_t*>(S);
  auto go = [&](auto* o) -> cudaError_t {
    using T = std::remove_pointer_t<decltype(o)>;
    switch (fmt) {
      case FMT_FP8: return dequant_go<FMT_FP8, T>(w, s, E, w_es, s_es, O, K, s_ld, o, o_es, st);
      case FMT_FP8T: return dequant_go<FMT_FP8T, T>(w, s, E, w_es, s_es, O, K, s_ld, o, o_es, st);
      case FMT_FP4: return dequant_go<FMT_FP4, T>(w, s, E, w_es, s_es, O, K, s_ld, o, o_es, st);
      case FMT_FP4P: return dequant_go<FMT_FP4P, T>(w, s, E, w_es, s_es, O, K, s_ld, o, o_es, st);
      default: return dequant_go<FMT_FP4T, T>(w, s, E, w_es, s_es, O, K, s_ld, o, o_es, st);
    }
  };
  return out_f32 ? go(static_cast<float*>(out)) : go(static_cast<__nv_bfloat16*>(out));
}

}  // namespace ds4
