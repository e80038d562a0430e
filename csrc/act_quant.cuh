// numerics=qat's FP8 activation simulation of 8 bf16 values (ds4.quant.act_quant_sim; spec §11 act_quant, inplace
// form), shared by its own launch (act_quant.cu) and the tensor-core kernels' activation staging (mma_dot.cuh
// stage_mma_rows, gemv.cu stage_mma_rmsnorm): per block of B = 64 or 128 values, amax = max(|x|, 1e-4),
// s = 2^ceil(log2(amax * fp32(1/448))) by the reference's bit trick (the product's exponent, + 1 if its mantissa is
// non-zero), out = e4m3(clamp(x / s, +-448)) * s as bf16 (exact: 4 significant bits times a power of two). The same
// operations as the torch twin in the same fp32 rounding, so the same bits.
#pragma once
#include <cuda_fp8.h>

#include "ds4_common.cuh"
#include "pow2_scale.cuh"

namespace ds4 {

// The 8 bf16 values of v as fp32 (f) and the amax of their block of B values, which B / 8 consecutive lanes hold
// (reduced by shuffles: every one of those lanes takes part).
template <int B>
__device__ __forceinline__ float act_quant_amax(const uint4& v, float (&f)[8]) {
  const uint32_t in[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) Dec<FMT_BF16>::word(in[q], f + 2 * q);
  float m = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(f[j]));
#pragma unroll
  for (int o = 1; o < B / 8; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// act_quant's scale s = 2^(e - 127) of a block's amax, as its biased exponent e: ceil(log2(max(amax, 1e-4) *
// fp32(1/448))) by the reference's bit trick (the product's exponent, + 1 if its mantissa is non-zero).
__device__ __forceinline__ uint32_t act_quant_exp(float amax) {
  return pow2_ceil_exp(__fmul_rn(fmaxf(amax, 1e-4f), 1.0f / 448.0f));
}

// One value's simulation at its block's scale: e4m3(clamp(x / s, +-448)) * s in fp32, x / s as x * sc.inv (the same
// bits, pow2_inv_of_exp). Also the attention entries' FP8 simulation of their nope dims (ds4_attn's decode_glue.cu).
__device__ __forceinline__ float act_quant_value(float x, const Pow2Scale& sc) {
  const float y = fminf(fmaxf(__fmul_rn(x, sc.inv), -448.f), 448.f);
  const __nv_fp8_storage_t e = __nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3);  // nearest, ties to even
  return __fmul_rn(__half2float(__half(__nv_cvt_fp8_to_halfraw(e, __NV_E4M3))), sc.s);
}

// The simulated values of the 8 bf16 in v (16 bytes), a lane's share of a block of B values held by B / 8
// consecutive lanes: every lane of the warp calls it (the amax's shuffles), lanes without values with zeros.
template <int B>
__device__ __forceinline__ uint4 act_quant_vec(const uint4& v) {
  float f[8];
  const Pow2Scale sc = pow2_scale_of_exp(act_quant_exp(act_quant_amax<B>(v, f)));
  uint32_t o4[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const __nv_bfloat162 b = __floats2bfloat162_rn(act_quant_value(f[2 * q], sc), act_quant_value(f[2 * q + 1], sc));
    o4[q] = *reinterpret_cast<const uint32_t*>(&b);
  }
  return make_uint4(o4[0], o4[1], o4[2], o4[3]);
}

}  // namespace ds4
