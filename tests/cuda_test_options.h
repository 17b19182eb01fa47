#pragma once
// CudaOptions for the GPU parity tests. DIFFGEMMA_TEST_GROUPED_EXPERTS=1 runs them with CudaOptions::padded_experts
// off (the grouped expert kernels on canvas passes too), DIFFGEMMA_TEST_CUBLAS_ROUTER=1 with
// CudaOptions::fused_router off (cuBLASLt's router GEMM), DIFFGEMMA_TEST_CUBLAS_EXPERTS=1 with CudaOptions::tma_experts off
// (cuBLASLt gate_up on Hopper too), DIFFGEMMA_TEST_TMA_EXPERTS_DOWN=1 with the TMA down kernel on as well,
// DIFFGEMMA_TEST_NO_TMA_GATHER=1 with CudaOptions::tma_gather_rows off, DIFFGEMMA_TEST_STATIC_EXPERT_TILES=1 with
// CudaOptions::dynamic_expert_tiles off, DIFFGEMMA_TEST_ROUTER_TC=1 with the router's partials on
// the tensor cores (cuda::set_router_tensor_cores), DIFFGEMMA_TEST_UNFUSED_EXPERTS=1 with CudaOptions::fused_experts
// off, DIFFGEMMA_TEST_UNPACKED_EXPERTS=1 with CudaOptions::pack_expert_gate_up / pack_expert_down off,
// DIFFGEMMA_TEST_LAYER_GRAPH=1 with CudaOptions::whole_step_graph off, DIFFGEMMA_TEST_DENSE_TMA=1 with
// CudaOptions::dense_tma on (=2: with clusters of 2), DIFFGEMMA_TEST_TWO_TOKEN_TILES=1 with
// CudaOptions::expert_two_token_tiles on, DIFFGEMMA_TEST_BF16_LOGITS=1 with CudaOptions::bf16_logits on, so every path
// stays covered.
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_kernels.h"

inline dg::CudaOptions cuda_test_options() {
  auto flag = [](const char* name) {
    const char* e = std::getenv(name);
    return e != nullptr && std::strcmp(e, "1") == 0;
  };
  dg::CudaOptions o;
  o.padded_experts = !flag("DIFFGEMMA_TEST_GROUPED_EXPERTS");
  o.fused_router = !flag("DIFFGEMMA_TEST_CUBLAS_ROUTER");
  o.tma_experts = !flag("DIFFGEMMA_TEST_CUBLAS_EXPERTS");
  o.tma_experts_down = flag("DIFFGEMMA_TEST_TMA_EXPERTS_DOWN");
  o.tma_gather_rows = !flag("DIFFGEMMA_TEST_NO_TMA_GATHER");
  o.dynamic_expert_tiles = !flag("DIFFGEMMA_TEST_STATIC_EXPERT_TILES");
  if (flag("DIFFGEMMA_TEST_ROUTER_TC")) dg::cuda::set_router_tensor_cores(true);
  o.fused_experts = !flag("DIFFGEMMA_TEST_UNFUSED_EXPERTS");
  o.pack_expert_gate_up = o.pack_expert_down = !flag("DIFFGEMMA_TEST_UNPACKED_EXPERTS");
  o.whole_step_graph = !flag("DIFFGEMMA_TEST_LAYER_GRAPH");
  o.expert_two_token_tiles = flag("DIFFGEMMA_TEST_TWO_TOKEN_TILES");
  o.bf16_logits = flag("DIFFGEMMA_TEST_BF16_LOGITS");
  const char* dense = std::getenv("DIFFGEMMA_TEST_DENSE_TMA");
  o.dense_tma = dense != nullptr && (std::strcmp(dense, "1") == 0 || std::strcmp(dense, "2") == 0);
  if (o.dense_tma) o.dense_tma_cluster = std::strcmp(dense, "2") == 0 ? 2 : 1;
  static const bool said = [&] {
    if (!o.padded_experts) std::fprintf(stderr, "[cuda tests] CudaOptions::padded_experts off (grouped experts)\n");
    if (!o.fused_router) std::fprintf(stderr, "[cuda tests] CudaOptions::fused_router off (cuBLASLt router)\n");
    if (!o.tma_experts) std::fprintf(stderr, "[cuda tests] CudaOptions::tma_experts off (cuBLASLt expert GEMMs)\n");
    if (o.tma_experts_down) std::fprintf(stderr, "[cuda tests] CudaOptions::tma_experts_down on\n");
    if (!o.tma_gather_rows) std::fprintf(stderr, "[cuda tests] CudaOptions::tma_gather_rows off\n");
    if (!o.dynamic_expert_tiles) std::fprintf(stderr, "[cuda tests] CudaOptions::dynamic_expert_tiles off\n");
    if (flag("DIFFGEMMA_TEST_ROUTER_TC")) std::fprintf(stderr, "[cuda tests] router partials on the tensor cores\n");
    if (!o.fused_experts) std::fprintf(stderr, "[cuda tests] CudaOptions::fused_experts off\n");
    if (!o.pack_expert_gate_up) std::fprintf(stderr, "[cuda tests] expert weights unpacked (checkpoint layout)\n");
    if (!o.whole_step_graph) std::fprintf(stderr, "[cuda tests] CudaOptions::whole_step_graph off\n");
    if (o.expert_two_token_tiles) std::fprintf(stderr, "[cuda tests] CudaOptions::expert_two_token_tiles on\n");
    if (o.bf16_logits) std::fprintf(stderr, "[cuda tests] CudaOptions::bf16_logits on\n");
    if (o.dense_tma) std::fprintf(stderr, "[cuda tests] CudaOptions::dense_tma on, clusters of %d\n", o.dense_tma_cluster);
    return true;
  }();
  (void)said;
  return o;
}
