// numerics=qat's FP8 activation simulation in one launch (ds4.quant.act_quant_sim; the arithmetic: act_quant.cuh).
// Why: the twin is about a dozen torch launches, run before every FP8 / FP4 GEMV of a qat decode step; with the
// library's fastest options that made qat 3.6 times slower than plain on an H200 (372 against 104 us per layer,
// experiments/decode_session52_h200.md). The tensor-core kernels apply the same simulation in their activation
// staging (act_quant=True), where this launch is not needed.
// One thread per 8 values (16 bytes); the B / 8 threads of a block are consecutive lanes, which reduce its amax by
// shuffles. Rows of K values, K % B == 0.
#include "act_quant.cuh"
#include "ds4_launch.h"

namespace ds4 {

constexpr int AQ_THREADS = 256;

template <int B>
__global__ void __launch_bounds__(AQ_THREADS) act_quant_sim_kernel(const uint4* __restrict__ x, uint4* __restrict__ out,
                                                                   long n8) {
  ds4_pdl::begin();
  const long i = (long)blockIdx.x * AQ_THREADS + threadIdx.x;
  const bool ok = i < n8;  // the lanes past the end still take part in the shuffles (whole blocks of B / 8 lanes)
  const uint4 q = act_quant_vec<B>(ok ? x[i] : make_uint4(0u, 0u, 0u, 0u));
  if (ok) out[i] = q;
}

cudaError_t launch_act_quant_sim(const void* x, void* out, long rows, int K, int block, cudaStream_t st) {
  if (rows < 1 || K < block || K % block != 0 || (block != 64 && block != 128)) return cudaErrorInvalidValue;
  const long n8 = rows * (long)K / 8, blocks = (n8 + AQ_THREADS - 1) / AQ_THREADS;
  if (blocks > 0x7fffffffL) return cudaErrorInvalidValue;
  const uint4* xi = static_cast<const uint4*>(x);
  uint4* o = static_cast<uint4*>(out);
  const dim3 grid((unsigned)blocks), threads(AQ_THREADS);
  return block == 64 ? ds4_pdl::launch(act_quant_sim_kernel<64>, grid, threads, 0, st, xi, o, n8)
                     : ds4_pdl::launch(act_quant_sim_kernel<128>, grid, threads, 0, st, xi, o, n8);
}

}  // namespace ds4
