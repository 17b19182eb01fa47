#pragma once
// A scripted Backend for the diffusion-loop tests: it records every call and lets a test decide each denoise
// result from the request (canvas, temperature, SC mode) and the call index.
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace dg::testing {

// A row whose tempered distribution has the given argmax, entropy and p(argmax).
inline RowStats make_row(int32_t argmax, float entropy, float pmax = 1.0f) {
  RowStats r;
  r.argmax = argmax;
  r.entropy = entropy;
  r.max_z = 0;
  r.logsumexp = -std::log(pmax);
  return r;
}

class FakeBackend : public Backend {
 public:
  struct Call {
    std::vector<int32_t> canvas;
    float temperature;
    SelfCondition sc;
    int64_t kv_len;
    bool want_logits;
    bool more_steps;
  };
  // Fills result.rows (one per canvas position) and, when asked, result.logits. `call` counts denoise calls.
  using Script = std::function<void(const DenoiseRequest& req, int call, int64_t kv_len, DenoiseResult& result)>;

  FakeBackend(int vocab, int canvas_length, Script script) : script_(std::move(script)) {
    cfg_.vocab_size = vocab;
    cfg_.canvas_length = canvas_length;
  }

  std::string name() const override { return "fake"; }
  const ModelConfig& config() const override { return cfg_; }
  void prefill(std::span<const int32_t> ids) override {
    prefills.emplace_back(ids.begin(), ids.end());
    kv_ += int64_t(ids.size());
  }
  void denoise(const DenoiseRequest& req, DenoiseResult& result) override {
    calls.push_back({{req.canvas.begin(), req.canvas.end()}, req.temperature, req.self_condition, kv_, req.want_logits,
                     req.more_steps});
    result.rows.assign(req.canvas.size(), RowStats{});
    result.logits.clear();
    script_(req, int(calls.size()) - 1, kv_, result);
  }
  int64_t kv_len() const override { return kv_; }
  bool can_truncate(int64_t n) const override { return n <= kv_; }
  void truncate(int64_t n) override { kv_ = n; }
  uint64_t kv_fingerprint() const override { return uint64_t(kv_); }
  KvSnapshot kv_snapshot(int) const override { return {}; }

  std::vector<Call> calls;
  std::vector<std::vector<int32_t>> prefills;

 private:
  ModelConfig cfg_;
  Script script_;
  int64_t kv_ = 0;
};

}  // namespace dg::testing
