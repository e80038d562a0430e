// Probe (sm_89+, no torch): the one-token FP4 product on FP8 tensor cores (mma.sync m16n8k32 e4m3) with the
// activations quantised to E4M3 per 128 values, as the official reference's act_quant does before every FP4 GEMM
// (V4_FLASH_SPEC.md §2, §11: ds4's numerics=qat), instead of BF16 mma.sync m16n8k16 on BF16 activations.
//
// Why: session 49 (scripts/probe_bulk.cu) timed the routed gate+up's FP4 arithmetic alone at 16.1 us of its 18.6,
// with the MMAs and their fragment loads at 10.4 and the decode at 3.7. One m16n8k16 MMA takes 8 weights per lane;
// one m16n8k32 e4m3 MMA takes 16, so a word of 8 E2M1 values is one MMA, not two. And E2M1 -> E4M3 is a bit move
// (s e1 e0 m -> s 0 0 e1 e0 m 0 0: the value x 2^-6, exact, e = 0 landing on E4M3 subnormals) that the fp4e word
// layout below does in 5 integer instructions per word, where fp4p_regs' BF16 registers take about 8. Under qat the
// activations are E4M3 values times a power of two anyway, so the products are the same numbers.
//
// fp4e words (made here on the device from the library's fp4p words, the same values): nibble codes n0..n7 of a word
// (k = 8j + i of the lane's 32-value chunk, word j), n0..n3 in bits (7, 4, 3, 2) of bytes 0..3 and n4..n7 in bits
// (5, 6, 1, 0) for (s, e1, e0, m). Then the A registers are lo = q & 0x9C9C9C9C and
// hi = ((q << 2) & 0x8C8C8C8C) | ((q >> 2) & 0x10101010), E4M3 bytes of k = 8j + 0..3 and 8j + 4..7.
// Lane (g, t) of the MMA holds k-slots 4t..4t+3 (a0 / a1: rows g / g + 8) and 16+4t..16+4t+3 (a2 / a3) of A and B;
// as in the library's kernels the lane's k-slots are its own chunk's values and only lanes g == t carry B (their
// chunk's E4M3 activations), so column n of D is lane t = n's chunk: 4 useful columns, in lanes t = 0, 1.
//
// Same bytes and stream as the library's register stream (gemv_mma_kernel<FMT_FP4T>): the fp4t tiled layout, a
// lane's 16-byte chunks of rows g and g + 8, U rounds of loads in flight per warp, 8 warps per block, each warp a
// contiguous range of (tile, round). PROD 0 is the library's BF16 product (mma_chunk<FMT_FP4T>) in this kernel, so
// the two products are compared in one stream; both read x after act_quant (x replaced by its quantised values by
// the library's act_quant_sim kernel, added after run 1, which had its own copy of it), and y is checked against the
// library's gemv_mma_kernel on the same bytes. MODE 1: no weight loads after the first U rounds (the arithmetic
// alone; y garbage; at U = 1 ptxas spilled, so U = 2 only).
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -DDS4_PROBE scripts/probe_fp8mma.cu -o build/probe_fp8mma && build/probe_fp8mma
#include "../csrc/act_quant.cu"
#include "../csrc/gemv.cu"
#include "../csrc/moe.cu"
#include "../csrc/moe_mma.cu"  // gemv.cu's hc_fold_ok asks moe_down_fold_ok
#include "../csrc/moe_dp4a.cu"  // moe.cu's launch_moe_gate_up calls it
#include "probe_gemv.cuh"

#include <cuda_fp8.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

