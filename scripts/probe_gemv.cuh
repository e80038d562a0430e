// The probes' reference: one launch of the library's one-token tensor-core GEMV (a gemv_mma_kernel instance) over
// O x K weights, fp32 out, its 16-row tiles split evenly over a resident wave of `wave` blocks, as gemv_mma_go
// launches it (no PDL, no norm, no fold). Include after ../csrc/gemv.cu (scripts/probe_bulk.cu, probe_hfma.cu,
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
                                                                    ds4::HcFold{}, -1, ds4::RowSkip{});
}
