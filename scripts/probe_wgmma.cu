// Probe (sm_90a, no torch; timing only): the one-token FP4 product's arithmetic on Hopper's asynchronous warpgroup
// MMAs (wgmma: A from registers, B from shared memory) against the library's synchronous mma.sync m16n8k16, in one
// skeleton. Outputs are not checked: B is a ring of shared-memory tiles of arbitrary content; only the time is read.
//
// Why: session 49 timed the routed gate+up's FP4 arithmetic alone at 16.1 us of its 18.6, 10.4 of it the MMAs with
// their B fragment loads (mma.sync runs at one m16n8k16 per ~26 cycles per scheduler there: bound by latency at
// ~5 warps per scheduler, not by the tensor pipe). Session 52 run 1 (scripts/probe_fp8mma.cu) found that sm_90 has
// no FP8 mma.sync (ptxas lowers m16n8k32 e4m3 to F2FP conversions and two f16 HMMA.16816): Hopper's FP8 tensor cores
// are reached only through wgmma. wgmma is issued once per warpgroup for 64 rows, needs no B fragment loads (a
// shared-memory descriptor), and runs asynchronously beside the decode of the next words.
//
// PROD 0: the library's product, mma_chunk<FMT_FP4T> (fp4p decode, 2 mma.sync m16n8k16 per word pair, B fragments
//         from shared memory), each warp on its own 16-row tile;
// PROD 2: fp4p decode into the same A registers, wgmma m64n8k16 bf16 (2 per word pair), the warpgroup's 4 warps on 4
//         tiles at the same round (B shared);
// PROD 3: the fp4e decode of probe_fp8mma.cu (5 integer ops per word), wgmma m64n8k32 e4m3 (1 per word pair): the
//         numerics=qat product (activations E4M3 per 128, as the official reference's act_quant).
// A chunk's MMAs accumulate into one of two accumulator sets; the FP4 scales are applied to the previous chunk's set
// after wgmma.wait_group 1 (so one chunk's MMAs run while the last one is scaled).
// PROD 4 (run 3): PROD 3 with U x W accumulator sets (wait_group U W - 1) and the B descriptor formed once (fixed
// tiles per chunk and word), where PROD 3 recomputed it per MMA in uniform registers.
// MODE 0: weight words loaded (U units in flight per thread), MODE 1: the first unit's words only (arithmetic alone).
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -DDS4_PROBE scripts/probe_wgmma.cu -o build/probe_wgmma
#include "../csrc/gemv.cu"
#include "../csrc/moe.cu"
#include "../csrc/moe_mma.cu"  // gemv.cu's hc_fold_ok asks moe_down_fold_ok
#include "../csrc/moe_dp4a.cu"  // moe.cu's launch_moe_gate_up calls it
#include "probe_gemv.cuh"

#include <cstdio>
#include <vector>

namespace wg {

constexpr int WARPS = 8, THREADS = 32 * WARPS, W = ds4::FP4T_W;
constexpr int ROUND_VALS = 4 * W * 32;  // 256 values of a row per round
constexpr int NB = 16;                  // B tiles in the shared-memory ring (256 bytes each)

__device__ __forceinline__ void fp4e_regs(uint32_t q, uint32_t& lo, uint32_t& hi) {
  lo = q & 0x9C9C9C9Cu;
  hi = ((q << 2) & 0x8C8C8C8Cu) | ((q >> 2) & 0x10101010u);
}

// shared-memory matrix descriptor, no swizzle: start >> 4 (bits 0-13), leading byte offset >> 4 (16-29), stride
// byte offset >> 4 (32-45)
__device__ __forceinline__ uint64_t desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((saddr >> 4) & 0x3fffu) | (uint64_t)((lbo >> 4) & 0x3fffu) << 16 |
         (uint64_t)((sbo >> 4) & 0x3fffu) << 32;
}

__device__ __forceinline__ void wg_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
// wait until at most N groups are pending; d (the set about to be read) is named so its reads stay after the wait
template <int N>
__device__ __forceinline__ void wg_wait(float (&d)[4]) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %4;" : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "n"(N) : "memory");
#endif
}

