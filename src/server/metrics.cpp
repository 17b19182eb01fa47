#include "server/metrics.h"

#include "util/error.h"

namespace dg::server {

void Histogram::observe(double v) {
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += v;
  ++count_;
}

void Histogram::render(std::string& out, const std::string& name) const {
  uint64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    out += format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds_[i], cum);
  }
  out += format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, count_, name, sum_, name, count_);
}

Metrics::Metrics()
    : steps_per_block_({1, 2, 4, 8, 12, 16, 24, 32, 48, 64}),
      step_latency_({0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5}) {}

void Metrics::request(const std::string& endpoint, int status) {
  std::lock_guard lock(mu_);
  ++requests_[{endpoint, status}];
}
void Metrics::tokens(int64_t prompt, int64_t completion) {
  std::lock_guard lock(mu_);
  prompt_tokens_ += uint64_t(prompt);
  completion_tokens_ += uint64_t(completion);
}
void Metrics::kv(int64_t reused, int64_t prefilled, bool reprefill) {
  std::lock_guard lock(mu_);
  if (reused > 0) ++kv_hits_;
  kv_reused_tokens_ += uint64_t(reused);
  prefilled_tokens_ += uint64_t(prefilled);
  if (reprefill) ++reprefills_;
}
void Metrics::block(int steps) {
  std::lock_guard lock(mu_);
  steps_per_block_.observe(steps);
}
void Metrics::step_seconds(double s) {
  std::lock_guard lock(mu_);
  step_latency_.observe(s);
}
void Metrics::queue_depth(int64_t depth) {
  std::lock_guard lock(mu_);
  queue_depth_ = depth;
}
void Metrics::cancelled() {
  std::lock_guard lock(mu_);
  ++cancelled_;
}

std::string Metrics::render() const {
  std::lock_guard lock(mu_);
  std::string out;
  out += "# HELP diffgemma_requests_total HTTP requests by endpoint and status.\n# TYPE diffgemma_requests_total counter\n";
  for (const auto& [key, n] : requests_)
    out += format("diffgemma_requests_total{{endpoint=\"{}\",status=\"{}\"}} {}\n", key.first, key.second, n);
  auto counter = [&](const char* name, const char* help, uint64_t v) {
    out += format("# HELP {} {}\n# TYPE {} counter\n{} {}\n", name, help, name, name, v);
  };
  counter("diffgemma_prompt_tokens_total", "Prompt tokens of finished requests.", prompt_tokens_);
  counter("diffgemma_completion_tokens_total", "Generated tokens of finished requests.", completion_tokens_);
  counter("diffgemma_kv_reuse_hits_total", "Turns that reused a cached conversation prefix.", kv_hits_);
  counter("diffgemma_kv_reused_tokens_total", "Prompt tokens served from the KV cache.", kv_reused_tokens_);
  counter("diffgemma_prefilled_tokens_total", "Prompt tokens run through the encoder.", prefilled_tokens_);
  counter("diffgemma_kv_reprefills_total", "Turns whose cache could not be rewound and was rebuilt.", reprefills_);
  counter("diffgemma_cancelled_total", "Generations cancelled (client gone or stop string).", cancelled_);
  out += format("# HELP diffgemma_queue_depth Requests waiting for the engine.\n# TYPE diffgemma_queue_depth gauge\n"
                "diffgemma_queue_depth {}\n", queue_depth_);
  out += "# HELP diffgemma_steps_per_block Denoising steps per committed block.\n# TYPE diffgemma_steps_per_block histogram\n";
  steps_per_block_.render(out, "diffgemma_steps_per_block");
  out += "# HELP diffgemma_step_seconds Latency of one denoising step.\n# TYPE diffgemma_step_seconds histogram\n";
  step_latency_.render(out, "diffgemma_step_seconds");
  return out;
}

}  // namespace dg::server
