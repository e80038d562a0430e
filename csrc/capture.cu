// A side-stream branch joined back into a captured decode step by programmatic edges (opt-in, DS4_PJOIN).
//
// A branch is normally joined by an event: the main stream's next kernel then depends on the branch's last
// kernel with a full edge, so it is launched only after that kernel has drained, even when both kernels use
// programmatic dependent launch (PDL) with their own predecessors. The MoE down kernel, for example, which
// adds the side-stream shared expert's output, cannot start its weight loads early beside the shared down.
// Here the branch's last captured nodes join the main stream's dependency set with programmatic edges instead
// (out of each node's programmatic port): the next kernel may launch once they (and its main predecessor)
// have triggered, and its griddepcontrol.wait (ds4_pdl::wait) still waits for all of them to complete with
// their memory visible. Only for a next kernel that waits before it reads what the branch wrote: every ds4
// kernel does; a torch kernel does not (the caller decides: ds4.ops.side_stream.Branch.join).
// The fork (DS4_PFORK; the shared expert's branch by default since session 76): a branch forked from the main stream
// depends on main's last kernels by programmatic edges instead of full ones, so its first kernel launches as soon as
// they have triggered (beside main's next kernel, before the one after it) and waits in griddepcontrol.wait for their
// completion. Only for a branch whose first launch is a ds4 kernel (the caller decides: ds4.ops.side_stream.fork).
#include <cuda_runtime.h>

#include <cstring>
#include <vector>

#include "ds4_launch.h"
#include "pdl.cuh"

namespace ds4 {

#if defined(CUDART_VERSION) && CUDART_VERSION >= 12030
#if CUDART_VERSION >= 13000
#define DS4_CAPTURE_INFO cudaStreamGetCaptureInfo
#define DS4_CAPTURE_UPDATE cudaStreamUpdateCaptureDependencies
#else
#define DS4_CAPTURE_INFO cudaStreamGetCaptureInfo_v3
#define DS4_CAPTURE_UPDATE cudaStreamUpdateCaptureDependencies_v2
#endif
// The last captured nodes of `from` (all kernel nodes), while `from` and `to` are captured into one graph with PDL on;
// false (and nodes empty) otherwise.
static bool capture_kernel_tail(cudaStream_t from, cudaStream_t to, std::vector<cudaGraphNode_t>& nodes) {
  nodes.clear();
  if (!ds4_pdl::enabled()) return false;  // sm_80 or DS4_PDL=0: no programmatic edges
  cudaStreamCaptureStatus fs = cudaStreamCaptureStatusNone, ts = cudaStreamCaptureStatusNone;
  unsigned long long fid = 0, tid = 0;
  const cudaGraphNode_t* deps = nullptr;
  const cudaGraphEdgeData* data = nullptr;
  size_t n = 0;
  if (DS4_CAPTURE_INFO(to, &ts, &tid) != cudaSuccess ||
      DS4_CAPTURE_INFO(from, &fs, &fid, nullptr, &deps, &data, &n) != cudaSuccess) {
    (void)cudaGetLastError();  // a failed query leaves nothing behind for the next launch check
    return false;
  }
  if (ts != cudaStreamCaptureStatusActive || fs != cudaStreamCaptureStatusActive || fid != tid || n == 0) return false;
  nodes.assign(deps, deps + n);  // the driver's array is valid until the next stream call
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    if (cudaGraphNodeGetType(node, &type) != cudaSuccess || type != cudaGraphNodeTypeKernel) {
      (void)cudaGetLastError();
      nodes.clear();
      return false;  // programmatic edges leave kernel nodes only: an event edge instead
    }
  }
  return true;
}

// `to`'s capture dependencies become (mode) the nodes, each by a programmatic edge out of its programmatic port.
static bool capture_depend_programmatic(cudaStream_t to, std::vector<cudaGraphNode_t>& nodes, unsigned mode) {
  std::vector<cudaGraphEdgeData> edges(nodes.size());
  for (cudaGraphEdgeData& e : edges) {
    std::memset(&e, 0, sizeof(e));
    e.from_port = cudaGraphKernelNodePortProgrammatic;
    e.type = cudaGraphDependencyTypeProgrammatic;
  }
  if (DS4_CAPTURE_UPDATE(to, nodes.data(), edges.data(), nodes.size(), mode) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return true;
}

bool capture_join_programmatic(cudaStream_t side, cudaStream_t main) {
  std::vector<cudaGraphNode_t> nodes;
  return capture_kernel_tail(side, main, nodes) &&
         capture_depend_programmatic(main, nodes, cudaStreamAddCaptureDependencies);
}

bool capture_fork_programmatic(cudaStream_t main, cudaStream_t side) {
  std::vector<cudaGraphNode_t> nodes;
  return capture_kernel_tail(main, side, nodes) &&
         capture_depend_programmatic(side, nodes, cudaStreamSetCaptureDependencies);
}
#undef DS4_CAPTURE_INFO
#undef DS4_CAPTURE_UPDATE
#else
bool capture_join_programmatic(cudaStream_t, cudaStream_t) { return false; }
bool capture_fork_programmatic(cudaStream_t, cudaStream_t) { return false; }
#endif

}  // namespace ds4
