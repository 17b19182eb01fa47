#pragma once
// The CPU op set (f32 compute, weights in their checkpoint dtype converted on the fly). Each op is the oracle its
// CUDA twin is tested against. Row-major everywhere; "wt" = a weight in PyTorch Linear layout [out, in].
#include <cstdint>
#include <vector>

#include "model/config.h"
#include "model/safetensors.h"
#include "util/dtype.h"
#include "util/thread_pool.h"

namespace dg::cpu {

// A 2-D weight [rows, cols] in storage dtype; a slice of a 3-D expert stack is also a WeightMatrix.
struct WeightMatrix {
  DType dtype = DType::F32;
  const uint8_t* data = nullptr;
  int64_t rows = 0, cols = 0;

  static WeightMatrix of(const TensorView& t);                 // 2-D tensor
  static WeightMatrix expert(const TensorView& t, int64_t e);  // t[e] of a 3-D stack
  void row_to_f32(int64_t r, float* out) const;
};

std::vector<float> to_f32(const TensorView& t);

// y[t, o] = sum_i x[t, i] * W[o, i]   (x: [T, W.cols], y: [T, W.rows])
void matmul_wt(ThreadPool& pool, const float* x, int64_t T, const WeightMatrix& W, float* y);
// y[t, :] = sum_v p[t, v] * E[v, :]   (p: [T, E.rows], y: [T, E.cols]) — soft embedding through the table
void matmul_w(ThreadPool& pool, const float* p, int64_t T, const WeightMatrix& E, float* y);

// out = x * (mean(x^2) + eps)^-1/2 * w over rows of length n (w == nullptr: no scale). In place allowed.
void rms_norm(const float* x, int64_t rows, int64_t n, const float* w, float eps, float* out);
float gelu_tanh(float x);
// x: [T, heads, D] in place, split-half rotation of the pairs (i, i + D/2) for i < rope.rotated_pairs.
void rope(float* x, int64_t T, int heads, int D, const int64_t* positions, const RopeParams& rope);
void softcap(float* x, int64_t n, float cap);  // x = cap * tanh(x / cap)

// Router: softmax over experts in f32, top-k (higher prob first, equal prob -> lower index), renormalized, times
// per_expert_scale. idx/weight: [k] each.
void route_top_k(const float* router_logits, int n_experts, int k, const float* per_expert_scale, int32_t* idx,
                 float* weight);

// Attention of T queries over nk keys for one layer. q: [T, nh, D]; k, v: [nk, nkv, D]; out: [T, nh, D].
// visible(t, j) decides the mask; scores are raw dot products (no 1/sqrt(D)), softmax in f32.
struct AttentionMask {
  enum Kind { Causal, Bidirectional } kind = Bidirectional;
  int64_t window = 0;                // causal only: key visible iff q_pos - k_pos < window (0: unlimited)
  const int64_t* q_pos = nullptr;    // [T]
  int64_t k_pos0 = 0;                // key j has position k_pos0 + j
};
void attention(ThreadPool& pool, const float* q, int64_t T, int nh, const float* k, const float* v, int64_t nk,
               int nkv, int D, const AttentionMask& mask, float* out);

}  // namespace dg::cpu
