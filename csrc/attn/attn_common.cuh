// Device helpers of the ds4_attn kernels (CUDA headers only). BF16 mma.sync m16n8k16 with fp32
// accumulation exists on sm_80 and sm_90 alike: nothing here needs sm_89+.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "../cp_async.cuh"
#include "../pdl.cuh"

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

}  // namespace ds4_attn
