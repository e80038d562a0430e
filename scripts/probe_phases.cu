// Phase probe of the decode kernels (no torch): builds the kernels' sources with DS4_PROBE, runs
// them at V4-Flash batch-1 shapes on random data and prints, per kernel, its time (the mean of back-to-back
// launches, CUDA events; the GEMV probes rotate weight copies through more than the L2, while the hc, sparse
// attention and indexer probes re-read one input set, L2-resident where it fits: up to 16384 indexer entries,
// the attention's window and selected rows, the hc weights) and the mean time of each phase between the kernel's
// DS4_MARKs (clock64 of thread 0 per block), plus the blocks' timeline (globaltimer): span from the
// first block's start to the last block's end, mean block life, blocks resident at once.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -DDS4_PROBE scripts/probe_phases.cu -o /tmp/probe && /tmp/probe [stream|sparse]
//
// The FMA GEMV variants (rows per warp R, chunks in flight U) are a sweep of the template parameters
// that the extension picks by shape; the read-only kernels give the ceiling of the same access patterns.
#include "../csrc/attn/hc.cu"
#include "../csrc/attn/indexer.cu"
#include "../csrc/attn/sparse_attn.cu"
#include "../csrc/gemv.cu"
#include "../csrc/moe.cu"
#include "../csrc/moe_dp4a.cu"  // moe.cu launches its gate+up (moe=fp4_dp4a)
#include "../csrc/moe_mma.cu"  // gemv.cu's hc_fold_ok asks moe_down_fold_ok
#include "probe_util.cuh"

#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

// One more launch with the probe buffers cleared, then the phase table of the marks in use.
template <typename F>
static void phases(const char* name, F f, int nmarks, float us) {
  static long long zc[4096][8];
  static unsigned long long zn[4096][8];
  std::fill(&zc[0][0], &zc[0][0] + 4096 * 8, 0LL);
  std::fill(&zn[0][0], &zn[0][0] + 4096 * 8, 0ULL);
  CK(cudaMemcpyToSymbol(ds4_pdl::probe_clk, zc, sizeof(zc)));
  CK(cudaMemcpyToSymbol(ds4_pdl::probe_ns, zn, sizeof(zn)));
  f(0);
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpyFromSymbol(zc, ds4_pdl::probe_clk, sizeof(zc)));
  CK(cudaMemcpyFromSymbol(zn, ds4_pdl::probe_ns, sizeof(zn)));
  const float ghz = clock_ghz();
  std::printf("%-34s %8.2f us |", name, us);
  int blocks = 0;
  double sum[8] = {0};
  unsigned long long t0 = ~0ULL, t1 = 0;
  double life = 0;
  std::vector<std::pair<unsigned long long, int>> ev;
  for (int b = 0; b < 4096; ++b) {
    if (zc[b][0] == 0 || zc[b][nmarks - 1] == 0) continue;
    ++blocks;
    for (int i = 1; i < nmarks; ++i) sum[i] += (double)(zc[b][i] - zc[b][i - 1]);
    t0 = std::min(t0, zn[b][0]);
    t1 = std::max(t1, zn[b][nmarks - 1]);
    life += (double)(zn[b][nmarks - 1] - zn[b][0]);
    ev.push_back({zn[b][0], 1});
    ev.push_back({zn[b][nmarks - 1], -1});
  }
  std::sort(ev.begin(), ev.end());
  int live = 0, peak = 0;
  for (auto& e : ev) peak = std::max(peak, live += e.second);
  for (int i = 1; i < nmarks; ++i) std::printf(" m%d-%d %6.2f", i - 1, i, blocks ? sum[i] / blocks / ghz / 1e3 : 0.0);
  std::printf(" | blocks %d span %.2f life %.2f peak %d\n", blocks, (t1 - t0) / 1e3, blocks ? life / blocks / 1e3 : 0.0,
              peak);
}

