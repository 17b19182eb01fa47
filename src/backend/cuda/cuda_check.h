#pragma once
// CUDA / cuBLASLt error checks that throw dg::Error. The throwing helper lives in a .cpp so that .cu files never
// include {fmt} (nvcc and header-only {fmt} do not always agree).
#include <cuda_runtime.h>

namespace dg::cuda {

[[noreturn]] void throw_cuda_error(const char* expr, const char* msg, int code, const char* file, int line);
void check_cublas(int status, const char* expr, const char* file, int line);

}  // namespace dg::cuda

#define CUDA_CHECK(expr)                                                                          \
  do {                                                                                            \
    cudaError_t err_ = (expr);                                                                    \
    if (err_ != cudaSuccess)                                                                      \
      ::dg::cuda::throw_cuda_error(#expr, cudaGetErrorString(err_), int(err_), __FILE__, __LINE__); \
  } while (0)

// After every launch: a bad configuration is reported here, not at the next unrelated call.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

#define CUBLAS_CHECK(expr) ::dg::cuda::check_cublas(int(expr), #expr, __FILE__, __LINE__)
