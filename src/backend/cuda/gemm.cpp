#include "backend/cuda/gemm.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <functional>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_kernels.h"
#include "util/error.h"

namespace dg::cuda {
namespace {

cudaDataType_t cuda_type(Dt t) { return t == Dt::BF16 ? CUDA_R_16BF : CUDA_R_32F; }

// An algorithm's configuration: id, tile, split-K, reduction scheme, CTA swizzle, custom option, stages, inner
// shape, cluster shape (the CUBLASLT_ALGO_CONFIG_* attributes 0..8).
using AlgoConfig = std::array<int64_t, 9>;

AlgoConfig config_of(const cublasLtMatmulAlgo_t& algo) {
  AlgoConfig c{};
  for (int a = 0; a < 9; ++a) {
    uint64_t v = 0;  // little endian: 4-byte attributes, the two shape ids (7, 8) 2-byte
    size_t written = 0;
    const size_t size = a >= 7 ? 2 : 4;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, cublasLtMatmulAlgoConfigAttributes_t(a), &v, size, &written) !=
        CUBLAS_STATUS_SUCCESS)
      v = 0;
    c[size_t(a)] = a == 0 || a == 2 ? int64_t(int32_t(uint32_t(v))) : int64_t(v);
  }
  return c;
}

struct TunedEntry {
  int sm;
  bool transa;
  int m, n, k, at, bt, ct, batch;
  AlgoConfig config;
};
const std::vector<TunedEntry> kTuned = {
#include "backend/cuda/gemm_tuned.inc"
};

bool g_tuning = false;
bool g_table = true;
std::vector<std::array<int, 3>> g_table_skip;
std::vector<std::pair<std::array<int, 3>, std::array<int64_t, 9>>> g_config_override;
std::vector<std::string>& report() {
  static std::vector<std::string> r;
  return r;
}

// The algorithm of a pinned configuration that the overall heuristic did not return (the tuner's per-id search
// found it): initialized from its id, given its other attributes, then checked against this problem.
bool algo_of_config(cublasLtHandle_t h, const AlgoConfig& c, cudaDataType_t at, cudaDataType_t bt, cudaDataType_t ct,
                    cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                    cublasLtMatrixLayout_t cl, size_t workspace_bytes, cublasLtMatmulAlgo_t& algo,
                    size_t& workspace_needed) {
  if (cublasLtMatmulAlgoInit(h, CUBLAS_COMPUTE_32F, CUDA_R_32F, at, bt, ct, ct, int(c[0]), &algo) !=
      CUBLAS_STATUS_SUCCESS)
    return false;
  for (int attr = 1; attr < 9; ++attr) {
    const uint64_t v = uint64_t(c[size_t(attr)]);  // little endian: the attribute's low bytes, as config_of reads them
    if (cublasLtMatmulAlgoConfigSetAttribute(&algo, cublasLtMatmulAlgoConfigAttributes_t(attr), &v,
                                             attr >= 7 ? 2 : 4) != CUBLAS_STATUS_SUCCESS)
      return false;
  }
  cublasLtMatmulHeuristicResult_t r{};
  if (cublasLtMatmulAlgoCheck(h, op, a, b, cl, cl, &algo, &r) != CUBLAS_STATUS_SUCCESS) return false;
  workspace_needed = r.workspaceSize;
  return r.workspaceSize <= workspace_bytes;
}

std::string config_text(const AlgoConfig& c) {
  std::string t = "{";
  for (size_t i = 0; i < c.size(); ++i) t += (i ? ", " : "") + std::to_string(c[i]);
  return t + "}";
}

}  // namespace

void set_gemm_tuning(bool on) { g_tuning = on; }
void set_gemm_table(bool on) { g_table = on; }
void set_gemm_table_skip(std::vector<std::array<int, 3>> shapes) { g_table_skip = std::move(shapes); }
void set_gemm_config_override(std::vector<std::pair<std::array<int, 3>, std::array<int64_t, 9>>> overrides) {
  g_config_override = std::move(overrides);
}
bool gemm_tuning() { return g_tuning; }
const std::vector<std::string>& gemm_tune_report() { return report(); }

