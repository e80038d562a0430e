// Probe (no torch, no library code): how long do 256 blocks of 256 threads take to stage 24 KB of bf16 activations
// (6 rows of 2048, the routed MoE down's h at V4's shapes) from global memory, and why? Session 82: the down's blocks
// spend 3.3-4.0 us staging h in the decode step and 3.5-3.9 us alone on an H100, by their threads' loads or by bulk
// copies, with h requested before any weight round or after them (experiments/session82.md). Each case below
// times, per block, thread 0's globaltimer from a barrier before the loads to a barrier after the staged values are
// stored in shared memory (the down's stage_mma_rows: 4 loads in flight per thread, then 2), and prints the mean and
// the largest block time over the blocks, medians over repetitions:
//   written    h written by a 384-block kernel right before (each block a slice, as the gate+up writes h)
//   reread     the same h read again by the same reader right after (its lines clean and resident in L2)
//   distinct   every block reads its own 24 KB (6 MB written right before; no line shared by two blocks)
//   copies8    block b reads copy b mod 8 of h (session 80's DS4_H_COPIES=8, which staged no faster in the step)
//   evicted    h written, then 128 MB streamed by all SMs (h's lines most likely out of L2), then read
//   one        a single block reads h right after it was written (no other block loads anything)
//   chain      one thread's dependent loads (a pointer chase through h's lines): the mean latency of one L2 hit
//   allin      written, each thread's 6 loads all in flight before any store
//   nc / cg    written, the loads as ld.global.nc / ld.global.cg
//   beside     written and read while a kernel on another stream streams 1 GB from HBM on every SM (2 blocks of 512
//              threads each, beside the reader's): session 84's reading, that the library's down stages h slowly
//              because the other SMs' weight streams load L2 and HBM while it does (experiments/session84.md)
//   beside/2   the same with the stream on half of the SMs' worth of blocks (a lighter load)
// Session 84 (H100): 0.81 us written, 4.68 beside (the stream 3124 GB/s alone), 0.90 beside/2 (3110 GB/s alone).
//
//   nvcc -std=c++17 -O3 -arch=sm_90 scripts/probe_h_read.cu -o /tmp/probe_h && /tmp/probe_h
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "probe_util.cuh"

constexpr int ROWS = 6, K = 2048, VEC = ROWS * K / 8;  // 1536 16-byte vectors: 24 KB
constexpr int THREADS = 256, BLOCKS = 256;

// 384 blocks write h (or, distinct, BLOCKS copies of it): each block an equal slice, as the gate+up's tiles do
__global__ void writer(uint4* h, long nvec, uint32_t salt) {
  const long per = (nvec + gridDim.x - 1) / gridDim.x;
  for (long i = blockIdx.x * per + threadIdx.x; i < min(nvec, (blockIdx.x + 1) * per); i += blockDim.x)
    h[i] = make_uint4((uint32_t)i ^ salt, (uint32_t)i + salt, 3u, 4u);
}

// The staging: block b reads VEC vectors of copy b mod copies of h into shared memory, IN loads in flight
// per thread before it stores them (4: the library's stage_mma_rows; 8: all of a thread's 6 at once)
template <int IN, int LD = 0>  // LD: 0 plain loads (the library's), 1 ld.global.nc, 2 ld.global.cg (L2 only)
__global__ void __launch_bounds__(THREADS) reader(const uint4* h, int copies, uint64_t* out) {
  __shared__ uint4 s[VEC];
  const uint4* src = h + (long)(blockIdx.x % copies) * VEC;  // copies: 1 (h), 8 (session 80's hcopy8), BLOCKS
  __syncthreads();
  uint64_t t0 = 0;
  if (threadIdx.x == 0) t0 = gtimer();
  for (int i0 = threadIdx.x; i0 < VEC; i0 += IN * THREADS) {
    uint4 v[IN];
#pragma unroll
    for (int j = 0; j < IN; ++j)
      if (i0 + j * THREADS < VEC) {
        const uint4* q = src + i0 + j * THREADS;
        v[j] = LD == 1 ? __ldg(q) : LD == 2 ? __ldcg(q) : *q;
      }
#pragma unroll
    for (int j = 0; j < IN; ++j)
      if (i0 + j * THREADS < VEC) s[i0 + j * THREADS] = v[j];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    out[2 * blockIdx.x] = t0;
    out[2 * blockIdx.x + 1] = gtimer() - t0 + (s[blockIdx.x % VEC].x == 0xdeadbeefu ? 1 : 0);
  }
}

