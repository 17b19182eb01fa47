#pragma once
// Prometheus text-format metrics (exposition format 0.0.4). Thread-safe; rendered on GET /metrics.
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace dg::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
  void observe(double v);
  void render(std::string& out, const std::string& name) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket, non-cumulative; last = +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

class Metrics {
 public:
  Metrics();
  void request(const std::string& endpoint, int status);
  void tokens(int64_t prompt, int64_t completion);
  void kv(int64_t reused, int64_t prefilled, bool reprefill);
  void block(int steps);
  void step_seconds(double s);
  void queue_depth(int64_t depth);
  void cancelled();
  std::string render() const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;
  uint64_t prompt_tokens_ = 0, completion_tokens_ = 0;
  uint64_t kv_hits_ = 0, kv_reused_tokens_ = 0, prefilled_tokens_ = 0, reprefills_ = 0, cancelled_ = 0;
  int64_t queue_depth_ = 0;
  Histogram steps_per_block_;
  Histogram step_latency_;
};

}  // namespace dg::server
