#include "model/weights.h"

#include "util/error.h"

namespace dg {

ModelWeights map_weights(const Checkpoint& ck, const ModelConfig& c) {
  using S = std::vector<int64_t>;
  const int64_t H = c.hidden_size, V = c.vocab_size, I = c.intermediate_size, E = c.num_experts,
                Ie = c.moe_intermediate_size, nh = c.num_heads;
  ModelWeights w{};
  w.embed = &ck.require("model.decoder.embed_tokens.weight", S{V, H});
  w.final_norm = &ck.require("model.decoder.norm.weight", S{H});
  const std::string sc = "model.decoder.self_conditioning.";
  w.sc_pre_norm = &ck.require(sc + "pre_norm.weight", S{H});
  w.sc_gate = &ck.require(sc + "gate_proj.weight", S{I, H});
  w.sc_up = &ck.require(sc + "up_proj.weight", S{I, H});
  w.sc_down = &ck.require(sc + "down_proj.weight", S{H, I});
  for (int i = 0; i < c.num_layers; ++i) {
    const LayerShape& ls = c.layers[i];
    const int64_t D = ls.head_dim, kv = ls.n_kv_heads;
    const std::string p = "model.decoder.layers." + std::to_string(i) + ".";
    LayerWeights l{};
    l.q_proj = &ck.require(p + "self_attn.q_proj.weight", S{nh * D, H});
    l.k_proj = &ck.require(p + "self_attn.k_proj.weight", S{kv * D, H});
    if (ls.has_v_proj) {
      l.v_proj = &ck.require(p + "self_attn.v_proj.weight", S{kv * D, H});
    } else if (ck.find(p + "self_attn.v_proj.weight")) {
      fail("{}: layer {} is a full-attention layer but has '{}self_attn.v_proj.weight'; full layers use K as V — "
           "check layer_types in config.json",
           ck.dir(), i, p);
    }
    l.o_proj = &ck.require(p + "self_attn.o_proj.weight", S{H, nh * D});
    l.q_norm = &ck.require(p + "self_attn.q_norm.weight", S{D});
    l.k_norm = &ck.require(p + "self_attn.k_norm.weight", S{D});
    l.input_norm = &ck.require(p + "input_layernorm.weight", S{H});
    l.post_attn_norm = &ck.require(p + "post_attention_layernorm.weight", S{H});
    l.pre_ff_norm = &ck.require(p + "pre_feedforward_layernorm.weight", S{H});
    l.post_ff_norm_1 = &ck.require(p + "post_feedforward_layernorm_1.weight", S{H});
    l.pre_ff_norm_2 = &ck.require(p + "pre_feedforward_layernorm_2.weight", S{H});
    l.post_ff_norm_2 = &ck.require(p + "post_feedforward_layernorm_2.weight", S{H});
    l.post_ff_norm = &ck.require(p + "post_feedforward_layernorm.weight", S{H});
    l.mlp_gate = &ck.require(p + "mlp.gate_proj.weight", S{I, H});
    l.mlp_up = &ck.require(p + "mlp.up_proj.weight", S{I, H});
    l.mlp_down = &ck.require(p + "mlp.down_proj.weight", S{H, I});
    l.router_proj = &ck.require(p + "router.proj.weight", S{E, H});
    l.router_scale = &ck.require(p + "router.scale", S{H});
    l.per_expert_scale = &ck.require(p + "router.per_expert_scale", S{E});
    l.experts_gate_up = &ck.require(p + "experts.gate_up_proj", S{E, 2 * Ie, H});
    l.experts_down = &ck.require(p + "experts.down_proj", S{E, H, Ie});
    l.decoder_layer_scalar = &ck.require(p + "layer_scalar", S{1});
    l.encoder_layer_scalar =
        &ck.require("model.encoder.language_model.layers." + std::to_string(i) + ".layer_scalar", S{1});
    w.layers.push_back(l);
  }
  return w;
}

std::unique_ptr<LoadedModel> load_model(const std::string& model_dir) {
  auto m = std::make_unique<LoadedModel>();
  m->dir = model_dir;
  m->config = load_model_config(model_dir);
  m->generation = load_generation_config(model_dir);
  m->checkpoint = Checkpoint::open(model_dir);
  m->weights = map_weights(*m->checkpoint, m->config);
  return m;
}

}  // namespace dg
