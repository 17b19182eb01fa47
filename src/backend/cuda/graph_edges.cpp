#include "backend/cuda/graph_edges.h"

#include <algorithm>
#include <cstdint>
#include <set>

#include "backend/cuda/cuda_check.h"

namespace dg::cuda {
namespace {

struct Edge {
  cudaGraphNode_t from;
  cudaGraphEdgeData data;
};

std::vector<Edge> incoming(cudaGraphNode_t node) {
  size_t n = 0;
  CUDA_CHECK(cudaGraphNodeGetDependencies(node, nullptr, nullptr, &n));
  std::vector<cudaGraphNode_t> from(n);
  std::vector<cudaGraphEdgeData> data(n);
  if (n) CUDA_CHECK(cudaGraphNodeGetDependencies(node, from.data(), data.data(), &n));
  std::vector<Edge> out;
  for (size_t i = 0; i < n; ++i) out.push_back({from[i], data[i]});
  return out;
}

size_t outgoing_count(cudaGraphNode_t node) {
  size_t n = 0;
  CUDA_CHECK(cudaGraphNodeGetDependentNodes(node, nullptr, nullptr, &n));
  return n;
}

cudaGraphNodeType type_of(cudaGraphNode_t node) {
  cudaGraphNodeType t;
  CUDA_CHECK(cudaGraphNodeGetType(node, &t));
  return t;
}

bool is_default(const cudaGraphEdgeData& e) { return e.type == cudaGraphDependencyTypeDefault && e.from_port == 0; }

void remove_edge(cudaGraph_t g, cudaGraphNode_t from, cudaGraphNode_t to, const cudaGraphEdgeData& e) {
  CUDA_CHECK(cudaGraphRemoveDependencies(g, &from, &to, &e, 1));
}
void add_edge(cudaGraph_t g, cudaGraphNode_t from, cudaGraphNode_t to, bool programmatic) {
  cudaGraphEdgeData e{};
  if (programmatic) {
    e.type = cudaGraphDependencyTypeProgrammatic;
    e.from_port = cudaGraphKernelNodePortProgrammatic;
  }
  CUDA_CHECK(cudaGraphAddDependencies(g, &from, &to, &e, 1));
}

// Whether memset node m writes only inside [ws, ws + bytes).
bool memset_inside(cudaGraphNode_t m, const void* ws, size_t bytes) {
  cudaMemsetParams p{};
  CUDA_CHECK(cudaGraphMemsetNodeGetParams(m, &p));
  const size_t row = size_t(p.width) * p.elementSize;
  const size_t span = p.height > 1 ? (p.height - 1) * p.pitch + row : row;
  const auto lo = reinterpret_cast<uintptr_t>(p.dst), w0 = reinterpret_cast<uintptr_t>(ws);
  return ws != nullptr && lo >= w0 && lo + span <= w0 + bytes;
}

}  // namespace

cudaGraphNode_t last_captured_node(cudaStream_t s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  const cudaGraphNode_t* deps = nullptr;
  size_t n = 0;
  CUDA_CHECK(cudaStreamGetCaptureInfo(s, &st, nullptr, nullptr, &deps, nullptr, &n));
  return st == cudaStreamCaptureStatusActive && n == 1 ? deps[0] : nullptr;
}

ProgrammaticEdgeReport make_gemms_programmatic(cudaGraph_t graph, const std::vector<CapturedGemm>& gemms,
                                               bool batched_only) {
  ProgrammaticEdgeReport r;
  std::set<cudaGraphNode_t> gemm_nodes;
  for (const CapturedGemm& c : gemms)
    if (c.kernel) gemm_nodes.insert(c.kernel);
  auto ours = [&](cudaGraphNode_t n) { return type_of(n) == cudaGraphNodeTypeKernel && !gemm_nodes.count(n); };
  for (const CapturedGemm& c : gemms) {
    if (!c.kernel || (batched_only && !c.batched)) continue;
    bool changed = false;
    for (const Edge& e : incoming(c.kernel)) {
      if (!is_default(e.data)) continue;
      if (ours(e.from)) {
        remove_edge(graph, e.from, c.kernel, e.data);
        add_edge(graph, e.from, c.kernel, true);
        ++r.edges, changed = true;
        continue;
      }
      // A memset of this GEMM alone, behind exactly one kernel of ours: hoist it above that kernel.
      if (type_of(e.from) != cudaGraphNodeTypeMemset || outgoing_count(e.from) != 1 ||
          !memset_inside(e.from, c.workspace, c.workspace_bytes))
        continue;
      const std::vector<Edge> before = incoming(e.from);
      if (before.size() != 1 || !is_default(before[0].data) || !ours(before[0].from)) continue;
      const cudaGraphNode_t memset = e.from, kernel = before[0].from;
      remove_edge(graph, kernel, memset, before[0].data);
      for (const Edge& k_in : incoming(kernel)) add_edge(graph, k_in.from, memset, false);
      add_edge(graph, kernel, c.kernel, true);
      ++r.edges, ++r.memsets_hoisted, changed = true;
    }
    if (!changed) ++r.blocked;
  }
  return r;
}

}  // namespace dg::cuda