// ---- mHC pre at V4 shapes: h bf16 [1, 4, 4096], fn fp32 [24, 16384], finish with the attn norm
static void probe_hc() {
  const int n = 4, D = 4096, K = n * D, mix = (2 + n) * n, nsplit = ds4_attn::hc_nsplit(K);
  auto* h = dev_random<__nv_bfloat16>(K, -1.f, 1.f);
  auto* fn = dev_random<float>((size_t)mix * K, -0.01f, 0.01f);
  auto* scale = dev_random<float>(3, 0.5f, 1.f);
  auto* base = dev_random<float>(mix, -0.1f, 0.1f);
  auto* norm = dev_random<__nv_bfloat16>(D, 0.5f, 1.5f);
  float *part, *post, *comb;
  __nv_bfloat16* x;
  CK(cudaMalloc(&part, sizeof(float) * nsplit * (mix + 1)));
  CK(cudaMalloc(&post, sizeof(float) * n));
  CK(cudaMalloc(&comb, sizeof(float) * n * n));
  CK(cudaMalloc(&x, sizeof(__nv_bfloat16) * D));
  auto* xo = dev_random<__nv_bfloat16>(D, -1.f, 1.f);
  auto* pin = dev_random<float>(n, 0.f, 2.f);
  auto* cin = dev_random<float>(n * n, 0.f, 1.f);
  __nv_bfloat16* hout;
  CK(cudaMalloc(&hout, sizeof(__nv_bfloat16) * K));
  auto partials = [&](int) {
    ds4_attn::hc_partials_kernel<24, false><<<dim3(nsplit, 1), ds4_attn::HC_THREADS>>>(h, false, fn, K, mix, nsplit,
                                                                                       part, ds4_attn::HcPostArgs{});
  };
  const ds4_attn::HcPostArgs pa{xo, false, pin, cin, n, D, hout};
  auto post_partials = [&](int) {
    ds4_attn::hc_partials_kernel<24, true><<<dim3(nsplit, 1), ds4_attn::HC_THREADS>>>(h, false, fn, K, mix, nsplit,
                                                                                      part, pa);
  };
  auto post_only = [&](int) {
    ds4_attn::hc_post_kernel<<<dim3(K / 256), 256>>>(xo, false, h, false, pin, cin, 1, n, D, hout);
  };
  auto finish = [&](int) {
    ds4_attn::hc_finish_kernel<ds4_attn::HC_NORM_THREADS><<<dim3(1, 1), ds4_attn::HC_NORM_THREADS, D * 4>>>(
        h, false, part, n, D, mix, nsplit, scale, base, 20, 1e-6f, 1e-6f, false, x, post, comb, norm, false);
  };
  phases("hc_partials (nsplit 128)", partials, 3, time_us(partials));
  phases("hc_partials POST (post fused)", post_partials, 3, time_us(post_partials));
  std::printf("hc_post alone: %.2f us\n", time_us(post_only));
  phases("hc_finish + norm (512 thr)", finish, 6, time_us(finish));
  auto finish_norm = [&](int) {
    ds4_attn::hc_finish_norm_kernel<4><<<dim3(1, 1), ds4_attn::HCN_THREADS>>>(
        h, part, D, mix, nsplit, scale, base, 20, 1e-6f, 1e-6f, x, post, comb, norm, false);
  };
  phases("hc_finish_norm (vectorised)", finish_norm, 4, time_us(finish_norm));
}

