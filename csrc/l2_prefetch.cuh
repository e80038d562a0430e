// An L2 prefetch of one byte range (a hint: nothing is written or waited for), shared by the side-stream prefetch
// kernel (prefetch.cu) and the one-token GEMV's early requests of its weight share (gemv.cu, DS4_GEMV_L2).
// On sm_90 one bulk request (cp.async.bulk.prefetch.L2, carried out by the SM's TMA unit, no registers held); on
// sm_80 one prefetch.global.L2 per 128-byte line. The range's unaligned head and tail bytes (< 16) are not prefetched.
#pragma once
#include <cstdint>

namespace ds4 {

__device__ __forceinline__ void prefetch_l2(const void* p, long bytes) {
  const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + 15) & ~uintptr_t(15);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + bytes) & ~uintptr_t(15);
  if (e <= a) return;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"((unsigned)(e - a)) : "memory");
#else
  for (uintptr_t q = a; q < e; q += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(q));
#endif
}

}  // namespace ds4
