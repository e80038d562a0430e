// Probe (sm_90, no torch): can a warp-specialised bulk-copy (TMA) stream feed the one-token FP4 tensor-core
// products faster than the register stream (MmaStream) that the routed MoE kernels use today?
//
// Why: the routed gate+up moves its 53.5 MB at ~2.4 TB/s (experiments/decode_session15_h200.md,
// decode_session20_h200.md: ~9 KB per us per block), where plain reads of the same bytes reach 3.9 TB/s
// (decode_session21_h200.md, tlb probe). Counters (sessions 8, 16) show the register-stream kernels starved of
// eligible warps: every warp both issues its loads and does the decode and MMAs, so the loads of a warp wait
// behind its own arithmetic. Here one producer warp per block issues cp.async.bulk copies of whole stages
// (the fp4t layout keeps a 16-row tile's rounds contiguous: one 16 KB copy per 8 rounds, plus the scales as 16
// row copies or one tile copy) into a ring of shared-memory stages guarded by mbarriers; the consumer warps
// only decode and multiply (the same fragments, MMAs and scale order as MmaStream), and release each stage to
// the producer. Modes without copies / without parts of the arithmetic time the arithmetic alone.
// Result (experiments/decode_session22_h200.md): the arithmetic alone takes 17.5 us of the 21-22 (ALU pipe at
// 70 %), so the bulk stream is no faster; what it showed led to the ALU cuts in fp4p_regs / MmaStream.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -DDS4_PROBE scripts/probe_bulk.cu -o /tmp/probe_bulk && /tmp/probe_bulk
//
// Shape: an fp4t matrix of O x K (24576 x 4096 = the routed top-6 gate+up's 53.5 MB with scales), one token.
// Every variant's y is checked against the library's register-stream kernel (gemv_mma_kernel<FMT_FP4T>)
// on the same bytes; times are means over back-to-back launches, weights rotated through more than the L2.
#include "../csrc/gemv.cu"
#include "../csrc/moe.cu"
#include "../csrc/moe_mma.cu"  // gemv.cu's hc_fold_ok asks moe_down_fold_ok
#include "../csrc/moe_dp4a.cu"  // moe.cu's launch_moe_gate_up calls it
#include "probe_gemv.cuh"

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace bulk {

__device__ __forceinline__ uint32_t su32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t* b, int count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(su32(b)), "r"(count) : "memory");
#endif
}
__device__ __forceinline__ void mbar_fence_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// the producer's arrival, announcing the bytes its copies will complete
__device__ __forceinline__ void mbar_expect_tx(uint64_t* b, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(su32(b)), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(su32(b)) : "memory");
#endif
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n\t.reg .pred P1;\n"
      "WAIT:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n\t"
      "@!P1 bra WAIT;\n}" ::"r"(su32(b)),
      "r"(parity)
      : "memory");
#endif
}
// global -> shared bulk copy (16-B aligned, bytes % 16 == 0) completing on mbarrier b
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   su32(dst)),
               "l"(src), "r"(bytes), "r"(su32(b))
               : "memory");
#endif
}

constexpr int W = ds4::FP4T_W;             // 2 chunks per lane and row per round
constexpr int ROUND_BYTES = 16 * 4 * W * 16;  // 16 rows x 128 B = 2 KB (contiguous in fp4t)
constexpr int ROUND_VALS = 4 * W * 32;        // 256 values of a row per round

// The arithmetic of one round chunk, with parts left out to time them (SKIP bit 0: the weight words go to the
// MMAs undecoded; the products are garbage).
template <int SKIP>
__device__ __forceinline__ void chunk_fp4t(const uint4& wg, const uint4& wg8, const uint4* xb, float (&d)[4]) {
  if constexpr (SKIP & 1) {
    const uint32_t qa[4] = {wg.x, wg.y, wg.z, wg.w}, qb[4] = {wg8.x, wg8.y, wg8.z, wg8.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint4 b = xb[w];
      ds4::mma_16816(d, qa[w], qb[w], qa[(w + 1) & 3], qb[(w + 1) & 3], b.x, b.y);
      ds4::mma_16816(d, qa[(w + 2) & 3], qb[(w + 2) & 3], qa[(w + 3) & 3], qb[(w + 3) & 3], b.z, b.w);
    }
  } else {
    ds4::mma_chunk<ds4::FMT_FP4T>(wg, wg8, xb, d);
  }
}

