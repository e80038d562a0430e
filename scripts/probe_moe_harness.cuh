// The timing harness of the MoE-form IDP4A probes (scripts/probe_dp4a_moe.cu, probe_dp4a_lib.cu): device buffers of
// hashed bytes, and bench_kernels.py's method of timing a launch (CUDA graphs of n launches, the median replay).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "probe_util.cuh"

namespace idp {

__global__ void fill_kernel(uint8_t* p, size_t n, uint32_t seed, int lo, int span) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t v = (uint32_t)i * 2654435761u ^ seed;
    v ^= v >> 13, v *= 0x5bd1e995u, v ^= v >> 15;
    p[i] = (uint8_t)(lo + v % span);
  }
}

inline uint8_t* dev_fill(size_t n, uint32_t seed, int lo, int hi) {
  uint8_t* d;
  CK(cudaMalloc(&d, n));
  fill_kernel<<<1024, 256>>>(d, n, seed, lo, hi - lo + 1);
  CK(cudaGetLastError());
  return d;
}

// median us per launch of a CUDA graph of `n` launches go(i), replayed `reps` times (bench_kernels.py's method)
template <typename Go>
float graph_us(Go go, int n = 48, int reps = 30) {
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < n; ++i) go(i, st);
  CK(cudaStreamEndCapture(st, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  CK(cudaGraphLaunch(ge, st));
  CK(cudaStreamSynchronize(st));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(a, st));
    CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(b, st));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1e3f / n);
  }
  std::sort(t.begin(), t.end());
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  CK(cudaStreamDestroy(st));
  return t[reps / 2];
}

}  // namespace idp
