// Probe (sm_80+, no torch): would the FP4 routed kernels' arithmetic run faster with an fp16 decode?
//
// Why: the routed experts' tensor-core kernels are bound by their FP4 arithmetic on the ALU pipe (session 22), and
// the decode is 7 ALU instructions per word of 8 nibbles (fp4p_regs, bf16 registers). scripts/fp4_decode_search.py
// finds no cheaper bit layout for bf16 registers, but one for fp16 registers: 6 LOP3 per word, every shift a left
// shift (IMAD.SHL, the FMA pipe). Building it means an fp16 B operand too (activations staged as fp16 with a per-block
// scale). This probe times the arithmetic alone first: the same rounds as MmaStream's (16 words per lane: 2 chunks of
// rows g and g+8, 16 MMAs, 8 scale FFMA pairs), weights and activations from shared memory (volatile loads, so
// nothing is hoisted), no global traffic, one resident wave of 3 blocks of 8 warps per SM (the routed gate+up's).
//
//   nvcc -std=c++17 -O3 -arch=sm_90 scripts/probe_fp16_decode.cu -o /tmp/probe_fp16 && /tmp/probe_fp16
//
// Modes: bf16 (fp4p_regs + bf16 MMA, today's), fp16 (the 6-LOP3 decode + f16 MMA), mask (one LOP3 per register and
// no shift: wrong values, the floor of any decode by masks). The host first checks the fp16 decode's values for every nibble
// at every position against E2M1 x 2^-14. Prints µs per launch and per-round figures.
// Result (H200, experiments/decode_session34_h200.md run 4): fp16 2232 us against bf16 2306 (0.968), the mask floor
// 1524: the fp16 decode's extra IMAD.SHL take most of what its fewer ALU instructions give, so it was not built.
#include "../csrc/mma_dot.cuh"
#include "probe_fp4h.cuh"
#include "probe_util.cuh"

#include <cmath>
#include <cstdio>
#include <cstring>

namespace p16 {

// The fp16 decode (scripts/fp4_decode_search.py, probe_fp4h.cuh): register i holds two values s 000e1e0 m000000000
// (x 2^-14).
using fp4h::regs;

__device__ __forceinline__ void mma_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                        uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

enum Mode { BF16 = 0, FP16 = 1, MASK = 2 };

// rounds of MmaStream's W = 2 FP4 work per warp; weights / B / scales from shared memory at a round-dependent slot
template <int MODE>
__global__ void __launch_bounds__(256, 3) arith_kernel(int rounds, float* out) {
  __shared__ uint4 ws[4][8][32];  // 4 round slots x 8 chunks (a round reads 0, 1, 4, 5: rows g, g+8 of its 2) x lanes
  __shared__ uint4 xb[4][8];      // B values per round slot
  __shared__ uint32_t scs[4][2][32];
  const int lane = threadIdx.x & 31;
  for (int i = threadIdx.x; i < 4 * 8 * 32; i += blockDim.x) {
    const uint32_t h = (uint32_t)i * 2654435761u;
    reinterpret_cast<uint4*>(ws)[i] = make_uint4(h, h ^ 0x9e3779b9u, h * 3u, ~h);
  }
  for (int i = threadIdx.x; i < 4 * 8; i += blockDim.x)
    reinterpret_cast<uint4*>(xb)[i] = make_uint4(0x3f803f80u, 0x3f003f00u, 0x3f803f80u, 0x3f003f00u);
  for (int i = threadIdx.x; i < 4 * 2 * 32; i += blockDim.x) reinterpret_cast<uint32_t*>(scs)[i] = 0x7f7f7f7fu;
  __syncthreads();
  float acc0 = 0.f, acc1 = 0.f;
  for (int r = 0; r < rounds; ++r) {
    const int slot = r & 3;
    const uint32_t wa = (uint32_t)__cvta_generic_to_shared(&ws[slot][0][lane]);
    const uint32_t sb = (uint32_t)__cvta_generic_to_shared(&xb[slot][0]);
    const uint32_t s0 = scs[slot][0][lane], s1 = scs[slot][1][lane];
#pragma unroll
    for (int w = 0; w < 2; ++w) {  // the round's two chunks
      const uint4 ga = ds4::lds128(wa + 16u * 32u * (4 * w)), gb = ds4::lds128(wa + 16u * 32u * (4 * w + 1));
      const uint32_t qa[4] = {ga.x, ga.y, ga.z, ga.w}, qb[4] = {gb.x, gb.y, gb.z, gb.w};
      float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint4 b = ds4::lds128(sb + 16u * (4 * w + k) % 128u);
        uint32_t ra[4], rb[4];
        if (MODE == BF16) {
          ds4::fp4p_regs(qa[k], ra);
          ds4::fp4p_regs(qb[k], rb);
        } else if (MODE == FP16) {
          regs(qa[k], ra);
          regs(qb[k], rb);
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) {  // one mask per register, no shift (wrong values: a floor, not a decode)
            ra[i] = qa[k] & (0x81C081C0u >> i);
            rb[i] = qb[k] & (0x81C081C0u >> i);
          }
        }
        if (MODE == FP16) {
          mma_f16(d, ra[0], rb[0], ra[1], rb[1], b.x, b.y);
          mma_f16(d, ra[2], rb[2], ra[3], rb[3], b.z, b.w);
        } else {
          ds4::mma_16816(d, ra[0], rb[0], ra[1], rb[1], b.x, b.y);
          ds4::mma_16816(d, ra[2], rb[2], ra[3], rb[3], b.z, b.w);
        }
      }
      acc0 = fmaf(d[0], ds4::e8m0_mma_scale(s0, w), acc0);
      acc0 = fmaf(d[1], ds4::e8m0_mma_scale(s0, 2 + w), acc0);
      acc1 = fmaf(d[2], ds4::e8m0_mma_scale(s1, w), acc1);
      acc1 = fmaf(d[3], ds4::e8m0_mma_scale(s1, 2 + w), acc1);
    }
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc0 + acc1;
}