// ---- sparse attention decode: 64 heads x 512, window 128, 512 selected of T/4 compressed entries
static void probe_sparse(int pos) {
  const int H = 64, D = 512, W = 128, P = 512, T = 65536, ratio = 4;
  auto* q = dev_random<__nv_bfloat16>((size_t)H * D, -1.f, 1.f);
  auto* win = dev_random<__nv_bfloat16>((size_t)W * D, -1.f, 1.f);
  auto* cache = dev_random<__nv_bfloat16>((size_t)(T / ratio) * D, -1.f, 1.f);
  auto* sink = dev_random<float>(H, -1.f, 1.f);
  const long nvis = (pos + 1) / ratio;
  std::vector<int64_t> sel(P);
  for (int p = 0; p < P; ++p) sel[p] = p < nvis ? (int64_t)((p * 7919L) % nvis) : -1;
  int64_t *dsel, *dpos;
  CK(cudaMalloc(&dsel, sizeof(int64_t) * P));
  CK(cudaMemcpy(dsel, sel.data(), sizeof(int64_t) * P, cudaMemcpyHostToDevice));
  const int64_t hpos = pos;
  CK(cudaMalloc(&dpos, sizeof(int64_t)));
  CK(cudaMemcpy(dpos, &hpos, sizeof(int64_t), cudaMemcpyHostToDevice));
  ds4_attn::SparseArgs a;
  a.q = q;
  a.kv = win;
  a.kv_r = D;
  a.sel = cache;
  a.sel_r = D;
  a.sink = sink;
  a.B = 1, a.S = 1, a.H = H, a.D = D, a.K = W, a.P = P;
  a.scale = 0.044f;
  a.pos = dpos, a.sel_idx = dsel, a.ratio = ratio;
  const int nsplit = ds4_attn::sparse_nsplit(W + P);
  float *opart, *ml;
  CK(cudaMalloc(&opart, sizeof(float) * nsplit * H * D));
  CK(cudaMalloc(&ml, sizeof(float) * nsplit * H * 2));
  const size_t smem = ds4_attn::sparse_smem(D);
  CK(cudaFuncSetAttribute(ds4_attn::sparse_chunk_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  auto chunk = [&](int) {  // D = 512: the kernel form whose output slices stay in registers
    ds4_attn::sparse_chunk_kernel<true>
        <<<dim3(nsplit, (H + 15) / 16, 1), ds4_attn::SP_THREADS, smem>>>(a, nsplit, opart, ml, false);
  };
  char name[64];
  std::snprintf(name, sizeof name, "sparse_chunk pos %d (%d splits)", pos, nsplit);
  phases(name, chunk, 4, time_us(chunk));
  __nv_bfloat16* out;
  CK(cudaMalloc(&out, sizeof(__nv_bfloat16) * H * D));
  auto freqs = dev_random<float>(32, 0.f, 1.f);
  auto combine = [&](int) {  // after the chunk kernel above: its ml / opart are the inputs
    ds4_attn::sparse_combine_kernel<<<dim3(H, 1), D / 4 < 128 ? D / 4 : 128, ds4_attn::sparse_combine_smem(nsplit)>>>(
        opart, ml, sink, nsplit, H, D, dpos, freqs, 64, out, ds4::SinkhornRide{}, false);
  };
  std::printf("sparse_combine pos %d: %.2f us\n", pos, time_us(combine));
}

// ---- indexer scores at decode: 64 heads x 128, T compressed entries allocated (the cache capacity / 4),
// the row at position pos (its (pos + 1) / 4 visible entries scored, the rest written -inf); rope: the
// query's RoPE applied in the kernel (the decode step's form) or q taken as already rotated.
static void probe_indexer(int pos, int T, bool rope) {
  const int H = 64, d = 128, R = 64, ratio = 4;
  setenv("DS4_PDL", "0", 1);
  auto* q = dev_random<__nv_bfloat16>((size_t)H * d, -1.f, 1.f);
  auto* w = dev_random<__nv_bfloat16>(H, -1.f, 1.f);
  auto* keys = dev_random<__nv_bfloat16>((size_t)T * d, -1.f, 1.f);
  auto* freqs = dev_random<float>(R / 2, 0.f, 1.f);
  const int64_t hpos = pos;
  int64_t* dpos;
  float* out;
  CK(cudaMalloc(&dpos, sizeof(int64_t)));
  CK(cudaMemcpy(dpos, &hpos, sizeof(int64_t), cudaMemcpyHostToDevice));
  CK(cudaMalloc(&out, sizeof(float) * T));
  auto f = [&](int) {
    CK(ds4_attn::launch_indexer_scores(q, w, true, 0.011f, keys, 0, d, 1, 1, H, d, T, false, dpos, ratio,
                                       rope ? freqs : nullptr, rope ? R : 0, out, 0));
  };
  char name[64];
  std::snprintf(name, sizeof name, "indexer T %d pos %d%s", T, pos, rope ? " rope" : "");
  phases(name, f, 7, time_us(f));
  cudaFree(q), cudaFree(w), cudaFree(keys), cudaFree(freqs), cudaFree(dpos), cudaFree(out);
}

// Buffers of one GEMV probe: weight / scale copies rotated through more than the L2 (50 MB), the
// activations (nx rows of K) and the output (O rows).
struct GemvBufs {
  std::vector<uint8_t*> Ws, Ss;
  __nv_bfloat16 *x, *out;
  int copies;
  GemvBufs(size_t wbytes, size_t sbytes, int w_hi, size_t nx, int K, int O) {
    copies = std::max(2, (int)(200e6 / wbytes) + 1);
    for (int c = 0; c < copies; ++c) {
      Ws.push_back(dev_bytes(wbytes, 0, w_hi));
      Ss.push_back(dev_bytes(sbytes, 118, 126));
    }
    x = dev_random<__nv_bfloat16>(nx * K, -1.f, 1.f);
    CK(cudaMalloc(&out, sizeof(__nv_bfloat16) * O));
  }
  GemvBufs(const GemvBufs&) = delete;
  GemvBufs& operator=(const GemvBufs&) = delete;
  ~GemvBufs() {
    for (auto* p : Ws) cudaFree(p);
    for (auto* p : Ss) cudaFree(p);
    cudaFree(x);
    cudaFree(out);
  }
};

// FP8 E4M3 codes below 0x7f (no NaN), scales per 128 x 128
static GemvBufs fp8_bufs(int O, int K, int group_rows) {
  return GemvBufs((size_t)O * K, (size_t)((O + 127) / 128) * (K / 128), 0x7e, group_rows > 0 ? O / group_rows : 1, K,
                  O);
}

// the launcher's tensor-core run width (DS4_MMA_W) and no PDL (plain back-to-back launches)
static void set_mma_width(int w) {
  char u[4];
  std::snprintf(u, sizeof u, "%d", w);
  setenv("DS4_MMA_W", u, 1);
  setenv("DS4_PDL", "0", 1);
}

// ---- FP8 FMA GEMV sweep over (R, U) at the attention projections' shapes
template <int R, int U>
static void probe_gemv_fp8(const char* what, int O, int K, int group_rows) {
  GemvBufs b = fp8_bufs(O, K, group_rows);
  auto kern = ds4::gemv_kernel<ds4::FMT_FP8, 1, R, U>;
  const long smem = ds4::gemv_smem<ds4::FMT_FP8>(1, K);
  CK(ds4::set_smem(kern, smem));
  const int rows_pb = ds4::GEMV_WARPS * R;
  auto f = [&](int i) {
    kern<<<(O + rows_pb - 1) / rows_pb, ds4::GEMV_THREADS, smem>>>(b.x, K, 1, b.Ws[i % b.copies], b.Ss[i % b.copies],
                                                                    K / 128, b.out, 0, O, O, K, group_rows);
  };
  const float us = time_us(f);
  char name[80];
  int nb = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, kern, ds4::GEMV_THREADS, smem));
  std::snprintf(name, sizeof name, "fp8 %s R%d U%d (%d/SM) %5.0f GB/s", what, R, U, nb, (O * (double)K) / us / 1e3);
  phases(name, f, 3, us);
}

