#pragma once
// Programmatic launches of cuBLASLt GEMMs inside a captured CUDA graph.
//
// Our kernels are PDL-launched (launch.cuh): each waits (griddepcontrol.wait) before touching memory and lets its
// successor start early. cuBLASLt has no launch-attribute API, so a GEMM after one of our kernels starts only once
// that kernel has fully finished, plus its own launch latency (the ~12 us gap before the experts' down GEMM in a
// layer). In a captured graph the edge from our kernel node into the GEMM's kernel node can be made programmatic
// afterwards; this is correct only because cuBLASLt's Hopper kernels themselves wait (griddepcontrol.wait) before
// they read their operands. That is not documented, so the engine checks it on the GPU first
// (gemm_waits_for_programmatic_predecessor, with the very plans the graph uses) and keeps default edges otherwise.
//
// A cuBLASLt memset node in front of a GEMM kernel (it zeroes part of the GEMM's workspace) blocks a programmatic
// edge, since only kernel -> kernel edges can be programmatic. When the memset writes only inside the workspace of
// the Gemm that launched it (which no kernel of ours touches) it is hoisted above our kernel: it then depends on that
// kernel's predecessors instead, and the GEMM kernel depends on the memset (default edge) and on our kernel
// (programmatic edge).
#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

namespace dg::cuda {

// A cuBLASLt GEMM as captured: its kernel node, and the workspace its memset nodes may write.
struct CapturedGemm {
  cudaGraphNode_t kernel = nullptr;
  const void* workspace = nullptr;
  size_t workspace_bytes = 0;
  bool batched = false;  // strided-batched (the experts' down GEMM)
};

struct ProgrammaticEdgeReport {
  int edges = 0;           // edges from our kernels into GEMM kernels made programmatic
  int memsets_hoisted = 0;  // memset nodes moved above our kernel
  int blocked = 0;         // GEMMs left with default edges (another node type in front, or a memset outside the workspace)
};

// Rewrites `graph` (not yet instantiated) so that each GEMM of `gemms` (only the batched ones when batched_only)
// starts programmatically after the kernel node of ours in front of it. Nodes that are not GEMM kernels are "ours".
ProgrammaticEdgeReport make_gemms_programmatic(cudaGraph_t graph, const std::vector<CapturedGemm>& gemms,
                                               bool batched_only);

// The leaf node of the capture on stream s after a call that must have added exactly one (else null).
cudaGraphNode_t last_captured_node(cudaStream_t s);

}  // namespace dg::cuda
