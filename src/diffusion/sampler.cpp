#include "diffusion/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "util/error.h"

namespace dg::diffusion {

const char* stop_reason_name(StopReason r) {
  switch (r) {
    case StopReason::None: return "none";
    case StopReason::Confident: return "confident";
    case StopReason::Plateau: return "plateau";
    case StopReason::EntropyOnly: return "entropy";
    case StopReason::MaxSteps: return "max_steps";
    case StopReason::Cancelled: return "cancelled";
  }
  return "?";
}

float schedule_temperature(int cur, int max_steps, double t_min, double t_max) {
  // Each float32 op is done in double and rounded: exact for + - * / of floats (53 >= 2*24 + 2 bits), and immune
  // to FMA contraction, which would skip the intermediate roundings.
  const float q = float(double(cur) / double(max_steps));
  const float m = float(double(float(t_max - t_min)) * double(q));
  return float(double(float(t_min)) + double(m));
}

int entropy_bound_accept(std::span<const RowStats> rows, double bound, std::span<uint8_t> mask) {
  const size_t n = rows.size();
  DG_CHECK(mask.size() == n, "mask size {} != rows {}", mask.size(), n);
  std::vector<int32_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return rows[a].entropy < rows[b].entropy; });
  const float fbound = float(bound);
  double cum = 0;
  int accepted = 0;
  std::fill(mask.begin(), mask.end(), uint8_t(0));
  for (size_t r = 0; r < n; ++r) {
    const float h = rows[order[r]].entropy;
    cum += h;
    const bool ok = float(cum) - h <= fbound;
    mask[order[r]] = ok;
    accepted += ok;
  }
  return accepted;
}

float mean_entropy(std::span<const RowStats> rows) {
  if (rows.empty()) return 0;
  double s = 0;
  for (const auto& r : rows) s += r.entropy;
  return float(s / double(rows.size()));
}

float row_pmax(const RowStats& r) { return float(std::exp(double(r.max_z) - double(r.logsumexp))); }

int32_t gumbel_max_sample(const float* logits, int vocab, float temperature, Rng& rng) {
  double best = -INFINITY;
  int32_t arg = 0;
  for (int i = 0; i < vocab; ++i) {
    const double z = double(logits[i] / temperature);
    const double key = z - std::log(-std::log(rng.uniform_open01()));
    if (key > best) { best = key; arg = i; }
  }
  return arg;
}

void StopTracker::reset() {
  history_.clear();
  prev_mask_.clear();
  run_ = 0;
}

StopReason StopTracker::observe(int step, std::span<const int32_t> argmax, std::span<const uint8_t> mask,
                                float mean_h) {
  // Stability as HF's StableAndConfidentStoppingCriteria: equal to each of the last S argmax canvases, where a
  // missing history entry (HF: -1) never matches, so S steps must precede the first possible stop.
  bool stable = true;
  const size_t s = size_t(o_.stability_threshold);
  if (s > 0) {
    stable = history_.size() == s;
    for (const auto& h : history_) stable = stable && std::equal(h.begin(), h.end(), argmax.begin(), argmax.end());
    history_.emplace_back(argmax.begin(), argmax.end());
    if (history_.size() > s) history_.pop_front();
  }
  if (!prev_mask_.empty() && std::equal(prev_mask_.begin(), prev_mask_.end(), mask.begin(), mask.end()))
    ++run_;
  else
    run_ = 1;
  prev_mask_.assign(mask.begin(), mask.end());

  // An all-pad argmax is a degenerate forward, not a converged answer (seed §6 pad gate).
  if (o_.pad_gate && std::all_of(argmax.begin(), argmax.end(), [&](int32_t t) { return t == o_.pad_id; }))
    return StopReason::None;
  if (stable && mean_h < float(o_.confidence_threshold)) return StopReason::Confident;
  if (o_.plateau_steps > 0 && run_ >= o_.plateau_steps && mean_h < float(o_.plateau_entropy))
    return StopReason::Plateau;
  if (o_.entropy_stop > 0 && step >= o_.entropy_stop_min_steps && mean_h < float(o_.entropy_stop))
    return StopReason::EntropyOnly;
  return StopReason::None;
}

}  // namespace dg::diffusion
