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
#include "hc_fold.cuh"
#include "pdl.cuh"

#include <cstdio>
#include <cstdlib>

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

// Element i of this rank's partial in the reduce precision (what every rank sums), sent to every peer's buffer
// (slot of epoch e, this rank's row) as {value, e}.
__device__ __forceinline__ float ll_send(const AllReduceArgs& a, long slot, long i, uint32_t e) {
  const float x = a.x_bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(a.x)[i])
                           : static_cast<const float*>(a.x)[i];
  const float v = a.round_bf16 ? round_bf16(x) : x;
  for (int r = 0; r < a.world; ++r)
    if (r != a.rank) st_ll(a.peers[r] + slot + (long)a.rank * a.cap + i, __float_as_uint(v), e);
  return v;
}

// The sum of element i over the ranks in rank order (the same sum on every rank), v being this rank's value: each
// peer's value polled from this rank's buffer until its flag is e (a trap after AR_SPIN_LIMIT polls: the ranks'
// calls differ, a bug); rounded to bf16 in the bf16 reduce precision.
__device__ __forceinline__ float ll_sum(const AllReduceArgs& a, long slot, long i, float v, uint32_t e) {
  float acc = 0.f;
  for (int r = 0; r < a.world; ++r) {
    float t = v;
    if (r != a.rank) {
      const uint2* p = a.peers[a.rank] + slot + (long)r * a.cap + i;
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
  return a.round_bf16 ? round_bf16(acc) : acc;
}

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
    if (i < a.n) v[u] = ll_send(a, slot, i, e);
  }
#pragma unroll
  for (int u = 0; u < AR_VPT; ++u) {
    const long i = (long)blockIdx.x * AR_CHUNK + u * AR_THREADS + threadIdx.x;
    if (i >= a.n) continue;
    const float acc = ll_sum(a, slot, i, v[u], e);
    if (a.out_bf16)
      static_cast<__nv_bfloat16*>(a.out)[i] = __float2bfloat16(acc);
    else
      static_cast<float*>(a.out)[i] = acc;
  }
  __syncthreads();  // every thread's epoch read is done before the counter moves on
  if (threadIdx.x == 0) a.counters[blockIdx.x] = (int)e;
}

// The all-reduce with the hc fold (hc_fold.cuh) in the same launch, for tensor-parallel decode: the block output
// y [D] is the sum over the ranks of their partials x, and what follows it in the step is the next mHC site's
// first launch (the post onto the streams and the site's partials). Without the fold that is an all-reduce
// launch and then hc_partials (POST form); here block b takes AR_FOLD_TILES 16-row tiles of y, exchanges and
// sums them as all_reduce_ll_kernel does (the same bits, bf16 out), and runs the fold's epilogue on them: the
// new streams and one partial per tile, as the one-GPU fold in wo_b's GEMV / the MoE down kernel forms them.
// The fn slice (a weight) is copied before the PDL wait. Its own counters (one per block) and its own buffer
// region: the epochs of these calls and of all_reduce_ll's are separate sequences, each slot argument as above.
__global__ void __launch_bounds__(AR_FOLD_THREADS) all_reduce_ll_fold_kernel(const AllReduceArgs a, const HcFold f) {
  extern __shared__ float4 smem4[];
  __shared__ uint32_t s_epoch;
  const int D = (int)a.n, t0 = blockIdx.x * AR_FOLD_TILES, nt = min(AR_FOLD_TILES, D / 16 - t0);
  const HcFoldSmem s = hc_fold_smem(reinterpret_cast<float*>(smem4), AR_FOLD_TILES, f.n, f.mix);
  hc_fold_load_fn(f, s, t0, nt, D);  // a weight: before the wait
  ds4_pdl::wait();  // x, the streams, post and comb come from the kernels before; the counters from this kernel's
  ds4_pdl::launch_dependents();  // previous launch
  if (threadIdx.x == 0) s_epoch = (uint32_t)a.counters[blockIdx.x] + 1u;
  hc_fold_load_act(f, s, t0, nt, D);
  __syncthreads();
  const uint32_t e = s_epoch;
  const long slot = (long)(e & 1u) * a.world * a.cap;
  const long i = (long)t0 * 16 + threadIdx.x;
  const bool mine = threadIdx.x < nt * 16;
  if (mine) {  // send first, then collect (all_reduce_ll_kernel's arithmetic)
    const float acc = ll_sum(a, slot, i, ll_send(a, slot, i, e), e);
    const __nv_bfloat16 y = __float2bfloat16(acc);
    static_cast<__nv_bfloat16*>(a.out)[i] = y;
    s.ys[threadIdx.x] = __bfloat162float(y);  // y as stored, as the fold's producers give it
  }
  hc_fold_epilogue(f, s, t0, nt, D);  // waits for the copies, synchronises, forms the streams and partials
  if (threadIdx.x == 0) a.counters[blockIdx.x] = (int)e;  // every epoch read was before the epilogue's barriers
}

