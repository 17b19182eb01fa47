// Denoise attention as two cuBLASLt GEMMs around one softmax kernel, timed at the model's shapes: in a denoise pass
// every canvas query sees the same keys (model-reference §3.5: no mask), so S = Q K^T, P = softmax(S), O = P V are
// plain batched GEMMs. Two batchings of the GQA groups:
//   kvmajor: one batch entry per kv head, the g query heads' rows stacked (Q written as [nkv][T][g][D]), O comes out
//            [nkv][T][g][D] and needs a reorder to [T][nh][D] (timed as its own kernel);
//   perhead: one entry per query head (pointer-array batch: K / V of kv head h / g), Q and O in the engine's
//            [T][nh][D] layout.
// For each GEMM every heuristic candidate is timed (K / V / Q rotated over copies so they come from DRAM, as in a
// step); then one graph of 20 x (S, softmax, PV[, reorder]) with the fastest algorithms gives the per-layer time with
// its launch gaps. Compare with attention_bench's fused kernels (sliding ~31 us + combine, full kv 4096 ~141 us).
// Build (C++17: nvcc 13 front end crashes on this file in C++20 mode): nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -cudart static
//   tools/gpu/microbench/attention_gemm_bench.cu -lcublasLt -o build-mb/attention_gemm_bench
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "microbench_check.h"


using bf16 = __nv_bfloat16;

static float b2f(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static uint16_t f2b(float f) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

// P[r, c] = bf16(exp(S[r, c] - max) / sum) over columns [0, n), columns in [mlo, mhi) excluded (P = 0).
template <int kPer>
__global__ void __launch_bounds__(128) softmax_rows_k(const float* S, int ldS, int n, int mlo, int mhi, bf16* P,
                                                      int ldP) {
  const float* s = S + size_t(blockIdx.x) * ldS;
  bf16* p = P + size_t(blockIdx.x) * ldP;
  float v[kPer];
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = threadIdx.x + 128 * i;
    v[i] = (c < n && (c < mlo || c >= mhi)) ? s[c] : -INFINITY;
    m = fmaxf(m, v[i]);
  }
  __shared__ float red[4];
  for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(~0u, m, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
  __syncthreads();
  m = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
  float sum = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    v[i] = expf(v[i] - m);
    sum += v[i];
  }
  for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(~0u, sum, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = sum;
  __syncthreads();
  const float inv = 1.0f / (red[0] + red[1] + red[2] + red[3]);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = threadIdx.x + 128 * i;
    if (c < ldP) p[c] = __float2bfloat16(c < n ? v[i] * inv : 0.0f);
  }
}

// The same with float4 loads and 8-byte stores: kThreads a row, kPer4 float4 chunks a thread (n, ldS, ldP % 4 == 0).
template <int kThreads, int kPer4>
__global__ void __launch_bounds__(kThreads) softmax_rows_v4_k(const float* S, int ldS, int n, int mlo, int mhi,
                                                               bf16* P, int ldP) {
  const float4* s = reinterpret_cast<const float4*>(S + size_t(blockIdx.x) * ldS);
  uint2* p = reinterpret_cast<uint2*>(P + size_t(blockIdx.x) * ldP);
  float v[kPer4 * 4];
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPer4; ++i) {
    const int c4 = threadIdx.x + kThreads * i;
    float4 x = make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
    if (4 * c4 < n) x = s[c4];
    v[4 * i] = x.x, v[4 * i + 1] = x.y, v[4 * i + 2] = x.z, v[4 * i + 3] = x.w;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int c = 4 * c4 + q;
      if (c >= n || (c >= mlo && c < mhi)) v[4 * i + q] = -INFINITY;
      m = fmaxf(m, v[4 * i + q]);
    }
  }
  constexpr int kW = kThreads / 32;
  __shared__ float red[kW];
  for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(~0u, m, o));
  if (kW > 1) {
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    m = red[0];
#pragma unroll
    for (int w = 1; w < kW; ++w) m = fmaxf(m, red[w]);
  }
  float sum = 0;
#pragma unroll
  for (int i = 0; i < kPer4 * 4; ++i) {
    v[i] = expf(v[i] - m);
    sum += v[i];
  }
  for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(~0u, sum, o);
  if (kW > 1) {
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = sum;
    __syncthreads();
    sum = red[0];
#pragma unroll
    for (int w = 1; w < kW; ++w) sum += red[w];
  }
  const float inv = 1.0f / sum;
