// Probe (sm_80+, no torch): the one-token FP4 product on the integer pipe (IDP4A) instead of BF16 mma.sync.
//
// Why: session 49's probe (experiments/decode_session49_h200.md §3) put the routed top-6's FP4 arithmetic alone at
// 16.1 + 9.7 us (gate+up + down), above their bytes' floor (12.6 + 6.3 us at 4.25 TB/s); the MMAs with their fragment
// loads take 10.4 of the 16.1 (one token uses 1 of the MMA's 8 columns) and the decode 3.7. Here the weights stay plain E2M1 bytes (low nibble first, as stored) and are never decoded to floats:
// 2 x E2M1 is an integer in [-12, 12], so with the activations as int8 per 32-value block (scale amax / 127) a
// block's dot product is exact in int32. One PRMT looks 4 nibbles up in the magnitude table {0,1,2,3,4,6,8,12}; its
// selector's top bit (the E2M1 sign) makes PRMT write 0 instead (sign replicate of a byte < 128), so
//   dot = dp4a(prmt(w), x) - dp4a(prmt(w ^ 0x88888888), x)
// takes 11 integer instructions per 8 weights (2 shifts, 1 LOP3, 4 PRMT, 4 IDP4A), with independent accumulators
// per row. ACT16: the activations as 16-bit per block (hi int8, lo uint8; 8 IDP4A per 8
// weights) — closer to BF16 than int8 is. Not a ds4 option: a measurement of the arithmetic's cost.
// (prmt and the weights' load: scripts/probe_idp4a.cuh.)
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -DDS4_PROBE scripts/probe_dp4a.cu -o /tmp/probe_dp4a && /tmp/probe_dp4a
//
// Per shape (the routed top-6 gate+up 24576 x 4096 and down 4096 x 12288, as probe_bulk.cu): the library's
// register-stream tensor-core kernel (gemv_mma_kernel<FMT_FP4T>) at its depths, then the IDP4A kernel's forms, timed
// on the same bytes (weights rotated through more than L2; "L2" rows: every warp reads the first 256 rows, so the
// arithmetic with its weights in L2). A warp takes R rows over a K slice (the down's 12288 in slices of 1024-4096:
// enough warps), each slice its own partial row; the host adds them (not timed). Checks (copy 0, the bytes read as
// plain E2M1 with this probe's scale order): rel L2 against a double-precision host product with the same quantized
// activations (the arithmetic: ~1e-7), and against the bf16 activations (what the quantization costs).
// Session 63: run 2 timed the first form (a warp per R rows over the whole K), run 3 this one
// (experiments/session63.md).
#include "../csrc/gemv.cu"
#include "../csrc/moe.cu"
#include "../csrc/moe_mma.cu"  // gemv.cu's hc_fold_ok asks moe_down_fold_ok
#include "../csrc/moe_dp4a.cu"  // moe.cu's launch_moe_gate_up calls it
#include "probe_gemv.cuh"
#include "probe_idp4a.cuh"

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace idp {

constexpr int THREADS = 256;

// One word of 8 E2M1 weights (k = 8j .. 8j+7) against x words x0 (k 8j..8j+3) and x1: the positive and the negative
// weights' sums (T int: int8 activations; T uint32_t: ACT16's unsigned low bytes).
template <typename T>
__device__ __forceinline__ void word8(uint32_t w, T x0, T x1, T& ap, T& an) {
  const uint32_t wn = w ^ 0x88888888u;
  ap = __dp4a((T)prmt(TAB_LO, TAB_HI, w), x0, ap);
  ap = __dp4a((T)prmt(TAB_LO, TAB_HI, w >> 16), x1, ap);
  an = __dp4a((T)prmt(TAB_LO, TAB_HI, wn), x0, an);
  an = __dp4a((T)prmt(TAB_LO, TAB_HI, wn >> 16), x1, an);
}

// y[s][o] = sum over slice s of k of w[o,k] x[k]: a warp per (R rows, K slice of KBS * 1024 values); lane l takes the
// 32-value blocks b = it * 32 + l (16 weight bytes per row, one E8M0 scale) of its slice's its, all its loads out
// together. Weights row-major [O][K/2]; the scale of (o, b) at S[o * s_ld + l * KB + it] (KB = K / 1024). Each slice
// writes its own partial row (the reader adds the slices; not timed here). xh: int8 activations [K] (ACT16: the high
// bytes), xl: ACT16's low bytes (unsigned), xs: the blocks' scales [K/32].
template <int R, int KBS, bool ACT16, bool L2ONLY>
__global__ void __launch_bounds__(THREADS) gemv_dp4a(const uint8_t* __restrict__ W, const uint8_t* __restrict__ S,
                                                     int s_ld, const uint32_t* __restrict__ xh,
                                                     const uint32_t* __restrict__ xl, const float* __restrict__ xs,
                                                     float* __restrict__ y, int O, int K) {
  const int lane = threadIdx.x & 31;
  const int KB = K / 1024, slices = KB / KBS;
  const int warp = blockIdx.x * (THREADS / 32) + (threadIdx.x >> 5);
  const int slice = warp % slices, row0 = warp / slices * R, it0 = slice * KBS;
  if (row0 >= O) return;
  uint4 wv[R][KBS];
  uint8_t sc[R][KBS];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const long o = L2ONLY ? (row0 + r) % 256 : row0 + r;
    const uint8_t* wr = W + o * (K / 2);
#pragma unroll
    for (int i = 0; i < KBS; ++i) {
      wv[r][i] = ld_stream(wr + (long)((it0 + i) * 32 + lane) * 16);
      sc[r][i] = S[o * s_ld + lane * KB + it0 + i];
    }
  }
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
#pragma unroll
  for (int i = 0; i < KBS; ++i) {
    const int b = (it0 + i) * 32 + lane;
    const uint4 h0 = __ldg(reinterpret_cast<const uint4*>(xh) + 2 * b), h1 = __ldg(reinterpret_cast<const uint4*>(xh) + 2 * b + 1);
    const int xw[8] = {(int)h0.x, (int)h0.y, (int)h0.z, (int)h0.w, (int)h1.x, (int)h1.y, (int)h1.z, (int)h1.w};
    uint32_t lw[8];
    if (ACT16) {
      const uint4 l0 = __ldg(reinterpret_cast<const uint4*>(xl) + 2 * b), l1 = __ldg(reinterpret_cast<const uint4*>(xl) + 2 * b + 1);
      lw[0] = l0.x, lw[1] = l0.y, lw[2] = l0.z, lw[3] = l0.w, lw[4] = l1.x, lw[5] = l1.y, lw[6] = l1.z, lw[7] = l1.w;
    }
    const float xsb = __ldg(xs + b);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint32_t ww[4] = {wv[r][i].x, wv[r][i].y, wv[r][i].z, wv[r][i].w};
      int ap = 0, an = 0;
      uint32_t lp = 0, ln = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        word8(ww[j], xw[2 * j], xw[2 * j + 1], ap, an);
        if (ACT16) word8(ww[j], lw[2 * j], lw[2 * j + 1], lp, ln);
      }
      float dot = (float)(ap - an);
      if (ACT16) dot = fmaf(dot, 256.f, (float)((int)lp - (int)ln));
      const float ws = e8m0(sc[r][i]);
      acc[r] = fmaf(dot, xsb * ws, acc[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float v = acc[r];
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
    if (lane == 0) y[(long)slice * O + row0 + r] = 0.5f * v;  // the table holds 2 x |E2M1|
  }
}

}  // namespace idp

