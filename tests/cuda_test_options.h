#pragma once
// CudaOptions for the GPU parity tests. DIFFGEMMA_TEST_GROUPED_EXPERTS=1 runs them with CudaOptions::padded_experts
// off (the grouped expert kernels on canvas passes too), so both expert paths stay covered.
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "backend/cuda/cuda_backend.h"

inline dg::CudaOptions cuda_test_options() {
  dg::CudaOptions o;
  const char* e = std::getenv("DIFFGEMMA_TEST_GROUPED_EXPERTS");
  o.padded_experts = !(e != nullptr && std::strcmp(e, "1") == 0);
  static const bool said = [&] {
    if (!o.padded_experts) std::fprintf(stderr, "[cuda tests] CudaOptions::padded_experts off (grouped experts)\n");
    return true;
  }();
  (void)said;
  return o;
}