#pragma unroll
  for (int i = 0; i < kPer4; ++i) {
    const int c4 = threadIdx.x + kThreads * i;
    if (4 * c4 < ldP) {
      __nv_bfloat162 a = __floats2bfloat162_rn(v[4 * i] * inv, v[4 * i + 1] * inv);
      __nv_bfloat162 b = __floats2bfloat162_rn(v[4 * i + 2] * inv, v[4 * i + 3] * inv);
      uint2 u;
      std::memcpy(&u.x, &a, 4), std::memcpy(&u.y, &b, 4);
      p[c4] = u;
    }
  }
}

// O[(k, t, j), d] -> out[t, k g + j, d], 16 bytes a thread.
__global__ void reorder_k(const uint4* O, int T, int nkv, int g, int D, uint4* out) {
  const int dv = D / 8;
  const size_t total = size_t(nkv) * T * g * dv;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x) {
    const int d = int(i % dv);
    size_t r = i / dv;
    const int j = int(r % g);
    r /= g;
    const int t = int(r % T), k = int(r / T);
    out[(size_t(t) * nkv * g + size_t(k) * g + j) * dv + d] = O[i];
  }
}

struct Gemm {
  cublasLtMatmulDesc_t op{};
  cublasLtMatrixLayout_t a{}, b{}, c{};
  std::vector<cublasLtMatmulAlgo_t> algos;
  int best = -1;
  float t0 = -1, tbest = 1e9;
};

static cublasLtHandle_t g_h;
static void* g_ws;
static size_t g_ws_bytes = size_t(64) << 20;

static void set_batch(cublasLtMatrixLayout_t l, int batch, long long stride, bool ptr_array) {
  CK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof batch));
  if (ptr_array) {
    uint32_t mode = CUBLASLT_BATCH_MODE_POINTER_ARRAY;
    CK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_MODE, &mode, sizeof mode));
  } else {
    CK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride));
  }
}

// Column-major C[m, n] = op(A) B: A [k, m] (transa) or [m, k]; strides in elements (ignored with pointer arrays).
static Gemm make(bool transa, int m, int n, int k, cudaDataType_t at, int lda, long long sa, cudaDataType_t bt,
                 int ldb, long long sb, cudaDataType_t ct, int ldc, long long sc, int batch, bool ptr) {
  Gemm g;
  CK(cublasLtMatmulDescCreate(&g.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = transa ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
  CK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  CK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  CK(cublasLtMatrixLayoutCreate(&g.a, at, transa ? k : m, transa ? m : k, lda));
  CK(cublasLtMatrixLayoutCreate(&g.b, bt, k, n, ldb));
  CK(cublasLtMatrixLayoutCreate(&g.c, ct, m, n, ldc));
  set_batch(g.a, batch, sa, ptr), set_batch(g.b, batch, sb, ptr), set_batch(g.c, batch, sc, ptr);
  cublasLtMatmulPreference_t pref;
  CK(cublasLtMatmulPreferenceCreate(&pref));
  CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &g_ws_bytes,
                                          sizeof g_ws_bytes));
  cublasLtMatmulHeuristicResult_t res[24];
  int found = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(g_h, g.op, g.a, g.b, g.c, g.c, pref, 24, res, &found);
  if (st != 0) found = 0;
  for (int i = 0; i < found; ++i) g.algos.push_back(res[i].algo);
  cublasLtMatmulPreferenceDestroy(pref);
  return g;
}

static bool run(const Gemm& g, int i, const void* A, const void* B, void* C, cudaStream_t s) {
  const float alpha = 1, beta = 0;
  return cublasLtMatmul(g_h, g.op, &alpha, A, g.a, B, g.b, &beta, C, g.c, C, g.c, &g.algos[size_t(i)], g_ws,
                        g_ws_bytes, s) == 0;
}

struct Case {
  const char* name;
  int nh, nkv, D, T, n_keys, mlo, mhi;  // [mlo, mhi): excluded key columns (a ring's slots outside the window)
};