static void probe_shape(int sms, int O, int K) {
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> xf(K);
  // activations with a spread of magnitudes (a block's small values are where int8 loses most)
  Fp4tShape sh(O, K, 122, 130, [&](int k) {
    const float v = u(rng) * (k % 7 == 0 ? 8.f : 1.f);
    xf[k] = __bfloat162float(__float2bfloat16(v));
    return __float2bfloat16(v);
  }, 52, "host");
  const int KB = K / 1024;
  // the activations quantized per 32-value block, int8 and 16-bit (hi int8, lo uint8)
  std::vector<int8_t> q8(K), h16(K);
  std::vector<uint8_t> l16(K);
  std::vector<float> s8(K / 32), s16(K / 32);
  for (int b = 0; b < K / 32; ++b) {
    float amax = 0.f;
    for (int k = 32 * b; k < 32 * b + 32; ++k) amax = std::max(amax, std::fabs(xf[k]));
    s8[b] = amax > 0 ? amax / 127.f : 1.f;
    s16[b] = amax > 0 ? amax / 32767.f : 1.f;
    for (int k = 32 * b; k < 32 * b + 32; ++k) {
      q8[k] = (int8_t)std::lrint(xf[k] / s8[b]);
      const int q = (int)std::lrint(xf[k] / s16[b]);
      h16[k] = (int8_t)(q >> 8);  // arithmetic shift: q = 256 hi + lo
      l16[k] = (uint8_t)(q & 255);
    }
  }
  auto up = [](const void* h, size_t n) {
    void* d;
    CK(cudaMalloc(&d, n));
    CK(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice));
    return d;
  };
  auto* dq8 = (uint32_t*)up(q8.data(), K);
  auto* dh16 = (uint32_t*)up(h16.data(), K);
  auto* dl16 = (uint32_t*)up(l16.data(), K);
  auto* ds8 = (float*)up(s8.data(), K / 32 * sizeof(float));
  auto* ds16 = (float*)up(s16.data(), K / 32 * sizeof(float));

  // host references on copy 0, its bytes read as plain E2M1 with this probe's scale order
  std::vector<uint8_t> w0((size_t)O * K / 2), sc0((size_t)O * sh.s_ld);
  CK(cudaMemcpy(w0.data(), sh.Ws[0], w0.size(), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(sc0.data(), sh.Ss[0], sc0.size(), cudaMemcpyDeviceToHost));
  std::vector<float> ref_bf(O), ref_8(O), ref_16(O);
  for (int o = 0; o < O; ++o) {
    double a = 0, b8 = 0, b16 = 0;
    for (int blk = 0; blk < K / 32; ++blk) {
      const int lane = blk % 32, it = blk / 32;
      const double ws = idp::e8m0(sc0[(size_t)o * sh.s_ld + lane * KB + it]);
      double da = 0, d8 = 0, d16 = 0;
      for (int k = 32 * blk; k < 32 * blk + 32; ++k) {
        const uint8_t by = w0[(size_t)o * (K / 2) + k / 2];
        const double w = idp::e2m1(k & 1 ? by >> 4 : by & 15);
        da += w * xf[k];
        d8 += w * q8[k];
        d16 += w * (256.0 * h16[k] + l16[k]);
      }
      a += ws * da, b8 += ws * s8[blk] * d8, b16 += ws * s16[blk] * d16;
    }
    ref_bf[o] = (float)a, ref_8[o] = (float)b8, ref_16[o] = (float)b16;
  }

  // the library's register stream (U 4 / 2 / 1 at 2 / 3 / 4 blocks per SM: depth 8, 4, 2)
  auto lib = [&](auto kern, int wave, const char* name) {
    sh.variant(name, [&](int i) { sh.gemv(kern, wave, i, sh.y); }, false);  // fp4t bytes: no plain reference
  };
  lib(ds4::gemv_mma_kernel<ds4::FMT_FP4T, 4, 2, false, false>, 2 * sms, "tensor cores U4 (library, fp4t bytes)");
  lib(ds4::gemv_mma_kernel<ds4::FMT_FP4T, 2, 2, false, false>, 3 * sms, "tensor cores U2 (library, fp4t bytes)");
  lib(ds4::gemv_mma_kernel<ds4::FMT_FP4T, 1, 2, false, false>, 4 * sms, "tensor cores U1 (library, fp4t bytes)");

  float* yp;  // the slices' partial rows
  CK(cudaMalloc(&yp, (size_t)KB * O * 4));
  std::vector<float> hp((size_t)KB * O), hy(O);
  auto mine = [&](auto kern, int R, int kbs, bool act16, const char* name, bool check) {
    const int warps = O / R * (KB / kbs), blocks = (warps + idp::THREADS / 32 - 1) / (idp::THREADS / 32);
    auto go = [&](int i) {
      kern<<<blocks, idp::THREADS>>>(sh.Ws[i % sh.copies], sh.Ss[i % sh.copies], sh.s_ld, act16 ? dh16 : dq8, dl16,
                                     act16 ? ds16 : ds8, yp, O, K);
    };
    CK(cudaMemset(yp, 0xff, (size_t)KB * O * 4));
    go(0);
    CK(cudaDeviceSynchronize());
    CK(cudaGetLastError());
    const float us = time_us(go);
    std::printf("%-52s %7.2f us %6.0f GB/s", name, us, sh.total / us / 1e3);
    if (check) {
      go(0);
      CK(cudaMemcpy(hp.data(), yp, hp.size() * 4, cudaMemcpyDeviceToHost));
      for (int o = 0; o < O; ++o) {
        double t = 0;
        for (int sl = 0; sl < KB / kbs; ++sl) t += hp[(size_t)sl * O + o];
        hy[o] = (float)t;
      }
      std::printf("  rel L2 vs bf16 x %.2e, vs the same quantized x %.2e", rel_l2(hy, ref_bf),
                  rel_l2(hy, act16 ? ref_16 : ref_8));
    }
    std::printf("\n");
  };
  using namespace idp;
  mine(gemv_dp4a<1, 4, false, false>, 1, 4, false, "IDP4A int8 x, R1, 4096 k per warp", true);
  mine(gemv_dp4a<1, 2, false, false>, 1, 2, false, "IDP4A int8 x, R1, 2048 k per warp", true);
  mine(gemv_dp4a<1, 1, false, false>, 1, 1, false, "IDP4A int8 x, R1, 1024 k per warp", true);
  mine(gemv_dp4a<2, 2, false, false>, 2, 2, false, "IDP4A int8 x, R2, 2048 k per warp", true);
  mine(gemv_dp4a<2, 1, false, false>, 2, 1, false, "IDP4A int8 x, R2, 1024 k per warp", true);
  mine(gemv_dp4a<1, 4, true, false>, 1, 4, true, "IDP4A 16-bit x, R1, 4096 k per warp", true);
  mine(gemv_dp4a<1, 2, true, false>, 1, 2, true, "IDP4A 16-bit x, R1, 2048 k per warp", true);
  mine(gemv_dp4a<1, 1, true, false>, 1, 1, true, "IDP4A 16-bit x, R1, 1024 k per warp", true);
  mine(gemv_dp4a<2, 2, true, false>, 2, 2, true, "IDP4A 16-bit x, R2, 2048 k per warp", true);
  mine(gemv_dp4a<1, 4, false, true>, 1, 4, false, "L2: IDP4A int8 x, R1, 4096 k (first 256 rows)", false);
  mine(gemv_dp4a<1, 2, false, true>, 1, 2, false, "L2: IDP4A int8 x, R1, 2048 k (first 256 rows)", false);
  mine(gemv_dp4a<1, 4, true, true>, 1, 4, true, "L2: IDP4A 16-bit x, R1, 4096 k (first 256 rows)", false);
  mine(gemv_dp4a<1, 2, true, true>, 1, 2, true, "L2: IDP4A 16-bit x, R1, 2048 k (first 256 rows)", false);
  cudaFree(yp);
  for (void* p : {(void*)dq8, (void*)dh16, (void*)dl16, (void*)ds8, (void*)ds16}) cudaFree(p);
}

int main() {
  probe_reps = 60;
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  std::printf("%s, %d SMs, clock %.2f GHz\n", p.name, p.multiProcessorCount, clock_ghz());
  print_copy_bandwidth();
  probe_shape(p.multiProcessorCount, 24576, 4096);  // the routed top-6 gate+up's bytes
  probe_shape(p.multiProcessorCount, 4096, 12288);  // the routed top-6 down's
  return 0;
}
