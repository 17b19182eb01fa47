#pragma once
// Every knob of the block-diffusion loop in one struct. Defaults are the seed contract (ARCHITECTURE Part II
// §4-§7, §9) on top of the checkpoint's generation_config.json; disable_extras() turns the seed-only additions off
// so the loop reproduces HF's DiffusionGemmaGenerationMixin.generate (with argmax denoising and our RNG).
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace dg::diffusion {

// What an accepted position receives.
enum class Denoiser : uint8_t {
  Argmax,       // the row argmax of the tempered logits (seed / MLX default)
  Categorical,  // a draw from softmax(logits / T) by Gumbel-max over the seeded stream (HF's multinomial, `--sampler hf`)
};

struct GenerationOptions {
  // --- HF generation_config.json semantics ---
  int max_new_tokens = 256;         // exact: output never exceeds it
  int max_steps = 48;               // max_denoising_steps
  double entropy_bound = 0.1;       // nats; accept while (sum of strictly lower-ranked entropies) <= bound
  double t_min = 0.4, t_max = 0.8;  // T = t_min + (t_max - t_min) * cur / max_steps, cur = max_steps .. 1
  int stability_threshold = 1;      // argmax identical to each of the previous N steps (0: always "stable")
  double confidence_threshold = 0.005;  // mean entropy strictly below it
  std::vector<int32_t> stop_ids = {1, 106, 50};
  int32_t pad_id = 0;

  // --- determinism and sampling ---
  uint64_t seed = 0;
  Denoiser denoiser = Denoiser::Argmax;

  // --- seed-only extras (each off in disable_extras()) ---
  bool first_step_sc = true;      // step 1 self-conditions on the canvas embedding (seed §4) instead of nothing
  int plateau_steps = 8;          // stop once the accept mask was identical for this many steps (0: off) ...
  double plateau_entropy = 0.05;  // ... and mean entropy < this
  bool pad_gate = true;           // an all-pad argmax never stops early
  double entropy_stop = 0.05;     // stop when mean entropy < this without waiting for stability (0: off) ...
  int entropy_stop_min_steps = 12;  // ... once at least this many steps ran in the block
  int empty_reply_retries = 3;    // re-roll a first block whose position 0 is a stop/pad token, halving L each retry
  double conf_trim = 0.9;         // commit-time trim, dup tier: cut a block at the first row with p_max < this that
                                  // repeats a neighbour's argmax (0: off)

  // --- A/B only ---
  bool freeze = false;  // legacy: once accepted, a position keeps its token for the rest of the block

  // Seed defaults with the sampler numbers, stop ids and pad id of generation_config.json.
  static GenerationOptions from_config(const GenerationConfig& gc);
  // HF parity: no first-step SC seed, no plateau / pad gate / entropy-only stop, no re-roll, no trim.
  GenerationOptions& disable_extras();
  // Benchmarking (`diffgemma bench --fixed-steps`, HF's "N steps per canvas" runs): every canvas runs exactly
  // `steps` denoise forwards. HF semantics plus no stop ids and a stability window as long as the block, so neither
  // a stop token nor the confident stop can end a block or the turn early.
  GenerationOptions& fixed_steps(int steps);
  // Throws dg::Error naming the offending field.
  void validate(const ModelConfig& model) const;
};

const char* denoiser_name(Denoiser d);
Denoiser parse_denoiser(const std::string& name);  // "seed"/"argmax" or "hf"/"categorical"

// The double a decimal literal in generation_config.json denotes, recovered from the float GenerationConfig stores
// (shortest round-trip digits, re-parsed as double): HF computes t_max - t_min in python doubles, so 0.8f - 0.4f
// would shift T by an ulp and break bit parity.
double decimal_double(float f);

}  // namespace dg::diffusion
