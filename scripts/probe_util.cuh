// Helpers shared by the probes (scripts/probe_phases.cu, probe_bulk.cu, probe_chain.cu, probe_h_read.cu,
// probe_splitk_tail.cu, probe_code_fetch.cu, ...): error check, random device buffers, CUDA-event timing, medians,
// launches with or without PDL; on the device, the global timer and an L2-evicting stream.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

static std::mt19937 rng(0);

template <typename T>
static T* dev_random(size_t n, float lo, float hi) {
  std::vector<T> h(n);
  std::uniform_real_distribution<float> u(lo, hi);
  for (auto& v : h) v = T(u(rng));
  T* d;
  CK(cudaMalloc(&d, n * sizeof(T)));
  CK(cudaMemcpy(d, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

static uint8_t* dev_bytes(size_t n, int lo, int hi) {
  std::vector<uint8_t> h(n);
  std::uniform_int_distribution<int> u(lo, hi);
  for (auto& v : h) v = (uint8_t)u(rng);
  uint8_t* d;
  CK(cudaMalloc(&d, n));
  CK(cudaMemcpy(d, h.data(), n, cudaMemcpyHostToDevice));
  return d;
}

static float clock_ghz() {
  int khz = 0;
  cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0);
  return khz / 1e6f;
}

// Mean microseconds per launch of f(i) over reps launches (f picks its buffers from i).
// Launches per timing and warm-up launches before it (probe_bulk's "once" mode, for ncu, sets 1 and 0).
static int probe_reps = 50, probe_warm = 3;

template <typename F>
static float time_us(F f, int reps = 0) {
  if (reps <= 0) reps = probe_reps;
  for (int i = 0; i < probe_warm; ++i) f(i);
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  CK(cudaEventRecord(a));
  for (int i = 0; i < reps; ++i) f(i);
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  float ms = 0.f;
  CK(cudaEventElapsedTime(&ms, a, b));
  CK(cudaGetLastError());
  return ms * 1e3f / reps;
}

// The device's copy bandwidth in this process (1 GiB device to device, read + write counted), printed in the probes'
// one form; reps launches timed.
static void print_copy_bandwidth(int reps = 10) {
  const size_t n = 1ull << 30;
  void *a, *b;
  CK(cudaMalloc(&a, n));
  CK(cudaMalloc(&b, n));
  const float us = time_us([&](int) { CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice)); }, reps);
  std::printf("copy 1 GiB: %.0f GB/s (read + write)\n", 2.0 * n / us / 1e3);
  cudaFree(a);
  cudaFree(b);
}

// |y - ref| / |ref| (L2 norms; |ref| = 0 counts as 1).
static double rel_l2(const std::vector<float>& y, const std::vector<float>& ref) {
  double err = 0.0, nrm = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    err += (double)(y[i] - ref[i]) * (y[i] - ref[i]);
    nrm += (double)ref[i] * ref[i];
  }
  return std::sqrt(err / (nrm > 0 ? nrm : 1.0));
}

// The median of v (the upper one of an even count).
static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The global timer in ns (one clock for all SMs).
__device__ __forceinline__ uint64_t gtimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// All SMs read nvec vectors of a large buffer (to evict L2); the xor keeps the loads. Plain loads: a streaming hint
// (ld.cs) could leave what it should evict in L2.
__global__ void streamer(const uint4* big, long nvec, uint32_t* sink) {
  uint32_t acc = 0;
  for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += (long)gridDim.x * blockDim.x)
    acc ^= big[i].x;
  if (acc == 0x12345678u) sink[0] = acc;
}

// A launch with the PDL attribute (programmatic stream serialization) or without it, chosen per call: the probes'
// form of the library's ds4_pdl::launch, which DS4_PDL decides.
template <typename... KArgs, typename... Args>
static void launch_pdl(bool pdl, void (*kernel)(KArgs...), int grid, int block, cudaStream_t st, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(block);
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  CK(cudaLaunchKernelEx(&cfg, kernel, args...));
}
