// Activations staged by the TMA unit (sm_90: cp.async.bulk global -> shared, completing on an mbarrier) instead of
// the block's own 16-byte loads: the one-token tensor-core kernels' opt-in DS4_BULK_STAGE (ds4_launch.h
// bulk_stage_site, which the launchers ask).
//
// Why try: in the decode step the routed MoE down's blocks spent 3.3 us staging 24 KB of h from L2, against 7.1 us
// streaming their weights (H100, the step probe, experiments/session78.md), and 3.5 us alone, where h sat in L2 long
// before. Its staging starts right after the weight rounds it requested before its PDL wait; whether the h loads then
// queue behind those loads in the block's own load path (its scoreboards, its SM's outstanding requests) is the
// question a bulk copy, which holds neither, answers. It answered no: on an H200 the staging took as long alone
// (3.1 us) and the step was slower (bsd 101.1 against 99.5 us per layer; experiments/session79.md): an opt-in.
//
// Protocol (one copy group per launch, thread 0 drives it, parity 0):
//   thread 0: bulk_begin(bar, bytes) — init, then arm it for `bytes`; bulk_copy(...) for each piece;
//   ... every thread's other work ...
//   every thread: stage_mma_bulk_landed (mma_dot.cuh): thread 0 waits on the barrier, a block barrier, then each
//   thread converts its own staged vectors in place.
// Pieces: 16-byte aligned, sizes multiples of 16 (the host checks before choosing it). The shared memory they land in
// may have been written by the block's threads before (scratch): the fence in bulk_begin orders those generic writes
// before the async ones, and the caller has a block barrier between them and bulk_begin.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace ds4 {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define DS4_BULK_ARCH 1
#else
#define DS4_BULK_ARCH 0
#endif

// Whether this device code has the bulk copies (sm_90+); below it a kernel takes its register staging.
__host__ __device__ constexpr bool bulk_arch() { return DS4_BULK_ARCH != 0; }

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void bulk_begin(uint64_t* bar, uint32_t bytes) {
#if DS4_BULK_ARCH
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#if DS4_BULK_ARCH
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
#endif
}

__device__ __forceinline__ void bulk_wait(uint64_t* bar) {
#if DS4_BULK_ARCH
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "WAIT_%=:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n\t"
      "@!p bra WAIT_%=;\n\t}" ::"r"(smem_u32(bar))
      : "memory");
#endif
}

}  // namespace ds4
