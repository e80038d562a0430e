// The reference kernels' power-of-two block scale (ds4.quant.qat._pow2_ceil_scale), shared by numerics=qat's FP8
// activation simulation (act_quant.cuh), the attention entries' FP8 and the indexer's FP4 simulations (ds4_attn).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace ds4 {

// 2^ceil(log2 p) of a positive fp32 p, as its biased exponent (the scale is that << 23 as fp32 bits): p's exponent
// field, + 1 where its mantissa is non-zero (the reference's bit trick; a subnormal p gives 2^-126).
__device__ __forceinline__ uint32_t pow2_ceil_exp(float p) {
  const uint32_t b = __float_as_uint(p);
  return ((b >> 23) & 0xffu) + ((b & 0x7fffffu) != 0u);
}

}  // namespace ds4
