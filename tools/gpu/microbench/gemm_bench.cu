// cuBLASLt algorithm survey for the engine's GEMM shapes at a 256-row canvas: for each shape, every heuristic
// candidate (up to 32) is timed; prints heuristic #0 (what gemm.cpp uses) against the fastest, so we know whether
// autotuning the plans pays. Build: nvcc -std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a -cudart static
//   tools/gpu/microbench/gemm_bench.cu -lcublasLt -o build-mb/gemm_bench
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "microbench_check.h"


// f32in 1: f32, 2: tf32. swap: the transposed product, column-major C[T, out] = x . W^T (row-major [out, T]), the
// orientation the engine does not use: whether cuBLASLt's kernels for it are faster (the lm_head at 256 rows).
struct Shape { const char* name; int out, T, in; bool through_table; int f32in = 0; bool swap = false; };

int main() {
  cublasLtHandle_t h;
  CK(cublasLtCreate(&h));
  size_t ws_bytes = 64 << 20;
  void* ws;
  CK(cudaMalloc(&ws, ws_bytes));
  const int V = 262144;
  std::vector<Shape> shapes = {
      {"qkv sliding", 8192, 256, 2816, false}, {"qkv full", 9216, 256, 2816, false},
      {"o_proj sliding", 2816, 256, 4096, false}, {"o_proj full", 2816, 256, 8192, false},
      {"dense gate_up", 4224, 256, 2816, false}, {"dense down", 2816, 256, 2112, false},
      {"lm_head", V, 256, 2816, false}, {"lm_head swapped", V, 256, 2816, false, 0, true},
      {"sc through_table", 2816, 256, V, true},
      {"router f32", 128, 256, 2816, false, 1}, {"router tf32", 128, 256, 2816, false, 2},
      {"qkv prefill4k", 8192, 4096, 2816, false}, {"gate_up prefill4k", 4224, 4096, 2816, false}};
  size_t max_elems = size_t(V) * 2816;
  __nv_bfloat16 *A, *B;
  float* C;
  CK(cudaMalloc(&A, max_elems * 2));
  CK(cudaMalloc(&B, size_t(4096) * V * 2 / 16 + size_t(256) * V * 2));
  CK(cudaMalloc(&C, size_t(V) * 4096 * 4 / 16 + size_t(V) * 256 * 4));
  CK(cudaMemset(A, 0x3c, max_elems * 2));
  CK(cudaMemset(B, 0x3c, size_t(256) * V * 2));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0), cudaEventCreate(&e1);
  for (auto& s : shapes) {
    for (int outdt = 0; outdt < 2; ++outdt) {
      const bool f32out = outdt == 1;
      if ((s.through_table || s.f32in) && !f32out) continue;
      const cudaDataType_t it = s.f32in ? CUDA_R_32F : CUDA_R_16BF;
      const cudaDataType_t ct = f32out ? CUDA_R_32F : CUDA_R_16BF;
      int m, n = s.T, k;
      bool transa;
      if (s.swap) m = s.T, n = s.out, k = s.in, transa = true;  // A = x^T as [k, m], B = W^T as [k, n]
      else if (!s.through_table) m = s.out, k = s.in, transa = true;
      else m = s.out, k = s.in, transa = false;  // E^T[H, V] . p^T[V, T]
      // swapped: the big buffer A holds W (operand B), the small one x (operand A)
      const void* opA = s.swap ? static_cast<const void*>(B) : static_cast<const void*>(A);
      const void* opB = s.swap ? static_cast<const void*>(A) : static_cast<const void*>(B);
      cublasLtMatmulDesc_t op;
      CK(cublasLtMatmulDescCreate(&op, s.f32in == 2 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F, CUDA_R_32F));
      cublasOperation_t ta = transa ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
      CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
      CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
      cublasLtMatrixLayout_t la, lb, lc;
      CK(cublasLtMatrixLayoutCreate(&la, it, transa ? k : m, transa ? m : k, transa ? k : m));
      CK(cublasLtMatrixLayoutCreate(&lb, it, k, n, k));
      CK(cublasLtMatrixLayoutCreate(&lc, ct, m, n, m));
      cublasLtMatmulPreference_t pref;
      CK(cublasLtMatmulPreferenceCreate(&pref));
      CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes));
      cublasLtMatmulHeuristicResult_t res[32];
      int found = 0;
      CK(cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, lc, lc, pref, 32, res, &found));
      float alpha = 1, beta = 0;
      double flop = 2.0 * m * n * k;
      float t0 = -1, best = 1e9;
      int best_i = -1;
      for (int i = 0; i < found; ++i) {
        bool ok = true;
        for (int w = 0; w < 2 && ok; ++w)
          ok = cublasLtMatmul(h, op, &alpha, opA, la, opB, lb, &beta, C, lc, C, lc, &res[i].algo, ws, ws_bytes, 0) == 0;
        if (!ok) continue;
        const int reps = 10;
        cudaEventRecord(e0);
        for (int r = 0; r < reps; ++r)
          cublasLtMatmul(h, op, &alpha, opA, la, opB, lb, &beta, C, lc, C, lc, &res[i].algo, ws, ws_bytes, 0);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        ms /= reps;
        if (i == 0) t0 = ms;
        if (ms < best) best = ms, best_i = i;
      }
      std::printf("%-20s %s m%-6d n%-5d k%-6d algos %2d  #0 %8.1f us (%5.0f TF)  best #%d %8.1f us (%5.0f TF)  x%.2f\n",
                  s.name, f32out ? "f32 " : "bf16", m, n, k, found, t0 * 1e3, flop / t0 / 1e9, best_i, best * 1e3,
                  flop / best / 1e9, t0 / best);
      cublasLtMatmulPreferenceDestroy(pref);
      cublasLtMatrixLayoutDestroy(la), cublasLtMatrixLayoutDestroy(lb), cublasLtMatrixLayoutDestroy(lc);
      cublasLtMatmulDescDestroy(op);
    }
  }
  CK(cudaGetLastError());
  return 0;
}
