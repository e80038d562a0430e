// Probe (sm_80+, no torch): the one-token FP4 product with packed fp16 FMAs (HFMA2) instead of BF16 mma.sync.
//
// Why: session 49 measured the routed MoE's FP4 arithmetic alone (scripts/probe_bulk.cu) above issue #4's whole
// time budget, and its MMAs with their fragment loads at 10.4 of the gate+up's 16.1 us. One m16n8k16 MMA takes
// 256 weights; here a lane multiplies its own weights by the activations with HFMA2 (2 products per instruction,
// a 4-cycle dependency instead of the MMA's ~30), in fp16. Products of an E2M1 weight (2 significant bits) and
// an activation held in fp16 (bf16's 8 significant bits) are exact in fp16; the sums of a 32-value chunk run in
// fp16 (16 products per half), then leave for fp32 with the chunk's scales.
//
// Activations: staged per 32-value chunk c (one weight-scale block) as fp16 x_c = x 2^(14 - E_c), E_c =
// floor(log2 max|x| over the chunk), so |x_c| < 2^15; weights decode to fp16 as the true value x 2^-14 (the
// E2M1 bits at fp16 bit 15 and 11..9: e = 0 lands on fp16 subnormals), so each product is the true one
// x 2^-E_c and |product| <= 6 x 2^15 x 2^-14 = 12; a chunk's fp16 partial sum (<= 16 products per chain)
// is multiplied by 2^E_c and the E8M0 scale in fp32.
//
// Same bytes as the library's register stream (gemv_mma_kernel<FMT_FP4T>): the fp4t tiled layout, fp4p words,
// a lane's 16-byte chunks of rows g and g + 8, U rounds of loads in flight per warp, 8 warps per block, each warp
// a contiguous range of (tile, round); y checked against the library kernel on the same bytes. That reference is
// the dense GEMV form: the routed MoE's own kernels read the same bytes faster (session 51, bench_kernels: gate+up
// 18.64 us, down 11.41 against this reference's 19.9 / 14.4), so compare with those before reading a gain here.
// DEC 0: the decode of today's fp4p words into fp16 (fp4p_regs' rotations, then 2 more ops per register);
// DEC 1: fp4p_regs' bf16 registers used as fp16 unchanged (wrong values: the cost of a decode as cheap as the
// bf16 one, what a permutation made for fp16 could reach); DEC 2 (session 51): the same bytes with each word's bits
// permuted on the device into the fp4h layout (probe_fp4h.cuh: 6 LOP3, every shift left), decoded by fp4h::regs
// into the registers DEC 0 gives (right values). MODE 1: no weight loads after the first U rounds (the arithmetic
// alone; y garbage).
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -DDS4_PROBE scripts/probe_hfma.cu -o build/probe_hfma && build/probe_hfma
#include "../csrc/gemv.cu"
#include "../csrc/moe.cu"
#include "../csrc/moe_mma.cu"  // gemv.cu's hc_fold_ok asks moe_down_fold_ok
#include "../csrc/moe_dp4a.cu"  // moe.cu's launch_moe_gate_up calls it
#include "probe_fp4h.cuh"
#include "probe_gemv.cuh"

#include <cuda_fp16.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

namespace hf {

constexpr int WARPS = 8, THREADS = 32 * WARPS, W = ds4::FP4T_W;
constexpr int ROUND_VALS = 4 * W * 32;  // 256 values of a row per round

// shared-memory half index of activation k: a 16-byte gap every 64 values, so the 4 lanes t of a warp (chunks
// 128 bytes apart) read different banks
__host__ __device__ constexpr int xaddr(int k) { return k + (k >> 6) * 8; }

template <int DEC>
__device__ __forceinline__ void fp16_regs(uint32_t q, uint32_t (&h)[4]) {
  uint32_t r[4];
  if (DEC == 2) {
    fp4h::regs(q, h);
  } else if (DEC == 1) {
    ds4::fp4p_regs(q, r);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = r[i];
  } else {
    // fp4p_regs' rotations put register i's sign at bit 15 / 31 and e1 e0 m at 8..6 / 24..22 (bf16); fp16
    // wants e1 e0 m at 11..9 / 27..25: the same rotation plus 3 for the magnitude.
    const uint32_t S = 0x80008000u, M = 0x0E000E00u;
    h[0] = (q & S) | ((q << 3) & M);
    h[1] = ((q << 4) & S) | ((q << 7) & M);
    h[2] = (ds4::rotl32(q, 10) & S) | (ds4::rotl32(q, 13) & M);
    // r3 = (rotl6 & 0x80C080C0) | (rotl14 & 0x01000100): the sign, e0 and m from rotl 6, e1 from rotl 14
    h[3] = ((q << 6) & S) | ((q << 9) & 0x06000600u) | (ds4::rotl32(q, 17) & 0x08000800u);
  }
}

// fp4p words (in place) -> fp4h words holding the same values: fp4h::regs of the result = DEC 0's registers.
__global__ void to_fp4h_kernel(uint32_t* w, long n) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
    uint32_t h[4];
    fp16_regs<0>(w[i], h);
    w[i] = fp4h::pack(h);
  }
}