// ---- tensor-core streaming GEMV (gemv_mma_kernel through its launcher, widest run W = DS4_MMA_W)
static void probe_gemv_mma(const char* what, int O, int K, int group_rows, int W) {
  GemvBufs b = fp8_bufs(O, K, group_rows);
  set_mma_width(W);
  auto f = [&](int i) {
    CK(ds4::launch_gemv(ds4::FMT_FP8, ds4::KERNEL_MMA, b.x, K, 1, b.Ws[i % b.copies], b.Ss[i % b.copies], K / 128,
                        b.out, false, O, O, K, group_rows, 0));
  };
  const float us = time_us(f);
  char name[80];
  std::snprintf(name, sizeof name, "mma %s W%d %5.0f GB/s", what, W, (O * (double)K) / us / 1e3);
  phases(name, f, 3, us);
}

// ---- FP4 GEMV (the routed gate+up's bytes in one matrix) through the launcher: tensor-core vs FMA
// shared_scales: every row reads row 0's scales (scale row stride 0, so the scale loads hit L1): the
// time the scale reads of the real layout cost (the output is then meaningless; timing only).
static void probe_gemv_fp4(int O, int K, int kernel, int W, bool shared_scales = false) {
  GemvBufs b((size_t)O * K / 2, (size_t)O * (K / 32), 255, 1, K, O);
  set_mma_width(W);
  auto f = [&](int i) {
    CK(ds4::launch_gemv(ds4::FMT_FP4, kernel, b.x, K, 1, b.Ws[i % b.copies], b.Ss[i % b.copies],
                        shared_scales ? 0 : K / 32, b.out, false, O, O, K, 0, 0));
  };
  const float us = time_us(f);
  char name[80];
  std::snprintf(name, sizeof name, "fp4 %dx%d %s W%d%s %5.0f GB/s", O, K, kernel == ds4::KERNEL_MMA ? "mma" : "fma", W,
                shared_scales ? " shared-scales" : "", (O * (double)K / 2) / us / 1e3);
  phases(name, f, 3, us);
}

// ---- read-only access patterns over a [O, K]-byte matrix (no decode / FMA): where is the ceiling?
// linear: thread i of the grid reads 16 B at i, i + grid, ... (U loads in flight per thread)
template <int U>
__global__ void read_linear_kernel(const uint4* __restrict__ p, long n16, unsigned* out) {
  unsigned acc = 0;
  const long stride = (long)gridDim.x * blockDim.x;
  for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += stride * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = i + u * stride < n16 ? ds4::ld_stream16(p + i + u * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x12345678u) out[0] = acc;
}
// rows: the FMA GEMV's pattern (warp = R rows, lanes over 16-B chunks of each row, U chunks per row in flight)
template <int R, int U>
__global__ void read_rows_kernel(const uint8_t* __restrict__ W, int O, int K, unsigned* out) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rbase = (blockIdx.x * 8 + warp) * R;
  const int nch = K / 16;
  unsigned acc = 0;
  for (int c0 = lane; c0 < nch; c0 += 32 * U) {
    uint4 v[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < R; ++j)
        v[u][j] = c0 + 32 * u < nch ? ds4::ld_stream16(W + (long)min(rbase + j, O - 1) * K + (long)(c0 + 32 * u) * 16)
                                    : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < R; ++j) acc ^= v[u][j].x ^ v[u][j].y ^ v[u][j].z ^ v[u][j].w;
  }
  if (acc == 0x12345678u) out[0] = acc;
}

// mma: the tensor-core kernels' pattern. A warp streams 16-row tiles; in round r lane (g, t) reads
// W consecutive 16-B chunks at (4 r + t) * W of rows g and g + 8 (W = 1: 16 rows x 64 B per
// instruction pair); U rounds in flight, reissued one by one as they are consumed (no drain).
// IL = 0: each warp owns tpw whole tiles; IL = 1: the block's 8 tpw tiles are dealt round by round
// (warp w takes rounds w, w + 8, ...). PD > 0 (IL = 0, sm_90): every 512 / (64 W) rounds lanes
// 0..15 also issue an L2 bulk prefetch (cp.async.bulk.prefetch) of 512 B of rows 0..15, PD such
// steps ahead of the loads. PK = 1 (IL = 0): the matrix repacked in fragment order, so that for each
// tile and round the 2 W loads of the warp are each 512 contiguous bytes (lane-ordered 16-B chunks).
template <int U, int W, int IL, int PD = 0, int PK = 0>
__global__ void read_mma_kernel(const uint8_t* __restrict__ M, int O, int rowb, int tpw, unsigned* out) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int gw = blockIdx.x * 8 + warp, nr = rowb / (64 * W);
  const int n = tpw * nr, tile0 = IL ? blockIdx.x * 8 * tpw : gw * tpw;
  constexpr int RP = 512 / (64 * W);  // rounds per 512-B prefetch step
  unsigned acc = 0;
  uint4 v[U][2 * W];
  auto prefetch = [&](int i) {  // the 512-B step that holds round i
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (PD > 0 && lane < 16 && i < n) {
      const int tile = tile0 + i / nr, r = i % nr;
      const uint8_t* p = M + (long)min(tile * 16 + lane, O - 1) * rowb + (long)r * 64 * W;
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], 512;" ::"l"(p) : "memory");
    }
