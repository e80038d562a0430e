// Probe (no torch; of the library only csrc/pdl.cuh's wait and trigger): what a launch boundary costs the routed
// MoE in two structures, each a producer and a consumer launched back to back with PDL (the consumer waits on
// griddepcontrol.wait, as the library's kernels do), 400 pairs timed by events, per pair:
//   empty      the producer writes nothing, the consumer waits and exits: the boundary alone
//   h          today's: 384 producer blocks write h (6 x 2048 bf16, 24 KB; each a slice, as the gate+up), 256
//              consumer blocks each stage all of h into shared memory (the down's stage_mma_rows: 4 loads in flight)
//   partP/R    a split-K fused MoE's tail (not built): P producer blocks each write a partial sum of the whole
//              output (4096 fp32, 16 KB; P = 384 at two 16-row pairs per block, 192 at four), then R consumer
//              blocks each sum their 4096 / R columns over the P partials in a fixed order (deterministic) and store
//              bf16
// Each case runs twice: as above (no kernel triggers; its successor launches when it exits) and "+trig", where every
// kernel lets its successor launch right after its own wait (griddepcontrol.launch_dependents: the library's
// ds4_pdl::begin), so the consumer's blocks are launched while the producer runs.
// The question (session 83): the down's blocks spend 3.3-4.0 us staging h in the step (experiments/session82.md);
// would a split-K pair's reduction be a cheaper tail than that staging plus the down's own launch?
//
//   nvcc -std=c++17 -O3 -arch=sm_90 scripts/probe_splitk_tail.cu -o /tmp/probe_tail && /tmp/probe_tail
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "../csrc/pdl.cuh"
#include "probe_util.cuh"

constexpr int DIM = 4096, H_VEC = 6 * 2048 / 8;  // h: 1536 16-byte vectors
constexpr int THREADS = 256;

__device__ bool g_trigger;  // +trig: launch the successor right after the wait (set once per case, before it runs)
__device__ __forceinline__ void pdl_begin() {
  ds4_pdl::wait();
  if (g_trigger) ds4_pdl::launch_dependents();
}

// Producers. Every kernel waits first: the previous pair's consumer is its predecessor in the stream.
__global__ void prod_empty() { pdl_begin(); }
__global__ void prod_h(uint4* h, uint32_t salt) {
  pdl_begin();
  const int per = (H_VEC + gridDim.x - 1) / gridDim.x;
  for (int i = blockIdx.x * per + threadIdx.x; i < min(H_VEC, (blockIdx.x + 1) * per); i += blockDim.x)
    h[i] = make_uint4(i ^ salt, i + salt, 3u, 4u);
}
__global__ void prod_part(float4* part, uint32_t salt) {  // block b: its partial, DIM fp32
  pdl_begin();
  for (int i = threadIdx.x; i < DIM / 4; i += blockDim.x)
    part[(long)blockIdx.x * (DIM / 4) + i] = make_float4(i, salt, blockIdx.x, 1.f);
}