__device__ __forceinline__ uint32_t hfma2u(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ float h2sum(uint32_t a) {
  const __half2 h = *reinterpret_cast<const __half2*>(&a);
  const float2 f = __half22float2(h);
  return f.x + f.y;
}

template <int U, int DEC, int MODE, int MINB>
__global__ void __launch_bounds__(THREADS, MINB)
hfma_fp4t_kernel(const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ Wt, const uint8_t* __restrict__ S,
                 int s_ld, float* __restrict__ out, int O, int K, int tpb) {
  extern __shared__ float4 smem4[];
  float* part = reinterpret_cast<float*>(smem4);  // tpb x WARPS x 16
  float* xsc = part + tpb * WARPS * 16;           // K / 32: 2^E_c
  __half* xh = reinterpret_cast<__half*>(xsc + K / 32);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int T = O / 16, t0 = blockIdx.x * tpb, nt = min(tpb, T - t0);
  if (nt <= 0) return;
  for (int i = threadIdx.x; i < tpb * WARPS * 16; i += THREADS) part[i] = 0.f;
  // stage: thread i converts values 8i..8i+7; 4 consecutive threads share a chunk's exponent
  for (int i = threadIdx.x; i < K / 8; i += THREADS) {
    const uint4 v = reinterpret_cast<const uint4*>(x)[i];
    const uint32_t in[4] = {v.x, v.y, v.z, v.w};
    float f[8];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      f[2 * q] = __uint_as_float(in[q] << 16);
      f[2 * q + 1] = __uint_as_float(in[q] & 0xffff0000u);
    }
    float m = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(f[j]));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    uint32_t e = __float_as_uint(m) >> 23;  // biased exponent of the chunk's max
    e = max(e, 15u);                         // |x| < 2^-112 everywhere: flushed (fp16 subnormal range)
    const float inv = __uint_as_float((268u - e) << 23);  // 2^(14 - E), E = e - 127
    if ((i & 3) == 0) xsc[i >> 2] = __uint_as_float(e << 23);
    __half hv[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) hv[j] = __float2half_rn(f[j] * inv);
    // permuted [0 4 1 5 2 6 3 7]: half2 i = (x_i, x_{i+4}), as fp4p register i pairs (n_i, n_{i+4})
    __half2 p[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) p[q] = __halves2half2(hv[q], hv[q + 4]);
    *reinterpret_cast<uint4*>(xh + xaddr(8 * i)) = *reinterpret_cast<const uint4*>(p);
  }
  __syncthreads();
  const int nr = K / ROUND_VALS;
  const long rowb = K / 2;
  const int total = nt * nr, beg = total * warp / WARPS, n = total * (warp + 1) / WARPS - beg;
  const uint32_t xs_base = (uint32_t)__cvta_generic_to_shared(xh);
  uint4 wa[U][W], wb[U][W];
  uint32_t sc[U];  // scale bytes (2 per row: chunks w = 0, 1): row g low half, row g + 8 high half
  auto load = [&](int k, int u) {
    const int tl = u / nr, r = u - tl * nr;
    const uint8_t* base = Wt + (long)(t0 + tl) * 16 * rowb + lane * 16;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      wa[k][w] = ds4::ld_stream16(base + ((r * W + w) * 2 + 0) * 512);
      wb[k][w] = ds4::ld_stream16(base + ((r * W + w) * 2 + 1) * 512);
    }
    const uint8_t* sp = S + (long)((t0 + tl) * 16 + g) * s_ld + 8 * r + 2 * t;
    sc[k] = (uint32_t)__ldg(reinterpret_cast<const unsigned short*>(sp)) |
            (uint32_t)__ldg(reinterpret_cast<const unsigned short*>(sp + 8L * s_ld)) << 16;
  };