#endif
  };
  auto load = [&](int k, int i) {
    if (PD > 0 && i % RP == 0) prefetch(i + PD * RP);
    const int f = IL ? i * 8 + warp : i;
    const int tile = tile0 + f / nr, r = f % nr;
    const int ra = min(tile * 16 + g, O - 1), rb = min(tile * 16 + g + 8, O - 1);
    if constexpr (PK) {
      const uint8_t* base = M + ((long)min(tile, O / 16 - 1) * nr + r) * (2 * W) * 512 + lane * 16;
#pragma unroll
      for (int w = 0; w < 2 * W; ++w) v[k][w] = ds4::ld_stream16(base + w * 512);
    } else {
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const long off = (long)((4 * r + t) * W + w) * 16;
        v[k][w] = ds4::ld_stream16(M + (long)ra * rowb + off);
        v[k][W + w] = ds4::ld_stream16(M + (long)rb * rowb + off);
      }
    }
  };
  for (int p = 0; p < PD; ++p) prefetch(p * RP);
#pragma unroll
  for (int k = 0; k < U; ++k)
    if (k < n) load(k, k);
  for (int i0 = 0; i0 < n; i0 += U) {
#pragma unroll
    for (int k = 0; k < U; ++k) {
      if (i0 + k < n) {
#pragma unroll
        for (int w = 0; w < 2 * W; ++w) acc ^= v[k][w].x ^ v[k][w].y ^ v[k][w].z ^ v[k][w].w;
        if (i0 + k + U < n) load(k, i0 + k + U);
      }
    }
  }
  if (acc == 0x12345678u) out[0] = acc;
}

static void probe_read_patterns(int O, int K) {
  const size_t bytes = (size_t)O * K;
  const int copies = std::max(2, (int)(200e6 / bytes) + 1);
  std::vector<uint8_t*> Ws;
  for (int c = 0; c < copies; ++c) Ws.push_back(dev_bytes(bytes, 0, 255));
  unsigned* out;
  CK(cudaMalloc(&out, 4));
  auto report = [&](const char* what, float us) {
    std::printf("read %-28s O=%5d K=%5d %7.2f us %6.0f GB/s\n", what, O, K, us, bytes / us / 1e3);
  };
  report("linear U4 (132x8 blk)", time_us([&](int i) {
           read_linear_kernel<4><<<132 * 8, 256>>>((const uint4*)Ws[i % copies], (long)(bytes / 16), out);
         }));
  report("linear U8 (132x4 blk)", time_us([&](int i) {
           read_linear_kernel<8><<<132 * 4, 256>>>((const uint4*)Ws[i % copies], (long)(bytes / 16), out);
         }));
  report("rows R2 U4", time_us([&](int i) {
           read_rows_kernel<2, 4><<<(O + 15) / 16, 256>>>(Ws[i % copies], O, K, out);
         }));
  report("rows R4 U2", time_us([&](int i) {
           read_rows_kernel<4, 2><<<(O + 31) / 32, 256>>>(Ws[i % copies], O, K, out);
         }));
  report("rows R1 U8", time_us([&](int i) {
           read_rows_kernel<1, 8><<<(O + 7) / 8, 256>>>(Ws[i % copies], O, K, out);
         }));
  // the mma pattern over 256 blocks of 8 warps, whole tiles per warp (needs >= 2048 tiles to fill the GPU)
  const int tiles = O / 16, tpw = tiles / (256 * 8);
  if (tpw < 1 || tiles % (256 * 8)) {
    std::printf("read mma patterns: O=%d gives %d tiles, not a multiple of 2048 (skipped)\n", O, tiles);
    for (auto* p : Ws) cudaFree(p);
    cudaFree(out);
    return;
  }
  const int nb = 256;
  report("mma U8 W1 (16 rows x 64 B)", time_us([&](int i) {
           read_mma_kernel<8, 1, 0><<<nb, 256>>>(Ws[i % copies], O, K, tpw, out);
         }));
  report("mma U4 W2 (16 rows x 128 B)", time_us([&](int i) {
           read_mma_kernel<4, 2, 0><<<nb, 256>>>(Ws[i % copies], O, K, tpw, out);
         }));
  report("mma U8 W1 interleaved", time_us([&](int i) {
           read_mma_kernel<8, 1, 1><<<nb, 256>>>(Ws[i % copies], O, K, tpw, out);
         }));
  report("mma U2 W4 (16 rows x 256 B)", time_us([&](int i) {
           read_mma_kernel<2, 4, 0><<<nb, 256>>>(Ws[i % copies], O, K, tpw, out);
         }));
  report("mma U8 W1 packed (512 B/instr)", time_us([&](int i) {
           read_mma_kernel<8, 1, 0, 0, 1><<<nb, 256>>>(Ws[i % copies], O, K, tpw, out);
         }));
  report("mma U4 W2 packed (512 B/instr)", time_us([&](int i) {
           read_mma_kernel<4, 2, 0, 0, 1><<<nb, 256>>>(Ws[i % copies], O, K, tpw, out);
         }));
  report("mma U2 W4 packed (512 B/instr)", time_us([&](int i) {
           read_mma_kernel<2, 4, 0, 0, 1><<<nb, 256>>>(Ws[i % copies], O, K, tpw, out);
         }));
  report("mma U8 W2 packed (512 B/instr)", time_us([&](int i) {
           read_mma_kernel<8, 2, 0, 0, 1><<<nb, 256>>>(Ws[i % copies], O, K, tpw, out);
         }));
  if (K % 512 == 0) {
    report("mma U4 W2 + L2 prefetch 1 x 512 B", time_us([&](int i) {
             read_mma_kernel<4, 2, 0, 1><<<nb, 256>>>(Ws[i % copies], O, K, tpw, out);
           }));
    report("mma U4 W2 + L2 prefetch 2 x 512 B", time_us([&](int i) {
             read_mma_kernel<4, 2, 0, 2><<<nb, 256>>>(Ws[i % copies], O, K, tpw, out);
           }));
    report("mma U2 W4 + L2 prefetch 2 x 512 B", time_us([&](int i) {
             read_mma_kernel<2, 4, 0, 2><<<nb, 256>>>(Ws[i % copies], O, K, tpw, out);
           }));
    report("mma U4 W2 + L2 prefetch 4 x 512 B", time_us([&](int i) {
             read_mma_kernel<4, 2, 0, 4><<<nb, 256>>>(Ws[i % copies], O, K, tpw, out);
           }));
  }
  for (auto* p : Ws) cudaFree(p);
  cudaFree(out);
}

