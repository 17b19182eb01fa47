#include "backend/cuda/cuda_check.h"

#include <cublasLt.h>

#include "util/error.h"

namespace dg::cuda {

void throw_cuda_error(const char* expr, const char* msg, int code, const char* file, int line) {
  fail("CUDA error {} ({}) in {} at {}:{}", code, msg, expr, file, line);
}

void check_cublas(int status, const char* expr, const char* file, int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  fail("cuBLASLt error {} ({}) in {} at {}:{}", status, cublasLtGetStatusString(cublasStatus_t(status)), expr, file,
       line);
}

}  // namespace dg::cuda
