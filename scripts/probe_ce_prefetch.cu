// Probe (sm_80+, no torch): can the copy engines bring the next GEMV's weights into L2 while the FP4 MoE product
// runs, without taking SM time from it?
//
// Why: session 49 prefetched the next block's wq_a + wkv and wq_b into L2 beside the FFN with a kernel
// (prefetch.global.L2 from a side-stream launch): the FFN's FP4 gate+up, which leaves HBM about half busy, was
// charged ~10 us more per layer, and the GEMVs it fed gained nothing on the path (experiments/
// decode_session49_h200.md). A cudaMemcpyAsync of the same bytes into a small scratch buffer issues no SM
// instruction if the driver runs it on a copy engine; whether its source lines stay in L2 for the GEMV that
// follows is what this probe measures.
//
// Per iteration (copy i of rotated buffer sets, so the weights are cold unless prefetched), on stream s0:
// the routed gate+up's FP4 product (fp4t 24576 x 4096, the library's register stream at depth 4), then wq_b's FP8
// product (fp8t 32768 x 1024, depth 2). The copies: wq_b's weights and scales of this iteration, in 1 MB pieces,
// into a 1 MB scratch (cudaMemcpyAsync device to device), on a side stream forked at the iteration's start
// (ce), or joined before the FP8 product (ce_wait: its weights then all passed through L2 before it).
// Every variant is captured as CUDA graphs; the derived line gives the FP8 product after the copies, and what the
// copies cost the FP4 product beside them.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -DDS4_PROBE scripts/probe_ce_prefetch.cu -o build/probe_ce && build/probe_ce
#include "../csrc/gemv.cu"
#include "../csrc/moe.cu"
#include "../csrc/moe_mma.cu"  // gemv.cu's hc_fold_ok asks moe_down_fold_ok
#include "../csrc/moe_dp4a.cu"  // moe.cu's launch_moe_gate_up calls it
#include "probe_gemv.cuh"

#include <cstdio>
#include <vector>

struct Mat {
  int O, K, s_ld;
  size_t wbytes, sbytes;
  std::vector<uint8_t*> W, S;
};

static Mat make_mat(int O, int K, bool fp8, int copies) {
  Mat m{O, K, 0, 0, 0, {}, {}};
  m.wbytes = fp8 ? (size_t)O * K : (size_t)O * K / 2;
  m.s_ld = fp8 ? K / 128 : K / 32;
  m.sbytes = fp8 ? (size_t)((O + 127) / 128) * m.s_ld : (size_t)O * m.s_ld;
  for (int c = 0; c < copies; ++c) {
    m.W.push_back(dev_bytes(m.wbytes, 0, 0x77));  // E4M3 / E2M1 bytes without NaN encodings
    m.S.push_back(dev_bytes(m.sbytes, 120, 130));
  }
  return m;
}

template <typename Kern>
static void launch_gemv(Kern kern, int wave, const Mat& m, int i, const __nv_bfloat16* x, float* y, cudaStream_t st) {
  const int c = i % (int)m.W.size();
  launch_gemv_mma(kern, wave, x, m.W[c], m.S[c], m.s_ld, y, m.O, m.K, st);
}