int main(int argc, char** argv) {
  CK(cublasLtCreate(&g_h));
  CK(cudaMalloc(&g_ws, g_ws_bytes));
  const char* only = argc > 1 ? argv[1] : nullptr;
  const std::vector<Case> cases = {
      {"sliding kv 4096 (1279 keys)", 16, 8, 256, 256, 1279, 0, 0},
      {"sliding kv 4096 padded (1280 cols, 1 masked)", 16, 8, 256, 256, 1280, 1279, 1280},
      {"sliding kv 4096 padded (1344 cols, 65 masked)", 16, 8, 256, 256, 1344, 1279, 1344},
      {"sliding ring+canvas (1791 cols, 512 masked)", 16, 8, 256, 256, 1791, 600, 1112},
      {"full kv 512 (768 keys)", 16, 2, 512, 256, 768, 0, 0},
      {"full kv 4096 (4352 keys)", 16, 2, 512, 256, 4352, 0, 0},
      {"full kv 8192 (8448 keys)", 16, 2, 512, 256, 8448, 0, 0},
  };
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0), cudaEventCreate(&e1);
  const int kRot = 8;
  for (const Case& c : cases) {
    if (only && !std::strstr(c.name, only)) continue;
    const int g = c.nh / c.nkv, n = c.n_keys, ldS = (n + 7) / 8 * 8, ldP = (n + 7) / 8 * 8;
    const size_t kv_elems = size_t(n) * c.nkv * c.D, q_elems = size_t(c.T) * c.nh * c.D;
    const size_t s_elems = size_t(c.nh) * c.T * ldS;
    bf16 *K, *V, *Q, *P, *O, *O2;
    float* S;
    CK(cudaMalloc(&K, kv_elems * 2 * kRot));
    CK(cudaMalloc(&V, kv_elems * 2 * kRot));
    CK(cudaMalloc(&Q, q_elems * 2 * kRot));
    CK(cudaMalloc(&S, s_elems * 4));
    CK(cudaMalloc(&P, s_elems * 2));
    CK(cudaMalloc(&O, q_elems * 2));
    CK(cudaMalloc(&O2, q_elems * 2));
    {  // small values: finite scores
      std::vector<uint16_t> h(std::max(kv_elems, q_elems) * kRot);
      for (size_t i = 0; i < h.size(); ++i) h[i] = f2b(0.05f * float(int((i * 2654435761u) % 17) - 8));
      CK(cudaMemcpy(K, h.data(), kv_elems * 2 * kRot, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(V, h.data(), kv_elems * 2 * kRot, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(Q, h.data(), q_elems * 2 * kRot, cudaMemcpyHostToDevice));
    }
    const double flop = 4.0 * c.nh * c.T * double(n) * c.D;
    std::printf("== %s: nh %d nkv %d D %d T %d keys %d, %.2f GFLOP (S + PV)\n", c.name, c.nh, c.nkv, c.D, c.T, n, flop / 1e9);
    for (int variant = 0; variant < 2; ++variant) {
      const bool perhead = variant == 1;
      Gemm gs, gp;
      // pointer arrays: [rot][h] for A, B, C of S and PV
      std::vector<const void*> hp;
      void** dptr = nullptr;
      const int batch = perhead ? c.nh : c.nkv;
      if (!perhead) {
        gs = make(true, n, c.T * g, c.D, CUDA_R_16BF, c.nkv * c.D, c.D, CUDA_R_16BF, c.D, (long long)c.T * g * c.D,
                  CUDA_R_32F, ldS, (long long)c.T * g * ldS, batch, false);
        gp = make(false, c.D, c.T * g, n, CUDA_R_16BF, c.nkv * c.D, c.D, CUDA_R_16BF, ldP, (long long)c.T * g * ldP,
                  CUDA_R_16BF, c.D, (long long)c.T * g * c.D, batch, false);
      } else {
        gs = make(true, n, c.T, c.D, CUDA_R_16BF, c.nkv * c.D, 0, CUDA_R_16BF, c.nh * c.D, 0, CUDA_R_32F, ldS, 0,
                  batch, true);
        gp = make(false, c.D, c.T, n, CUDA_R_16BF, c.nkv * c.D, 0, CUDA_R_16BF, ldP, 0, CUDA_R_16BF, c.nh * c.D, 0,
                  batch, true);
        for (int r = 0; r < kRot; ++r) {
          const bf16 *Kr = K + kv_elems * r, *Vr = V + kv_elems * r, *Qr = Q + q_elems * r;
          for (int h = 0; h < c.nh; ++h) hp.push_back(Kr + (h / g) * c.D);          // S: A
          for (int h = 0; h < c.nh; ++h) hp.push_back(Qr + h * c.D);                // S: B
          for (int h = 0; h < c.nh; ++h) hp.push_back(S + size_t(h) * c.T * ldS);   // S: C
          for (int h = 0; h < c.nh; ++h) hp.push_back(Vr + (h / g) * c.D);          // PV: A
          for (int h = 0; h < c.nh; ++h) hp.push_back(P + size_t(h) * c.T * ldP);   // PV: B
          for (int h = 0; h < c.nh; ++h) hp.push_back(O + h * c.D);                 // PV: C
        }
        CK(cudaMalloc(&dptr, hp.size() * sizeof(void*)));
        CK(cudaMemcpy(dptr, hp.data(), hp.size() * sizeof(void*), cudaMemcpyHostToDevice));
      }
      auto argsS = [&](int r, const void*& A, const void*& B, void*& C) {
        if (perhead) {
          A = dptr + size_t(r) * 6 * c.nh, B = dptr + size_t(r) * 6 * c.nh + c.nh, C = dptr + size_t(r) * 6 * c.nh + 2 * c.nh;
        } else {
          A = K + kv_elems * r, B = Q + q_elems * r, C = S;
        }
      };
      auto argsP = [&](int r, const void*& A, const void*& B, void*& C) {
        if (perhead) {
          A = dptr + size_t(r) * 6 * c.nh + 3 * c.nh, B = dptr + size_t(r) * 6 * c.nh + 4 * c.nh,
          C = dptr + size_t(r) * 6 * c.nh + 5 * c.nh;
        } else {
          A = V + kv_elems * r, B = P, C = O;
        }
      };
      for (int which = 0; which < 2; ++which) {
        Gemm& G = which == 0 ? gs : gp;
        for (int i = 0; i < int(G.algos.size()); ++i) {
          const void *A, *B;
          void* C;
          bool ok = true;
          for (int w = 0; w < 2 && ok; ++w) {
            which == 0 ? argsS(w, A, B, C) : argsP(w, A, B, C);
            ok = run(G, i, A, B, C, s);
          }
          if (!ok) {
            cudaGetLastError();
            continue;
          }
          const int reps = 24;
          cudaEventRecord(e0, s);
          for (int r = 0; r < reps; ++r) {
            which == 0 ? argsS(r % kRot, A, B, C) : argsP(r % kRot, A, B, C);
            run(G, i, A, B, C, s);
          }
          cudaEventRecord(e1, s);
          CK(cudaEventSynchronize(e1));
          float ms;
          cudaEventElapsedTime(&ms, e0, e1);
          ms /= reps;
          if (i == 0) G.t0 = ms;
          if (ms < G.tbest) G.tbest = ms, G.best = i;
        }
        std::printf("  %s %s: %zu algos, #0 %.1f us, best #%d %.1f us (%.0f TFLOP/s)\n", perhead ? "perhead" : "kvmajor",
                    which == 0 ? "S = Q K^T" : "O = P V  ", G.algos.size(), G.t0 * 1e3, G.best, G.tbest * 1e3,
                    flop / 2 / (G.tbest * 1e-3) / 1e12);
      }
      if (gs.best < 0 || gp.best < 0) continue;
      // softmax alone
      const int rows = c.nh * c.T;
      int smv = 0;  // softmax version: 0 scalar, 1.. vectorized configurations
      auto softmax = [&]() {
        if (smv > 0 && n % 4 == 0) {
          const int n4 = n / 4;
          auto go = [&](auto kern, int threads, int per4) {
            if (per4 * threads >= (ldP + 3) / 4) kern<<<rows, threads, 0, s>>>(S, ldS, n, c.mlo, c.mhi, P, ldP);
            else std::printf("  (softmax v%d: too few threads)\n", smv);
          };
          (void)n4;
          if (smv == 1) go(softmax_rows_v4_k<64, 6>, 64, 6);
          else if (smv == 2) go(softmax_rows_v4_k<128, 3>, 128, 3);
          else if (smv == 3) go(softmax_rows_v4_k<256, 5>, 256, 5);
          else if (smv == 4) go(softmax_rows_v4_k<256, 9>, 256, 9);
          else if (smv == 5) go(softmax_rows_v4_k<128, 9>, 128, 9);
          else if (smv == 6) go(softmax_rows_v4_k<512, 5>, 512, 5);
          return;
        }
        const int per = (n + 127) / 128;
        if (per <= 12) softmax_rows_k<12><<<rows, 128, 0, s>>>(S, ldS, n, c.mlo, c.mhi, P, ldP);
        else if (per <= 36) softmax_rows_k<36><<<rows, 128, 0, s>>>(S, ldS, n, c.mlo, c.mhi, P, ldP);
        else if (per <= 68) softmax_rows_k<68><<<rows, 128, 0, s>>>(S, ldS, n, c.mlo, c.mhi, P, ldP);
        else std::printf("  (softmax: %d columns not supported here)\n", n);
      };
      float sm_best = 1e9;
      int sm_bv = 0;
      for (smv = 0; smv <= 6; ++smv) {
        if (smv > 0 && n % 4) break;
        const int per4 = smv == 1 ? 6 * 64 : smv == 2 ? 3 * 128 : smv == 3 ? 5 * 256 : smv == 4 ? 9 * 256 : smv == 5 ? 9 * 128 : 5 * 512;
        if (smv > 0 && per4 < (ldP + 3) / 4) continue;
        if (smv == 0 && (n + 127) / 128 > 68) continue;
        softmax();
        CK(cudaStreamSynchronize(s));
        const int reps = 24;
        cudaEventRecord(e0, s);
        for (int r = 0; r < reps; ++r) softmax();
        cudaEventRecord(e1, s);
        CK(cudaEventSynchronize(e1));
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        ms /= reps;
        std::printf("  softmax v%d (%d rows x %d): %.1f us\n", smv, rows, n, ms * 1e3);
        if (ms < sm_best) sm_best = ms, sm_bv = smv;
      }
      smv = sm_bv;
      // the chain in one graph
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      const int reps = 20;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
      for (int r = 0; r < reps; ++r) {
        const void *A, *B;
        void* C;
        argsS(r % kRot, A, B, C);
        run(gs, gs.best, A, B, C, s);
        softmax();
        argsP(r % kRot, A, B, C);
        run(gp, gp.best, A, B, C, s);
        if (!perhead) reorder_k<<<264, 256, 0, s>>>(reinterpret_cast<const uint4*>(O), c.T, c.nkv, g, c.D,
                                                    reinterpret_cast<uint4*>(O2));
      }
      CK(cudaStreamEndCapture(s, &graph));
      CK(cudaGraphInstantiate(&exec, graph, 0));
      CK(cudaGraphLaunch(exec, s));
      CK(cudaStreamSynchronize(s));
      float best = 1e9;
      for (int trial = 0; trial < 5; ++trial) {
        cudaEventRecord(e0, s);
        CK(cudaGraphLaunch(exec, s));
        cudaEventRecord(e1, s);
        CK(cudaEventSynchronize(e1));
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        best = std::min(best, ms / reps);
      }
      std::printf("  %s chain (graph, S + softmax + PV%s): %.1f us a layer\n", perhead ? "perhead" : "kvmajor",
                  perhead ? "" : " + reorder", best * 1e3);
      // correctness spot check of one row against a host reference (row 0 of head 0: t 0)
      {
        std::vector<uint16_t> hq(size_t(c.D)), hk(kv_elems), hv(kv_elems), ho(size_t(c.D));
        const int r = (reps - 1) % kRot;
        CK(cudaMemcpy(hq.data(), Q + q_elems * r, size_t(c.D) * 2, cudaMemcpyDeviceToHost));  // t 0, head 0
        CK(cudaMemcpy(hk.data(), K + kv_elems * r, kv_elems * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hv.data(), V + kv_elems * r, kv_elems * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(ho.data(), perhead ? O : O2, size_t(c.D) * 2, cudaMemcpyDeviceToHost));
        std::vector<double> score(static_cast<size_t>(n));
        double mx = -1e300;
        for (int j = 0; j < n; ++j) {
          if (j >= c.mlo && j < c.mhi) continue;
          double a = 0;
          for (int d = 0; d < c.D; ++d)
            a += double(b2f(hq[size_t(d)])) * b2f(hk[size_t(j) * c.nkv * c.D + d]);
          score[size_t(j)] = a, mx = std::max(mx, a);
        }
        double sum = 0;
        for (int j = 0; j < n; ++j)
          if (!(j >= c.mlo && j < c.mhi)) sum += std::exp(score[size_t(j)] - mx);
        double err = 0, ref_max = 0;
        for (int d = 0; d < c.D; ++d) {
          double o = 0;
          for (int j = 0; j < n; ++j)
            if (!(j >= c.mlo && j < c.mhi))
              o += std::exp(score[size_t(j)] - mx) / sum * b2f(hv[size_t(j) * c.nkv * c.D + d]);
          err = std::max(err, std::fabs(o - double(b2f(ho[size_t(d)]))));
          ref_max = std::max(ref_max, std::fabs(o));
        }
        std::printf("  check row (t 0, head 0): max |err| %.3g (|ref| max %.3g)\n", err, ref_max);
      }
      cudaGraphExecDestroy(exec), cudaGraphDestroy(graph);
      if (dptr) cudaFree(dptr);
    }
    cudaFree(K), cudaFree(V), cudaFree(Q), cudaFree(S), cudaFree(P), cudaFree(O), cudaFree(O2);
  }
  CK(cudaGetLastError());
  return 0;
}