__device__ __forceinline__ void wgmma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                           uint64_t b, int acc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(acc));
#endif
}
__device__ __forceinline__ void wgmma_e4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                           uint64_t b, int acc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(acc));
#endif
}

// Work: (row group of 64 rows = 4 tiles, round) units, split evenly over the warpgroups; warp v of a warpgroup takes
// tile 4 group + v. Each thread: per unit its 16-byte chunks of rows g and g + 8 for both chunks w (as MmaStream).
template <int U, int PROD, int MODE, int MINB>
__global__ void __launch_bounds__(THREADS, MINB)
wg_kernel(const uint8_t* __restrict__ Wt, const uint8_t* __restrict__ S, int s_ld, float* __restrict__ out, int O,
          int K) {
  __shared__ __align__(128) uint8_t bring[NB * 256];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // the warpgroup's index read through a shuffle, so ptxas holds it (and the loop bounds) in uniform registers: wgmma
  // on a path it cannot prove warpgroup-uniform is serialised
  const int wgi = __shfl_sync(0xffffffffu, blockIdx.x * (WARPS / 4) + (warp >> 2), 0), nwg = gridDim.x * (WARPS / 4);
  const int v = warp & 3;
  for (int i = threadIdx.x; i < NB * 64; i += THREADS) reinterpret_cast<uint32_t*>(bring)[i] = 0x3f803f80u ^ i;
  __syncthreads();
  const int nr = K / ROUND_VALS, units = (O / 64) * nr;
  const int beg = (int)((long)units * wgi / nwg), n = (int)((long)units * (wgi + 1) / nwg) - beg;
  const long rowb = K / 2;
  const uint32_t b0 = (uint32_t)__cvta_generic_to_shared(bring);
  uint4 wa[U][W], wb[U][W];
  uint32_t sa[U], sb[U];
  auto load = [&](int k, int u) {
    const int grp = u / nr, r = u - grp * nr, tile = 4 * grp + v;
    const uint8_t* base = Wt + (long)tile * 16 * rowb + lane * 16;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      wa[k][w] = ds4::ld_stream16(base + ((r * W + w) * 2 + 0) * 512);
      wb[k][w] = ds4::ld_stream16(base + ((r * W + w) * 2 + 1) * 512);
    }
    const uint8_t* sp = S + (long)(tile * 16 + g) * s_ld + 8 * r + 4 * (t & 1);
    sa[k] = __ldg(reinterpret_cast<const uint32_t*>(sp));
    sb[k] = __ldg(reinterpret_cast<const uint32_t*>(sp + 8L * s_ld));
  };
