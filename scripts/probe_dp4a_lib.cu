// Probe (sm_80+, no torch): the library's integer-pipe gate+up (csrc/moe_dp4a.cu, moe=fp4_dp4a) in the harness of
// scripts/probe_dp4a_moe.cu — CUDA graphs of 48 launches over 16 rotating sets of 6 distinct experts, 30 replays, the
// median per launch — for NE experts (argv[1], default 64; bench_kernels.py stacks 256), so that the library
// kernel and the probe's resident 16-bit form (probe_dp4a_moe.cu) compare on one machine and one harness.
// -DDS4_DP4A_SCALE_LANE=1 builds moe_dp4a.cu's timing diagnostic (the scales read in lane order; the check then reads
// them so). Session 64's runs 2 and 3 also timed two build-time switches of that session's first kernel, since removed
// (experiments/session64.md: the scale bytes by one byte load per chunk, the default then, 28.4 us; by shuffles 25.8).
//
//   nvcc -std=c++17 -O3 -arch=sm_90 scripts/probe_dp4a_lib.cu -o build/probe_dp4a_lib && build/probe_dp4a_lib 256
//
// Check on the first id set: h against a double-precision host product of bf16 x (relative L2; the bf16 rounding of h
// and the 16-bit activations: ~1e-3).
#include "../csrc/moe_dp4a.cu"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_idp4a.cuh"
#include "probe_moe_harness.cuh"
#include "probe_util.cuh"

namespace ds4 {
// gemv.cu's (resident_wave's SM count), which this probe does not link
int sm_count() {
  int dev = 0, n = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}
}  // namespace ds4

namespace {

constexpr int D = 4096, I = 2048, TOPK = 6, NSETS = 16;

using idp::dev_fill, idp::graph_us;

}  // namespace

int main(int argc, char** argv) {
  const int NE = argc > 1 ? std::atoi(argv[1]) : 64;
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  std::printf("%s; library dp4a gate+up, lane-order scales (diagnostic) %d; %d experts\n", p.name,
              DS4_DP4A_SCALE_LANE, NE);
  const size_t wbytes = (size_t)NE * I * D / 2, sbytes = (size_t)NE * I * D / 32;
  uint8_t *W1 = dev_fill(wbytes, 1, 0, 255), *W3 = dev_fill(wbytes, 2, 0, 255);
  uint8_t *S1 = dev_fill(sbytes, 3, 122, 130), *S3 = dev_fill(sbytes, 4, 122, 130);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<__nv_bfloat16> bx(D);
  for (int k = 0; k < D; ++k) bx[k] = __float2bfloat16(u(rng) * (k % 7 == 0 ? 8.f : 1.f));
  std::vector<float> hrw(TOPK);
  for (auto& v : hrw) v = 0.1f + 0.3f * (u(rng) + 1.f);
  __nv_bfloat16 *x, *hs[NSETS];
  float* rw;
  int64_t* ids[NSETS];
  CK(cudaMalloc(&x, D * 2));
  CK(cudaMemcpy(x, bx.data(), D * 2, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&rw, TOPK * 4));
  CK(cudaMemcpy(rw, hrw.data(), TOPK * 4, cudaMemcpyHostToDevice));
  std::vector<int64_t> set0;
  std::vector<int> perm(NE);
  for (int s = 0; s < NSETS; ++s) {
    for (int e = 0; e < NE; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<int64_t> set(perm.begin(), perm.begin() + TOPK);
    if (s == 0) set0 = set;
    CK(cudaMalloc(&ids[s], TOPK * 8));
    CK(cudaMemcpy(ids[s], set.data(), TOPK * 8, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&hs[s], TOPK * I * 2));
  }
  ds4::MoEArgs a;
  a.fmt = ds4::FMT_FP4, a.n_tok = 1, a.topk = TOPK, a.rw = rw, a.expert_offset = 0, a.n_local = NE;
  a.W1 = W1, a.W3 = W3, a.S1 = S1, a.S3 = S3, a.w13_estride = (long)I * D / 2, a.s13_estride = (long)I * D / 32;
  a.s13_ld = D / 32, a.dim = D, a.inter = I, a.limit = 10.f, a.kernel = ds4::KERNEL_DP4A;
  auto go = [&](int i, cudaStream_t st) {
    ds4::MoEArgs c = a;
    c.ids = ids[i % NSETS];
    CK(ds4::launch_moe_gate_up_dp4a(c, x, hs[i % NSETS], st));
  };
  go(0, 0);
  CK(cudaDeviceSynchronize());
  const float t = graph_us(go);
  // check set 0 against a double product of bf16 x
  std::vector<__nv_bfloat16> hh(TOPK * I);
  CK(cudaMemcpy(hh.data(), hs[0], hh.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<uint8_t> w1(I * D / 2), w3(I * D / 2), s1(I * D / 32), s3(I * D / 32);
  double num = 0, den = 0;
  for (int e = 0; e < TOPK; ++e) {
    const size_t eo = (size_t)set0[e];
    CK(cudaMemcpy(w1.data(), W1 + eo * I * D / 2, w1.size(), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(w3.data(), W3 + eo * I * D / 2, w3.size(), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(s1.data(), S1 + eo * I * D / 32, s1.size(), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(s3.data(), S3 + eo * I * D / 32, s3.size(), cudaMemcpyDeviceToHost));
    for (int j = 0; j < I; j += 7) {  // every 7th row: the host product is slow
      double gu[2] = {0, 0};
      for (int k = 0; k < D; ++k) {
        const double xv = __bfloat162float(bx[k]);
        // (DS4_DP4A_SCALE_LANE: block b's scale read at row byte 4 (b % 32) + b / 32, the lane order)
        const int b = k / 32, bs = DS4_DP4A_SCALE_LANE ? (b % 32) * 4 + b / 32 : b;
        const size_t by = (size_t)j * (D / 2) + k / 2, sc = (size_t)j * (D / 32) + bs;
        gu[0] += idp::e2m1(k & 1 ? w1[by] >> 4 : w1[by] & 15) * idp::e8m0(s1[sc]) * xv;
        gu[1] += idp::e2m1(k & 1 ? w3[by] >> 4 : w3[by] & 15) * idp::e8m0(s3[sc]) * xv;
      }
      const double g = std::min(gu[0], 10.0), uu = std::min(std::max(gu[1], -10.0), 10.0);
      const double want = g / (1 + std::exp(-g)) * uu * hrw[e], got = __bfloat162float(hh[e * I + j]);
      num += (got - want) * (got - want), den += want * want;
    }
  }
  const double bytes = TOPK * (2.0 * I * D / 2 + 2.0 * I * D / 32);
  std::printf("library dp4a gate+up: %6.2f us (%4.0f GB/s) | rel L2 of h against bf16 x: %.2e\n", t,
              bytes / t / 1e3, std::sqrt(num / den));
  return 0;
}
