#include "diffusion/options.h"

#include <charconv>
#include <cmath>

#include "util/error.h"

namespace dg::diffusion {

double decimal_double(float f) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, f);
  double d = f;
  std::from_chars(buf, r.ptr, d);
  return d;
}

GenerationOptions GenerationOptions::from_config(const GenerationConfig& gc) {
  GenerationOptions o;
  o.max_new_tokens = gc.max_new_tokens;
  o.max_steps = gc.max_denoising_steps;
  o.entropy_bound = decimal_double(gc.entropy_bound);
  o.t_min = decimal_double(gc.t_min);
  o.t_max = decimal_double(gc.t_max);
  o.stability_threshold = gc.stability_threshold;
  o.confidence_threshold = decimal_double(gc.confidence_threshold);
  o.stop_ids.assign(gc.eos_token_ids.begin(), gc.eos_token_ids.end());
  o.pad_id = gc.pad_token_id;
  return o;
}

GenerationOptions& GenerationOptions::disable_extras() {
  first_step_sc = false;
  plateau_steps = 0;
  pad_gate = false;
  entropy_stop = 0;
  empty_reply_retries = 0;
  conf_trim = 0;
  freeze = false;
  return *this;
}

GenerationOptions& GenerationOptions::fixed_steps(int steps) {
  disable_extras();
  max_steps = steps;
  stability_threshold = steps;  // S previous canvases must exist before a stop: never within a block of S steps
  stop_ids.clear();
  return *this;
}

const char* denoiser_name(Denoiser d) { return d == Denoiser::Argmax ? "seed" : "hf"; }

Denoiser parse_denoiser(const std::string& name) {
  if (name == "seed" || name == "argmax") return Denoiser::Argmax;
  if (name == "hf" || name == "categorical") return Denoiser::Categorical;
  fail("sampler: '{}' is not a sampler (expected 'seed' for argmax denoising or 'hf' for categorical draws)", name);
}

namespace {
void require_finite(double v, const char* field) {
  if (!std::isfinite(v)) fail("generation option {}: {} is not a finite number", field, v);
}
}  // namespace

void GenerationOptions::validate(const ModelConfig& model) const {
  if (max_new_tokens <= 0) fail("generation option max_new_tokens: must be a positive integer (got {})", max_new_tokens);
  if (max_steps <= 0) fail("generation option max_steps: must be a positive integer (got {})", max_steps);
  require_finite(entropy_bound, "entropy_bound");
  if (!(entropy_bound > 0)) fail("generation option entropy_bound: must be > 0 nats (got {})", entropy_bound);
  require_finite(t_min, "t_min");
  require_finite(t_max, "t_max");
  // t_min = 0 is legal: cur never reaches 0, so T > 0 as long as t_max > t_min.
  if (!(t_min >= 0)) fail("generation option t_min: must be >= 0 (got {})", t_min);
  if (!(t_max > t_min)) fail("generation option t_max: must be greater than t_min (got t_max {} <= t_min {})", t_max, t_min);
  if (stability_threshold < 0)
    fail("generation option stability_threshold: must be >= 0 (got {})", stability_threshold);
  require_finite(confidence_threshold, "confidence_threshold");
  if (!(confidence_threshold > 0))
    fail("generation option confidence_threshold: must be > 0 (got {})", confidence_threshold);
  for (int32_t id : stop_ids)
    if (id < 0 || id >= model.vocab_size)
      fail("generation option stop_ids: id {} is outside the vocabulary [0, {})", id, model.vocab_size);
  if (pad_id < 0 || pad_id >= model.vocab_size)
    fail("generation option pad_id: id {} is outside the vocabulary [0, {})", pad_id, model.vocab_size);
  if (plateau_steps < 0) fail("generation option plateau_steps: must be >= 0, 0 disables (got {})", plateau_steps);
  require_finite(plateau_entropy, "plateau_entropy");
  if (plateau_entropy < 0) fail("generation option plateau_entropy: must be >= 0 (got {})", plateau_entropy);
  require_finite(entropy_stop, "entropy_stop");
  if (entropy_stop < 0) fail("generation option entropy_stop: must be >= 0, 0 disables (got {})", entropy_stop);
  if (entropy_stop_min_steps < 1)
    fail("generation option entropy_stop_min_steps: must be >= 1 (got {})", entropy_stop_min_steps);
  if (empty_reply_retries < 0 || empty_reply_retries > 8)
    fail("generation option empty_reply_retries: must be in [0, 8] (got {})", empty_reply_retries);
  require_finite(conf_trim, "conf_trim");
  if (conf_trim < 0 || conf_trim > 1)
    fail("generation option conf_trim: must be a probability in [0, 1], 0 disables (got {})", conf_trim);
  if (model.canvas_length <= 0) fail("model canvas_length: must be positive (got {})", model.canvas_length);
}

}  // namespace dg::diffusion