int all_reduce_fold_smem(int n, int mix) { return 4 * (int)hc_fold_smem_floats(AR_FOLD_TILES, n, mix); }

// The dynamic shared memory a fold launch asks for: its buffers, raised so that two blocks do not fit on one SM
// (DS4_AR_FOLD_SPREAD=0: the buffers alone; read per launch, for the A/B). Why: with its blocks sized by their
// buffers (19 KB, 128 threads: up to 11 per SM) and launched early under PDL, the kernel took 14-17 us on the
// critical path per call against 2.4 + 3.3 for the two launches it replaces, and no more than they did when
// launched without PDL (tp=2, session 19 run 3). The likely cause: the blocks become resident wherever the
// previous kernel (one resident wave) leaves room, a few SMs, and run packed there. One block per SM spreads
// the grid (128 blocks for D = 4096) over the SMs as they free up (not yet measured).
static int fold_launch_smem(int need) {
  const char* env = std::getenv("DS4_AR_FOLD_SPREAD");
  if (env && env[0] == '0') return need;
  int dev = 0, per_sm = 0, per_block = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
    return need;
  const int want = per_sm / 2 + 1024;  // two such blocks (and the 1 KB the SM reserves per block) no longer fit
  return want > need ? (want < per_block ? want : per_block) : need;
}

cudaError_t launch_all_reduce_ll_fold(const AllReduceArgs& a, const HcFold& f, cudaStream_t st) {
  if (a.world < 2 || a.world > AR_MAX_WORLD || a.rank < 0 || a.rank >= a.world || a.n < 16 || a.n % 16 ||
      a.n > a.cap || !a.out_bf16 || !(f.n == 1 || f.n == 2 || f.n == 4) || f.mix != (2 + f.n) * f.n)
    return cudaErrorInvalidValue;
  const int need = all_reduce_fold_smem(f.n, f.mix);
  if (need > 48 * 1024) return cudaErrorInvalidValue;
  const int smem = fold_launch_smem(need);
  cudaError_t e = set_smem(all_reduce_ll_fold_kernel, smem);
  if (e != cudaSuccess) return e;
  const long blocks = (a.n / 16 + AR_FOLD_TILES - 1) / AR_FOLD_TILES;
  // DS4_AR_FOLD_PDL=0 (read per launch, for the A/B): launched in plain stream order, not early under PDL
  const char* pdl_env = std::getenv("DS4_AR_FOLD_PDL");
  if (pdl_env && pdl_env[0] == '0') {
    all_reduce_ll_fold_kernel<<<(unsigned)blocks, AR_FOLD_THREADS, (size_t)smem, st>>>(a, f);
    return cudaGetLastError();
  }
  return ds4_pdl::launch(all_reduce_ll_fold_kernel, dim3((unsigned)blocks), dim3(AR_FOLD_THREADS), (size_t)smem, st,
                         a, f);
}

cudaError_t launch_all_reduce_ll(const AllReduceArgs& a, cudaStream_t st) {
  if (a.world < 2 || a.world > AR_MAX_WORLD || a.rank < 0 || a.rank >= a.world || a.n < 1 || a.n > a.cap)
    return cudaErrorInvalidValue;
  const long blocks = (a.n + AR_CHUNK - 1) / AR_CHUNK;
  return ds4_pdl::launch(all_reduce_ll_kernel, dim3((unsigned)blocks), dim3(AR_THREADS), 0, st, a);
}

}  // namespace ds4
