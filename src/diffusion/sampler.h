#pragma once
// The per-step rules of the entropy-bound sampler (seed §6, model-reference §4.1), as pure functions over the row
// statistics a Backend returns, so every rule is testable without a model.
#include <cstdint>
#include <deque>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "diffusion/options.h"
#include "diffusion/rng.h"

namespace dg::diffusion {

enum class StopReason : uint8_t { None, Confident, Plateau, EntropyOnly, MaxSteps, Cancelled };
const char* stop_reason_name(StopReason r);

// T for the step with `cur` steps remaining (cur = max_steps .. 1), rounded exactly as HF computes it. HF's
// _denoising_step turns cur_step into an int32 tensor before LinearTemperatureScheduleLogitsProcessor evaluates
// t_min + ((t_max - t_min) * (cur_step / N)), so every operation after the python-double `t_max - t_min` is a
// float32 tensor op: q = f32(cur / N), m = f32(f32(t_max - t_min) * q), T = f32(f32(t_min) + m). Rounding the
// all-double formula once instead differs in the last bit for 12 of the 48 default steps.
float schedule_temperature(int cur, int max_steps, double t_min, double t_max);

// HF's accept rule: positions sorted by ascending entropy (ties by position), position at rank r accepted iff
// cumsum_r - H_r <= bound. Mirrors torch on CPU: the cumsum accumulates in double and is stored as float, the
// subtraction and the comparison with the bound are float32. Writes mask[i] in {0,1}; returns the accepted count.
int entropy_bound_accept(std::span<const RowStats> rows, double bound, std::span<uint8_t> mask);

// Mean row entropy, accumulated in double and narrowed to float (what every threshold compares, as float32).
float mean_entropy(std::span<const RowStats> rows);

// p(argmax) under the tempered distribution: exp(max_z - logsumexp).
float row_pmax(const RowStats& r);

// A categorical draw from softmax(logits / T) by Gumbel-max: argmax_i (z_i + g_i), z_i = float(logits_i / T) widened
// to double, g_i = -log(-log(u_i)), u_i = rng.uniform_open01(), one draw per vocabulary entry in index order; ties
// keep the lowest index.
int32_t gumbel_max_sample(const float* logits, int vocab, float temperature, Rng& rng);

// The early-stop rules evaluated after every step of one canvas (reset per block). Max steps is the caller's loop.
class StopTracker {
 public:
  explicit StopTracker(const GenerationOptions& o) : o_(o) {}
  void reset();
  // step: 1-based step index within the block.
  StopReason observe(int step, std::span<const int32_t> argmax, std::span<const uint8_t> mask, float mean_h);
  int plateau_run() const { return run_; }

 private:
  const GenerationOptions& o_;
  std::deque<std::vector<int32_t>> history_;  // the previous stability_threshold argmax canvases
  std::vector<uint8_t> prev_mask_;
  int run_ = 0;  // consecutive steps (including the latest) with an identical accept mask
};

}  // namespace dg::diffusion
