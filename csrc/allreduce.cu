// One-shot all-reduce of decode activations over peer memory (NVLink through torch's symmetric memory), for
// tensor-parallel batch-1 decode (parallel.comm=ll).
//
// Why: at tp > 1 every layer sums two activation rows over the ranks (attention output, MoE output). On two
// H200s torch's symm_mem one-shot all-reduce plus the casts around it cost about a fifth of the layer
// (session 17: the all-reduce kernels 14.9 us per layer on the critical path, the elementwise casts / adds
// beside them 11 us). Here one launch reads this rank's partial in its own dtype, exchanges it, sums the
// ranks' partials in rank order (so every rank gets the same bits) and writes the output dtype.
//
// Protocol (low latency, as NCCL's LL): each value travels as one 8-byte store {value bits, flag}; an
// aligned 8-byte store is seen whole, so a reader that sees the flag sees the value, and no barrier or reset
// is needed between calls.
//  * Rank r's buffer: [2 slots][W source ranks][cap] uint2, zeroed once before the first call.
//  * Element i is always handled by block i / AR_CHUNK, and each block keeps a call counter of its own
//    (counters[b], this rank's memory). All ranks make the same calls in the same order, so the counters
//    agree across ranks; the call's flag (epoch) = counter + 1 exceeds every flag written before into the
//    block's part of the buffer.
//  * slot = epoch & 1. A rank is at most one call ahead of a peer: to finish call e it needs the peer's
//    values of e, which the peer sends only after its call e - 1 has completed (stream order, and PDL's
//    wait before any send). So the values of call e + 1 never land in the slot a peer still reads for e - 1.
// A rank whose peer never sends (the ranks' calls differ: a bug) traps after AR_SPIN_LIMIT polls instead
// of hanging the step.
#include "ds4_common.cuh"
#include "ds4_launch.h"
#include "pdl.cuh"

#include <cstdio>

namespace ds4 {

constexpr int AR_VPT = AR_CHUNK / AR_THREADS;  // values per thread
constexpr long long AR_SPIN_LIMIT = 1ll << 26;

__device__ __forceinline__ void st_ll(uint2* p, uint32_t v, uint32_t flag) {
  asm volatile("st.volatile.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(v), "r"(flag) : "memory");
}

__device__ __forceinline__ uint2 ld_ll(const uint2* p) {
  uint2 r;
  asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p) : "memory");
  return r;
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

__global__ void __launch_bounds__(AR_THREADS) all_reduce_ll_kernel(const AllReduceArgs a) {
  __shared__ uint32_t s_epoch;
  ds4_pdl::wait();  // x comes from the kernels before; the counters from this kernel's previous launch
  ds4_pdl::launch_dependents();
  if (threadIdx.x == 0) s_epoch = (uint32_t)a.counters[blockIdx.x] + 1u;
  __syncthreads();
  const uint32_t e = s_epoch;
  const long slot = (long)(e & 1u) * a.world * a.cap;
  float v[AR_VPT];
#pragma unroll
  for (int u = 0; u < AR_VPT; ++u) {  // send this rank's values to every peer first, then collect
    const long i = (long)blockIdx.x * AR_CHUNK + u * AR_THREADS + threadIdx.x;
    if (i >= a.n) continue;
    const float x = a.x_bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(a.x)[i])
                             : static_cast<const float*>(a.x)[i];
    v[u] = a.round_bf16 ? round_bf16(x) : x;  // the reduce precision: what every rank sums
    for (int r = 0; r < a.world; ++r)
      if (r != a.rank) st_ll(a.peers[r] + slot + (long)a.rank * a.cap + i, __float_as_uint(v[u]), e);
  }
  const uint2* mine = a.peers[a.rank] + slot;
#pragma unroll
  for (int u = 0; u < AR_VPT; ++u) {
    const long i = (long)blockIdx.x * AR_CHUNK + u * AR_THREADS + threadIdx.x;
    if (i >= a.n) continue;
    float acc = 0.f;
    for (int r = 0; r < a.world; ++r) {  // rank order on every rank: the same sum everywhere
      float t = v[u];
      if (r != a.rank) {
        const uint2* p = mine + (long)r * a.cap + i;
        uint2 w = ld_ll(p);
        for (long long spins = 0; w.y != e; w = ld_ll(p)) {
          if (++spins == AR_SPIN_LIMIT) {
            printf("ds4 all_reduce_ll: rank %d, block %d waited %lld polls for rank %d (epoch %u, flag %u)\n", a.rank,
                   blockIdx.x, spins, r, e, w.y);
            __trap();
          }
        }
        t = __uint_as_float(w.x);
      }
      acc += t;
    }
    if (a.round_bf16) acc = round_bf16(acc);  // the reduced sum in the reduce precision
    if (a.out_bf16)
      static_cast<__nv_bfloat16*>(a.out)[i] = __float2bfloat16(acc);
    else
      static_cast<float*>(a.out)[i] = acc;
  }
  __syncthreads();  // every thread's epoch read is done before the counter moves on
  if (threadIdx.x == 0) a.counters[blockIdx.x] = (int)e;
}

cudaError_t launch_all_reduce_ll(const AllReduceArgs& a, cudaStream_t st) {
  if (a.world < 2 || a.world > AR_MAX_WORLD || a.rank < 0 || a.rank >= a.world || a.n < 1 || a.n > a.cap)
    return cudaErrorInvalidValue;
  const long blocks = (a.n + AR_CHUNK - 1) / AR_CHUNK;
  return ds4_pdl::launch(all_reduce_ll_kernel, dim3((unsigned)blocks), dim3(AR_THREADS), 0, st, a);
}

}  // namespace ds4