// one thread: n dependent loads, each line's first word the index of the next line (a chase through h's lines)
__global__ void chase(const uint32_t* h, int n, uint64_t* out) {
  uint32_t i = 0;
  const uint64_t t0 = gtimer();
  for (int k = 0; k < n; ++k) i = h[i];
  out[0] = gtimer() - t0;
  out[1] = i;
}
__global__ void spin(uint64_t ns) {  // one thread: returns ns nanoseconds after it starts
  const uint64_t t0 = gtimer();
  while (gtimer() - t0 < ns) {
  }
}
__global__ void chain_init(uint32_t* h, int lines) {  // line l (32 words) -> line (l * 37 + 11) % lines
  for (int l = threadIdx.x; l < lines; l += blockDim.x) h[l * 32] = ((l * 37 + 11) % lines) * 32;
}

struct Stat {
  double mean_us, max_us;
};
static Stat stat(const std::vector<uint64_t>& o, int blocks) {
  double s = 0, m = 0;
  for (int b = 0; b < blocks; ++b) {
    s += o[2 * b + 1] / 1e3;
    m = std::max(m, o[2 * b + 1] / 1e3);
  }
  return {s / blocks, m};
}

int main() {
  const long big_bytes = 128L << 20;
  uint4 *h, *hd, *big;
  uint64_t* out;
  uint32_t* sink;
  CK(cudaMalloc(&h, VEC * 16L));
  CK(cudaMalloc(&hd, (long)BLOCKS * VEC * 16));
  CK(cudaMalloc(&big, big_bytes));
  CK(cudaMalloc(&out, 2 * BLOCKS * sizeof(uint64_t)));
  CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(big, 1, big_bytes));
  std::vector<uint64_t> o(2 * BLOCKS);
  const int reps = 9;
  auto run = [&](const char* name, auto body, int blocks) {  // (CK exits on an error)
    std::vector<double> means, maxes;
    for (int r = 0; r < reps; ++r) {
      body((uint32_t)r);
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(o.data(), out, o.size() * 8, cudaMemcpyDeviceToHost));
      const Stat s = stat(o, blocks);
      means.push_back(s.mean_us);
      maxes.push_back(s.max_us);
    }
    std::printf("%-9s block staging mean %6.2f us, largest %6.2f us (medians of %d)\n", name, median(means),
                median(maxes), reps);
  };
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  std::printf("%s, %d SMs; %d blocks x %d threads stage %d bytes each\n", p.name, p.multiProcessorCount, BLOCKS,
              THREADS, VEC * 16);
  run("written", [&](uint32_t r) { writer<<<384, 256>>>(h, VEC, r); reader<4><<<BLOCKS, THREADS>>>(h, 1, out); },
      BLOCKS);
  run("reread", [&](uint32_t r) {
    writer<<<384, 256>>>(h, VEC, r);
    reader<4><<<BLOCKS, THREADS>>>(h, 1, out);
    reader<4><<<BLOCKS, THREADS>>>(h, 1, out);
  }, BLOCKS);
  run("distinct", [&](uint32_t r) {
    writer<<<384, 256>>>(hd, (long)BLOCKS * VEC, r);
    reader<4><<<BLOCKS, THREADS>>>(hd, BLOCKS, out);
  }, BLOCKS);
  run("copies8", [&](uint32_t r) {
    writer<<<384, 256>>>(hd, 8L * VEC, r);
    reader<4><<<BLOCKS, THREADS>>>(hd, 8, out);
  }, BLOCKS);
  run("evicted", [&](uint32_t r) {
    writer<<<384, 256>>>(h, VEC, r);
    streamer<<<p.multiProcessorCount * 4, 512>>>(big, big_bytes / 16, sink);
    reader<4><<<BLOCKS, THREADS>>>(h, 1, out);
  }, BLOCKS);
  run("one", [&](uint32_t r) { writer<<<384, 256>>>(h, VEC, r); reader<4><<<1, THREADS>>>(h, 1, out); }, 1);
  run("allin", [&](uint32_t r) { writer<<<384, 256>>>(h, VEC, r); reader<8><<<BLOCKS, THREADS>>>(h, 1, out); },
      BLOCKS);
  run("nc", [&](uint32_t r) { writer<<<384, 256>>>(h, VEC, r); reader<4, 1><<<BLOCKS, THREADS>>>(h, 1, out); },
      BLOCKS);
  run("cg", [&](uint32_t r) { writer<<<384, 256>>>(h, VEC, r); reader<4, 2><<<BLOCKS, THREADS>>>(h, 1, out); },
      BLOCKS);
  // beside a stream on another stream: it starts first; the reader's stream waits 20 us (a spin) so that it runs
  // inside the stream, which takes about 300 us for 1 GB
  const long huge_bytes = 1L << 30;
  uint4* huge;
  CK(cudaMalloc(&huge, huge_bytes));
  CK(cudaMemset(huge, 1, huge_bytes));
  cudaStream_t s1, s2;
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  for (int div : {1, 2}) {
    run(div == 1 ? "beside" : "beside/2", [&](uint32_t r) {
      streamer<<<2 * p.multiProcessorCount / div, 512, 0, s1>>>(huge, huge_bytes / 16, sink);
      spin<<<1, 1, 0, s2>>>(20000);
      writer<<<384, 256, 0, s2>>>(h, VEC, r);
      reader<4><<<BLOCKS, THREADS, 0, s2>>>(h, 1, out);
    }, BLOCKS);
  }
  {  // the stream's own rate, alone
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int div : {1, 2}) {
      std::vector<double> gbs;
      for (int r = 0; r < 5; ++r) {
        CK(cudaEventRecord(e0));
        streamer<<<2 * p.multiProcessorCount / div, 512>>>(huge, huge_bytes / 16, sink);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        gbs.push_back(huge_bytes / (ms * 1e6));
      }
      std::printf("stream    %d blocks of 512 threads: %.0f GB/s alone (median of 5)\n",
                  2 * p.multiProcessorCount / div, median(gbs));
    }
  }
  // the chase: h's 192 lines, 192 dependent loads, right after they were written (the first pass) and again
  const int lines = VEC * 16 / 128, n = lines;
  std::vector<double> first, again;
  for (int r = 0; r < reps; ++r) {
    chain_init<<<1, 256>>>(reinterpret_cast<uint32_t*>(h), lines);
    chase<<<1, 1>>>(reinterpret_cast<uint32_t*>(h), n, out);
    CK(cudaMemcpy(o.data(), out, 16, cudaMemcpyDeviceToHost));
    first.push_back(o[0] / 1e3 / n * 1e3);
    chase<<<1, 1>>>(reinterpret_cast<uint32_t*>(h), n, out);
    CK(cudaMemcpy(o.data(), out, 16, cudaMemcpyDeviceToHost));
    again.push_back(o[0] / 1e3 / n * 1e3);
  }
  std::printf("chain     one dependent load: %.0f ns after the lines were written, %.0f ns when read again "
              "(medians of %d; %d loads)\n", median(first), median(again), reps, n);
  return 0;
}