// CW consumer warps + 1 producer warp; a stage = CW rounds of one tile (one round per consumer warp);
// NS stages in the ring. Block b owns tiles [b tpb, (b + 1) tpb). MODE 1: the product; 0: the consumers only
// release the stages (the stream's read ceiling); 2: no copies, the consumers multiply whatever the ring holds
// (the arithmetic's ceiling; y is garbage). SCOPY 0: a stage's scales as 16 row copies of its rounds' bytes;
// 1: the tile's whole scale block (16 rows x K / 32 bytes, contiguous when s_ld = K / 32) as one copy per
// stage. SKIP (MODE 2): bit 0 no decode, bit 1 no scales, bit 2 no activation loads (timing only).
template <int CW, int NS, int MODE, int MINB, int SCOPY = 0, int SKIP = 0>
__global__ void __launch_bounds__(32 * (CW + 1), MINB)
fp4t_bulk_kernel(const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ Wt, const uint8_t* __restrict__ S,
                 int s_ld, float* __restrict__ out, int O, int K, int tpb) {
  constexpr int SW = CW * ROUND_BYTES;  // weight bytes per stage
  const int SC = SCOPY ? K / 32 : CW * 8;  // scale bytes per row per stage
  const int STAGE = SW + 16 * SC;
  extern __shared__ float4 smem4[];
  uint8_t* ring = reinterpret_cast<uint8_t*>(smem4);
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(ring + NS * STAGE);
  float* part = reinterpret_cast<float*>(xs + K);
  __shared__ __align__(8) uint64_t full[NS], empty[NS];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int T = O / 16, t0 = blockIdx.x * tpb, nt = min(tpb, T - t0);
  const int nr = K / ROUND_VALS, cps = nr / CW, ns = nt > 0 ? nt * cps : 0;
  const long rowb = K / 2;
  if (threadIdx.x == 0) {
    for (int s = 0; s < NS; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], CW);
    }
    mbar_fence_init();
  }
  __syncthreads();
  if (warp == CW) {  // producer (MODE 2: none)
    for (int i = 0; i < (MODE == 2 ? 0 : ns); ++i) {
      const int s = i % NS;
      if (i >= NS) mbar_wait(&empty[s], ((i / NS) - 1) & 1);
      const int tile = t0 + i / cps, c = i % cps;
      uint8_t* b = ring + s * STAGE;
      if (lane == 0) mbar_expect_tx(&full[s], STAGE);
      __syncwarp();
      if (lane == 0) bulk_g2s(b, Wt + (long)tile * 16 * rowb + (long)c * SW, SW, &full[s]);
      if (SCOPY) {
        if (lane == 1) bulk_g2s(b + SW, S + (long)tile * 16 * s_ld, 16 * SC, &full[s]);
      } else if (lane < 16) {
        bulk_g2s(b + SW + lane * SC, S + (long)(tile * 16 + lane) * s_ld + (long)c * CW * 8, SC, &full[s]);
      }
    }
    return;
  }
  // consumers: stage x (bf16 x 2^64, permuted for the fp4 MMAs), then the ring
  for (int i = threadIdx.x; i < K / 8; i += 32 * CW)
    reinterpret_cast<uint4*>(xs)[i] = ds4::mma_stage_vec<ds4::FMT_FP4T>(reinterpret_cast<const uint4*>(x)[i]);
  asm volatile("bar.sync 1, %0;" ::"r"(32 * CW) : "memory");
  const int g = lane >> 2, t = lane & 3;
  const bool has_b = (SKIP & 4) ? false : g == t;
  float acc0 = 0.f, acc1 = 0.f;
  for (int i = 0; i < ns; ++i) {
    const int s = i % NS, c = i % cps;
    if (MODE != 2) mbar_wait(&full[s], (i / NS) & 1);
    const uint8_t* b = ring + s * STAGE;
    if constexpr (MODE != 0) {
      const int rr = c * CW + warp;  // this warp's round of the tile
      const uint8_t* wr = b + warp * ROUND_BYTES + lane * 16;
      const uint4* src = reinterpret_cast<const uint4*>(xs + (long)rr * ROUND_VALS + t * W * 32);
      const int so = SCOPY ? rr * 8 + 4 * (t & 1) : warp * 8 + 4 * (t & 1);
      const uint32_t sa = *reinterpret_cast<const uint32_t*>(b + SW + g * SC + so);
      const uint32_t s8 = *reinterpret_cast<const uint32_t*>(b + SW + (g + 8) * SC + so);
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const uint4 wa = *reinterpret_cast<const uint4*>(wr + (w * 2 + 0) * 512);
        const uint4 wb = *reinterpret_cast<const uint4*>(wr + (w * 2 + 1) * 512);
        float d[4] = {0.f, 0.f, 0.f, 0.f};
        uint4 xb[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) xb[j] = has_b ? src[w * 4 + j] : make_uint4(0u, 0u, 0u, 0u);
        chunk_fp4t<SKIP>(wa, wb, xb, d);
        if constexpr (SKIP & 2) {
          acc0 += d[0] + d[1];
          acc1 += d[2] + d[3];
        } else {
          acc0 = fmaf(d[0], ds4::e8m0_byte_to_f32(sa, w), acc0);
          acc0 = fmaf(d[1], ds4::e8m0_byte_to_f32(sa, W + w), acc0);
          acc1 = fmaf(d[2], ds4::e8m0_byte_to_f32(s8, w), acc1);
          acc1 = fmaf(d[3], ds4::e8m0_byte_to_f32(s8, W + w), acc1);
        }
      }
    }
    __syncwarp();
    if (MODE != 2 && lane == 0) mbar_arrive(&empty[s]);
    if (c == cps - 1) {  // the tile's last stage: this warp's partial sums of its 16 rows
      acc0 += __shfl_xor_sync(0xffffffffu, acc0, 1);
      acc1 += __shfl_xor_sync(0xffffffffu, acc1, 1);
      if (t == 0) {
        float* dst = part + ((i / cps) * CW + warp) * 16;
        dst[g] = acc0 * ds4::Mma<ds4::FMT_FP4T>::POST;
        dst[g + 8] = acc1 * ds4::Mma<ds4::FMT_FP4T>::POST;
      }
      acc0 = acc1 = 0.f;
    }
  }
  asm volatile("bar.sync 1, %0;" ::"r"(32 * CW) : "memory");
  for (int i = threadIdx.x; i < nt * 16; i += 32 * CW) {
    float y = 0.f;
    for (int w = 0; w < CW; ++w) y += part[((i >> 4) * CW + w) * 16 + (i & 15)];
    out[(long)t0 * 16 + i] = y;
  }
}

