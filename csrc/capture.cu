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
#include <cuda_runtime.h>

#include <cstring>
#include <vector>

#include "ds4_launch.h"
#include "pdl.cuh"

namespace ds4 {

bool capture_join_programmatic(cudaStream_t side, cudaStream_t main) {
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12030
#if CUDART_VERSION >= 13000
#define DS4_CAPTURE_INFO cudaStreamGetCaptureInfo
#define DS4_CAPTURE_UPDATE cudaStreamUpdateCaptureDependencies
#else
#define DS4_CAPTURE_INFO cudaStreamGetCaptureInfo_v3
#define DS4_CAPTURE_UPDATE cudaStreamUpdateCaptureDependencies_v2
#endif
  if (!ds4_pdl::enabled()) return false;  // sm_80 or DS4_PDL=0: no programmatic edges
  cudaStreamCaptureStatus ss = cudaStreamCaptureStatusNone, ms = cudaStreamCaptureStatusNone;
  unsigned long long sid = 0, mid = 0;
  const cudaGraphNode_t* deps = nullptr;
  const cudaGraphEdgeData* data = nullptr;
  size_t n = 0;
  if (DS4_CAPTURE_INFO(main, &ms, &mid) != cudaSuccess ||
      DS4_CAPTURE_INFO(side, &ss, &sid, nullptr, &deps, &data, &n) != cudaSuccess) {
    (void)cudaGetLastError();  // a failed query leaves nothing behind for the next launch check
    return false;
  }
  if (ms != cudaStreamCaptureStatusActive || ss != cudaStreamCaptureStatusActive || sid != mid || n == 0) return false;
  std::vector<cudaGraphNode_t> nodes(deps, deps + n);  // the driver's array is valid until the next stream call
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    if (cudaGraphNodeGetType(node, &type) != cudaSuccess || type != cudaGraphNodeTypeKernel) {
      (void)cudaGetLastError();
      return false;  // programmatic edges join kernel nodes only: an event join instead
    }
  }
  std::vector<cudaGraphEdgeData> edges(n);
  for (cudaGraphEdgeData& e : edges) {
    std::memset(&e, 0, sizeof(e));
    e.from_port = cudaGraphKernelNodePortProgrammatic;
    e.type = cudaGraphDependencyTypeProgrammatic;
  }
  if (DS4_CAPTURE_UPDATE(main, nodes.data(), edges.data(), n, cudaStreamAddCaptureDependencies) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return true;
#undef DS4_CAPTURE_INFO
#undef DS4_CAPTURE_UPDATE
#else
  (void)side;
  (void)main;
  return false;
#endif
}

}  // namespace ds4
