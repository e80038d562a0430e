// Helpers of the IDP4A probes (scripts/probe_dp4a.cu, probe_dp4a_moe.cu): the E2M1 magnitude lookup by PRMT
// and the weight stream's load. (__byte_perm ignores the selector's sign bit — experiments/kernels_h200.md — so prmt
// is inline PTX: there the sign bit makes PRMT replicate the looked-up byte's top bit, 0 for this table.)
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include <cmath>

namespace idp {

constexpr uint32_t TAB_LO = 0x03020100u, TAB_HI = 0x0C080604u;  // 2 x |E2M1| for codes 0..7

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
// 16 weight bytes, read once: not kept in L1
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// an E8M0 scale byte: 2^(b - 127)
__host__ __device__ inline float e8m0(uint32_t b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(b << 23);
#else
  return std::ldexp(1.f, (int)b - 127);
#endif
}

// an E2M1 code's value (the host references)
inline float e2m1(int code) {
  static const float mag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  return (code & 8 ? -1.f : 1.f) * mag[code & 7];
}

}  // namespace idp
