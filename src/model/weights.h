#pragma once
// The named tensors the forward pass needs, mapped from an HF DiffusionGemma checkpoint (model-reference §2).
// One decoder copy of the text weights serves both passes; only layer_scalar differs per pass.
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/safetensors.h"

namespace dg {

struct LayerWeights {
  const TensorView *q_proj, *k_proj, *v_proj /* null on full layers */, *o_proj, *q_norm, *k_norm;
  const TensorView *input_norm, *post_attn_norm, *pre_ff_norm, *post_ff_norm_1, *pre_ff_norm_2, *post_ff_norm_2,
      *post_ff_norm;
  const TensorView *mlp_gate, *mlp_up, *mlp_down;
  const TensorView *router_proj, *router_scale, *per_expert_scale;
  const TensorView *experts_gate_up;  // [E, 2*I, H]: rows 0..I-1 gate, I..2I-1 up
  const TensorView *experts_down;     // [E, H, I]
  const TensorView *encoder_layer_scalar, *decoder_layer_scalar;  // [1] each
};

struct ModelWeights {
  const TensorView* embed;  // [V, H], also the tied lm_head
  const TensorView* final_norm;
  const TensorView *sc_pre_norm, *sc_gate, *sc_up, *sc_down;
  std::vector<LayerWeights> layers;
};

struct LoadedModel {
  std::string dir;
  ModelConfig config;
  GenerationConfig generation;
  std::unique_ptr<Checkpoint> checkpoint;
  ModelWeights weights;
};

// Opens config.json, generation_config.json and the safetensors files and maps every tensor, checking shapes.
std::unique_ptr<LoadedModel> load_model(const std::string& model_dir);
ModelWeights map_weights(const Checkpoint& ck, const ModelConfig& cfg);

}  // namespace dg
