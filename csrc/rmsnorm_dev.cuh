// Weighted RMSNorm pieces over 16-byte vectors of 8 bf16, shared by ds4_attn's rms_norm_vec_kernel
// (decode_glue.cu) and the GEMV that stages q_norm'ed activations (gemv.cu, gemv_rmsnorm): one source
// for the arithmetic and its order, so both round every value the same way.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

namespace ds4_norm {

// ss + the squares of the 8 values of v, added in element order
__device__ __forceinline__ float sumsq8(const uint4& v, float ss) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __bfloat1622float2(p[k]);
    ss += f.x * f.x + f.y * f.y;
  }
  return ss;
}

// The 8 weights at w[c0..c0+8) (fp32 or bf16) as fp32
__device__ __forceinline__ void load8_weight(const void* w, bool w_f32, int c0, float* out) {
  if (w_f32) {
    const float4 a = *reinterpret_cast<const float4*>(static_cast<const float*>(w) + c0);
    const float4 b = *reinterpret_cast<const float4*>(static_cast<const float*>(w) + c0 + 4);
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w; out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
  } else {
    const uint4 v = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(w) + c0);
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = __bfloat1622float2(p[k]);
      out[2 * k] = f.x;
      out[2 * k + 1] = f.y;
    }
  }
}

// bf16(x * r * w) of the 8 values of v, rounded once each
__device__ __forceinline__ uint4 scale8(const uint4& v, float r, const float* w) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
  uint4 o;
  __nv_bfloat162* q = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __bfloat1622float2(p[k]);
    q[k] = __floats2bfloat162_rn(f.x * r * w[2 * k], f.y * r * w[2 * k + 1]);
  }
  return o;
}

}  // namespace ds4_norm
