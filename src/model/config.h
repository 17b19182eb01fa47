#pragma once
// Model and generation configuration, parsed once from an HF snapshot and validated.
#include <cstdint>
#include <string>
#include <vector>

namespace dg {

enum class LayerKind : uint8_t { Sliding, Full };

struct RopeParams {
  float theta = 10000.0f;
  int rotated_pairs = 0;     // n_rot: frequency slots i < n_rot rotate dims (i, i + head_dim/2); the rest pass through
  float exponent_dim = 0;    // inv_freq[i] = theta^(-2i / exponent_dim); head_dim for "proportional"
};

struct LayerShape {
  LayerKind kind = LayerKind::Sliding;
  int head_dim = 0;
  int n_kv_heads = 0;
  bool has_v_proj = true;  // full layers: V is the raw k_proj output
  RopeParams rope;
};

struct ModelConfig {
  int vocab_size = 262144;
  int hidden_size = 0;
  int intermediate_size = 0;      // dense MLP and self-conditioning MLP width
  int moe_intermediate_size = 0;  // per-expert width
  int num_layers = 0;
  int num_heads = 0;
  int num_experts = 0;
  int top_k_experts = 0;
  int sliding_window = 0;
  int canvas_length = 256;
  float rms_norm_eps = 1e-6f;
  float final_logit_softcapping = 30.0f;
  int pad_token_id = 0, bos_token_id = 2;
  std::vector<int> eos_token_ids = {1};
  std::vector<LayerShape> layers;

  int max_head_dim() const;
  int64_t parameter_count() const;  // text decoder parameters (the copy that is loaded)
  std::string layer_pattern() const;  // e.g. "SSSSSF" x5
};

// Parses config.json (top-level DiffusionGemmaConfig with text_config, or a bare text config). Accepts both
// serialized forms: `per_layer_config` (transformers >= 5.17) and `global_head_dim`/`num_global_key_value_heads`.
ModelConfig parse_model_config_json(const std::string& json_text, const std::string& source_name);
ModelConfig load_model_config(const std::string& model_dir);
// The shapes of google/diffusiongemma-26B-A4B-it's text decoder (model-reference §1), for synthetic full-size
// weights (bench, bench-kernels) where no checkpoint is at hand.
ModelConfig diffusiongemma_26b_a4b_config();

struct GenerationConfig {
  int max_new_tokens = 256;
  int max_denoising_steps = 48;
  float entropy_bound = 0.1f;
  float t_min = 0.4f, t_max = 0.8f;
  int stability_threshold = 1;
  float confidence_threshold = 0.005f;
  std::vector<int> eos_token_ids = {1, 106, 50};
  int pad_token_id = 0;
};

GenerationConfig parse_generation_config_json(const std::string& json_text, const std::string& source_name);
// Missing generation_config.json -> defaults (the checkpoint's own values).
GenerationConfig load_generation_config(const std::string& model_dir);

}  // namespace dg