#pragma unroll
  for (int k = 0; k < U; ++k)
    if (k < n) load(k, beg + k);
  float acc0 = 0.f, acc1 = 0.f;
  float D[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  uint32_t ps = 0, ps8 = 0;  // the scales of the chunk in flight (the previous one), rows g / g + 8
  int pw = 0, step = 0, chunks = 0;
  auto scale_prev = [&](float (&d)[4]) {
    acc0 = fmaf(d[0], ds4::e8m0_mma_scale(ps, pw), acc0);
    acc0 = fmaf(d[1], ds4::e8m0_mma_scale(ps, 2 + pw), acc0);
    acc1 = fmaf(d[2], ds4::e8m0_mma_scale(ps8, pw), acc1);
    acc1 = fmaf(d[3], ds4::e8m0_mma_scale(ps8, 2 + pw), acc1);
  };
  // PROD 4: NS accumulator sets (NS - 1 chunks in flight while the oldest is scaled), fixed B tiles per chunk and
  // word, the descriptor formed once
  constexpr int NS = U * W;
  float E[NS][4];
  bool pend[NS];
  uint32_t ps4[NS], ps48[NS];
#pragma unroll
  for (int c = 0; c < NS; ++c) {
    E[c][0] = E[c][1] = E[c][2] = E[c][3] = 0.f;
    pend[c] = false;
    ps4[c] = ps48[c] = 0u;
  }
  const uint64_t bdesc = desc(b0, 128, 256);
  auto scale_set = [&](int c) {  // c: a compile-time set index at every call (unrolled)
    const int w = c % W;
    acc0 = fmaf(E[c][0], ds4::e8m0_mma_scale(ps4[c], w), acc0);
    acc0 = fmaf(E[c][1], ds4::e8m0_mma_scale(ps4[c], 2 + w), acc0);
    acc1 = fmaf(E[c][2], ds4::e8m0_mma_scale(ps48[c], w), acc1);
    acc1 = fmaf(E[c][3], ds4::e8m0_mma_scale(ps48[c], 2 + w), acc1);
    pend[c] = false;
  };
  for (int i0 = 0; i0 < n; i0 += U) {
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int i = i0 + k;
      if (i < n) {
        if constexpr (MODE == 1) {  // the same words every unit: hide that, or the decode leaves the loop
#pragma unroll
          for (int w = 0; w < W; ++w) {
            asm volatile("" : "+r"(wa[k][w].x), "+r"(wa[k][w].y), "+r"(wa[k][w].z), "+r"(wa[k][w].w));
            asm volatile("" : "+r"(wb[k][w].x), "+r"(wb[k][w].y), "+r"(wb[k][w].z), "+r"(wb[k][w].w));
          }
          asm volatile("" : "+r"(sa[k]), "+r"(sb[k]));
        }
        if constexpr (PROD == 0) {
          const uint32_t xa = b0 + 64u * ((step++) % NB);  // B fragments from the ring (arbitrary values)
#pragma unroll
          for (int w = 0; w < W; ++w) {
            uint4 xb[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) xb[j] = ds4::lds128(xa + 16u * (j + 4 * (t & 1)));
            float d[4] = {0.f, 0.f, 0.f, 0.f};
            ds4::mma_chunk<ds4::FMT_FP4T>(wa[k][w], wb[k][w], xb, d);
            acc0 = fmaf(d[0], ds4::e8m0_mma_scale(sa[k], w), acc0);
            acc0 = fmaf(d[1], ds4::e8m0_mma_scale(sa[k], 2 + w), acc0);
            acc1 = fmaf(d[2], ds4::e8m0_mma_scale(sb[k], w), acc1);
            acc1 = fmaf(d[3], ds4::e8m0_mma_scale(sb[k], 2 + w), acc1);
          }
        } else if constexpr (PROD == 4) {
#pragma unroll
          for (int w = 0; w < W; ++w) {
            const int c = k * W + w;  // this chunk's accumulator set; the oldest in flight is set (c + 1) % NS
            const uint32_t qa[4] = {wa[k][w].x, wa[k][w].y, wa[k][w].z, wa[k][w].w};
            const uint32_t qb[4] = {wb[k][w].x, wb[k][w].y, wb[k][w].z, wb[k][w].w};
            wg_fence();
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              uint32_t la, ha, lb, hb;
              fp4e_regs(qa[j], la, ha);
              fp4e_regs(qb[j], lb, hb);
              wgmma_e4m3(E[c], la, lb, ha, hb, bdesc + (uint64_t)(16 * (4 * c + j)), j);  // 256-byte B tiles
            }
            wg_commit();
            pend[c] = true;
            ps4[c] = sa[k];
            ps48[c] = sb[k];
            const int o = (c + 1) % NS;
            wg_wait<NS - 1>(E[o]);
            if (pend[o]) scale_set(o);
          }
        } else {
#pragma unroll
          for (int w = 0; w < W; ++w) {
            float (&d)[4] = D[w];  // chunk w of each unit in set w: the other set is the chunk before
            const uint32_t qa[4] = {wa[k][w].x, wa[k][w].y, wa[k][w].z, wa[k][w].w};
            const uint32_t qb[4] = {wb[k][w].x, wb[k][w].y, wb[k][w].z, wb[k][w].w};
            wg_fence();
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const uint64_t bd = desc(b0 + 256u * ((step++) % NB), 128, 256);
              if constexpr (PROD == 2) {
                uint32_t ra[4], rb[4];
                ds4::fp4p_regs(qa[j], ra);
                ds4::fp4p_regs(qb[j], rb);
                wgmma_bf16(d, ra[0], rb[0], ra[1], rb[1], bd, j);
                wgmma_bf16(d, ra[2], rb[2], ra[3], rb[3], desc(b0 + 256u * ((step++) % NB), 128, 256), 1);
              } else {
                uint32_t la, ha, lb, hb;
                fp4e_regs(qa[j], la, ha);
                fp4e_regs(qb[j], lb, hb);
                wgmma_e4m3(d, la, lb, ha, hb, bd, j);
              }
            }
            wg_commit();
            wg_wait<1>(D[w ^ 1]);  // the chunk before (the other set; zeros with scale 0 at the first) is done
            scale_prev(D[w ^ 1]);
            ++chunks;
            ps = sa[k];  // chunk w's scales become the ones in flight
            ps8 = sb[k];
            pw = w;
          }
        }
        if (MODE == 0 && i + U < n) load(k, beg + i + U);
      }
    }
  }
  if constexpr (PROD == 4) {
    float dummy[4] = {0.f, 0.f, 0.f, 0.f};
    wg_wait<0>(dummy);
#pragma unroll
    for (int c = 0; c < NS; ++c) {
      asm volatile("" : "+f"(E[c][0]), "+f"(E[c][1]), "+f"(E[c][2]), "+f"(E[c][3]));
      if (pend[c]) scale_set(c);
    }
  } else if constexpr (PROD != 0) {
    if (chunks > 0) {  // the last chunk is a unit's w = 1: set 1
      wg_wait<0>(D[1]);
      scale_prev(D[1]);
    }
  }
  out[blockIdx.x * THREADS + threadIdx.x] = acc0 + acc1;
}

}  // namespace wg