// Consumers
__global__ void cons_empty() { pdl_begin(); }
__global__ void __launch_bounds__(THREADS) cons_h(const uint4* h, float* out) {
  __shared__ uint4 s[H_VEC];
  pdl_begin();
  for (int i0 = threadIdx.x; i0 < H_VEC; i0 += 4 * THREADS) {
    uint4 v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (i0 + j * THREADS < H_VEC) v[j] = h[i0 + j * THREADS];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (i0 + j * THREADS < H_VEC) s[i0 + j * THREADS] = v[j];
  }
  __syncthreads();
  if (threadIdx.x < 16) out[blockIdx.x * 16 + threadIdx.x] = __uint_as_float(s[threadIdx.x * 7].x);
}
// block r: columns [r C, (r + 1) C) as C / 4 float4 lanes; the threads split the P partials into THREADS / (C / 4)
// groups, each summing its partials in order, then the groups' sums in order
template <int C>
__global__ void __launch_bounds__(THREADS) cons_part(const float4* part, int P, __nv_bfloat16* out) {
  constexpr int L = C / 4, G = THREADS / L;
  static_assert(L >= 1 && THREADS % L == 0, "columns per block");
  __shared__ float4 s[G][L];
  pdl_begin();
  const int l = threadIdx.x % L, g = threadIdx.x / L;
  const float4* src = part + blockIdx.x * L + l;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int p = g; p < P; p += G) {
    const float4 v = src[(long)p * (DIM / 4)];
    acc.x += v.x;
    acc.y += v.y;
    acc.z += v.z;
    acc.w += v.w;
  }
  s[g][l] = acc;
  __syncthreads();
  if (threadIdx.x < L) {
    float4 t = s[0][l];
    for (int j = 1; j < G; ++j) {
      t.x += s[j][l].x;
      t.y += s[j][l].y;
      t.z += s[j][l].z;
      t.w += s[j][l].w;
    }
    __nv_bfloat16* o = out + blockIdx.x * C + 4 * l;
    o[0] = __float2bfloat16(t.x);
    o[1] = __float2bfloat16(t.y);
    o[2] = __float2bfloat16(t.z);
    o[3] = __float2bfloat16(t.w);
  }
}

int main() {
  uint4* h;
  float4* part;
  float* out;
  __nv_bfloat16* y;
  CK(cudaMalloc(&h, H_VEC * 16L));
  CK(cudaMalloc(&part, 384L * DIM * 4));
  CK(cudaMalloc(&out, 256 * 16 * 4));
  CK(cudaMalloc(&y, DIM * 2));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  std::printf("%s, %d SMs; per pair of launches (PDL), us: the median of 5 runs of 400 pairs\n", p.name,
              p.multiProcessorCount);
  const int pairs = 400;
  auto time = [&](const char* name, auto pair) {  // (CK exits on an error)
    std::vector<double> runs;
    for (int r = 0; r < 5; ++r) {
      for (int i = 0; i < 20; ++i) pair((uint32_t)i);
      CK(cudaEventRecord(e0, st));
      for (int i = 0; i < pairs; ++i) pair((uint32_t)i);
      CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      runs.push_back(ms * 1e3 / pairs);
    }
    std::printf("%-18s %7.2f us   (runs %.2f .. %.2f)\n", name, median(runs),
                *std::min_element(runs.begin(), runs.end()), *std::max_element(runs.begin(), runs.end()));
  };
  for (bool trig : {false, true}) {
    CK(cudaMemcpyToSymbol(g_trigger, &trig, sizeof trig));
    const char* tag = trig ? "+trig" : "";
    char name[40];
    std::snprintf(name, sizeof name, "empty%s", tag);
    time(name, [&](uint32_t) {
      launch_pdl(true, prod_empty, 384, THREADS, st);
      launch_pdl(true, cons_empty, 256, THREADS, st);
    });
    std::snprintf(name, sizeof name, "h 384/256%s", tag);
    time(name, [&](uint32_t s) {
      launch_pdl(true, prod_h, 384, THREADS, st, h, s);
      launch_pdl(true, cons_h, 256, THREADS, st, (const uint4*)h, out);
    });
    for (int P : {384, 192}) {
      std::snprintf(name, sizeof name, "part%d/128%s", P, tag);
      time(name, [&](uint32_t s) {
        launch_pdl(true, prod_part, P, THREADS, st, part, s);
        launch_pdl(true, cons_part<32>, DIM / 32, THREADS, st, (const float4*)part, P, y);
      });
      std::snprintf(name, sizeof name, "part%d/256%s", P, tag);
      time(name, [&](uint32_t s) {
        launch_pdl(true, prod_part, P, THREADS, st, part, s);
        launch_pdl(true, cons_part<16>, DIM / 16, THREADS, st, (const float4*)part, P, y);
      });
      std::snprintf(name, sizeof name, "part%d/512%s", P, tag);
      time(name, [&](uint32_t s) {
        launch_pdl(true, prod_part, P, THREADS, st, part, s);
        launch_pdl(true, cons_part<8>, DIM / 8, THREADS, st, (const float4*)part, P, y);
      });
    }
  }
  return 0;
}
