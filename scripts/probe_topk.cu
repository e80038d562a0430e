// Probe: the indexer's top-k kernel alone (csrc/attn/topk.cu, or another version of it named by TOPK_SRC), one row
// of fp32 scores at the long context's sizes, by the kind of scores (sm_90, no torch).
//
// Why: at position 65536 the step's critical path charged the top-k 36-40 us per CSA layer
// (experiments/decode_session42_h200.md), with the profile's zero cache entries (every score equal) and with random
// ones alike. Rows (k = 512): T = 16384 entries allocated and visible (a 65536-token cache); T = 16423 with 16384
// visible (the profile's allocation at position 65536, entries past them -inf as the indexer writes them); T = 32768
// all visible. Scores zeros, uniform random, or three levels. Each figure is the mean of 200 launches on one stream
// (no PDL), in us; each selection is checked against the host's (the k largest, ties lowest index first).
// Session 42 (H200): the kernel's time followed the entries per thread (about 15 us at 16 per thread, 30 at 32 with
// half the threads idle), not the ties; session 43 spread the visible entries over all threads, then strided them
// (experiments/decode_session43_h200.md, experiments/s43_attempts/probe_topk_variants.sh for the variants).
// Session 44 added the wide form (rows past 32768 entries, one block per 8192 entries meeting at grid barriers):
// rows "wide" run launch_topk_wide at 16384 / 32768 entries too (what the one-block form does there), the longer
// rows go through launch_topk (the wide form), up to 2^19 entries (2M tokens at ratio 4), and one row of 262144
// with 100000 visible (a decode position inside a long allocation).
// WITHOUT_WIDE: a TOPK_SRC from before session 44 (the first three rows only).
//   nvcc -std=c++17 -O3 -arch=sm_90 -I. -Icsrc/attn -Icsrc -DTOPK_SRC='"csrc/attn/topk.cu"' scripts/probe_topk.cu \
//     -o /tmp/probe_topk && /tmp/probe_topk
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "probe_util.cuh"
#include TOPK_SRC

// The kernel's selection on the host: the k largest by the kernel's key order (float order, -0 below +0), ties
// lowest index first; sorted ids.
static uint32_t host_key(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
static std::vector<int64_t> host_topk(const std::vector<float>& v, int n, int k) {
  std::vector<int64_t> id(n);
  for (int i = 0; i < n; ++i) id[i] = i;
  std::stable_sort(id.begin(), id.end(), [&](int64_t a, int64_t b) { return host_key(v[a]) > host_key(v[b]); });
  id.resize(k);
  std::sort(id.begin(), id.end());
  return id;
}

int main() {
  const int k = 512;
  // (entries allocated, visible): a 65536-token cache; the profile's allocation at position 65536 (P = 32 form,
  // 16384 visible); 32768 all visible
  // (entries allocated, visible, 1 = launch_topk_wide whatever T)
  const int sizes[][3] = {{16384, 16384, 0}, {16423, 16384, 0}, {32768, 32768, 0},
#ifndef WITHOUT_WIDE
                          {16384, 16384, 1}, {32768, 32768, 1}, {65536, 65536, 0}, {131072, 131072, 0},
                          {262144, 262144, 0}, {262144, 100000, 0}, {524288, 524288, 0}
#endif
  };
  const char* kinds[] = {"zeros", "random", "3 levels"};
  std::printf("%-8s %-8s %-5s %-9s %10s\n", "T", "visible", "form", "scores", "us/call");
  int bad = 0;
  for (const auto& sz : sizes) {
    const int T = sz[0], n = sz[1];
    const bool wide = sz[2] != 0 || T > 32768;
#ifndef WITHOUT_WIDE
    auto launch = [&](const float* d, const int64_t* pos, int64_t* out) {
      return sz[2] ? ds4_attn::launch_topk_wide(d, 1, T, k, pos, 4, out, 0)
                   : ds4_attn::launch_topk(d, 1, T, k, pos, 4, out, 0);
    };
#else
    auto launch = [&](const float* d, const int64_t* pos, int64_t* out) {
      return ds4_attn::launch_topk(d, 1, T, k, pos, 4, out, 0);
    };
#endif
    std::vector<float> h(T);
    float* d;
    int64_t *pos, *out;
    CK(cudaMalloc(&d, T * sizeof(float)));
    CK(cudaMalloc(&pos, sizeof(int64_t)));
    CK(cudaMalloc(&out, k * sizeof(int64_t)));
    const int64_t p = 4L * n;  // (p + 1) / 4 = n visible
    CK(cudaMemcpy(pos, &p, sizeof(p), cudaMemcpyHostToDevice));
    for (int kind = 0; kind < 3; ++kind) {
      std::uniform_real_distribution<float> u(-1.f, 1.f);
      std::uniform_int_distribution<int> lv(0, 2);
      for (int i = 0; i < T; ++i)
        h[i] = i >= n ? -INFINITY : (kind == 0 ? 0.f : (kind == 1 ? u(rng) : (float)lv(rng)));
      CK(cudaMemcpy(d, h.data(), T * sizeof(float), cudaMemcpyHostToDevice));
      const float us = time_us([&](int) { CK(launch(d, pos, out)); }, 200);
      std::vector<int64_t> ids(k);
      CK(cudaMemcpy(ids.data(), out, k * sizeof(int64_t), cudaMemcpyDeviceToHost));
      long sum = 0;  // zeros select 0 .. k - 1
      for (int64_t i : ids) sum += i;
      std::sort(ids.begin(), ids.end());
      const bool ok = ids == host_topk(h, n, k);
      bad += !ok;
      std::printf("%-8d %-8d %-5s %-9s %10.2f   (sum of ids %ld, %s)\n", T, n, wide ? "wide" : "one",
                  kinds[kind], us, sum,
                  ok ? "equal to the host's" : "DIFFERS from the host's");
    }
    CK(cudaFree(d));
    CK(cudaFree(pos));
    CK(cudaFree(out));
  }
  return bad ? 1 : 0;
}