namespace f8 {

constexpr int WARPS = 8, THREADS = 32 * WARPS, W = ds4::FP4T_W;
constexpr int ROUND_VALS = 4 * W * 32;  // 256 values of a row per round

// shared-memory byte of E4M3 activation k: an 8-byte gap every 128 values, so the 4 lanes t of a warp (chunks
// 64 bytes apart) do not meet in one bank
__host__ __device__ constexpr int xaddr(int k) { return k + (k >> 7) * 8; }

__device__ __forceinline__ void mma_e4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// fp4e word -> the E4M3 bytes of its values 0..3 (lo) and 4..7 (hi), x 2^-6
__device__ __forceinline__ void fp4e_regs(uint32_t q, uint32_t& lo, uint32_t& hi) {
  lo = q & 0x9C9C9C9Cu;
  hi = ((q << 2) & 0x8C8C8C8Cu) | ((q >> 2) & 0x10101010u);
}

// fp4p words (in place) -> fp4e words of the same values
__global__ void to_fp4e_kernel(uint32_t* w, long n) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
    uint32_t r[4], code[8];
    ds4::fp4p_regs(w[i], r);  // register i = (n_i, n_{i+4}) as bf16: sign at 15, e1 e0 m at 8..6
    for (int j = 0; j < 4; ++j) {
      code[j] = ((r[j] >> 12) & 8u) | ((r[j] >> 6) & 7u);
      code[j + 4] = ((r[j] >> 28) & 8u) | ((r[j] >> 22) & 7u);
    }
    uint32_t q = 0;
    for (int j = 0; j < 4; ++j) {
      const uint32_t a = code[j], b = code[j + 4];
      const uint32_t lo = ((a >> 3) & 1u) << 7 | ((a >> 2) & 1u) << 4 | ((a >> 1) & 1u) << 3 | (a & 1u) << 2;
      const uint32_t hi = ((b >> 3) & 1u) << 5 | ((b >> 2) & 1u) << 6 | ((b >> 1) & 1u) << 1 | (b & 1u);
      q |= (lo | hi) << (8 * j);
    }
    w[i] = q;
  }
}

// 8 bf16 -> the exponent e of their 128-value block's act_quant scale (the block held by 16 consecutive threads) and
// the E4M3 bytes of x / s (the library's act_quant helpers, csrc/act_quant.cuh)
__device__ __forceinline__ uint2 actq8(const uint4& v, uint32_t& e) {
  float f[8];
  e = ds4::act_quant_exp(ds4::act_quant_amax<128>(v, f));
  const float inv = __uint_as_float((254u - e) << 23);  // 1 / s
  uint32_t b[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    __nv_fp8x2_storage_t p = __nv_cvt_float2_to_fp8x2(make_float2(f[2 * q] * inv, f[2 * q + 1] * inv),
                                                      __NV_SATFINITE, __NV_E4M3);
    b[q] = p;
  }
  return make_uint2(b[0] | b[1] << 16, b[2] | b[3] << 16);
}

__device__ __forceinline__ uint2 lds64(uint32_t a) {
  uint2 r;
  asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "r"(a));
  return r;
}

// PROD 1: E4M3 MMAs on fp4e words; PROD 0: the library's BF16 MMAs (mma_chunk<FMT_FP4T>) on fp4p words.
template <int U, int PROD, int MODE, int MINB>
__global__ void __launch_bounds__(THREADS, MINB)
fp4t_kernel(const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ Wt, const uint8_t* __restrict__ S,
            int s_ld, float* __restrict__ out, int O, int K, int tpb) {
  extern __shared__ float4 smem4[];
  float* part = reinterpret_cast<float*>(smem4);  // tpb x WARPS x 16
  float* xsc = part + tpb * WARPS * 16;           // PROD 1: K / 128 factors s 2^6
  uint32_t* zero = reinterpret_cast<uint32_t*>(xsc + K / 128);  // 64 zero bytes: B of the lanes that carry none
  uint8_t* xs = reinterpret_cast<uint8_t*>(zero + 16);  // PROD 1: E4M3 at xaddr; PROD 0: the library's staged bf16
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int T = O / 16, t0 = blockIdx.x * tpb, nt = min(tpb, T - t0);
  if (nt <= 0) return;
  for (int i = threadIdx.x; i < tpb * WARPS * 16; i += THREADS) part[i] = 0.f;
  if (threadIdx.x < 16) zero[threadIdx.x] = 0u;
  for (int i = threadIdx.x; i < K / 8; i += THREADS) {  // K / 8 is a multiple of THREADS at the probed shapes
    const uint4 v = reinterpret_cast<const uint4*>(x)[i];
    if (PROD == 1) {
      uint32_t e;
      const uint2 q = actq8(v, e);
      *reinterpret_cast<uint2*>(xs + xaddr(8 * i)) = q;
      if ((i & 15) == 0) xsc[i >> 4] = __uint_as_float(e << 23) * 64.f;
    } else {
      reinterpret_cast<uint4*>(xs)[i] = ds4::mma_stage_vec<ds4::FMT_FP4T>(v);
    }
  }
  __syncthreads();
  const int nr = K / ROUND_VALS;
  const long rowb = K / 2;
  const int total = nt * nr, beg = total * warp / WARPS, n = total * (warp + 1) / WARPS - beg;
  const bool has_b = g == t;
  const uint32_t xs_base = (uint32_t)__cvta_generic_to_shared(xs), z_base = (uint32_t)__cvta_generic_to_shared(zero);
  uint4 wa[U][W], wb[U][W];
  uint32_t sa[U], sb[U];  // rows g / g + 8: the scale bytes of chunks 8r + 4(t & 1) .. + 3
  auto load = [&](int k, int u) {
    const int tl = u / nr, r = u - tl * nr;
    const uint8_t* base = Wt + (long)(t0 + tl) * 16 * rowb + lane * 16;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      wa[k][w] = ds4::ld_stream16(base + ((r * W + w) * 2 + 0) * 512);
      wb[k][w] = ds4::ld_stream16(base + ((r * W + w) * 2 + 1) * 512);
    }
    const uint8_t* sp = S + (long)((t0 + tl) * 16 + g) * s_ld + 8 * r + 4 * (t & 1);
    sa[k] = __ldg(reinterpret_cast<const uint32_t*>(sp));
    sb[k] = __ldg(reinterpret_cast<const uint32_t*>(sp + 8L * s_ld));
  };