template <int CW, int NS, int SCOPY = 0>
constexpr long smem_bytes(int K, int tpb) {
  return (long)NS * (CW * ROUND_BYTES + 16 * (SCOPY ? K / 32 : CW * 8)) + 2L * K + 4L * tpb * CW * 16;
}

}  // namespace bulk

// One shape: the register stream at depth 8 and 2, then the bulk stream's forms, each checked against depth 8.
static void probe_shape(int sms, int O, int K) {
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  Fp4tShape sh(O, K, 122, 130, [&](int) { return __float2bfloat16(u(rng)); }, 44, "register stream");  // scales near 1
  const int T = O / 16;

  // the library's register stream (depth 8 = U 4, the routed gate+up's form)
  auto run_ref = [&](int i, float* o) { sh.gemv(ds4::gemv_mma_kernel<ds4::FMT_FP4T, 4, 2, false, false>, 2 * sms, i, o); };
  auto run_d2 = [&](int i, float* o) { sh.gemv(ds4::gemv_mma_kernel<ds4::FMT_FP4T, 1, 2, false, false>, 4 * sms, i, o); };
  run_ref(0, sh.yref);
  sh.keep_ref();
  sh.report("register stream depth 8 (U4 W2, 2 blocks/SM)", time_us([&](int i) { run_ref(i, sh.yref); }), false);
  sh.variant("register stream depth 2 (U1 W2, 4 blocks/SM)", [&](int i) { run_d2(i, sh.y); }, true);

  auto variant = [&](const char* name, auto kern, int cw, int blocks, long smem, int tpb, bool check) {
    if (smem > 227 * 1024) {
      std::printf("%-44s skipped: %ld KB of shared memory\n", name, smem >> 10);
      return;
    }
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    char full[96];
    std::snprintf(full, sizeof full, "%s (%d blocks, %ld KB smem)", name, blocks, smem >> 10);
    sh.variant(full, [&](int i) {
      kern<<<blocks, 32 * (cw + 1), smem>>>(sh.x, sh.Ws[i % sh.copies], sh.Ss[i % sh.copies], sh.s_ld, sh.y, O, K, tpb);
    }, check);
  };
  // one block per SM (8 or 16 consumer warps) and two (8 each)
  {
    const int tpb = (T + sms - 1) / sms, nb = (T + tpb - 1) / tpb;
    variant("bulk read only, 8 warps, 8 stages", bulk::fp4t_bulk_kernel<8, 8, 0, 1>, 8, nb,
            bulk::smem_bytes<8, 8>(K, tpb), tpb, false);
    variant("... scales in one copy", bulk::fp4t_bulk_kernel<8, 8, 0, 1, 1>, 8, nb, bulk::smem_bytes<8, 8, 1>(K, tpb),
            tpb, false);
    variant("... 16 warps, 5 stages, scales in one copy", bulk::fp4t_bulk_kernel<16, 5, 0, 1, 1>, 16, nb,
            bulk::smem_bytes<16, 5, 1>(K, tpb), tpb, false);
    variant("bulk arithmetic only, 8 warps", bulk::fp4t_bulk_kernel<8, 8, 2, 1>, 8, nb, bulk::smem_bytes<8, 8>(K, tpb),
            tpb, false);
    variant("... without the decode", bulk::fp4t_bulk_kernel<8, 8, 2, 1, 0, 1>, 8, nb, bulk::smem_bytes<8, 8>(K, tpb),
            tpb, false);
    variant("... without the scales", bulk::fp4t_bulk_kernel<8, 8, 2, 1, 0, 2>, 8, nb, bulk::smem_bytes<8, 8>(K, tpb),
            tpb, false);
    variant("... without the activation loads", bulk::fp4t_bulk_kernel<8, 8, 2, 1, 0, 4>, 8, nb,
            bulk::smem_bytes<8, 8>(K, tpb), tpb, false);
    variant("... without all three (MMAs and fragment loads)", bulk::fp4t_bulk_kernel<8, 8, 2, 1, 0, 7>, 8, nb,
            bulk::smem_bytes<8, 8>(K, tpb), tpb, false);
    variant("bulk 8 warps, 8 stages", bulk::fp4t_bulk_kernel<8, 8, 1, 1>, 8, nb, bulk::smem_bytes<8, 8>(K, tpb), tpb,
            true);
    variant("... scales in one copy", bulk::fp4t_bulk_kernel<8, 8, 1, 1, 1>, 8, nb, bulk::smem_bytes<8, 8, 1>(K, tpb),
            tpb, true);
    variant("... 16 warps, 5 stages, scales in one copy", bulk::fp4t_bulk_kernel<16, 5, 1, 1, 1>, 16, nb,
            bulk::smem_bytes<16, 5, 1>(K, tpb), tpb, true);
  }
  {
    const int tpb = (T + 2 * sms - 1) / (2 * sms), nb = (T + tpb - 1) / tpb;
    variant("bulk 8 warps, 5 stages, 2 blocks/SM, 1 scale copy", bulk::fp4t_bulk_kernel<8, 5, 1, 2, 1>, 8, nb,
            bulk::smem_bytes<8, 5, 1>(K, tpb), tpb, true);
  }
  sh.report("register stream depth 8 again", time_us([&](int i) { run_ref(i, sh.yref); }), false);
}

int main(int argc, char** argv) {
  probe_reps = 60;  // the session 22 records' setting
  if (argc > 1 && std::string(argv[1]) == "once") probe_reps = 1, probe_warm = 0;
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  const int sms = p.multiProcessorCount;
  std::printf("%s, %d SMs\n", p.name, sms);
  print_copy_bandwidth(probe_reps > 1 ? 10 : 1);  // same process
  probe_shape(sms, 24576, 4096);  // the routed top-6 gate+up's bytes (6 x 4096 rows of 4096)
  probe_shape(sms, 4096, 12288);  // the routed top-6 down's (4096 rows of 6 x 2048)
  return 0;
}