// E2M1 value of nibble v (s e1 e0 m)
static float e2m1(int v) {
  static const float mag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  return (v & 8 ? -1.f : 1.f) * mag[v & 7];
}

static float half_bits_to_float(uint32_t h) {  // IEEE fp16 -> float (normals, subnormals, zeros)
  const int s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
  const float v = e == 0 ? std::ldexp((float)m, -24) : std::ldexp(1.f + m / 1024.f, e - 15);
  return s ? -v : v;
}

// Where regs takes value j (register j / 2, half j % 2) from: its sign bit and its e1 e0 m bits in the word.
static void place(int j, int bits[4]) {  // bits[0] = s, bits[1..3] = e1, e0, m
  const int reg = j / 2, hi = (j % 2) * 16;
  bits[0] = fp4h::sign_bit(reg) + hi;
  bits[1] = fp4h::mag_lsb(reg) + 2 + hi;
  bits[2] = fp4h::mag_lsb(reg) + 1 + hi;
  bits[3] = fp4h::mag_lsb(reg) + hi;
}

static bool check_decode() {
  int bad = 0;
  for (int j = 0; j < 8; ++j)
    for (int v = 0; v < 16; ++v) {
      int bits[4];
      place(j, bits);
      uint32_t q = ((v >> 3) & 1u) << bits[0] | ((v >> 2) & 1u) << bits[1] | ((v >> 1) & 1u) << bits[2] |
                   (v & 1u) << bits[3];
      uint32_t r[4];
      regs(q, r);
      const uint32_t h = (r[j / 2] >> (16 * (j % 2))) & 0xffffu;
      const float got = half_bits_to_float(h) * 16384.f, want = e2m1(v);
      bad += got != want && !(got == 0.f && want == 0.f);
      for (int i = 0; i < 4; ++i)  // the other registers stay zero
        bad += i != j / 2 && r[i] != 0u;
      bad += ((r[j / 2] >> (16 * (1 - j % 2))) & 0xffffu) != 0u;
    }
  std::printf("fp16 decode check: %s (%d mismatches over 8 positions x 16 nibbles)\n", bad ? "FAILED" : "ok", bad);
  return bad == 0;
}

}  // namespace p16

int main() {
  if (!p16::check_decode()) return 1;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int blocks = 3 * sms, rounds = 2048;
  float* out;
  CK(cudaMalloc(&out, sizeof(float) * blocks * 256));
  const double warp_rounds = (double)blocks * 8 * rounds;
  const char* names[3] = {"bf16 decode (fp4p_regs) + bf16 MMA", "fp16 decode (6 LOP3) + f16 MMA",
                          "4 LOP3 per word (a floor) + bf16 MMA"};
  float us[3];
  us[0] = time_us([&](int) { p16::arith_kernel<p16::BF16><<<blocks, 256>>>(rounds, out); }, 20);
  us[1] = time_us([&](int) { p16::arith_kernel<p16::FP16><<<blocks, 256>>>(rounds, out); }, 20);
  us[2] = time_us([&](int) { p16::arith_kernel<p16::MASK><<<blocks, 256>>>(rounds, out); }, 20);
  std::printf("%d blocks x 8 warps x %d rounds (W = 2: 16 words, 16 MMAs per lane-round), clock attr %.2f GHz\n",
              blocks, rounds, clock_ghz());
  for (int m = 0; m < 3; ++m)
    std::printf("  %-40s %9.1f us  %6.2f ns per warp-round per SM\n", names[m], us[m],
                us[m] * 1e3 / (warp_rounds / sms));
  std::printf("fp16 / bf16 = %.3f\n", us[1] / us[0]);
  return 0;
}