int main() {
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  const int sms = p.multiProcessorCount;
  std::printf("%s, %d SMs, L2 %d MB, async engines %d\n", p.name, sms, p.l2CacheSize >> 20, p.asyncEngineCount);
  const int copies = 6;  // 6 x (53.5 + 33.6) MB: far more than the L2
  Mat up = make_mat(24576, 4096, false, copies);
  Mat qb = make_mat(32768, 1024, true, copies);
  __nv_bfloat16* x = dev_random<__nv_bfloat16>(4096, -1.f, 1.f);
  float* y1;
  float* y2;
  CK(cudaMalloc(&y1, 24576 * 4));
  CK(cudaMalloc(&y2, 32768 * 4));
  const size_t piece = 1 << 20;
  uint8_t* scratch;
  CK(cudaMalloc(&scratch, piece));
  cudaStream_t s0, s1;
  CK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  auto fp4 = [&](int i) { launch_gemv(ds4::gemv_mma_kernel<ds4::FMT_FP4T, 2, 2, false, false>, 3 * sms, up, i, x, y1, s0); };
  auto fp8 = [&](int i) { launch_gemv(ds4::gemv_mma_kernel<ds4::FMT_FP8T, 1, 2, false, false>, 4 * sms, qb, i, x, y2, s0); };
  auto copy = [&](int i, cudaStream_t st) {
    const int c = i % copies;
    for (size_t off = 0; off < qb.wbytes; off += piece)
      CK(cudaMemcpyAsync(scratch, qb.W[c] + off, std::min(piece, qb.wbytes - off), cudaMemcpyDeviceToDevice, st));
    CK(cudaMemcpyAsync(scratch, qb.S[c], qb.sbytes, cudaMemcpyDeviceToDevice, st));
  };

  // Each variant as one CUDA graph per rotated copy (the decode step is a graph: no host cost between the copies),
  // timed by events around each replay; means over the replays.
  cudaEvent_t fork, join, e0, e1;
  CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  // parts: bit 0 fp4, bit 1 fp8, bit 2 copies beside (forked at the start, joined at the end), bit 3 fp8 waits
  // for the copies, bit 4 copies first and then fp8 (serial, on s0)
  auto capture = [&](int parts, int c) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeThreadLocal));
    if (parts & 4) {
      CK(cudaEventRecord(fork, s0));
      CK(cudaStreamWaitEvent(s1, fork, 0));
      copy(c, s1);
      CK(cudaEventRecord(join, s1));
    }
    if (parts & 16) copy(c, s0);
    if (parts & 1) fp4(c);
    if (parts & 8) CK(cudaStreamWaitEvent(s0, join, 0));
    if (parts & 2) fp8(c);
    if ((parts & 4) && !(parts & 8)) CK(cudaStreamWaitEvent(s0, join, 0));
    CK(cudaStreamEndCapture(s0, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphDestroy(g));
    return ge;
  };
  auto run = [&](int parts, const char* name) {
    std::vector<cudaGraphExec_t> gs;
    for (int c = 0; c < copies; ++c) gs.push_back(capture(parts, c));
    const int iters = 60, warm = 6;
    double t = 0;
    for (int it = 0; it < warm + iters; ++it) {
      CK(cudaEventRecord(e0, s0));
      CK(cudaGraphLaunch(gs[it % copies], s0));
      CK(cudaEventRecord(e1, s0));
      CK(cudaEventSynchronize(e1));
      if (it < warm) continue;
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      t += ms;
    }
    CK(cudaGetLastError());
    for (auto ge : gs) CK(cudaGraphExecDestroy(ge));
    const double us = t * 1e3 / iters;
    std::printf("%-44s %8.2f us\n", name, us);
    return us;
  };
  for (int pass = 0; pass < 2; ++pass) {
    std::printf("\npass %d (copies: %.1f MB of wq_b weights + scales in %zu KB pieces)\n", pass,
                (qb.wbytes + qb.sbytes) / 1e6, piece >> 10);
    const double f4 = run(1, "fp4 alone");
    const double f8 = run(2, "fp8 alone (cold)");
    const double cp = run(4, "copies alone");
    const double cp8 = run(16 | 2, "copies, then fp8");
    const double f4cp = run(1 | 4, "fp4 beside the copies");
    const double base = run(1 | 2, "base: fp4, fp8");
    const double ce = run(1 | 2 | 4, "ce: fp4, fp8; copies beside");
    const double cew = run(1 | 2 | 4 | 8, "ce_wait: fp4, copies joined, fp8");
    std::printf("derived: fp8 after the copies %.2f us (cold %.2f); fp4 slowed by the copies %+.2f us; "
                "ce - base %+.2f us, ce_wait - base %+.2f us\n",
                cp8 - cp, f8, f4cp - f4, ce - base, cew - base);
  }
  return 0;
}
