// Would a padded strided-batched cuBLASLt GEMM (every expert padded to M rows) stream the expert weights faster than
// our grouped kernels (~3.4 TB/s at decode)? Times gate_up (1408 x M x 2816 per expert) and down (2816 x M x 704)
// over 128 experts for several M, every heuristic candidate, and a plain read for the ceiling.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "microbench_check.h"


int main() {
  cublasLtHandle_t h;
  CK(cublasLtCreate(&h));
  size_t ws_bytes = 64 << 20;
  void* ws;
  CK(cudaMalloc(&ws, ws_bytes));
  const int E = 128, H = 2816, I = 704, NL = 3;  // NL layers of weights rotated so L2 does not help
  const size_t wgu = size_t(E) * 2 * I * H, wdn = size_t(E) * H * I;
  __nv_bfloat16 *Wg, *Wd, *X, *A;
  float* Y;
  CK(cudaMalloc(&Wg, wgu * 2 * NL));
  CK(cudaMalloc(&Wd, wdn * 2 * NL));
  CK(cudaMalloc(&X, size_t(E) * 64 * H * 2));
  CK(cudaMalloc(&A, size_t(E) * 64 * 2 * I * 2));
  CK(cudaMalloc(&Y, size_t(E) * 64 * H * 4));
  CK(cudaMemset(Wg, 0x3c, wgu * 2 * NL));
  CK(cudaMemset(Wd, 0x3c, wdn * 2 * NL));
  CK(cudaMemset(X, 0x3c, size_t(E) * 64 * H * 2));
  CK(cudaMemset(A, 0x3c, size_t(E) * 64 * 2 * I * 2));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0), cudaEventCreate(&e1);
  for (int gated = 1; gated >= 0; --gated) {
    for (int M : {16, 24, 32, 48, 64}) {
      const int m = gated ? 2 * I : H, k = gated ? H : I, n = M;
      const size_t wstride = size_t(m) * k;
      const void* Bp = gated ? (const void*)X : (const void*)A;
      void* Cp = gated ? (void*)A : (void*)Y;
      const cudaDataType_t ct = gated ? CUDA_R_16BF : CUDA_R_32F;
      cublasLtMatmulDesc_t op;
      CK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
      CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
      CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
      cublasLtMatrixLayout_t la, lb, lc;
      CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, k, m, k));
      CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, k, n, k));
      CK(cublasLtMatrixLayoutCreate(&lc, ct, m, n, m));
      int32_t batch = E;
      int64_t sa = int64_t(wstride), sb = int64_t(k) * n, sc = int64_t(m) * n;
      for (auto [l, s] : {std::pair{la, sa}, std::pair{lb, sb}, std::pair{lc, sc}}) {
        CK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof batch));
        CK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &s, sizeof s));
      }
      cublasLtMatmulPreference_t pref;
      CK(cublasLtMatmulPreferenceCreate(&pref));
      CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes));
      cublasLtMatmulHeuristicResult_t res[16];
      int found = 0;
      CK(cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, lc, lc, pref, 16, res, &found));
      float alpha = 1, beta = 0, best = 1e9, t0 = -1;
      int bi = -1;
      for (int i = 0; i < found; ++i) {
        const __nv_bfloat16* Wbase = gated ? Wg : Wd;
        const size_t wl = gated ? wgu : wdn;
        bool ok = cublasLtMatmul(h, op, &alpha, Wbase, la, Bp, lb, &beta, Cp, lc, Cp, lc, &res[i].algo, ws, ws_bytes, 0) == 0;
        if (!ok) continue;
        const int reps = 9;
        cudaEventRecord(e0);
        for (int r = 0; r < reps; ++r)
          cublasLtMatmul(h, op, &alpha, Wbase + (r % NL) * wl, la, Bp, lb, &beta, Cp, lc, Cp, lc, &res[i].algo, ws,
                         ws_bytes, 0);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        ms /= reps;
        if (i == 0) t0 = ms;
        if (ms < best) best = ms, bi = i;
      }
      const double bytes = double(gated ? wgu : wdn) * 2;
      std::printf("%s M=%-3d algos %2d  #0 %.4f ms (%.2f TB/s)  best #%d %.4f ms (%.2f TB/s) per layer\n",
                  gated ? "gate_up" : "down   ", M, found, t0, bytes / t0 / 1e9, bi, best, bytes / best / 1e9);
      cublasLtMatmulPreferenceDestroy(pref);
      cublasLtMatrixLayoutDestroy(la), cublasLtMatrixLayoutDestroy(lb), cublasLtMatrixLayoutDestroy(lc);
      cublasLtMatmulDescDestroy(op);
    }
  }
  CK(cudaGetLastError());
  return 0;
}
