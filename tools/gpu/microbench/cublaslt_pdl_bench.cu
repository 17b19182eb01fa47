// Can the engine's cuBLASLt GEMMs be launched programmatically (PDL) after one of our kernels, and does it pay?
//
// cuBLASLt has no launch-attribute API, but in a CUDA graph the edge from our kernel node to its GEMM kernel node can
// be made programmatic afterwards (make_programmatic below, which also hoists a cuBLASLt memset node in front of the
// GEMM kernel above our kernel): the GEMM's blocks may then start while our kernel still runs. That is only correct
// if the GEMM kernel itself waits (griddepcontrol.wait) before it reads its operands, which cuBLASLt does not
// document. So for every GEMM shape of a denoise layer (the engine's Gemm class, so the pinned algorithms of
// gemm_tuned.inc):
//   1. race check: our kernel triggers its dependents at once, spins ~60 us, then writes the GEMM's input; with the
//      programmatic edge, the GEMM's output must still equal the output of the same GEMM on the written input
//      (bitwise). A GEMM that did not wait would read the old input and fail.
//   2. timing: 30 x [our small PDL kernel -> GEMM] as one graph, default edges vs programmatic edges into the GEMMs.
// Result (H200, 2026-11-30 session 8, docs/BENCHMARKS.md): every shape passes the race check (cuBLASLt 13's kernels
// do wait), but a pair gains at most 0.7 us (qkv lost 1.1 us), and in the engine (every GEMM of the layer graph
// programmatic, the down GEMM's memset hoisted) the 4K step moved by < 0.05 ms: not adopted. Mind that a GEMM may be
// several kernels (split-K with a reduction kernel): only edges from OUR nodes may become programmatic. The engine
// trial took every kernel node but a GEMM call's last as "ours" and failed parity with all GEMMs programmatic (full
// shape cosine 0.75), most likely through such an edge between two of cuBLASLt's own kernels.
// Build: part of the CMake build (microbench_cublaslt_pdl). Run on the GPU machine: build-gpu/microbench_cublaslt_pdl
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "backend/cuda/gemm.h"

#include "microbench_check.h"


using bf16 = __nv_bfloat16;
using dg::cuda::Dt;

namespace {

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// Our producer: lets its dependents launch at once, then (optionally) spins, then writes x[i] = f(i, salt).
__global__ void producer_k(bf16* x, size_t n, uint32_t salt, uint32_t spin_ns) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (spin_ns) {
    const uint64_t t0 = now_ns();
    while (now_ns() - t0 < spin_ns) {
    }
  }
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ salt;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    x[i] = __float2bfloat16(float(h & 0xffff) * (1.0f / 65536.0f) - 0.5f);
  }
}

__global__ void fill_k(bf16* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2246822519u ^ seed;
    h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
    p[i] = __float2bfloat16((float(h & 0xffff) * (1.0f / 65536.0f) - 0.5f) * 0.05f);
  }
}

void launch_producer(bf16* x, size_t n, uint32_t salt, uint32_t spin_ns, cudaStream_t s) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(132);
  cfg.blockDim = dim3(256);
  cfg.stream = s;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at, cfg.numAttrs = 1;
  CK(cudaLaunchKernelEx(&cfg, producer_k, x, n, salt, spin_ns));
}

struct Shape {
  const char* name;
  int T, out, in, batch;
  Dt yt;
};


struct Edge {
  cudaGraphNode_t from;
  cudaGraphEdgeData data;
};
std::vector<Edge> incoming(cudaGraphNode_t node) {
  size_t n = 0;
  CK(cudaGraphNodeGetDependencies(node, nullptr, nullptr, &n));
  std::vector<cudaGraphNode_t> from(n);
  std::vector<cudaGraphEdgeData> data(n);
  if (n) CK(cudaGraphNodeGetDependencies(node, from.data(), data.data(), &n));
  std::vector<Edge> out;
  for (size_t i = 0; i < n; ++i) out.push_back({from[i], data[i]});
  return out;
}
cudaGraphNodeType type_of(cudaGraphNode_t n) {
  cudaGraphNodeType t;
  CK(cudaGraphNodeGetType(n, &t));
  return t;
}
void set_edge(cudaGraph_t g, cudaGraphNode_t from, cudaGraphNode_t to, const cudaGraphEdgeData* old, bool programmatic) {
  if (old) CK(cudaGraphRemoveDependencies(g, &from, &to, old, 1));
  cudaGraphEdgeData e{};
  if (programmatic) e.type = cudaGraphDependencyTypeProgrammatic, e.from_port = cudaGraphKernelNodePortProgrammatic;
  CK(cudaGraphAddDependencies(g, &from, &to, &e, 1));
}

