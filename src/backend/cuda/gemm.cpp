#include "backend/cuda/gemm.h"

#include "backend/cuda/cuda_check.h"
#include "util/error.h"

namespace dg::cuda {

static cudaDataType_t cuda_type(Dt t) { return t == Dt::BF16 ? CUDA_R_16BF : CUDA_R_32F; }

Gemm::Gemm(size_t workspace_bytes) : workspace_bytes_(workspace_bytes) {
  CUBLAS_CHECK(cublasLtCreate(&handle_));
  CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
}

Gemm::~Gemm() {
  for (auto& [k, p] : plans_) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.c);
    cublasLtMatmulDescDestroy(p.op);
  }
  cudaFree(workspace_);
  cublasLtDestroy(handle_);
}

void Gemm::linear(const void* x, Dt xt, int T, const void* W, Dt wt, int out, int in, void* y, Dt yt,
                  cudaStream_t s) {
  // Row-major y = x W^T is column-major y^T[out, T] = W^T(op T of col-major [in, out]) . x^T[in, T].
  run(true, out, T, in, W, wt, in, x, xt, in, y, yt, out, s);
}

void Gemm::linear_batched(const void* x, Dt xt, int T, const void* W, Dt wt, int out, int in, void* y, Dt yt,
                          int batch, cudaStream_t s) {
  run(true, out, T, in, W, wt, in, x, xt, in, y, yt, out, s, batch);
}

void Gemm::through_table(const void* p, Dt pt, int T, const void* E, Dt et, int V, int H, void* y, Dt yt,
                         cudaStream_t s) {
  // Column-major y^T[H, T] = E^T(col-major [H, V]) . p^T(col-major [V, T]).
  run(false, H, T, V, E, et, H, p, pt, V, y, yt, H, s);
}

void Gemm::run(bool transa, int m, int n, int k, const void* A, Dt at, int lda, const void* B, Dt bt, int ldb,
               void* C, Dt ct, int ldc, cudaStream_t s, int batch) {
  if (m == 0 || n == 0 || batch == 0) return;
  Key key{transa, m, n, k, int(at), int(bt), int(ct), batch};
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    Plan p;
    const bool all_f32 = at == Dt::F32 && bt == Dt::F32;
    // f32 operands (the router) use true f32 arithmetic: routing near-ties must not flip on TF32 rounding.
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = transa ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, cuda_type(at), transa ? k : m, transa ? m : k, lda));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, cuda_type(bt), k, n, ldb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, cuda_type(ct), m, n, ldc));
    if (batch > 1) {  // densely packed operands: A_b at b m k, B_b at b k n, C_b at b m n
      const int32_t count = batch;
      const int64_t strides[3] = {int64_t(m) * k, int64_t(k) * n, int64_t(m) * n};
      const cublasLtMatrixLayout_t layouts[3] = {p.a, p.b, p.c};
      for (int i = 0; i < 3; ++i) {
        CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                                      sizeof count));
        CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                      &strides[i], sizeof strides[i]));
      }
    }
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &workspace_bytes_, sizeof workspace_bytes_));
    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle_, p.op, p.a, p.b, p.c, p.c, pref, 1, &res, &found));
    cublasLtMatmulPreferenceDestroy(pref);
    if (found == 0)
      fail("cuBLASLt found no algorithm for a {}x{}x{} GEMM ({} operands)", m, n, k, all_f32 ? "f32" : "bf16");
    p.algo = res.algo;
    it = plans_.emplace(key, p).first;
  }
  const float alpha = 1.0f, beta = 0.0f;
  Plan& p = it->second;
  CUBLAS_CHECK(cublasLtMatmul(handle_, p.op, &alpha, A, p.a, B, p.b, &beta, C, p.c, C, p.c, &p.algo, workspace_,
                              workspace_bytes_, s));
}

}  // namespace dg::cuda