#pragma unroll
  for (int k = 0; k < U; ++k)
    if (k < n) load(k, beg + k);
  float acc0 = 0.f, acc1 = 0.f;
  int cur = n > 0 ? beg / nr : 0;
  auto flush = [&] {  // the warp's partial sums of its rows in tile cur (its 4 lanes t add up; warp-uniform)
    acc0 += __shfl_xor_sync(0xffffffffu, acc0, 1);
    acc0 += __shfl_xor_sync(0xffffffffu, acc0, 2);
    acc1 += __shfl_xor_sync(0xffffffffu, acc1, 1);
    acc1 += __shfl_xor_sync(0xffffffffu, acc1, 2);
    if (t == 0) {
      part[(cur * WARPS + warp) * 16 + g] = acc0;
      part[(cur * WARPS + warp) * 16 + g + 8] = acc1;
    }
    acc0 = acc1 = 0.f;
  };
  for (int i0 = 0; i0 < n; i0 += U) {
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int i = i0 + k;
      if (i < n) {
        const int u = beg + i, tl = u / nr, r = u - tl * nr;
        if (tl != cur) {  // the warp leaves tile cur
          flush();
          cur = tl;
        }
#pragma unroll
        for (int w = 0; w < W; ++w) {
          const int c = 8 * r + 2 * t + w;  // the lane's chunk of its rows
          const uint32_t xa = xs_base + 2u * xaddr(32 * c);
          const uint32_t qa[4] = {wa[k][w].x, wa[k][w].y, wa[k][w].z, wa[k][w].w};
          const uint32_t qb[4] = {wb[k][w].x, wb[k][w].y, wb[k][w].z, wb[k][w].w};
          uint32_t a0 = 0u, a1 = 0u, b0 = 0u, b1 = 0u;  // fp16x2 chains: rows g, g + 8, two each
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const uint4 xb = ds4::lds128(xa + 16u * j);
            const uint32_t xr[4] = {xb.x, xb.y, xb.z, xb.w};
            uint32_t ha[4], hb[4];
            fp16_regs<DEC>(qa[j], ha);
            fp16_regs<DEC>(qb[j], hb);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              if (q & 1) {
                a1 = hfma2u(ha[q], xr[q], a1);
                b1 = hfma2u(hb[q], xr[q], b1);
              } else {
                a0 = hfma2u(ha[q], xr[q], a0);
                b0 = hfma2u(hb[q], xr[q], b0);
              }
            }
          }
          const float xe = *reinterpret_cast<const float*>(xsc + c);  // broadcast per t
          const float sa = ds4::e8m0_byte_to_f32(sc[k], w) * xe, sb = ds4::e8m0_byte_to_f32(sc[k], 2 + w) * xe;
          acc0 = fmaf(h2sum(a0) + h2sum(a1), sa, acc0);
          acc1 = fmaf(h2sum(b0) + h2sum(b1), sb, acc1);
        }
        if (MODE == 0 && i + U < n) load(k, u + U);
      }
    }
  }
  if (n > 0) flush();
  __syncthreads();
  for (int i = threadIdx.x; i < nt * 16; i += THREADS) {
    float y = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) y += part[((i >> 4) * WARPS + w) * 16 + (i & 15)];
    out[(long)t0 * 16 + i] = y;
  }
}

inline long smem_bytes(int K, int tpb) { return 4L * tpb * WARPS * 16 + 4L * (K / 32) + 2L * xaddr(K) + 16; }

}  // namespace hf

