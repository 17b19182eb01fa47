#pragma once
// The generation case of the well-conditioned fixture tests/fixtures/tiny-c (tools/reference/make_conditioned_fixture.py),
// shared by test_conditioned_fixture.cpp (CPU: the case has no near-ties) and test_cuda_parity.cpp (CUDA must then
// generate exactly the CPU's tokens), plus a Backend wrapper that measures how far every discrete decision of a
// generation is from flipping.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "diffusion/generate.h"
#include "model/weights.h"

namespace dg::conditioned {

inline std::string fixture_dir() { return std::string(DIFFGEMMA_FIXTURES_DIR) + "/tiny-c"; }

// 20 tokens (longer than the sliding window 12, so the ring is exercised), no stop id (1, 50, 106) among them.
inline std::vector<int32_t> prompt() {
  std::vector<int32_t> p = {2};
  for (int i = 1; i < 20; ++i) p.push_back(int32_t(3 + (i * 37) % 250));
  return p;
}

inline diffusion::GenerationOptions options(const LoadedModel& m) {
  auto o = diffusion::GenerationOptions::from_config(m.generation);
  o.disable_extras();
  o.seed = 42;  // seeds 7 (confident stop 8e-5 from its threshold) and 274 / 305 (no stop id): see the fixture test
  o.max_new_tokens = 48;
  o.max_steps = 8;
  return o;
}

// Smallest distance of a generation's discrete decisions from their thresholds, over every call seen.
struct Margins {
  float logit_top1 = std::numeric_limits<float>::infinity();   // softcapped logits: top-1 minus top-2, any row
  float router_topk = std::numeric_limits<float>::infinity();  // router logits: k-th minus (k+1)-th, any token/layer
  double accept = std::numeric_limits<double>::infinity();     // |entropy mass before a row - entropy_bound|
  double confident = std::numeric_limits<double>::infinity();  // |mean entropy - confidence_threshold|
  int denoise_calls = 0, prefill_calls = 0, router_decisions = 0;
};

// Forwards to `inner`, asking for the logits (and the inner backend's LayerTrace router logits) on every call, so the
// margins above can be measured on exactly the calls generate() makes.
class MarginBackend : public Backend {
 public:
  MarginBackend(Backend& inner, const diffusion::GenerationOptions& o) : in_(inner), o_(o) {
    in_.set_layer_trace(&trace_);
  }
  ~MarginBackend() override { in_.set_layer_trace(nullptr); }
  std::string name() const override { return in_.name(); }
  const ModelConfig& config() const override { return in_.config(); }
  void prefill(std::span<const int32_t> ids) override {
    in_.prefill(ids);
    ++m.prefill_calls;
    routers();
  }
  void denoise(const DenoiseRequest& req, DenoiseResult& res) override {
    DenoiseRequest r = req;
    r.want_logits = true;
    in_.denoise(r, res);
    ++m.denoise_calls;
    routers();
    const int V = config().vocab_size, L = int(req.canvas.size());
    for (int row = 0; row < L; ++row) {
      const float* x = res.logits.data() + size_t(row) * V;
      float t1 = -INFINITY, t2 = -INFINITY;
      for (int i = 0; i < V; ++i) {
        if (x[i] > t1) t2 = t1, t1 = x[i];
        else if (x[i] > t2) t2 = x[i];
      }
      m.logit_top1 = std::min(m.logit_top1, t1 - t2);
    }
    // entropy_bound_accept: row accepted iff the entropy of the rows ranked before it is <= bound.
    std::vector<float> h(static_cast<size_t>(L));
    for (int row = 0; row < L; ++row) h[size_t(row)] = res.rows[size_t(row)].entropy;
    std::sort(h.begin(), h.end());
    double cum = 0, mean = 0;
    for (float e : h) {
      m.accept = std::min(m.accept, std::fabs(cum - o_.entropy_bound));
      cum += e;
    }
    mean = cum / L;
    m.confident = std::min(m.confident, std::fabs(mean - o_.confidence_threshold));
    if (!req.want_logits) res.logits.clear();
  }
  int64_t kv_len() const override { return in_.kv_len(); }
  bool can_truncate(int64_t n) const override { return in_.can_truncate(n); }
  void truncate(int64_t n) override { in_.truncate(n); }
  KvSnapshot kv_snapshot(int layer) const override { return in_.kv_snapshot(layer); }

  Margins m;

 private:
  void routers() {
    const int E = config().num_experts, K = config().top_k_experts;
    for (const auto& rl : trace_.router_logits)
      for (size_t t = 0; t + size_t(E) <= rl.size(); t += size_t(E)) {
        std::vector<float> s(rl.begin() + ptrdiff_t(t), rl.begin() + ptrdiff_t(t + size_t(E)));
        std::sort(s.begin(), s.end(), std::greater<float>());
        m.router_topk = std::min(m.router_topk, s[size_t(K) - 1] - s[size_t(K)]);
        ++m.router_decisions;
      }
  }
  Backend& in_;
  diffusion::GenerationOptions o_;
  LayerTrace trace_;
};

}  // namespace dg::conditioned
