// Device helpers of the ds4_attn kernels (CUDA headers only). BF16 mma.sync m16n8k16 with fp32
// accumulation exists on sm_80 and sm_90 alike: nothing here needs sm_89+.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "../cp_async.cuh"
#include "../pdl.cuh"
#include "../pow2_scale.cuh"
#include "attn_launch.h"

namespace ds4_attn {

// D = A(16x16, row) * B(16x8, col) + C. Fragments (g = lane/4, c = lane%4):
//  a0 (row g, k 2c..2c+1), a1 (row g+8, k 2c..), a2 (row g, k 2c+8..), a3 (row g+8, k 2c+8..)
//  b0 (k 2c..2c+1, col g), b1 (k 2c+8.., col g);  c0,c1 (row g, col 2c, 2c+1), c2,c3 (row g+8, ...)
// Each 32-bit register holds two bf16: the lower k (or column) index in the low half.
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t pack_u16(uint16_t lo, uint16_t hi) { return (uint32_t)lo | ((uint32_t)hi << 16); }

__device__ __forceinline__ float bf16r(float x) { return __bfloat162float(__float2bfloat16(x)); }

__device__ __forceinline__ float ld_as_float(const void* p, long i, bool f32) {
  return f32 ? static_cast<const float*>(p)[i] : __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}

// 16 bytes global -> shared without a register (cp.async, sm_80+); ok == false writes 16 zero bytes and
// reads nothing (src must still be a valid address). A thread can put all its copies of a staging loop
// in flight this way, where a load-then-store loop waits one memory round trip per trip.
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool ok) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"((uint32_t)__cvta_generic_to_shared(dst)),
               "l"(src), "r"(ok ? 16 : 0) : "memory");
#endif
}
// Waits for all of this thread's cp.async copies (the block still needs a barrier to see the others').
__device__ __forceinline__ void cp_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}
// Copy groups (commit, wait until at most N are in flight): the wrappers the ds4 extension's streams use.
using ds4::cp_async_commit;
using ds4::cp_async_wait;

// A fragment of a 16 x 16 tile of a row-major bf16 matrix (row stride ld elements); rows >= nrows are 0.
// GLOBAL: base is read-only global memory (loaded through the non-coherent path); else any memory
// (e.g. shared).
template <bool GLOBAL = true>
__device__ __forceinline__ void load_a_rows(uint32_t* a, const uint16_t* base, int ld, int row0, int nrows, int k0,
                                            int lane) {
  const int g = lane >> 2, c = lane & 3;
  const int r0 = row0 + g, r1 = row0 + g + 8;
  const uint32_t* p0 = reinterpret_cast<const uint32_t*>(base + (long)r0 * ld + k0 + 2 * c);
  const uint32_t* p1 = reinterpret_cast<const uint32_t*>(base + (long)r1 * ld + k0 + 2 * c);
  auto ld32 = [](const uint32_t* p) { return GLOBAL ? __ldg(p) : *p; };
  a[0] = r0 < nrows ? ld32(p0) : 0u;
  a[1] = r1 < nrows ? ld32(p1) : 0u;
  a[2] = r0 < nrows ? ld32(p0 + 4) : 0u;
  a[3] = r1 < nrows ? ld32(p1 + 4) : 0u;
}

// ---- numerics=qat: the indexer's Hadamard + FP4 simulation (ds4.quant: fp4_act_quant_sim(hadamard(x), 32)) ----
// Of a row of d = 32 * VPL values held by one warp, lane l holding x[l * VPL, (l + 1) * VPL) as fp32 (bf16 values):
// the Sylvester Hadamard butterfly in fp32 in the twin's stage order (h = 1, 2, ..., d / 2; the pair (i, i + h) ->
// (a + b, a - b)), times fp32(d^-0.5), rounded to bf16; then per block of 32 values amax = max(|x|, 6 * 2^-126),
// s = 2^ceil(log2(amax * fp32(1/6))) by the reference's bit trick, e2m1(clamp(x / s, +-6)) * s (nearest, ties to the
// even code, a negative value that rounds to zero gives -0, as fp4_e2m1_encode / decode), rounded to bf16. The same
// fp32 operations in the same order as the twin, so the same bits (tests/test_qat_cuda_gpu.py). NaN inputs are not
// matched (the twin's clamp keeps NaN, fminf / fmaxf drop it).
// (d a power of two in [32, 256]: hadamard_fp4_ok, attn_launch.h)
// fp32(n^-0.5) for n = 2^k as torch forms `y * (n ** -0.5)`: the double n^-0.5 rounded to fp32; 2^-(k/2) times
// fp32(double(sqrt(0.5))) for odd k (power-of-two scalings are exact in both precisions)
__host__ __device__ constexpr float inv_sqrt_pow2(int k) {
  float s = (k & 1) ? (float)0.7071067811865476 : 1.f;
  for (int i = 0; i < k / 2; ++i) s *= 0.5f;
  return s;
}