// Every edge from one of `ours` into a kernel node that is not ours (a cuBLASLt kernel) becomes programmatic; a memset
// node between ours and such a kernel (cuBLASLt's: 4 bytes of its workspace) is hoisted above our kernel first (it
// then depends on our kernel's predecessors). Only kernel -> kernel edges can be programmatic. Returns the edges
// changed; *hoisted counts the memsets moved.
int make_programmatic(cudaGraph_t g, const std::set<cudaGraphNode_t>& ours, int* hoisted) {
  size_t n = 0;
  CK(cudaGraphGetEdges(g, nullptr, nullptr, nullptr, &n));
  std::vector<cudaGraphNode_t> from(n), to(n);
  std::vector<cudaGraphEdgeData> ed(n);
  CK(cudaGraphGetEdges(g, from.data(), to.data(), ed.data(), &n));
  int changed = 0;
  *hoisted = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!ours.count(from[i]) || ours.count(to[i])) continue;
    const cudaGraphNodeType t = type_of(to[i]);
    if (t == cudaGraphNodeTypeKernel) {
      set_edge(g, from[i], to[i], &ed[i], true);
      ++changed;
    } else if (t == cudaGraphNodeTypeMemset) {
      size_t nd = 0;
      CK(cudaGraphNodeGetDependentNodes(to[i], nullptr, nullptr, &nd));
      std::vector<cudaGraphNode_t> dep(nd);
      CK(cudaGraphNodeGetDependentNodes(to[i], dep.data(), nullptr, &nd));
      if (nd != 1 || type_of(dep[0]) != cudaGraphNodeTypeKernel) continue;
      CK(cudaGraphRemoveDependencies(g, &from[i], &to[i], &ed[i], 1));
      for (const Edge& e : incoming(from[i])) set_edge(g, e.from, to[i], nullptr, false);
      set_edge(g, from[i], dep[0], nullptr, true);
      ++changed, ++*hoisted;
    }
  }
  return changed;
}

