// L2 prefetch of weights that a later kernel of the decode step streams (ds4.ops.prefetch; opt-in).
//
// A batch-1 decode step alternates bandwidth-bound GEMVs with latency-bound chains of small kernels
// (mHC, router, attention core) during which HBM is mostly idle. A prefetch launched on a side stream
// at the start of such a chain is meant to fill L2 with the weights of the GEMV that follows it. In the
// H200 step it measured slower at every site (experiments/decode_session13_h200.md), so the model only
// launches it when DS4_L2_PREFETCH asks.
// The kernel only issues the requests: blocks of PF_THREADS threads, each thread one PF_CHUNK-byte
// chunk per grid-stride step — on sm_90 one bulk prefetch (cp.async.bulk.prefetch.L2, handled by the
// copy engine), on sm_80 one prefetch.global.L2 per 128-byte line. Nothing is written and nothing is
// waited for: a prefetch is a hint, so a chunk's unaligned head and tail bytes (< 16) are simply not
// prefetched.
//
// Ranges (L2PrefetchArgs): direct — [ptr[r], ptr[r] + bytes[r]); or indexed by the device tensor ids
// [n_ids] (the routed experts the router chose) — range r of slot k is ptr[r] + e * stride[r] for the
// local expert e = ids[k] - id_offset, skipped when e is not in [0, n_local).
#include "ds4_common.cuh"
#include "ds4_launch.h"

#include <algorithm>

namespace ds4 {

constexpr int PF_THREADS = 128;
constexpr long PF_CHUNK = 4096;
constexpr int PF_MAX_BLOCKS = 264;

__device__ __forceinline__ void prefetch_l2(const char* p, long bytes) {
  const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + 15) & ~uintptr_t(15);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + bytes) & ~uintptr_t(15);
  if (e <= a) return;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"((unsigned)(e - a)) : "memory");
#else
  for (uintptr_t q = a; q < e; q += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(q));
#endif
}

__global__ void __launch_bounds__(PF_THREADS) l2_prefetch_kernel(const L2PrefetchArgs a) {
  const int per_slot = a.chunk_end[a.n_ranges - 1];  // chunks of all ranges of one slot
  const long total = (long)per_slot * (a.ids ? a.n_ids : 1);
  for (long c = (long)blockIdx.x * PF_THREADS + threadIdx.x; c < total; c += (long)gridDim.x * PF_THREADS) {
    const int k = (int)(c / per_slot), j = (int)(c - (long)k * per_slot);
    int r = 0;
    while (j >= a.chunk_end[r]) ++r;
    const long first = r ? a.chunk_end[r - 1] : 0;
    const char* base = a.ptr[r];
    if (a.ids) {
      const long e = a.ids[k] - a.id_offset;
      if (e < 0 || e >= a.n_local) continue;
      base += e * a.stride[r];
    }
    const long off = (j - first) * PF_CHUNK;
    prefetch_l2(base + off, min(PF_CHUNK, a.bytes[r] - off));
  }
}

cudaError_t launch_l2_prefetch(const L2PrefetchArgs& a, cudaStream_t st) {
  if (a.n_ranges < 1 || a.n_ranges > PF_MAX_RANGES || (a.ids && a.n_ids < 1)) return cudaErrorInvalidValue;
  L2PrefetchArgs b = a;
  int acc = 0;
  for (int r = 0; r < a.n_ranges; ++r) {
    if (a.bytes[r] < 0) return cudaErrorInvalidValue;
    acc += (int)((a.bytes[r] + PF_CHUNK - 1) / PF_CHUNK);
    b.chunk_end[r] = acc;
  }
  const long total = (long)acc * (a.ids ? a.n_ids : 1);
  if (total == 0) return cudaSuccess;
  const int blocks = (int)std::min<long>((total + PF_THREADS - 1) / PF_THREADS, PF_MAX_BLOCKS);
  l2_prefetch_kernel<<<blocks, PF_THREADS, 0, st>>>(b);
  return cudaGetLastError();
}

}  // namespace ds4