// ---- L2 prefetch: how fast does a GEMV read weights that an earlier kernel pulled into the L2?
// (decode has ~40 us per layer of latency-bound kernels during which the DRAM idles)
__global__ void l2_prefetch_lines_kernel(const char* __restrict__ p, long bytes) {
  const long stride = (long)gridDim.x * blockDim.x * 128;
  for (long off = ((long)blockIdx.x * blockDim.x + threadIdx.x) * 128; off < bytes; off += stride)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p + off));
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define DS4_BULK_PREFETCH 1
#endif
__global__ void l2_prefetch_bulk_kernel(const char* __restrict__ p, long bytes, int chunk) {
#ifdef DS4_BULK_PREFETCH
  const long off = ((long)blockIdx.x * blockDim.x + threadIdx.x) * chunk;
  if (off < bytes) {
    const int n = (int)(bytes - off < chunk ? bytes - off : chunk);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(n) : "memory");
  }
#endif
}
__global__ void l2_touch_kernel(const uint4* __restrict__ p, long n16, unsigned* out) {
  unsigned acc = 0;
  const long stride = (long)gridDim.x * blockDim.x;
  for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += stride) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p + i));
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}
__global__ void spin_kernel(long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); while ((long)(t - t0) < ns);
}

// median of reps single-launch times of `timed` (event pair around it), each after `setup` on the stream
template <typename S, typename F>
static float median_us(S setup, F timed, int reps = 15) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> v;
  for (int r = 0; r < reps + 2; ++r) {
    setup();
    CK(cudaEventRecord(a));
    timed();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0.f;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (r >= 2) v.push_back(ms * 1e3f);
  }
  CK(cudaGetLastError());
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

