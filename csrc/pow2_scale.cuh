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

// 1 / s of a scale s = 2^(e - 127) given as its biased exponent e (pow2_ceil_exp's), exactly: 2^(127 - e), biased
// exponent 254 - e, a normal float for 1 <= e <= 253. x * (1 / s) is then the same real number as x / s, rounded once
// the same way: the reference's division, bit for bit, for one multiply instead of an IEEE division per value
// (__fdiv_rn is a multi-instruction sequence). e >= 254 only where the block's amax is infinite (s = inf): 0 there,
// as x / inf (inf * 0 = NaN = inf / inf; NaN stays NaN). pow2_ceil_exp gives e >= 1 for any positive p.
__device__ __forceinline__ float pow2_inv_of_exp(uint32_t e) {
  return e <= 253u ? __uint_as_float((254u - e) << 23) : 0.f;
}

// The scale s = 2^(e - 127) of a biased exponent e (pow2_ceil_exp's) and its exact reciprocal (pow2_inv_of_exp): a
// simulation divides by s as x * inv and multiplies back by s.
struct Pow2Scale {
  float s, inv;
};
__device__ __forceinline__ Pow2Scale pow2_scale_of_exp(uint32_t e) {
  return {__uint_as_float(e << 23), pow2_inv_of_exp(e)};
}

}  // namespace ds4
