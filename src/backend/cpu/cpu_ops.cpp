#include "backend/cpu/cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "util/error.h"

namespace dg::cpu {

WeightMatrix WeightMatrix::of(const TensorView& t) {
  DG_CHECK(t.shape.size() == 2, "{} is not 2-D", t.name);
  return {t.dtype, t.data, t.shape[0], t.shape[1]};
}

WeightMatrix WeightMatrix::expert(const TensorView& t, int64_t e) {
  DG_CHECK(t.shape.size() == 3 && e >= 0 && e < t.shape[0], "{}[{}]", t.name, e);
  size_t stride = size_t(t.shape[1] * t.shape[2]) * dtype_size(t.dtype);
  return {t.dtype, t.data + size_t(e) * stride, t.shape[1], t.shape[2]};
}

void WeightMatrix::row_to_f32(int64_t r, float* out) const {
  convert_to_f32(dtype, data + size_t(r * cols) * dtype_size(dtype), out, size_t(cols));
}

std::vector<float> to_f32(const TensorView& t) { return t.to_f32(); }

// Fixed 8-lane accumulation order: vectorizes without -ffast-math and is identical on every thread count.
static inline float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  float tail = 0;
  for (; i < n; ++i) tail += a[i] * b[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
}

void matmul_wt(ThreadPool& pool, const float* x, int64_t T, const WeightMatrix& W, float* y) {
  const int64_t in = W.cols, out = W.rows;
  pool.parallel_for(size_t(out), [&](size_t o0, size_t o1) {
    std::vector<float> row(static_cast<size_t>(in));
    for (size_t o = o0; o < o1; ++o) {
      W.row_to_f32(int64_t(o), row.data());
      for (int64_t t = 0; t < T; ++t) y[t * out + int64_t(o)] = dot(x + t * in, row.data(), in);
    }
  }, 16);
}

void matmul_w(ThreadPool& pool, const float* p, int64_t T, const WeightMatrix& E, float* y) {
  const int64_t V = E.rows, H = E.cols;
  constexpr int64_t kBlock = 64;
  pool.parallel_for(size_t(T), [&](size_t t0, size_t t1) {
    std::vector<float> rows(size_t(kBlock * H));
    std::fill(y + t0 * H, y + t1 * H, 0.0f);
    for (int64_t v0 = 0; v0 < V; v0 += kBlock) {
      int64_t nb = std::min(kBlock, V - v0);
      for (int64_t b = 0; b < nb; ++b) E.row_to_f32(v0 + b, rows.data() + b * H);
      for (size_t t = t0; t < t1; ++t) {
        float* yt = y + t * H;
        const float* pt = p + t * V + v0;
        for (int64_t b = 0; b < nb; ++b) {
          float w = pt[b];
          if (w == 0.0f) continue;
          const float* r = rows.data() + b * H;
          for (int64_t h = 0; h < H; ++h) yt[h] += w * r[h];
        }
      }
    }
  });
}

void rms_norm(const float* x, int64_t rows, int64_t n, const float* w, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(xr[i]) * xr[i];
    float inv = float(1.0 / std::sqrt(ss / double(n) + double(eps)));
    float* o = out + r * n;
    if (w)
      for (int64_t i = 0; i < n; ++i) o[i] = xr[i] * inv * w[i];
    else
      for (int64_t i = 0; i < n; ++i) o[i] = xr[i] * inv;
  }
}

float gelu_tanh(float x) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  return 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * (x + 0.044715f * x * x * x)));
}

void rope(float* x, int64_t T, int heads, int D, const int64_t* positions, const RopeParams& rp) {
  const int half = D / 2;
  std::vector<float> inv_freq(size_t(rp.rotated_pairs));
  for (int i = 0; i < rp.rotated_pairs; ++i)
    inv_freq[size_t(i)] = float(1.0 / std::pow(double(rp.theta), 2.0 * i / double(rp.exponent_dim)));
  for (int64_t t = 0; t < T; ++t) {
    for (int i = 0; i < rp.rotated_pairs; ++i) {
      // HF computes the angle in f32 (pos * inv_freq) and cos/sin of it in f32.
      float ang = float(positions[t]) * inv_freq[size_t(i)];
      float c = std::cos(ang), s = std::sin(ang);
      for (int h = 0; h < heads; ++h) {
        float* xh = x + (t * heads + h) * D;
        float a = xh[i], b = xh[i + half];
        xh[i] = a * c - b * s;
        xh[i + half] = b * c + a * s;
      }
    }
  }
}

void softcap(float* x, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) x[i] = cap * std::tanh(x[i] / cap);
}

void route_top_k(const float* logits, int n_experts, int k, const float* per_expert_scale, int32_t* idx,
                 float* weight) {
  float mx = *std::max_element(logits, logits + n_experts);
  std::vector<float> p(static_cast<size_t>(n_experts));
  double sum = 0;
  for (int e = 0; e < n_experts; ++e) sum += p[size_t(e)] = std::exp(logits[e] - mx);
  for (auto& v : p) v = float(v / sum);
  std::vector<int32_t> order(static_cast<size_t>(n_experts));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
    return p[size_t(a)] > p[size_t(b)] || (p[size_t(a)] == p[size_t(b)] && a < b);
  });
  float total = 0;
  for (int j = 0; j < k; ++j) total += p[size_t(order[size_t(j)])];
  for (int j = 0; j < k; ++j) {
    idx[j] = order[size_t(j)];
    weight[j] = p[size_t(idx[j])] / total * per_expert_scale[idx[j]];
  }
}

void attention(ThreadPool& pool, const float* q, int64_t T, int nh, const float* k, const float* v, int64_t nk,
               int nkv, int D, const AttentionMask& mask, float* out) {
  const int group = nh / nkv;
  pool.parallel_for(size_t(T * nh), [&](size_t i0, size_t i1) {
    std::vector<float> scores(static_cast<size_t>(nk));
    for (size_t i = i0; i < i1; ++i) {
      int64_t t = int64_t(i) / nh;
      int h = int(int64_t(i) % nh), kvh = h / group;
      const float* qv = q + (t * nh + h) * D;
      float mx = -INFINITY;
      for (int64_t j = 0; j < nk; ++j) {
        bool visible = true;
        if (mask.kind == AttentionMask::Causal) {
          int64_t qp = mask.q_pos[t], kp = mask.k_pos0 + j;
          visible = kp <= qp && (mask.window == 0 || qp - kp < mask.window);
        }
        float s = visible ? dot(qv, k + (j * nkv + kvh) * D, D) : -INFINITY;
        scores[size_t(j)] = s;
        mx = std::max(mx, s);
      }
      double sum = 0;
      for (int64_t j = 0; j < nk; ++j) {
        float e = scores[size_t(j)] == -INFINITY ? 0.0f : std::exp(scores[size_t(j)] - mx);
        scores[size_t(j)] = e;
        sum += e;
      }
      float inv = float(1.0 / sum);
      float* o = out + (t * nh + h) * D;
      std::fill(o, o + D, 0.0f);
      for (int64_t j = 0; j < nk; ++j) {
        float p = scores[size_t(j)] * inv;
        if (p == 0.0f) continue;
        const float* vv = v + (j * nkv + kvh) * D;
        for (int d = 0; d < D; ++d) o[d] += p * vv[d];
      }
    }
  });
}

}  // namespace dg::cpu