static void probe_l2(const char* what, int fmt, int O, int K, int group_rows) {
  const size_t wbytes = fmt == ds4::FMT_FP4 ? (size_t)O * K / 2 : (size_t)O * K;
  const size_t sbytes = fmt == ds4::FMT_FP4 ? (size_t)O * (K / 32) : (size_t)((O + 127) / 128) * (K / 128);
  const int sld = fmt == ds4::FMT_FP4 ? K / 32 : K / 128;
  uint8_t* W = dev_bytes(wbytes, 0, fmt == ds4::FMT_FP4 ? 255 : 0x7e);
  uint8_t* S = dev_bytes(sbytes, 118, 126);
  auto* x = dev_random<__nv_bfloat16>(K, -1.f, 1.f);
  __nv_bfloat16* out;
  CK(cudaMalloc(&out, 2 * O));
  char* flush;
  const size_t fl = 256ull << 20;
  CK(cudaMalloc(&flush, fl));
  unsigned* sink;
  CK(cudaMalloc(&sink, 4));
  set_mma_width(2);
  auto gemv = [&] {
    CK(ds4::launch_gemv(fmt, ds4::KERNEL_MMA, x, K, 1, W, S, sld, out, false, O, O, K, group_rows, 0));
  };
  auto cold = [&] { CK(cudaMemsetAsync(flush, 1, fl)); };
  const int sms = 132;
  auto pf_lines = [&](size_t bytes) { l2_prefetch_lines_kernel<<<2 * sms, 256>>>((const char*)W, (long)bytes); };
  auto pf_bulk = [&](size_t bytes) {
    const int chunk = 16384;
    const long n = ((long)bytes + chunk - 1) / chunk;
    l2_prefetch_bulk_kernel<<<(n + 127) / 128, 128>>>((const char*)W, (long)bytes, chunk);
  };
  auto touch = [&](size_t bytes) { l2_touch_kernel<<<4 * sms, 512>>>((const uint4*)W, (long)(bytes / 16), sink); };
  const float t_cold = median_us(cold, gemv);
  const float t_lines = median_us([&] { cold(); pf_lines(wbytes); spin_kernel<<<1, 1>>>(30000); }, gemv);
  const float t_bulk = median_us([&] { cold(); pf_bulk(wbytes); spin_kernel<<<1, 1>>>(30000); }, gemv);
  const float t_touch = median_us([&] { cold(); touch(wbytes); }, gemv);
  const float t_half = median_us([&] { cold(); touch(wbytes / 2); }, gemv);
  // the prefetchers' own time (kernel duration) and a GEMV issued right behind them (no idle gap)
  const float k_lines = median_us(cold, [&] { pf_lines(wbytes); });
  const float k_bulk = median_us(cold, [&] { pf_bulk(wbytes); });
  const float k_touch = median_us(cold, [&] { touch(wbytes); });
  const float bulk_then = median_us(cold, [&] { pf_bulk(wbytes); gemv(); });
  const float mb = wbytes / 1e6;
  std::printf("l2 %-22s %5.1f MB | gemv cold %6.2f | after prefetch.L2 %6.2f, bulk %6.2f, ld.cg %6.2f (half %6.2f) | "
              "prefetcher lines %6.2f bulk %6.2f ld.cg %6.2f (%4.0f GB/s) | bulk+gemv %6.2f us\n",
              what, mb, t_cold, t_lines, t_bulk, t_touch, t_half, k_lines, k_bulk, k_touch, wbytes / k_touch / 1e3,
              bulk_then);
  cudaFree(W), cudaFree(S), cudaFree(x), cudaFree(out), cudaFree(flush), cudaFree(sink);
}

template <int R, int U>
static void gemv_shapes() {
  probe_gemv_fp8<R, U>("wq_b 32768x1024", 32768, 1024, 0);
  probe_gemv_fp8<R, U>("wo_a 8192x4096/g", 8192, 4096, 1024);
  probe_gemv_fp8<R, U>("wo_b 4096x8192", 4096, 8192, 0);
}

// ---- TLB reach: a decode step reads ~11 GB of weights per token, each layer's from new 2 MB pages (the
// routed experts from random places in 3.4 GB per layer), where a micro-benchmark re-reads a few hundred
// MB. Same bytes, same kernel, three placements: does reading from pages far apart cost more?
// read_chunks_kernel: the grid reads n16 16-byte words, chunk c (2^lg bytes) of them at base + offs[c]
// (U loads in flight per thread).
template <int U>
__global__ void read_chunks_kernel(const char* __restrict__ base, const long* __restrict__ offs, int lg, long n16,
                                   unsigned* out) {
  unsigned acc = 0;
  const long stride = (long)gridDim.x * blockDim.x;
  const int sh = lg - 4;
  const long mask = (1L << sh) - 1;
  for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += stride * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long k = i + u * stride;
      v[u] = k < n16 ? ds4::ld_stream16(base + offs[k >> sh] + ((k & mask) << 4)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x12345678u) out[0] = acc;
}