#pragma unroll
  for (int k = 0; k < U; ++k)
    if (k < n) load(k, beg + k);
  float acc0 = 0.f, acc1 = 0.f;
  int cur = n > 0 ? beg / nr : 0;
  auto flush = [&] {  // the warp's partial sums of its rows in tile cur (lanes t = 0, 1; t = 2, 3 hold zeros)
    acc0 += __shfl_xor_sync(0xffffffffu, acc0, 1);
    acc1 += __shfl_xor_sync(0xffffffffu, acc1, 1);
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
        if constexpr (MODE == 1) {  // the same words every round: hide that, or the decode leaves the loop
#pragma unroll
          for (int w = 0; w < W; ++w) {
            asm volatile("" : "+r"(wa[k][w].x), "+r"(wa[k][w].y), "+r"(wa[k][w].z), "+r"(wa[k][w].w));
            asm volatile("" : "+r"(wb[k][w].x), "+r"(wb[k][w].y), "+r"(wb[k][w].z), "+r"(wb[k][w].w));
          }
          asm volatile("" : "+r"(sa[k]), "+r"(sb[k]));
        }
        if constexpr (PROD == 1) {
          float r0 = 0.f, r1 = 0.f;  // this round's sums, before the activation block's factor
#pragma unroll
          for (int w = 0; w < W; ++w) {
            const int c = 8 * r + 2 * t + w;  // the lane's chunk
            const uint32_t xa = has_b ? xs_base + (uint32_t)xaddr(32 * c) : z_base;
            const uint32_t qa[4] = {wa[k][w].x, wa[k][w].y, wa[k][w].z, wa[k][w].w};
            const uint32_t qb[4] = {wb[k][w].x, wb[k][w].y, wb[k][w].z, wb[k][w].w};
            float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const uint2 b = lds64(xa + 8u * j);
              uint32_t la, ha, lb, hb;
              fp4e_regs(qa[j], la, ha);
              fp4e_regs(qb[j], lb, hb);
              mma_e4m3(d, la, lb, ha, hb, b.x, b.y);
            }
            r0 = fmaf(d[0], ds4::e8m0_mma_scale(sa[k], w), r0);
            r0 = fmaf(d[1], ds4::e8m0_mma_scale(sa[k], 2 + w), r0);
            r1 = fmaf(d[2], ds4::e8m0_mma_scale(sb[k], w), r1);
            r1 = fmaf(d[3], ds4::e8m0_mma_scale(sb[k], 2 + w), r1);
          }
          const float f = xsc[2 * r + (t & 1)];  // the 128-value block of both columns' chunks
          acc0 = fmaf(r0, f, acc0);
          acc1 = fmaf(r1, f, acc1);
        } else {
#pragma unroll
          for (int w = 0; w < W; ++w) {
            const int c = 8 * r + 2 * t + w;
            const uint32_t xa = has_b ? xs_base + 64u * c : z_base;
            uint4 xb[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) xb[j] = ds4::lds128(xa + 16u * j);
            float d[4] = {0.f, 0.f, 0.f, 0.f};
            ds4::mma_chunk<ds4::FMT_FP4T>(wa[k][w], wb[k][w], xb, d);
            acc0 = fmaf(d[0], ds4::e8m0_mma_scale(sa[k], w), acc0);
            acc0 = fmaf(d[1], ds4::e8m0_mma_scale(sa[k], 2 + w), acc0);
            acc1 = fmaf(d[2], ds4::e8m0_mma_scale(sb[k], w), acc1);
            acc1 = fmaf(d[3], ds4::e8m0_mma_scale(sb[k], 2 + w), acc1);
          }
        }
        if (MODE == 0 && i + U < n) load(k, u + U);
      }
    }
  }
  if (n > 0) flush();
  __syncthreads();
  const float post = PROD == 1 ? 1.f : ds4::Mma<ds4::FMT_FP4T>::POST;
  for (int i = threadIdx.x; i < nt * 16; i += THREADS) {
    float y = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) y += part[((i >> 4) * WARPS + w) * 16 + (i & 15)];
    out[(long)t0 * 16 + i] = y * post;
  }
}

