// Programmatic dependent launch (PDL, sm_90+), shared by both ds4 extensions.
//
// Inside a CUDA graph a batch-1 decode step is a chain of small kernels; each one otherwise pays
// the launch latency and its grid's ramp-up after the previous kernel fully drains. With PDL the
// next kernel is launched while the previous one runs: its blocks do the work that does not depend
// on the previous kernel (e.g. a GEMV's first weight loads — weights are constant) and then block in
// wait() until the previous grid has completed and its memory is visible. Every ds4 kernel calls
// wait() before it reads any activation / state or writes any output, so the result is the same as
// with ordinary stream order; launch_dependents() right after lets the following kernel start its
// own prologue early (one kernel ahead).
// On sm_80 (and with DS4_PDL=0, for the ablation) the attribute is not set and wait() is a no-op.
#pragma once
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

namespace ds4_pdl {

__device__ __forceinline__ void wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A kernel's pre-wait work may read what the launch two back wrote only because the kernel in between waits before it
// lets its successor launch (begin). Three kernels release their successor at their start instead (launch_dependents,
// then wait): the attention combine (csrc/attn/sparse_attn.cu), the one-token hc finish (csrc/attn/hc.cu) and, opt-in,
// the router's top-k (csrc/router.cu); their successors (weight GEMVs, the top-k, the routed gate+up) read only
// weights before their own wait. Completion stays transitive: every kernel waits before it exits.
//
// wait for the previous kernel, then let the next one launch: the first statement of most kernels. (Letting
// the latency-bound kernels before a weight GEMV — the sparse combine, the hc finish — trigger only after their
// own loads had returned, so the GEMV's early weight loads would not queue in front of theirs, measured slower:
// 119.2 against 117.4 us per layer on an H200, experiments/decode_session24_h200.md.)
__device__ __forceinline__ void begin() {
  wait();
  launch_dependents();
}

// The early-trigger form (the kernels named above): release_early(early) before the kernel's pre-wait work, then
// begin(early) — the wait alone where it released, else begin().
__device__ __forceinline__ void release_early(bool early) {
  if (early) launch_dependents();
}
__device__ __forceinline__ void begin(bool released) {
  if (released) wait();
  else begin();
}

// Host: whether a launch of such a kernel releases early: the environment variable `env` (read per launch; the
// ablation) says "early" or "wait"; unset or anything else, `by_default`.
inline bool trigger_early(const char* env, bool by_default) {
  const char* v = std::getenv(env);
  if (v != nullptr && std::strcmp(v, "early") == 0) return true;
  if (v != nullptr && std::strcmp(v, "wait") == 0) return false;
  return by_default;
}

// Host: the current device's compute capability major (asked once per device; 0 where it cannot be asked).
inline int device_major() {
  static int major_of[64] = {0};  // per device, 0 = not asked yet
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  if (major_of[dev] == 0) cudaDeviceGetAttribute(&major_of[dev], cudaDevAttrComputeCapabilityMajor, dev);
  return major_of[dev];
}

// Host: launches on the current device use PDL (compute capability >= 9.0 and DS4_PDL != "0"; the
// variable is read at every launch so one process can measure both, e.g. before two graph captures).
inline bool enabled() {
  const char* env = std::getenv("DS4_PDL");
  if (env && env[0] == '0') return false;
  return device_major() >= 9;
}

// The GPU's nanosecond clock (%globaltimer), the same on every SM: the phase probes' timestamps (DS4_MARK below,
// moe_ffn.cu's DS4_FFN_PROBE, moe_mma.cu's DS4_MOE_PROBE).
__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}

// Phase probe: scripts/probe_phases.cu compiles the kernels with DS4_PROBE; thread 0 of each block
// then records clock64() and %globaltimer at DS4_MARK(i) (i < 8), so a kernel's time can be split
// into its phases and its blocks' timeline seen. Compiled out in the extensions.
#ifdef DS4_PROBE
__device__ long long probe_clk[4096][8];
__device__ unsigned long long probe_ns[4096][8];
__device__ __forceinline__ void probe_mark(int i) {
  const unsigned b = blockIdx.y * gridDim.x + blockIdx.x;
  if (threadIdx.x != 0 || b >= 4096) return;
  const unsigned long long ns = globaltimer();
  probe_clk[b][i] = clock64();
  probe_ns[b][i] = ns;
}
#define DS4_MARK(i) ds4_pdl::probe_mark(i)
#else
#define DS4_MARK(i) \
  do {              \
  } while (0)
#endif

template <typename... KArgs, typename... Args>
cudaError_t launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = enabled() ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

}  // namespace ds4_pdl
