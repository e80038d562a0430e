// The probes' reference: one launch of the library's one-token tensor-core GEMV (a gemv_mma_kernel instance) over
// O x K weights, fp32 out, its 16-row tiles split evenly over a resident wave of `wave` blocks, as gemv_mma_go
// launches it (no PDL, no norm, no fold, no bulk staging). Include after ../csrc/gemv.cu (scripts/probe_bulk.cu, probe_hfma.cu,
// probe_ce_prefetch.cu).
#pragma once
#include "probe_util.cuh"

template <typename Kern>
static void launch_gemv_mma(Kern kern, int wave, const __nv_bfloat16* x, const uint8_t* W, const uint8_t* S, int s_ld,
                            float* out, int O, int K, cudaStream_t st = 0) {
  const int T = O / 16, tpb = ds4::mma_tiles_per_block(T, wave);
  const long smem = 4L * ds4::mma_part_floats(tpb) + 2L * K;
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  kern<<<(T + tpb - 1) / tpb, ds4::MMA_STREAM_THREADS, smem, st>>>(x, W, S, s_ld, out, 1, O, K, 0, tpb, nullptr, 0, 0.f,
                                                                    ds4::HcFold{}, -1, ds4::RowSkip{}, 0);
}

// One fp4t product shape of the probes (probe_bulk.cu, probe_hfma.cu): `copies` random weight / scale sets of O x K
// (enough to rotate 400 MB past L2; E8M0 scale bytes in [scale_lo, scale_hi]), bf16 activations x (make_x(k) for
// k < K, drawn after the weights), a reference output yref and a probe output y. Rows print at `width`, the relative
// L2 against the reference named `ref_name`.
struct Fp4tShape {
  int O, K, s_ld, copies;
  size_t wbytes, total;  // one set's weight bytes; with its scales
  std::vector<uint8_t*> Ws, Ss;
  __nv_bfloat16* x = nullptr;
  float *yref = nullptr, *y = nullptr;
  std::vector<float> h_ref, h_y;
  int width;
  const char* ref_name;

  template <typename MakeX>
  Fp4tShape(int O_, int K_, int scale_lo, int scale_hi, MakeX make_x, int width_, const char* ref_name_)
      : O(O_), K(K_), s_ld(K_ / 32), wbytes((size_t)O_ * K_ / 2), h_ref(O_), h_y(O_), width(width_),
        ref_name(ref_name_) {
    total = wbytes + (size_t)O * s_ld;
    copies = (int)(400e6 / total) + 1;
    for (int c = 0; c < copies; ++c) {
      Ws.push_back(dev_bytes(wbytes, 0, 255));
      Ss.push_back(dev_bytes((size_t)O * s_ld, scale_lo, scale_hi));
    }
    std::vector<__nv_bfloat16> hx(K);
    for (int k = 0; k < K; ++k) hx[k] = make_x(k);
    CK(cudaMalloc(&x, K * 2));
    CK(cudaMemcpy(x, hx.data(), K * 2, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&yref, O * 4));
    CK(cudaMalloc(&y, O * 4));
    std::printf("\nfp4t %dx%d: %.1f MB with scales, %d copies rotated\n", O, K, total / 1e6, copies);
  }
  ~Fp4tShape() {
    for (auto* q : Ws) cudaFree(q);
    for (auto* q : Ss) cudaFree(q);
    cudaFree(x);
    cudaFree(y);
    cudaFree(yref);
  }

  // the library's gemv_mma kernel `kern` over copy i % copies into o
  template <typename Kern> void gemv(Kern kern, int wave, int i, float* o) const {
    launch_gemv_mma(kern, wave, x, Ws[i % copies], Ss[i % copies], s_ld, o, O, K);
  }
  // yref (written by the launches before) as the reference the checks read
  void keep_ref() {
    CK(cudaDeviceSynchronize());
    CK(cudaGetLastError());
    CK(cudaMemcpy(h_ref.data(), yref, O * 4, cudaMemcpyDeviceToHost));
  }
  void report(const char* name, float us, bool check) {
    std::printf("%-*s %7.2f us %6.0f GB/s", width, name, us, total / us / 1e3);
    if (check) {
      CK(cudaMemcpy(h_y.data(), y, O * 4, cudaMemcpyDeviceToHost));
      std::printf("  rel L2 vs %s %.2e", ref_name, rel_l2(h_y, h_ref));
    }
    std::printf("\n");
  }
  // go(i) (launches over copy i, output y) timed and reported; y poisoned first (every row must be written), and where
  // checked, copy 0 run again (the timing loop ends on another copy)
  template <typename Go> void variant(const char* name, Go go, bool check) {
    CK(cudaMemset(y, 0xff, O * 4));
    go(0);
    CK(cudaDeviceSynchronize());
    CK(cudaGetLastError());
    const float us = time_us(go);
    if (check) {
      go(0);
      CK(cudaDeviceSynchronize());
    }
    report(name, us, check);
  }
};
