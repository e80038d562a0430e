// Probe (no torch, no library code): what running code for the first time costs a block, when that code is in the
// SM's instruction caches, only in L2, or only in DRAM. Session 83's reading of the routed down's slow staging of h
// (3.3-3.9 us in the library against 0.8 us in scripts/probe_h_read.cu, experiments/session83.md) is a cold start:
// each layer's weight streams send about 100 MB through the 50 MB L2 and many kernels run per layer, so a kernel's
// code may come from L2 or DRAM every time it runs.
//
// `straight<S>` is S x 128 xorshift steps of straight-line integer code (8 independent chains, no loop; about S x 8 KB
// of SASS: 17 / 66 / 264 KB at S = 2 / 8 / 32, by the cubin's .text sections). Each
// block's thread 0 times it with globaltimer from its first step to its last. One block of one warp per SM. Cases,
// each the median of 9 repetitions, per block mean / largest:
//   warm     the kernel again right after itself (its code in every cache)
//   churned  after a different straight-line kernel of 4x the size (66 / 264 KB; the SMs' instruction caches refilled,
//            the code still in L2)
//   streamed after 128 MB read by all SMs (its lines most likely out of L2; the SMs' caches hold it, unless evicted)
//   both     churned and streamed (the code from DRAM)
//
//   nvcc -std=c++17 -O3 -arch=sm_90 scripts/probe_code_fetch.cu -o /tmp/probe_code && /tmp/probe_code
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "probe_util.cuh"

// the timer read once dep is computed (an input of the read, so the compiler cannot move the work after it)
__device__ __forceinline__ uint64_t gtimer_after(uint32_t dep) {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : "r"(dep));
  return t;
}

// S x 128 xorshift steps (about 4 instructions each) over 8 chains: the shifts vary with the step, so no two steps
// fold, and the 8 chains let the warp issue about one instruction a cycle once its code is fetched. SALT makes each
// instantiation's code distinct.
template <int S, int SALT>
__global__ void __launch_bounds__(32) straight(uint32_t seed, uint32_t* sink, uint64_t* out) {
  const uint64_t t0 = gtimer();
  uint32_t c[8];  // seeded from the timer, so no step can run before it is read
#pragma unroll
  for (int j = 0; j < 8; ++j) c[j] = (seed ^ (uint32_t)t0) + j * 0x9e3779b9u + SALT;
#pragma unroll
  for (int i = 0; i < S * 128; ++i) {
    uint32_t& x = c[i & 7];
    x ^= x << ((i * 7 + SALT) % 13 + 1);
    x ^= x >> ((i * 5 + SALT) % 11 + 1);
  }
  uint32_t acc = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) acc ^= c[j];
  const uint64_t t1 = gtimer_after(acc);
  if (acc == 0x12345678u) sink[blockIdx.x] = acc;  // keeps the chains
  if (threadIdx.x == 0) out[blockIdx.x] = t1 - t0;
}

template <int S>  // (CK exits on an error)
static void run_size(int sms, const uint4* big, long big_vec, uint32_t* sink, uint64_t* out) {
  std::vector<uint64_t> o(sms);
  auto kern = straight<S, 0>;
  auto churn = straight<4 * S, 1>;
  uint64_t* junk = out + sms;  // the churn kernel's own times
  std::printf("straight-line code of about %d KB (%d xorshift steps), %d blocks:\n", S * 8, S * 128, sms);
  const char* names[] = {"warm", "churned", "streamed", "both"};
  for (int c = 0; c < 4; ++c) {
    std::vector<double> means, maxes;
    for (int r = 0; r < 9; ++r) {
      kern<<<sms, 32>>>(r, sink, out);
      if (c == 1 || c == 3) churn<<<sms, 32>>>(r, sink, junk);
      if (c >= 2) streamer<<<sms * 4, 512>>>(big, big_vec, sink);
      kern<<<sms, 32>>>(r + 1, sink, out);
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(o.data(), out, sms * 8, cudaMemcpyDeviceToHost));
      double s = 0, m = 0;
      for (int b = 0; b < sms; ++b) {
        s += o[b] / 1e3;
        m = std::max(m, o[b] / 1e3);
      }
      means.push_back(s / sms);
      maxes.push_back(m);
    }
    std::printf("  %-9s mean %7.2f us, largest %7.2f us\n", names[c], median(means), median(maxes));
  }
}

int main() {
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  const int sms = p.multiProcessorCount;
  const long big_bytes = 128L << 20;
  uint4* big;
  uint32_t* sink;
  uint64_t* out;
  CK(cudaMalloc(&big, big_bytes));
  CK(cudaMalloc(&sink, sms * 4));
  CK(cudaMalloc(&out, 2 * sms * 8));
  CK(cudaMemset(big, 1, big_bytes));
  std::printf("%s, %d SMs, L2 %d MB\n", p.name, sms, p.l2CacheSize >> 20);
  run_size<2>(sms, big, big_bytes / 16, sink, out);
  run_size<8>(sms, big, big_bytes / 16, sink, out);
  return 0;
}