static void probe_tlb() {
  const long region = 48L << 30, per = 80L << 20;  // 48 GB allocation, 80 MB read per launch (~ a layer's routed experts)
  char* base;
  CK(cudaMalloc(&base, region));
  CK(cudaMemset(base, 1, region));
  unsigned* out;
  CK(cudaMalloc(&out, 4));
  std::mt19937_64 r(7);
  for (int lg : {22, 21, 20}) {  // chunks of 4, 2, 1 MB
    const long chunk = 1L << lg;
    const int nch = (int)(per / chunk), sets = 64;
    // placement 0: 8 disjoint sets inside the first 640 MB (a micro-benchmark's rotating copies);
    // 1: each launch the next 80 MB of the 48 GB (a dense weight walk); 2: random chunks of the 48 GB (experts)
    for (int place = 0; place < 3; ++place) {
      std::vector<long> h((size_t)sets * nch);
      for (int s = 0; s < sets; ++s)
        for (int c = 0; c < nch; ++c) {
          long off;
          if (place == 0) off = (long)(s % 8) * per + (long)c * chunk;
          else if (place == 1) off = ((long)s * per + (long)c * chunk) % region;
          else off = (long)(r() % (unsigned long)(region / chunk)) * chunk;
          h[(size_t)s * nch + c] = off;
        }
      long* d;
      CK(cudaMalloc(&d, h.size() * sizeof(long)));
      CK(cudaMemcpy(d, h.data(), h.size() * sizeof(long), cudaMemcpyHostToDevice));
      const long n16 = per / 16;
      const float us = time_us([&](int i) {
        read_chunks_kernel<4><<<132 * 8, 256>>>(base, d + (size_t)(i % sets) * nch, lg, n16, out);
      }, 60);
      static const char* names[3] = {"640 MB, rotating sets", "48 GB, sequential walk", "48 GB, random chunks"};
      std::printf("tlb %4ld KB chunks, %-24s %7.2f us %6.0f GB/s\n", chunk >> 10, names[place], us, per / us / 1e3);
      cudaFree(d);
    }
  }
  cudaFree(base);
  cudaFree(out);
}

int main(int argc, char** argv) {
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  std::printf("%s, %d SMs, clock %.2f GHz\n", p.name, p.multiProcessorCount, clock_ghz());
  print_copy_bandwidth();
  if (argc > 1 && std::string(argv[1]) == "scales") {  // what the FP4 scale reads cost the tensor-core GEMV
    for (int W : {2, 4})
      for (bool sh : {false, true}) probe_gemv_fp4(24576, 4096, ds4::KERNEL_MMA, W, sh);
    for (bool sh : {false, true}) probe_gemv_fp4(12288, 4096, ds4::KERNEL_MMA, 2, sh);
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "l2") {  // weights read from the L2 after a prefetch
    probe_l2("wq_b 32768x1024", ds4::FMT_FP8, 32768, 1024, 0);
    probe_l2("wo_a 8192x4096/g", ds4::FMT_FP8, 8192, 4096, 1024);
    probe_l2("wo_b 4096x8192", ds4::FMT_FP8, 4096, 8192, 0);
    probe_l2("shared w13 4096x4096", ds4::FMT_FP8, 4096, 4096, 0);
    probe_l2("wq_a+wkv 1536x4096", ds4::FMT_FP8, 1536, 4096, 0);
    probe_l2("fp4 12288x4096", ds4::FMT_FP4, 12288, 4096, 0);
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "sparse") {  // the attention core alone
    for (int pos : {63, 200, 8191}) probe_sparse(pos);
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "indexer") {  // the indexer's scores kernel (decode), both q forms,
    for (int T : {2048, 16384})                          // and the sparse attention kernel
      for (int pos : {63, 8191})
        for (bool rope : {false, true}) probe_indexer(pos, T, rope);
    probe_sparse(63);
    probe_sparse(8191);
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "tlb") {  // the same bytes read from near or far pages
    probe_tlb();
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "hc") {  // the mHC kernels only
    probe_hc();
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "packed") {  // read patterns only (incl. fragment-order repack)
    probe_read_patterns(24576, 2048);
    probe_read_patterns(32768, 4096);
    probe_read_patterns(4096, 8192);
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "prefetch") {  // read patterns only
    probe_read_patterns(24576, 2048);
    probe_read_patterns(32768, 1024);
    probe_read_patterns(32768, 4096);
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "stream") {  // the streaming tensor-core kernels only
    probe_read_patterns(24576, 2048);
    probe_read_patterns(32768, 1024);
    probe_read_patterns(4096, 8192);
    for (int U : {1, 2, 4}) {  // DS4_MMA_W
      probe_gemv_fp4(24576, 4096, ds4::KERNEL_MMA, U);
      probe_gemv_mma("wq_b 32768x1024", 32768, 1024, 0, U);
      probe_gemv_mma("wo_b 4096x8192", 4096, 8192, 0, U);
    }
    probe_gemv_fp4(24576, 4096, ds4::KERNEL_FMA, 8);
    return 0;
  }
  probe_hc();
  probe_sparse(63);
  probe_sparse(8191);
  probe_read_patterns(32768, 1024);
  probe_read_patterns(4096, 8192);
  probe_read_patterns(1 << 16, 4096);
  gemv_shapes<2, 4>();
  gemv_shapes<4, 2>();
  for (int U : {1, 2, 4}) {  // DS4_MMA_W
    probe_gemv_mma("wq_b 32768x1024", 32768, 1024, 0, U);
    probe_gemv_mma("wo_a 8192x4096/g", 8192, 4096, 1024, U);
    probe_gemv_mma("wo_b 4096x8192", 4096, 8192, 0, U);
    probe_gemv_mma("wq_a+wkv 1536x4096", 1536, 4096, 0, U);
  }
  return 0;
}
