// Greedy selection on the device: out[r] = the index of the first maximal value of row r of fp32 x [B, V],
// as torch.argmax(-1) gives it (NaN counts as the largest value, ties go to the lowest index).
// One launch: blocks of ARGMAX_THREADS each reduce ARGMAX_PER_BLOCK values of a row to one 64-bit key
// (order-preserving bits of the value << 32 | ~index), an atomicMax per block folds them, and the last
// block of the row to arrive (a counter in device memory) writes the index and resets the key and the
// counter for the next launch. torch's two-level argmax took six launches (two reductions, two gathers,
// the index arithmetic); one reduction over a 129280-wide row in one block took 36.7 us on an H200.
// One argmax runs at a time per device (the decode step runs them in stream order), as the router's
// arrival counter (router.cu).
#include "ds4_common.cuh"
#include "ds4_launch.h"

namespace ds4 {

constexpr int ARGMAX_THREADS = 256;
constexpr int ARGMAX_PER_BLOCK = 4 * ARGMAX_THREADS;

__device__ unsigned long long argmax_best[ARGMAX_MAX_ROWS];  // zero at module load; reset by each row's last block
__device__ unsigned argmax_arrivals[ARGMAX_MAX_ROWS];

__device__ __forceinline__ unsigned long long argmax_key(float v, unsigned i) {
  const uint32_t b = __float_as_uint(v);
  const uint32_t ord = isnan(v) ? 0xffffffffu : (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return (unsigned long long)ord << 32 | (0xffffffffu - i);  // > 0 for every value (-inf: 0x007fffff)
}

__device__ __forceinline__ unsigned long long max_u64(unsigned long long a, unsigned long long b) { return a > b ? a : b; }

__global__ void __launch_bounds__(ARGMAX_THREADS) argmax_kernel(const float* __restrict__ x, long V,
                                                                int64_t* __restrict__ out) {
  ds4_pdl::begin();
  __shared__ unsigned long long red[ARGMAX_THREADS / 32];
  const int r = blockIdx.y;
  const long base = (long)blockIdx.x * ARGMAX_PER_BLOCK;
  const float* row = x + (long)r * V;
  float v[ARGMAX_PER_BLOCK / ARGMAX_THREADS];
#pragma unroll
  for (int u = 0; u < ARGMAX_PER_BLOCK / ARGMAX_THREADS; ++u) {  // all loads issued before any compare
    const long i = base + u * ARGMAX_THREADS + threadIdx.x;
    v[u] = i < V ? row[i] : 0.f;
  }
  unsigned long long best = 0;
#pragma unroll
  for (int u = 0; u < ARGMAX_PER_BLOCK / ARGMAX_THREADS; ++u) {
    const long i = base + u * ARGMAX_THREADS + threadIdx.x;
    if (i < V) best = max_u64(best, argmax_key(v[u], (unsigned)i));
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) best = max_u64(best, __shfl_xor_sync(0xffffffffu, best, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < ARGMAX_THREADS / 32; ++w) best = max_u64(best, red[w]);
    atomicMax(&argmax_best[r], best);
    __threadfence();  // this block's maximum is in before it counts as arrived
    if (atomicAdd(&argmax_arrivals[r], 1u) == gridDim.x - 1) {  // the row's last block: every maximum is in
      const unsigned long long k = atomicExch(&argmax_best[r], 0ull);
      argmax_arrivals[r] = 0u;
      out[r] = (int64_t)(0xffffffffu - (unsigned)(k & 0xffffffffull));
    }
  }
}

cudaError_t launch_argmax(const float* x, int B, long V, int64_t* out, cudaStream_t st) {
  if (B < 1 || B > ARGMAX_MAX_ROWS || V < 1 || V > 0xffffffffL) return cudaErrorInvalidValue;
  const long blocks = (V + ARGMAX_PER_BLOCK - 1) / ARGMAX_PER_BLOCK;
  if (blocks > 65535L * 32) return cudaErrorInvalidValue;
  return ds4_pdl::launch(argmax_kernel, dim3((unsigned)blocks, B), dim3(ARGMAX_THREADS), 0, st, x, V, out);
}

}  // namespace ds4