static void probe_shape(int sms, int O, int K) {
  Fp4tShape sh(O, K, 118, 130, [](int) { return __float2bfloat16(1.f); }, 56, "-");
  float* out;
  CK(cudaMalloc(&out, (size_t)sms * 8 * wg::THREADS * 4));
  auto row = [&](const char* name, auto kern, int minb) {
    const int nb = minb * sms;
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    char full[96];
    std::snprintf(full, sizeof full, "%s (%d blocks)", name, nb);
    sh.variant(full, [&](int i) {
      kern<<<nb, wg::THREADS>>>(sh.Ws[i % sh.copies], sh.Ss[i % sh.copies], sh.s_ld, out, O, K);
    }, false);
  };
  row("mma.sync bf16 (library product) U2, 3 blocks/SM", wg::wg_kernel<2, 0, 0, 3>, 3);
  row("wgmma bf16 m64n8k16 U2, 3 blocks/SM", wg::wg_kernel<2, 2, 0, 3>, 3);
  row("wgmma e4m3 m64n8k32 U2, 3 blocks/SM", wg::wg_kernel<2, 3, 0, 3>, 3);
  row("wgmma e4m3 m64n8k32 U1, 4 blocks/SM", wg::wg_kernel<1, 3, 0, 4>, 4);
  row("wgmma e4m3, 4 sets, fixed descriptors U2, 3 blocks/SM", wg::wg_kernel<2, 4, 0, 3>, 3);
  row("wgmma e4m3, 2 sets, fixed descriptors U1, 4 blocks/SM", wg::wg_kernel<1, 4, 0, 4>, 4);
  row("arithmetic alone: mma.sync bf16 U2, 3 blocks/SM", wg::wg_kernel<2, 0, 1, 3>, 3);
  row("arithmetic alone: wgmma bf16 U2, 3 blocks/SM", wg::wg_kernel<2, 2, 1, 3>, 3);
  row("arithmetic alone: wgmma e4m3 U2, 3 blocks/SM", wg::wg_kernel<2, 3, 1, 3>, 3);
  row("arithmetic alone: wgmma e4m3, 4 sets, fixed descriptors U2", wg::wg_kernel<2, 4, 1, 3>, 3);
  cudaFree(out);
}

int main() {
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  const int sms = p.multiProcessorCount;
  std::printf("%s, %d SMs (timing only: B is arbitrary, outputs are not checked)\n", p.name, sms);
  print_copy_bandwidth();  // same process
  probe_shape(sms, 24576, 4096);  // the routed top-6 gate+up's bytes
  probe_shape(sms, 4096, 12288);  // the routed top-6 down's
  return 0;
}