Gemm::Gemm(size_t workspace_bytes, int sm_count_target)
    : sm_count_target_(sm_count_target), workspace_bytes_(workspace_bytes) {
  CUBLAS_CHECK(cublasLtCreate(&handle_));
  CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
  int dev = 0, major = 0, minor = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  sm_ = major * 10 + minor;
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

void Gemm::batched_pointers(bool transa, int m, int n, int k, const void* A, Dt at, int lda, const void* B, Dt bt,
                            int ldb, void* C, Dt ct, int ldc, int batch, cudaStream_t s) {
  run(transa, m, n, k, A, at, lda, B, bt, ldb, C, ct, ldc, s, batch, true);
}

void Gemm::run(bool transa, int m, int n, int k, const void* A, Dt at, int lda, const void* B, Dt bt, int ldb,
               void* C, Dt ct, int ldc, cudaStream_t s, int batch, bool pointer_array) {
  if (m == 0 || n == 0 || batch == 0) return;
  Key key{transa, m, n, k, int(at), int(bt), int(ct), batch, lda, ldb, ldc, pointer_array};
  auto it = plans_.find(key);
  if (it == plans_.end())
    it = plans_
             .emplace(key, make_plan(transa, m, n, k, at, bt, ct, lda, ldb, ldc, batch, pointer_array, A, B, C, s))
             .first;
  const float alpha = 1.0f, beta = 0.0f;
  Plan& p = it->second;
  CUBLAS_CHECK(cublasLtMatmul(handle_, p.op, &alpha, A, p.a, B, p.b, &beta, C, p.c, C, p.c, &p.algo, workspace_,
                              workspace_bytes_, s));
}

Gemm::Plan Gemm::make_plan(bool transa, int m, int n, int k, Dt at, Dt bt, Dt ct, int lda, int ldb,
                           int ldc, int batch, bool pointer_array, const void* A, const void* B, void* C,
                           cudaStream_t s) {
  Plan p;
  const bool all_f32 = at == Dt::F32 && bt == Dt::F32;
  // f32 operands (the router) use true f32 arithmetic: routing near-ties must not flip on TF32 rounding.
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = transa ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  if (sm_count_target_ > 0) {
    const int32_t sms = sm_count_target_;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sms, sizeof sms));
  }
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, cuda_type(at), transa ? k : m, transa ? m : k, lda));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, cuda_type(bt), k, n, ldb));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, cuda_type(ct), m, n, ldc));
  if (pointer_array) {
    const int32_t count = batch;
    const uint32_t mode = CUBLASLT_BATCH_MODE_POINTER_ARRAY;
    for (cublasLtMatrixLayout_t l : {p.a, p.b, p.c}) {
      CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
      CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_MODE, &mode, sizeof mode));
    }
  } else if (batch > 1) {  // densely packed operands: A_b at b m k, B_b at b k n, C_b at b m n
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
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(s, &capturing));
  const bool tune = g_tuning && capturing == cudaStreamCaptureStatusNone;
  const cudaDataType_t a_type = cuda_type(at), b_type = cuda_type(bt), c_type = cuda_type(ct);
  cublasLtMatmulPreference_t pref;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes_,
                                                    sizeof workspace_bytes_));
  constexpr int kCandidates = 32;
  std::vector<cublasLtMatmulHeuristicResult_t> res(kCandidates);
  int found = 0;
  CUBLAS_CHECK(
      cublasLtMatmulAlgoGetHeuristic(handle_, p.op, p.a, p.b, p.c, p.c, pref, kCandidates, res.data(), &found));
  res.resize(size_t(found));
  if (tune) {
    // The overall heuristic returns ~8 candidates; asked once per algorithm id (CUBLASLT_SEARCH_LIMITED_BY_ALGO_ID)
    // it offers more configurations (tiles, split-K, stages) to time. New configurations only.
    const uint32_t mode = CUBLASLT_SEARCH_LIMITED_BY_ALGO_ID;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_SEARCH_MODE, &mode, sizeof mode));
    std::vector<int> ids(128);
    int n_ids = 0;
    if (cublasLtMatmulAlgoGetIds(handle_, CUBLAS_COMPUTE_32F, CUDA_R_32F, a_type, b_type, c_type, c_type,
                                 int(ids.size()), ids.data(), &n_ids) != CUBLAS_STATUS_SUCCESS)
      n_ids = 0;
    for (int i = 0; i < n_ids; ++i) {
      std::vector<cublasLtMatmulHeuristicResult_t> per(8);
      bool inited = true;
      for (auto& r : per)
        inited = inited && cublasLtMatmulAlgoInit(handle_, CUBLAS_COMPUTE_32F, CUDA_R_32F, a_type, b_type, c_type,
                                                  c_type, ids[size_t(i)], &r.algo) == CUBLAS_STATUS_SUCCESS;
      int got = 0;
      if (!inited || cublasLtMatmulAlgoGetHeuristic(handle_, p.op, p.a, p.b, p.c, p.c, pref, int(per.size()),
                                                    per.data(), &got) != CUBLAS_STATUS_SUCCESS)
        got = 0;
      for (int j = 0; j < got; ++j) {
        const AlgoConfig c = config_of(per[size_t(j)].algo);
        bool seen = false;
        for (const auto& r : res) seen = seen || config_of(r.algo) == c;
        if (!seen) res.push_back(per[size_t(j)]);
      }
    }
    found = int(res.size());
  }
  cublasLtMatmulPreferenceDestroy(pref);
  // Precision policy: partial sums of a split-K product are added in f32, never in a bf16 output.
  auto acceptable = [&](const cublasLtMatmulAlgo_t& algo) {
    const AlgoConfig c = config_of(algo);
    return !(ct == Dt::BF16 && c[2] > 1 && c[3] != CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE);
  };
  std::vector<int> ok;
  for (int i = 0; i < found; ++i) {
    if (res[size_t(i)].state != CUBLAS_STATUS_SUCCESS) continue;
    if (!acceptable(res[size_t(i)].algo)) continue;
    ok.push_back(i);
  }
  if (ok.empty())
    fail("cuBLASLt found no algorithm for a {}x{}x{} GEMM ({} operands)", m, n, k, all_f32 ? "f32" : "bf16");
  int pick = ok[0];
  // A configuration the heuristic did not return (the tuner's per-id search found it, or bench --gemm-config names
  // it): built from its attributes, checked against this problem and the precision policy, then picked (and timed
  // too in tuning mode).
  auto adopt = [&](const AlgoConfig& config) {
    cublasLtMatmulHeuristicResult_t built{};
    if (!algo_of_config(handle_, config, a_type, b_type, c_type, p.op, p.a, p.b, p.c, workspace_bytes_, built.algo,
                        built.workspaceSize) ||
        !acceptable(built.algo))
      return false;
    built.state = CUBLAS_STATUS_SUCCESS;
    res.push_back(built);
    pick = int(res.size()) - 1;
    ok.push_back(pick);
    found = int(res.size());
    return true;
  };
  const int table_batch = pointer_array ? -batch : batch;
  const bool skipped = std::find(g_table_skip.begin(), g_table_skip.end(), std::array<int, 3>{m, n, k}) !=
                       g_table_skip.end();
  for (const TunedEntry& t : kTuned) {
    if (!g_table || skipped) break;
    if (t.sm != sm_ || t.transa != transa || t.m != m || t.n != n || t.k != k || t.at != int(at) ||
        t.bt != int(bt) || t.ct != int(ct) || t.batch != table_batch)
      continue;
    bool matched = false;
    for (int i : ok)
      if (config_of(res[size_t(i)].algo) == t.config) pick = i, matched = true;
    if (!matched) adopt(t.config);  // found by the per-id search, not among the overall heuristic's
  }
  for (const auto& [shape, config] : g_config_override)
    if (shape == std::array<int, 3>{m, n, k} && !adopt(config))
      fail("--gemm-config: cuBLASLt rejects {} for the {}x{}x{} GEMM (or it breaks the precision policy)",
           config_text(config), m, n, k);
  if (tune) {
    // Time every acceptable candidate on the real operands much as the engine runs it: inside a CUDA graph, each
    // call right after a kernel (a one-word copy_words). Back-to-back eager calls hid what a configuration costs
    // there: one that zeroes its workspace first adds a memset node, and in the decoder graph that node left the GPU
    // idle ~12 us before the full layers' S GEMM (H200 trace, session 12). The engine's graphs now turn those memset
    // nodes into kernel nodes (CudaOptions::graph_memset_kernels); this graph keeps them, as session 12's tuning did.
    // Best of 3 replays of 10 (kernel, GEMM) pairs, less the same graph without the GEMMs.
    const float alpha = 1.0f, beta = 0.0f;
    std::vector<float> us(size_t(found), 1e30f);
    auto* word = reinterpret_cast<uint32_t*>(static_cast<unsigned char*>(workspace_) + workspace_bytes_ - 8);
    auto time_graph = [&](const std::function<bool()>& gemm_call) -> float {  // us per pair
      const float ms = graph_after_copies_ms(s, word, 10, 3, gemm_call, false);
      return ms < 0 ? 1e30f : ms * 100.0f;
    };
    const float copies_us = time_graph(nullptr);
    for (int i : ok) {
      auto call = [&] {
        return cublasLtMatmul(handle_, p.op, &alpha, A, p.a, B, p.b, &beta, C, p.c, C, p.c, &res[size_t(i)].algo,
                              workspace_, workspace_bytes_, s) == CUBLAS_STATUS_SUCCESS;
      };
      if (!call() || !call()) continue;  // eager warm-ups (and a check that it runs at all)
      CUDA_CHECK(cudaStreamSynchronize(s));
      us[size_t(i)] = std::max(0.0f, time_graph(call) - copies_us);
    }
    int best = ok[0];
    for (int i : ok)
      if (us[size_t(i)] < us[size_t(best)]) best = i;
    char line[512];
    std::snprintf(line, sizeof line,
                  "{%d, %s, %d, %d, %d, %d, %d, %d, %d, %s},  // in a graph after a kernel: heuristic first %.1f us, "
                  "table %.1f us, best %.1f us (candidate %d of %zu, workspace %zu B)",
                  sm_, transa ? "true" : "false", m, n, k, int(at), int(bt), int(ct), table_batch,
                  config_text(config_of(res[size_t(best)].algo)).c_str(), double(us[size_t(ok[0])]),
                  double(us[size_t(pick)]), double(us[size_t(best)]), best, ok.size(),
                  res[size_t(best)].workspaceSize);
    report().push_back(line);
    // Every candidate on stderr, for choosing by hand what the timing here cannot judge (bench --gemm-config).
    for (int i : ok)
      std::fprintf(stderr, "  gemm %dx%dx%d candidate %d %s: %.1f us, workspace %zu B\n", m, n, k, i,
                   config_text(config_of(res[size_t(i)].algo)).c_str(), double(us[size_t(i)]),
                   res[size_t(i)].workspaceSize);
    pick = best;
  }
  p.algo = res[size_t(pick)].algo;
  return p;
}

}  // namespace dg::cuda