static void probe_shape(int sms, int O, int K) {
  // E8M0 scales 2^-9 .. 2^3; activations normal with a few outliers
  std::normal_distribution<float> nd(0.f, 1.f);
  auto make_x = [&](int k) { return __float2bfloat16(nd(rng) * (k % 97 == 0 ? 40.f : 1.f)); };
  Fp4tShape sh(O, K, 118, 130, make_x, 52, "MMA");
  std::vector<uint8_t*> Wh;  // the same bytes as fp4h words (DEC 2)
  for (auto* w : sh.Ws) {
    uint8_t* h;
    CK(cudaMalloc(&h, sh.wbytes));
    CK(cudaMemcpy(h, w, sh.wbytes, cudaMemcpyDeviceToDevice));
    hf::to_fp4h_kernel<<<1024, 256>>>(reinterpret_cast<uint32_t*>(h), (long)(sh.wbytes / 4));
    Wh.push_back(h);
  }
  const int T = O / 16;
  auto run_d4 = [&](int i, float* o) { sh.gemv(ds4::gemv_mma_kernel<ds4::FMT_FP4T, 2, 2, false, false>, 3 * sms, i, o); };
  auto run_d8 = [&](int i, float* o) { sh.gemv(ds4::gemv_mma_kernel<ds4::FMT_FP4T, 4, 2, false, false>, 2 * sms, i, o); };
  run_d4(0, sh.yref);
  sh.keep_ref();
  sh.report("MMA register stream depth 4 (U2 W2, 3 blocks/SM)", time_us([&](int i) { run_d4(i, sh.yref); }), false);
  sh.report("MMA register stream depth 8 (U4 W2, 2 blocks/SM)", time_us([&](int i) { run_d8(i, sh.yref); }), false);
  run_d4(0, sh.yref);  // copy 0 again: the reference the checks read
  sh.keep_ref();

  auto variant = [&](const char* name, auto kern, int minb, bool check, bool fp4h_words = false) {
    const int tpb = (T + minb * sms - 1) / (minb * sms), nb = (T + tpb - 1) / tpb;
    const long smem = hf::smem_bytes(K, tpb);
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    const std::vector<uint8_t*>& ws = fp4h_words ? Wh : sh.Ws;
    char full[96];
    std::snprintf(full, sizeof full, "%s (%d blocks)", name, nb);
    sh.variant(full, [&](int i) {
      kern<<<nb, hf::THREADS, smem>>>(sh.x, ws[i % sh.copies], sh.Ss[i % sh.copies], sh.s_ld, sh.y, O, K, tpb);
    }, check);
  };
  variant("HFMA2 fp4p->fp16 U2, 3 blocks/SM", hf::hfma_fp4t_kernel<2, 0, 0, 3>, 3, true);
  variant("HFMA2 fp4p->fp16 U1, 4 blocks/SM", hf::hfma_fp4t_kernel<1, 0, 0, 4>, 4, true);
  variant("HFMA2 bf16-cost decode (wrong) U2, 3 blocks/SM", hf::hfma_fp4t_kernel<2, 1, 0, 3>, 3, false);
  variant("HFMA2 bf16-cost decode (wrong) U1, 4 blocks/SM", hf::hfma_fp4t_kernel<1, 1, 0, 4>, 4, false);
  variant("HFMA2 fp4h words U2, 3 blocks/SM", hf::hfma_fp4t_kernel<2, 2, 0, 3>, 3, true, true);
  variant("HFMA2 fp4h words U2, 4 blocks/SM", hf::hfma_fp4t_kernel<2, 2, 0, 4>, 4, true, true);
  variant("HFMA2 fp4h words U1, 4 blocks/SM", hf::hfma_fp4t_kernel<1, 2, 0, 4>, 4, true, true);
  variant("HFMA2 fp4h words U4, 2 blocks/SM", hf::hfma_fp4t_kernel<4, 2, 0, 2>, 2, true, true);
  variant("HFMA2 arithmetic alone bf16-cost U1, 4 blocks/SM", hf::hfma_fp4t_kernel<1, 1, 1, 4>, 4, false);
  variant("HFMA2 arithmetic alone fp4h U1, 4 blocks/SM", hf::hfma_fp4t_kernel<1, 2, 1, 4>, 4, false, true);
  variant("HFMA2 arithmetic alone fp4h U2, 3 blocks/SM", hf::hfma_fp4t_kernel<2, 2, 1, 3>, 3, false, true);
  sh.report("MMA register stream depth 4 again", time_us([&](int i) { run_d4(i, sh.yref); }), false);
  for (auto* q : Wh) cudaFree(q);
}

int main() {
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  const int sms = p.multiProcessorCount;
  std::printf("%s, %d SMs\n", p.name, sms);
  print_copy_bandwidth();  // same process
  probe_shape(sms, 24576, 4096);  // the routed top-6 gate+up's bytes
  probe_shape(sms, 4096, 12288);  // the routed top-6 down's
  return 0;
}