cudaGraphNode_t last_captured(cudaStream_t s) {
  cudaStreamCaptureStatus st;
  const cudaGraphNode_t* deps = nullptr;
  size_t nd = 0;
  CK(cudaStreamGetCaptureInfo(s, &st, nullptr, nullptr, &deps, nullptr, &nd));
  if (nd != 1) {
    std::printf("FAIL: expected one leaf node after a capture step, got %zu\n", nd);
    std::exit(1);
  }
  return deps[0];
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 30;
  int dev = 0;
  CK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, dev));
  std::printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  const Shape shapes[] = {
      {"qkv sliding", 256, 8192, 2816, 1, Dt::BF16},  {"o_proj sliding", 256, 2816, 4096, 1, Dt::BF16},
      {"dense gate_up", 256, 4224, 2816, 1, Dt::BF16}, {"dense down", 256, 2816, 2112, 1, Dt::BF16},
      {"expert down", 32, 2816, 704, 128, Dt::F32},   {"qkv full", 256, 9216, 2816, 1, Dt::BF16},
  };
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  dg::cuda::Gemm gemm;
  int failures = 0;
  for (const Shape& sh : shapes) {
    const size_t nx = size_t(sh.batch) * sh.T * sh.in, nw = size_t(sh.batch) * sh.out * sh.in;
    const size_t ny = size_t(sh.batch) * sh.T * sh.out, ybytes = ny * (sh.yt == Dt::F32 ? 4 : 2);
    bf16 *x, *w;
    void *y, *yref;
    CK(cudaMalloc(&x, nx * 2));
    CK(cudaMalloc(&w, nw * 2));
    CK(cudaMalloc(&y, ybytes));
    CK(cudaMalloc(&yref, ybytes));
    fill_k<<<264, 256, 0, s>>>(w, nw, 7u);
    auto run_gemm = [&](void* out) {
      if (sh.batch > 1) gemm.linear_batched(x, Dt::BF16, sh.T, w, Dt::BF16, sh.out, sh.in, out, sh.yt, sh.batch, s);
      else gemm.linear(x, Dt::BF16, sh.T, w, Dt::BF16, sh.out, sh.in, out, sh.yt, s);
    };
    // Reference: the written input (salt 2), plain stream order.
    launch_producer(x, nx, 2u, 0, s);
    run_gemm(yref);
    CK(cudaStreamSynchronize(s));

    // 1. Race check: x holds salt 1; the producer writes salt 2 after a 60 us spin; the GEMM must see salt 2.
    auto build = [&](int n_pairs, uint32_t spin_ns, bool programmatic, int* changed, int* hoisted) {
      std::set<cudaGraphNode_t> ours;
      cudaGraph_t g;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      for (int i = 0; i < n_pairs; ++i) {
        launch_producer(x, nx, 2u, spin_ns, s);
        ours.insert(last_captured(s));
        run_gemm(y);
      }
      CK(cudaStreamEndCapture(s, &g));
      *changed = *hoisted = 0;
      if (programmatic && n_pairs == 1) {  // what the memset nodes write, against the workspace and the output
        size_t nn = 0;
        CK(cudaGraphGetNodes(g, nullptr, &nn));
        std::vector<cudaGraphNode_t> nodes(nn);
        CK(cudaGraphGetNodes(g, nodes.data(), &nn));
        for (cudaGraphNode_t n : nodes) {
          cudaGraphNodeType t;
          CK(cudaGraphNodeGetType(n, &t));
          if (t != cudaGraphNodeTypeMemset) continue;
          cudaMemsetParams p{};
          CK(cudaGraphMemsetNodeGetParams(n, &p));
          std::printf("%-15s memset node: %zu x %u bytes x %zu rows at output%+lld\n", sh.name, size_t(p.width),
                      p.elementSize, size_t(p.height),
                      (long long)(static_cast<const char*>(p.dst) - static_cast<const char*>(y)));
        }
      }
      if (programmatic) *changed = make_programmatic(g, ours, hoisted);
      cudaGraphExec_t ge;
      CK(cudaGraphInstantiate(&ge, g, 0));
      CK(cudaGraphDestroy(g));
      return ge;
    };
    int changed = 0, hoisted = 0;
    launch_producer(x, nx, 1u, 0, s);
    CK(cudaMemsetAsync(y, 0xff, ybytes, s));
    cudaGraphExec_t race = build(1, 60000, true, &changed, &hoisted);
    CK(cudaGraphLaunch(race, s));
    CK(cudaStreamSynchronize(s));
    std::vector<unsigned char> a(ybytes), b(ybytes);
    CK(cudaMemcpy(a.data(), y, ybytes, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b.data(), yref, ybytes, cudaMemcpyDeviceToHost));
    const bool same = std::memcmp(a.data(), b.data(), ybytes) == 0;
    failures += !same;
    std::printf("%-15s race check: %d edge(s) made programmatic (%d memset nodes hoisted): %s\n", sh.name,
                changed, hoisted, same ? "PASS (the GEMM waited for our writes)" : "FAIL (the GEMM read early)");
    CK(cudaGraphExecDestroy(race));

    // 2. Timing: reps x [producer (no spin) -> GEMM], default vs programmatic edges.
    for (bool prog : {false, true}) {
      cudaGraphExec_t ge = build(reps, 0, prog, &changed, &hoisted);
      cudaEvent_t e0, e1;
      CK(cudaEventCreate(&e0));
      CK(cudaEventCreate(&e1));
      float best = 1e30f;
      for (int r = 0; r < 12; ++r) {
        CK(cudaEventRecord(e0, s));
        CK(cudaGraphLaunch(ge, s));
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (r >= 2) best = std::min(best, ms);
      }
      std::printf("%-15s %s edges: %.2f us per [producer + GEMM] (best of 10 graph launches of %d pairs)\n",
                  sh.name, prog ? "programmatic" : "default     ", best * 1000.0f / reps, reps);
      CK(cudaGraphExecDestroy(ge));
      cudaEventDestroy(e0), cudaEventDestroy(e1);
    }
    CK(cudaMemcpy(a.data(), y, ybytes, cudaMemcpyDeviceToHost));
    if (std::memcmp(a.data(), b.data(), ybytes) != 0) {
      ++failures;
      std::printf("%-15s FAIL: the timed graph's output differs from the reference\n", sh.name);
    }
    cudaFree(x), cudaFree(w), cudaFree(y), cudaFree(yref);
  }
  std::printf("%s\n", failures ? "SOME CHECKS FAILED" : "ALL CHECKS PASSED");
  return failures ? 1 : 0;
}
