// cp.async wrappers (sm_80+; no-ops below), shared by both extensions: global -> shared copies that hold no register
// while in flight (the MMA streams, the hc fold's staging, the indexer's key ring).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace ds4 {

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((uint32_t)__cvta_generic_to_shared(dst)),
               "l"(src) : "memory");
#endif
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"((uint32_t)__cvta_generic_to_shared(dst)),
               "l"(src) : "memory");
#endif
}
// Groups: the copies issued since the last commit form one group; cp_async_wait<N> waits until at most N of this
// thread's groups are still in flight (groups complete in commit order). The block still needs a barrier to see the
// other threads' copies.
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

}  // namespace ds4
