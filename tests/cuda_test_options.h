#pragma once
// CudaOptions for the GPU parity tests. DIFFGEMMA_TEST_PADDED_EXPERTS=1 runs them with CudaOptions::padded_experts,
// the experimental expert path that must pass them before it becomes the default (docs/BENCHMARKS.md 2026-11-30).
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "backend/cuda/cuda_backend.h"

inline dg::CudaOptions cuda_test_options() {
  dg::CudaOptions o;
  const char* e = std::getenv("DIFFGEMMA_TEST_PADDED_EXPERTS");
  o.padded_experts = e != nullptr && std::strcmp(e, "1") == 0;
  static const bool said = [&] {
    if (o.padded_experts) std::fprintf(stderr, "[cuda tests] CudaOptions::padded_experts on\n");
    return true;
  }();
  (void)said;
  return o;
}
