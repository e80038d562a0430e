// Probe: what a kernel boundary costs a chain of dependent kernels in a CUDA graph (sm_90, no torch).
//
// Why: the decode step is a chain of ~14 dependent launches per layer, most of them short. Each one waits
// for its predecessor with PDL's griddepcontrol.wait, which returns once the whole previous grid has exited
// and its memory is flushed. A kernel could instead wait on a counter its predecessor's blocks bump as
// they finish (after a fence), so it proceeds without the grid-completion step. This probe times N
// dependent kernels (each block reads what the previous kernel wrote and writes its own buffer) three ways:
//   plain  launches without PDL;
//   pdl    griddepcontrol.wait, then launch_dependents (ds4_pdl::begin(), csrc/pdl.cuh);
//   flag   thread 0 polls the previous kernel's counter (ld.acquire.gpu) until every block of it has
//          finished, then launch_dependents; at its end each block fences and bumps its own counter.
// Time per kernel = graph replay / N. Outputs are checked where the kernels do no arithmetic (work = 0: every
// element must equal N; with work the values drift from N by design, so no check is printed).
//   nvcc -std=c++17 -O3 -arch=sm_90 scripts/probe_chain.cu -o /tmp/probe_chain && /tmp/probe_chain
#include "../csrc/pdl.cuh"
#include "probe_util.cuh"

constexpr int THREADS = 256;

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// MODE 0 plain, 1 pdl, 2 flag. prev / cur: [G * THREADS] floats; cnt: this kernel's counter (cnt[-1]: the previous
// kernel's; the first kernel of the chain gets first = 1 and waits for nothing).
template <int MODE>
__global__ void __launch_bounds__(THREADS) chain_kernel(const float* prev, float* cur, unsigned* cnt, int first,
                                                        int gprev, int work) {
  if (MODE == 1) {
    ds4_pdl::wait();
    ds4_pdl::launch_dependents();
  }
  if (MODE == 2) {
    if (!first && threadIdx.x == 0) {
      while (ld_acquire(cnt - 1) < (unsigned)gprev) __nanosleep(32);
    }
    __syncthreads();
    ds4_pdl::launch_dependents();
  }
  const int i = blockIdx.x * THREADS + threadIdx.x;
  float v = first ? 0.f : __ldcg(prev + i);
  for (int k = 0; k < work; ++k) v = v * 1.0000001f + 1e-30f;  // a little arithmetic (work = 0: none)
  __stcg(cur + i, v + 1.f);
  if (MODE == 2) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(cnt, 1u);
  }
}

// Microseconds per replay of the graph that capture(stream) records (3 warm-up replays, then `reps` timed).
template <typename F>
static float graph_us(F capture, int reps) {
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaGraph_t graph;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  capture(st);
  CK(cudaStreamEndCapture(st, &graph));
  cudaGraphExec_t exec;
  CK(cudaGraphInstantiate(&exec, graph, 0));
  for (int r = 0; r < 3; ++r) CK(cudaGraphLaunch(exec, st));
  CK(cudaStreamSynchronize(st));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  CK(cudaEventRecord(a, st));
  for (int r = 0; r < reps; ++r) CK(cudaGraphLaunch(exec, st));
  CK(cudaEventRecord(b, st));
  CK(cudaEventSynchronize(b));
  float ms = 0.f;
  CK(cudaEventElapsedTime(&ms, a, b));
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaStreamDestroy(st));
  return ms * 1000.f / reps;
}

template <int MODE>
static float run(int N, int G, int work, float** bufs, unsigned* cnt, bool* ok) {
  const float us = graph_us([&](cudaStream_t st) {
    CK(cudaMemsetAsync(cnt, 0, sizeof(unsigned) * (N + 1), st));
    for (int k = 0; k < N; ++k)
      launch_pdl(MODE != 0, chain_kernel<MODE>, G, THREADS, st, (const float*)bufs[k], bufs[k + 1], cnt + 1 + k,
             (int)(k == 0), G, work);
  }, 20);
  std::vector<float> h((size_t)G * THREADS);
  CK(cudaMemcpy(h.data(), bufs[N], h.size() * sizeof(float), cudaMemcpyDeviceToHost));
  *ok = true;
  for (float v : h)
    if (v != (float)N) *ok = false;
  return us / N;
}

