// Probe: the indexer's top-k kernel alone (csrc/attn/topk.cu, or another version of it named by TOPK_SRC), one row
// of fp32 scores at the long context's sizes, by the kind of scores (sm_90, no torch).
//
// Why: at position 65536 the step's critical path charged the top-k 36-40 us per CSA layer
// (experiments/decode_session42_h200.md), with the profile's zero cache entries (every score equal) and with random
// ones alike. Rows: T entries allocated (16384: a 65536-token cache; 16423: the profile's, just over it, so the
// kernel's P = 32 form; 32768), all visible (pos = 4 T - 1, ratio 4), k = 512; scores zeros, uniform random, or three
// levels. Each figure is the mean of 200 launches on one stream (no PDL), in us. Session 42 (H200): the kernel's time
// follows the entries per thread (about 15 us at 16 per thread, 30 at 32 with half the threads idle), not the ties.
//   nvcc -std=c++17 -O3 -arch=sm_90 -I. -Icsrc/attn -Icsrc -DTOPK_SRC='"csrc/attn/topk.cu"' scripts/probe_topk.cu \
//     -o /tmp/probe_topk && /tmp/probe_topk
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "probe_util.cuh"
#include TOPK_SRC

int main() {
  const int k = 512;
  const int sizes[] = {16384, 16423, 32768};
  const char* kinds[] = {"zeros", "random", "3 levels"};
  std::printf("%-8s %-9s %10s\n", "T", "scores", "us/call");
  for (int T : sizes) {
    std::vector<float> h(T);
    float* d;
    int64_t *pos, *out;
    CK(cudaMalloc(&d, T * sizeof(float)));
    CK(cudaMalloc(&pos, sizeof(int64_t)));
    CK(cudaMalloc(&out, k * sizeof(int64_t)));
    const int64_t p = 4L * T - 1;
    CK(cudaMemcpy(pos, &p, sizeof(p), cudaMemcpyHostToDevice));
    for (int kind = 0; kind < 3; ++kind) {
      std::uniform_real_distribution<float> u(-1.f, 1.f);
      std::uniform_int_distribution<int> lv(0, 2);
      for (auto& v : h) v = kind == 0 ? 0.f : (kind == 1 ? u(rng) : (float)lv(rng));
      CK(cudaMemcpy(d, h.data(), T * sizeof(float), cudaMemcpyHostToDevice));
      const float us = time_us([&](int) { CK(ds4_attn::launch_topk(d, 1, T, k, pos, 4, out, 0)); }, 200);
      std::vector<int64_t> ids(k);
      CK(cudaMemcpy(ids.data(), out, k * sizeof(int64_t), cudaMemcpyDeviceToHost));
      long sum = 0;  // a check that the launches selected something: zeros select 0 .. k - 1
      for (int64_t i : ids) sum += i;
      std::printf("%-8d %-9s %10.2f   (sum of ids %ld)\n", T, kinds[kind], us, sum);
    }
    CK(cudaFree(d));
    CK(cudaFree(pos));
    CK(cudaFree(out));
  }
  return 0;
}