inline long smem_bytes(int K, int tpb) { return 4L * tpb * WARPS * 16 + 4L * (K / 128) + 64 + 2L * K + 16; }

}  // namespace f8

static void probe_shape(int sms, int O, int K) {
  // E8M0 scales 2^-9 .. 2^3; activations normal with a few outliers, then act_quant's values (all variants)
  std::normal_distribution<float> nd(0.f, 1.f);
  auto make_x = [&](int k) { return __float2bfloat16(nd(rng) * (k % 97 == 0 ? 40.f : 1.f)); };
  Fp4tShape sh(O, K, 118, 130, make_x, 56, "library MMA");
  {  // x <- act_quant's values e4m3(x / s) s (the library kernel), the input of every variant
    __nv_bfloat16* xq;
    CK(cudaMalloc(&xq, K * 2));
    CK(ds4::launch_act_quant_sim(sh.x, xq, 1, K, 128, 0));
    CK(cudaMemcpy(sh.x, xq, K * 2, cudaMemcpyDeviceToDevice));
    CK(cudaFree(xq));
  }
  std::vector<uint8_t*> We;  // the same bytes as fp4e words
  for (auto* w : sh.Ws) {
    uint8_t* h;
    CK(cudaMalloc(&h, sh.wbytes));
    CK(cudaMemcpy(h, w, sh.wbytes, cudaMemcpyDeviceToDevice));
    f8::to_fp4e_kernel<<<1024, 256>>>(reinterpret_cast<uint32_t*>(h), (long)(sh.wbytes / 4));
    We.push_back(h);
  }
  CK(cudaDeviceSynchronize());
  const int T = O / 16;
  auto run_d4 = [&](int i, float* o) { sh.gemv(ds4::gemv_mma_kernel<ds4::FMT_FP4T, 2, 2, false, false>, 3 * sms, i, o); };
  run_d4(0, sh.yref);
  sh.keep_ref();
  sh.report("library MMA register stream depth 4 (U2 W2, 3 blocks/SM)", time_us([&](int i) { run_d4(i, sh.yref); }),
            false);
  run_d4(0, sh.yref);  // copy 0 again: the reference the checks read
  sh.keep_ref();

  auto variant = [&](const char* name, auto kern, int minb, bool check, bool fp4e_words) {
    const int tpb = (T + minb * sms - 1) / (minb * sms), nb = (T + tpb - 1) / tpb;
    const long smem = f8::smem_bytes(K, tpb);
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    const std::vector<uint8_t*>& ws = fp4e_words ? We : sh.Ws;
    char full[96];
    std::snprintf(full, sizeof full, "%s (%d blocks)", name, nb);
    sh.variant(full, [&](int i) {
      kern<<<nb, f8::THREADS, smem>>>(sh.x, ws[i % sh.copies], sh.Ss[i % sh.copies], sh.s_ld, sh.y, O, K, tpb);
    }, check);
  };
  variant("BF16 MMA (library product) U2, 3 blocks/SM", f8::fp4t_kernel<2, 0, 0, 3>, 3, true, false);
  variant("BF16 MMA (library product) U1, 4 blocks/SM", f8::fp4t_kernel<1, 0, 0, 4>, 4, true, false);
  variant("E4M3 MMA U2, 3 blocks/SM", f8::fp4t_kernel<2, 1, 0, 3>, 3, true, true);
  variant("E4M3 MMA U1, 4 blocks/SM", f8::fp4t_kernel<1, 1, 0, 4>, 4, true, true);
  variant("E4M3 MMA U4, 2 blocks/SM", f8::fp4t_kernel<4, 1, 0, 2>, 2, true, true);
  variant("BF16 MMA arithmetic alone U2, 3 blocks/SM", f8::fp4t_kernel<2, 0, 1, 3>, 3, false, false);
  variant("E4M3 MMA arithmetic alone U2, 3 blocks/SM", f8::fp4t_kernel<2, 1, 1, 3>, 3, false, true);
  sh.report("library MMA register stream depth 4 again", time_us([&](int i) { run_d4(i, sh.yref); }), false);
  for (auto* q : We) cudaFree(q);
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