// ---- Do a PDL successor's blocks, resident and waiting in griddepcontrol.wait, slow the kernel before them?
// busy_kernel: 1 block per SM of BUSY_THREADS threads, independent FMA chains (issue-bound), launch_dependents at
// its start; waiter_kernel: griddepcontrol.wait, then one store per block. Pairs (busy, waiter) in one graph:
// with PDL the waiters sit beside the busy blocks for the busy kernel's whole life; without it they launch
// after it. If waiting warps took issue slots, the PDL pairs would be the slower.
constexpr int BUSY_THREADS = 1024;
__global__ void __launch_bounds__(BUSY_THREADS) busy_kernel(float* out, int iters) {
  ds4_pdl::launch_dependents();
  float a = threadIdx.x * 1e-3f, b = a + 1.f, c = a + 2.f, d = a + 3.f;
  for (int i = 0; i < iters; ++i) {
    a = fmaf(a, 0.9999f, 1e-4f);
    b = fmaf(b, 0.9999f, 1e-4f);
    c = fmaf(c, 0.9999f, 1e-4f);
    d = fmaf(d, 0.9999f, 1e-4f);
  }
  if (a + b + c + d == 12345.f) out[0] = a;  // never: keeps the loop
}
__global__ void waiter_kernel(float* out) {
  ds4_pdl::wait();
  if (threadIdx.x == 0) out[blockIdx.x] = 1.f;
}

static float run_pair(bool pdl, int wblocks, int wthreads, int iters, float* buf) {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int P = 20;
  return graph_us([&](cudaStream_t st) {
    for (int k = 0; k < P; ++k) {
      launch_pdl(pdl, busy_kernel, sms, BUSY_THREADS, st, buf, iters);
      launch_pdl(pdl, waiter_kernel, wblocks, wthreads, st, buf + 1);
    }
  }, 10) / P;
}

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int N = 200, GMAX = 4 * sms;
  std::vector<float*> bufs(N + 1);
  for (auto& p : bufs) CK(cudaMalloc(&p, sizeof(float) * GMAX * THREADS));
  unsigned* cnt;
  CK(cudaMalloc(&cnt, sizeof(unsigned) * (N + 1)));
  std::printf("chain of %d dependent kernels in one graph, %d threads per block; us per kernel\n", N, THREADS);
  std::printf("%6s %6s %9s %9s %9s  %s\n", "grid", "work", "plain", "pdl", "flag", "outputs");
  for (int G : {1, sms, 2 * sms, 4 * sms})
    for (int work : {0, 2000}) {
      bool o0, o1, o2;
      const float t0 = run<0>(N, G, work, bufs.data(), cnt, &o0);
      const float t1 = run<1>(N, G, work, bufs.data(), cnt, &o1);
      const float t2 = run<2>(N, G, work, bufs.data(), cnt, &o2);
      std::printf("%6d %6d %9.3f %9.3f %9.3f  %s\n", G, work, t0, t1, t2,
                  work ? "-" : (o0 && o1 && o2 ? "ok" : "WRONG"));
    }
  std::printf("\n(busy, waiter) pairs: busy = %d blocks x %d threads of FMA chains; us per pair\n", sms, BUSY_THREADS);
  std::printf("%8s %8s %8s %9s %9s\n", "iters", "wblocks", "wthreads", "no PDL", "PDL");
  for (int iters : {2000, 20000})
    for (int wb : {sms, 4 * sms, 8 * sms})
      for (int wt : {256, 1024}) {
        if (wt == 1024 && wb > sms) continue;
        const float t0 = run_pair(false, wb, wt, iters, bufs[0]);
        const float t1 = run_pair(true, wb, wt, iters, bufs[0]);
        std::printf("%8d %8d %8d %9.3f %9.3f\n", iters, wb, wt, t0, t1);
      }
  return 0;
}