// E2M1 rounding of y in [-6, 6] as fp4_e2m1_encode then decode: '>' where the lower code is even (a tie goes
// down), '>=' where the upper one is
__device__ __forceinline__ float e2m1_round(float y) {
  const float a = fabsf(y);
  const float q = a > 5.f ? 6.f : a >= 3.5f ? 4.f : a > 2.5f ? 3.f : a >= 1.75f ? 2.f : a > 1.25f ? 1.5f
                : a >= 0.75f ? 1.f : a > 0.25f ? 0.5f : 0.f;
  return copysignf(q, y);
}

template <int VPL>
__device__ __forceinline__ void hadamard_fp4_warp(float (&v)[VPL], int lane) {
  constexpr int LPB = 32 / VPL;  // lanes per block of 32 values
#pragma unroll
  for (int h = 1; h < VPL; h <<= 1) {  // the stages inside a lane
#pragma unroll
    for (int i = 0; i < VPL; ++i)
      if (!(i & h)) {
        const float a = v[i], b = v[i + h];
        v[i] = a + b;
        v[i + h] = a - b;
      }
  }
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {  // the stages across lanes (h = o * VPL): the upper lane of a pair forms a - b
    const bool upper = lane & o;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const float p = __shfl_xor_sync(0xffffffffu, v[i], o);
      v[i] = upper ? p - v[i] : v[i] + p;
    }
  }
  constexpr float sc = inv_sqrt_pow2(5 + (VPL >= 2) + (VPL >= 4) + (VPL >= 8));  // d = 32 VPL = 2^k
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    v[i] = bf16r(v[i] * sc);
    m = fmaxf(m, fabsf(v[i]));
  }
#pragma unroll
  for (int o = 1; o < LPB; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  // v * inv: v / s, bit for bit
  const ds4::Pow2Scale ps =
      ds4::pow2_scale_of_exp(ds4::pow2_ceil_exp(__fmul_rn(fmaxf(m, 6.f * 0x1p-126f), (float)(1.0 / 6.0))));
#pragma unroll
  for (int i = 0; i < VPL; ++i)
    v[i] = bf16r(__fmul_rn(e2m1_round(fminf(fmaxf(__fmul_rn(v[i], ps.inv), -6.f), 6.f)), ps.s));
}

// hadamard_fp4_warp on a row of d bf16 (uint16_t) or fp32 (bf16 values) in shared or global memory: src -> dst (the
// same row for in place); the whole warp calls it (d: hadamard_fp4_ok). The caller orders the row's writes before and
// after (__syncwarp or a barrier).
template <int VPL, typename T>
__device__ __forceinline__ void hadamard_fp4_row_vpl(const T* src, T* dst, int lane) {
  float v[VPL];
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    if constexpr (sizeof(T) == 2)
      v[i] = __uint_as_float((uint32_t)src[lane * VPL + i] << 16);
    else
      v[i] = src[lane * VPL + i];
  }
  hadamard_fp4_warp<VPL>(v, lane);
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    if constexpr (sizeof(T) == 2)
      dst[lane * VPL + i] = (T)(__float_as_uint(v[i]) >> 16);  // bf16 values: the upper half is exact
    else
      dst[lane * VPL + i] = v[i];
  }
}

template <typename T>
__device__ __forceinline__ void hadamard_fp4_row(const T* src, T* dst, int d, int lane) {
  switch (d) {
    case 32: hadamard_fp4_row_vpl<1>(src, dst, lane); break;
    case 64: hadamard_fp4_row_vpl<2>(src, dst, lane); break;
    case 128: hadamard_fp4_row_vpl<4>(src, dst, lane); break;
    case 256: hadamard_fp4_row_vpl<8>(src, dst, lane); break;
    default: break;  // (launches check hadamard_fp4_ok)
  }
}

}  // namespace ds4_attn
