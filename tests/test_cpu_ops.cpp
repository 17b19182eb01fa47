// Unit tests of the CPU op set against direct formulas (the CPU ops are themselves the CUDA oracle).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backend/backend.h"
#include "backend/cpu/cpu_ops.h"
#include "util/dtype.h"

namespace dg::cpu {
namespace {

std::vector<float> random_vec(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

TEST(CpuOps, RmsNormWeightedAndNoScale) {
  auto x = random_vec(3 * 37, 1);
  auto w = random_vec(37, 2);
  std::vector<float> y(x.size()), y0(x.size());
  rms_norm(x.data(), 3, 37, w.data(), 1e-6f, y.data());
  rms_norm(x.data(), 3, 37, nullptr, 1e-6f, y0.data());
  for (int r = 0; r < 3; ++r) {
    double ss = 0;
    for (int i = 0; i < 37; ++i) ss += double(x[r * 37 + i]) * x[r * 37 + i];
    double inv = 1.0 / std::sqrt(ss / 37 + 1e-6);
    for (int i = 0; i < 37; ++i) {
      EXPECT_NEAR(y0[r * 37 + i], x[r * 37 + i] * inv, 1e-5);
      EXPECT_NEAR(y[r * 37 + i], x[r * 37 + i] * inv * w[i], 1e-5);  // plain w, not (1 + w)
    }
  }
}

TEST(CpuOps, GeluTanhMatchesFormula) {
  for (float x : {-5.0f, -1.3f, -0.1f, 0.0f, 0.7f, 2.5f, 9.0f}) {
    double ref = 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
    EXPECT_NEAR(gelu_tanh(x), ref, 1e-6);
  }
}

TEST(CpuOps, RopeSlidingFullRotary) {
  const int D = 8, heads = 2;
  RopeParams rp{10000.0f, D / 2, float(D)};
  auto x = random_vec(size_t(3 * heads * D), 3);
  auto y = x;
  int64_t pos[3] = {0, 5, 1023};
  rope(y.data(), 3, heads, D, pos, rp);
  for (int t = 0; t < 3; ++t)
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < D / 2; ++i) {
        double ang = pos[t] * std::pow(10000.0, -2.0 * i / D);
        const float* a = &x[size_t((t * heads + h) * D)];
        const float* b = &y[size_t((t * heads + h) * D)];
        EXPECT_NEAR(b[i], a[i] * std::cos(ang) - a[i + D / 2] * std::sin(ang), 2e-4);
        EXPECT_NEAR(b[i + D / 2], a[i + D / 2] * std::cos(ang) + a[i] * std::sin(ang), 2e-4);
      }
  // position 0 is the identity
  for (int i = 0; i < heads * D; ++i) EXPECT_EQ(y[size_t(i)], x[size_t(i)]);
}

TEST(CpuOps, RopeProportionalPartialPairsDimIWithIPlusHalf) {
  // Full-layer layout: D=32, 0.25 partial -> 4 rotated slots pairing dims {0..3} with {16..19}; exponent over 32.
  const int D = 32;
  RopeParams rp{1e6f, 4, 32.0f};
  auto x = random_vec(D, 4);
  auto y = x;
  int64_t pos[1] = {77};
  rope(y.data(), 1, 1, D, pos, rp);
  for (int i = 0; i < D / 2; ++i) {
    if (i < 4) {
      double ang = 77 * std::pow(1e6, -2.0 * i / 32);
      EXPECT_NEAR(y[i], x[i] * std::cos(ang) - x[i + 16] * std::sin(ang), 1e-4);
      EXPECT_NEAR(y[i + 16], x[i + 16] * std::cos(ang) + x[i] * std::sin(ang), 1e-4);
    } else {
      EXPECT_EQ(y[i], x[i]) << "dim " << i << " must pass through";
      EXPECT_EQ(y[i + 16], x[i + 16]) << "dim " << i + 16 << " must pass through";
    }
  }
}

TEST(CpuOps, RouterTopKRenormalizesScalesAndBreaksTiesByLowerIndex) {
  // experts 1, 3 and 6 tie for the top probability; 4 is second.
  float logits[8] = {0.0f, 2.0f, 0.5f, 2.0f, 1.0f, -1.0f, 2.0f, 0.0f};
  float scale[8] = {1, 1.5f, 1, 0.5f, 2, 1, 1, 1};
  int32_t idx[2];
  float w[2];
  route_top_k(logits, 8, 2, scale, idx, w);
  EXPECT_EQ(idx[0], 1);
  EXPECT_EQ(idx[1], 3);
  EXPECT_NEAR(w[0], 0.5f * 1.5f, 1e-6);
  EXPECT_NEAR(w[1], 0.5f * 0.5f, 1e-6);
  int32_t idx4[4];
  float w4[4];
  route_top_k(logits, 8, 4, scale, idx4, w4);
  EXPECT_EQ(idx4[0], 1);
  EXPECT_EQ(idx4[1], 3);
  EXPECT_EQ(idx4[2], 6);
  EXPECT_EQ(idx4[3], 4);
  double e2 = std::exp(2.0), e1 = std::exp(1.0), tot = 3 * e2 + e1;
  EXPECT_NEAR(w4[3], e1 / tot * 2.0, 1e-6);
}

TEST(CpuOps, AttentionMasksCausalWindowAndBidirectional) {
  ThreadPool pool(2);
  const int T = 5, nh = 4, nkv = 2, D = 6;
  auto q = random_vec(size_t(T * nh * D), 5), k = random_vec(size_t(T * nkv * D), 6), v = random_vec(size_t(T * nkv * D), 7);
  int64_t pos[T] = {10, 11, 12, 13, 14};
  auto reference = [&](int t, int h, auto visible) {
    std::vector<double> out(D, 0.0), s(T);
    double mx = -1e30;
    for (int j = 0; j < T; ++j) {
      if (!visible(t, j)) continue;
      double d = 0;
      for (int i = 0; i < D; ++i) d += double(q[size_t((t * nh + h) * D + i)]) * k[size_t((j * nkv + h / 2) * D + i)];
      s[size_t(j)] = d;  // no 1/sqrt(D)
      mx = std::max(mx, d);
    }
    double z = 0;
    for (int j = 0; j < T; ++j)
      if (visible(t, j)) z += std::exp(s[size_t(j)] - mx);
    for (int j = 0; j < T; ++j)
      if (visible(t, j))
        for (int i = 0; i < D; ++i) out[size_t(i)] += std::exp(s[size_t(j)] - mx) / z * v[size_t((j * nkv + h / 2) * D + i)];
    return out;
  };
  auto run = [&](AttentionMask m, auto visible) {
    std::vector<float> out(size_t(T * nh * D));
    attention(pool, q.data(), T, nh, k.data(), v.data(), T, nkv, D, m, out.data());
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < nh; ++h) {
        auto ref = reference(t, h, visible);
        for (int i = 0; i < D; ++i) EXPECT_NEAR(out[size_t((t * nh + h) * D + i)], ref[size_t(i)], 1e-4);
      }
  };
  AttentionMask causal{AttentionMask::Causal, 0, pos, 10};
  run(causal, [](int t, int j) { return j <= t; });
  AttentionMask window{AttentionMask::Causal, 3, pos, 10};  // 3 keys including self
  run(window, [](int t, int j) { return j <= t && t - j < 3; });
  AttentionMask bidir{};
  run(bidir, [](int, int) { return true; });
}

TEST(CpuOps, MatmulMatchesNaiveOnAwkwardSizesForBf16AndF32) {
  ThreadPool pool(3);
  const int T = 7, in = 53, out = 29;
  auto x = random_vec(size_t(T * in), 8), wf = random_vec(size_t(out * in), 9);
  std::vector<uint16_t> wb(wf.size());
  for (size_t i = 0; i < wf.size(); ++i) wb[i] = f32_to_bf16(wf[i]);
  for (DType dt : {DType::F32, DType::BF16}) {
    WeightMatrix W{dt, dt == DType::F32 ? reinterpret_cast<const uint8_t*>(wf.data())
                                        : reinterpret_cast<const uint8_t*>(wb.data()),
                   out, in};
    std::vector<float> y(size_t(T * out));
    matmul_wt(pool, x.data(), T, W, y.data());
    for (int t = 0; t < T; ++t)
      for (int o = 0; o < out; ++o) {
        double ref = 0;
        for (int i = 0; i < in; ++i)
          ref += double(x[size_t(t * in + i)]) *
                 (dt == DType::F32 ? wf[size_t(o * in + i)] : bf16_to_f32(wb[size_t(o * in + i)]));
        EXPECT_NEAR(y[size_t(t * out + o)], ref, 1e-4);
      }
  }
}

TEST(CpuOps, MatmulIsBitIdenticalAcrossThreadCounts) {
  const int T = 9, in = 70, out = 41;
  auto x = random_vec(size_t(T * in), 10), w = random_vec(size_t(out * in), 11);
  WeightMatrix W{DType::F32, reinterpret_cast<const uint8_t*>(w.data()), out, in};
  std::vector<float> y1(size_t(T * out)), y4(size_t(T * out));
  ThreadPool p1(1), p4(4);
  matmul_wt(p1, x.data(), T, W, y1.data());
  matmul_wt(p4, x.data(), T, W, y4.data());
  EXPECT_EQ(0, std::memcmp(y1.data(), y4.data(), y1.size() * 4));
}

TEST(CpuOps, RowStatsEntropyArgmaxAndTies) {
  std::vector<float> logits = {1.0f, 3.0f, 3.0f, -2.0f};
  RowStats s = compute_row_stats(logits.data(), 4, 0.5f);
  EXPECT_EQ(s.argmax, 1);  // lowest index among equal maxima
  double z[4], mx = 6.0, sum = 0;
  for (int i = 0; i < 4; ++i) sum += std::exp((z[i] = logits[size_t(i)] / 0.5) - mx);
  double H = 0;
  for (int i = 0; i < 4; ++i) {
    double p = std::exp(z[i] - mx) / sum;
    H -= p * std::log(p);
  }
  EXPECT_NEAR(s.entropy, H, 1e-6);
  EXPECT_NEAR(s.logsumexp, mx + std::log(sum), 1e-6);
  EXPECT_FLOAT_EQ(s.max_z, 6.0f);
}

TEST(CpuOps, Bf16AndF16Conversions) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  EXPECT_EQ(round_to_bf16(std::sqrt(2816.0f)), 53.0f);  // model-reference: bf16(sqrt(2816)) = 53.0
  for (float f : {0.0f, 1.0f, -2.5f, 65504.0f, 6.1035156e-05f, 5.9604645e-08f})
    EXPECT_EQ(f16_to_f32(f32_to_f16(f)), f) << f;
}

}  // namespace
}  // namespace dg::cpu
