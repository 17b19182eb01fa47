#include "model/config.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "util/error.h"
#include "util/mmap_file.h"

namespace dg {
namespace {

using json = nlohmann::json;

struct Reader {
  const json& obj;
  std::string where;  // "config.json: text_config"

  bool has(const char* key) const { return obj.contains(key) && !obj[key].is_null(); }

  int integer(const char* key, int fallback, bool required = false, int min_value = 1) const {
    if (!has(key)) {
      if (required) fail("{}: missing required field '{}'", where, key);
      return fallback;
    }
    const json& v = obj[key];
    if (!v.is_number_integer()) fail("{}: field '{}' must be an integer, got {}", where, key, v.dump());
    int64_t x = v.get<int64_t>();
    if (x < min_value || x > (int64_t(1) << 31) - 1)
      fail("{}: field '{}' = {} is out of range (must be >= {})", where, key, x, min_value);
    return int(x);
  }

  float number(const char* key, float fallback) const {
    if (!has(key)) return fallback;
    const json& v = obj[key];
    if (!v.is_number()) fail("{}: field '{}' must be a number, got {}", where, key, v.dump());
    return v.get<float>();
  }

  std::vector<int> id_list(const char* key, std::vector<int> fallback) const {
    if (!has(key)) return fallback;
    const json& v = obj[key];
    std::vector<int> out;
    if (v.is_number_integer()) {
      out.push_back(v.get<int>());
    } else if (v.is_array()) {
      for (auto& e : v) {
        if (!e.is_number_integer()) fail("{}: field '{}' must hold integer token ids, got {}", where, key, v.dump());
        out.push_back(e.get<int>());
      }
    } else {
      fail("{}: field '{}' must be an integer or a list of integers, got {}", where, key, v.dump());
    }
    return out;
  }
};

json parse_json(const std::string& text, const std::string& source) {
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    fail("{}: invalid JSON ({}); re-download or re-save the file", source, e.what());
  }
}

RopeParams rope_for(const json* params, int head_dim, float default_theta, const std::string& where) {
  RopeParams r;
  std::string type = "default";
  float factor = 1.0f;
  r.theta = default_theta;
  if (params) {
    Reader rd{*params, where};
    r.theta = rd.number("rope_theta", default_theta);
    factor = rd.number("partial_rotary_factor", 1.0f);
    if (params->contains("rope_type")) type = (*params)["rope_type"].get<std::string>();
  }
  if (type != "default" && type != "proportional")
    fail("{}: rope_type '{}' is not supported (expected 'default' or 'proportional')", where, type);
  if (!(factor > 0.0f && factor <= 1.0f)) fail("{}: partial_rotary_factor {} must be in (0, 1]", where, factor);
  // Python: int(factor * head_dim // 2); "proportional" keeps the full head_dim as the exponent denominator.
  r.rotated_pairs = int(double(factor) * head_dim / 2.0);
  r.exponent_dim = type == "proportional" ? float(head_dim) : float(2 * r.rotated_pairs);
  return r;
}

}  // namespace

int ModelConfig::max_head_dim() const {
  int m = 0;
  for (auto& l : layers) m = std::max(m, l.head_dim);
  return m;
}

int64_t ModelConfig::parameter_count() const {
  int64_t H = hidden_size, n = int64_t(vocab_size) * H + H;  // embedding + final norm
  n += 3 * int64_t(intermediate_size) * H + H;                 // self-conditioning MLP + pre_norm
  for (auto& l : layers) {
    int64_t q = int64_t(num_heads) * l.head_dim, kv = int64_t(l.n_kv_heads) * l.head_dim;
    n += q * H + kv * H * (l.has_v_proj ? 2 : 1) + q * H + 2 * l.head_dim;  // q, k, (v), o, q/k norms
    n += 3 * int64_t(intermediate_size) * H;                                // dense MLP
    n += int64_t(num_experts) * H + H + num_experts;                        // router proj, scale, per-expert scale
    n += int64_t(num_experts) * 3 * moe_intermediate_size * H;              // experts
    n += 7 * H + 1;                                                         // norms + decoder layer_scalar
  }
  return n;
}

std::string ModelConfig::layer_pattern() const {
  std::string s;
  for (auto& l : layers) s += l.kind == LayerKind::Full ? 'F' : 'S';
  return s;
}

ModelConfig parse_model_config_json(const std::string& json_text, const std::string& source) {
  json root = parse_json(json_text, source);
  if (!root.is_object()) fail("{}: expected a JSON object at the top level", source);
  const json* text = &root;
  std::string where = source;
  if (root.contains("text_config")) {
    text = &root["text_config"];
    where = source + ": text_config";
    if (!text->is_object()) fail("{}: must be an object", where);
  }
  Reader rd{*text, where};
  Reader top{root, source};
  ModelConfig c;
  c.vocab_size = rd.integer("vocab_size", 262144);
  c.hidden_size = rd.integer("hidden_size", 0, true);
  c.intermediate_size = rd.integer("intermediate_size", 0, true);
  c.moe_intermediate_size = rd.integer("moe_intermediate_size", 0, true);
  c.num_layers = rd.integer("num_hidden_layers", 0, true);
  c.num_heads = rd.integer("num_attention_heads", 0, true);
  c.num_experts = rd.integer("num_experts", 0, true);
  c.top_k_experts = rd.integer("top_k_experts", 0, true);
  c.sliding_window = rd.integer("sliding_window", 512, false, 2);
  c.canvas_length = top.integer("canvas_length", 256);
  c.rms_norm_eps = rd.number("rms_norm_eps", 1e-6f);
  c.final_logit_softcapping = rd.number("final_logit_softcapping", 30.0f);  // 5.17 saves no such key
  c.pad_token_id = rd.integer("pad_token_id", 0, false, 0);
  c.bos_token_id = rd.integer("bos_token_id", 2, false, 0);
  c.eos_token_ids = top.has("eos_token_id") ? top.id_list("eos_token_id", {1}) : rd.id_list("eos_token_id", {1});
  if (c.top_k_experts > c.num_experts)
    fail("{}: top_k_experts ({}) exceeds num_experts ({})", where, c.top_k_experts, c.num_experts);
  if (rd.has("tie_word_embeddings") && !(*text)["tie_word_embeddings"].get<bool>())
    fail("{}: tie_word_embeddings=false is not supported (DiffusionGemma ties lm_head to the embedding)", where);

  int head_dim = rd.integer("head_dim", 256);
  int n_kv = rd.integer("num_key_value_heads", 0, true);
  int global_head_dim = rd.integer("global_head_dim", 512);
  // transformers 5.17 falls back to num_key_value_heads when num_global_key_value_heads is absent.
  int global_kv = rd.integer("num_global_key_value_heads", n_kv);

  std::vector<std::string> types;
  if (rd.has("layer_types")) {
    const json& lt = (*text)["layer_types"];
    if (!lt.is_array() || int(lt.size()) != c.num_layers)
      fail("{}: layer_types must be a list of {} entries (num_hidden_layers), got {}", where, c.num_layers,
           lt.dump().substr(0, 200));
    for (auto& t : lt) types.push_back(t.is_string() ? t.get<std::string>() : "?");
  } else {
    for (int i = 0; i < c.num_layers; ++i)
      types.push_back((i % 6 == 5 || i == c.num_layers - 1) ? "full_attention" : "sliding_attention");
  }

  const json* rope = rd.has("rope_parameters") ? &(*text)["rope_parameters"] : nullptr;
  const json* rope_sliding = rope && rope->contains("sliding_attention") ? &(*rope)["sliding_attention"] : nullptr;
  const json* rope_full = rope && rope->contains("full_attention") ? &(*rope)["full_attention"] : nullptr;
  json default_full = {{"rope_type", "proportional"}, {"partial_rotary_factor", 0.25}, {"rope_theta", 1e6}};
  if (!rope_full) rope_full = &default_full;

  const json* per_layer = rd.has("per_layer_config") ? &(*text)["per_layer_config"] : nullptr;
  if (per_layer && !per_layer->is_object()) fail("{}: per_layer_config must be an object keyed by layer index", where);

  for (int i = 0; i < c.num_layers; ++i) {
    LayerShape l;
    const std::string& t = types[i];
    if (t == "sliding_attention") {
      l.kind = LayerKind::Sliding;
      l.head_dim = head_dim;
      l.n_kv_heads = n_kv;
    } else if (t == "full_attention") {
      l.kind = LayerKind::Full;
      l.head_dim = global_head_dim;
      l.n_kv_heads = global_kv;
      l.has_v_proj = false;
    } else {
      fail("{}: layer_types[{}] = '{}' is not 'sliding_attention' or 'full_attention'", where, i, t);
    }
    if (per_layer && per_layer->contains(std::to_string(i))) {
      Reader pl{(*per_layer)[std::to_string(i)], where + ": per_layer_config." + std::to_string(i)};
      l.head_dim = pl.integer("head_dim", l.head_dim);
      l.n_kv_heads = pl.integer("num_key_value_heads", l.n_kv_heads);
    }
    if (l.head_dim % 2) fail("{}: layer {} head_dim {} must be even (split-half RoPE)", where, i, l.head_dim);
    if (c.num_heads % l.n_kv_heads)
      fail("{}: layer {}: num_attention_heads {} is not a multiple of its {} kv heads", where, i, c.num_heads,
           l.n_kv_heads);
    l.rope = l.kind == LayerKind::Sliding ? rope_for(rope_sliding, l.head_dim, 10000.0f, where + ": rope_parameters")
                                          : rope_for(rope_full, l.head_dim, 1e6f, where + ": rope_parameters");
    c.layers.push_back(l);
  }
  return c;
}

ModelConfig load_model_config(const std::string& model_dir) {
  std::string path = (std::filesystem::path(model_dir) / "config.json").string();
  if (!std::filesystem::exists(path))
    fail("{}: no config.json; point -m at a Hugging Face snapshot directory of DiffusionGemma", model_dir);
  return parse_model_config_json(read_text_file(path), path);
}

GenerationConfig parse_generation_config_json(const std::string& json_text, const std::string& source) {
  json root = parse_json(json_text, source);
  if (!root.is_object()) fail("{}: expected a JSON object", source);
  Reader rd{root, source};
  GenerationConfig g;
  g.max_new_tokens = rd.integer("max_new_tokens", g.max_new_tokens);
  g.max_denoising_steps = rd.integer("max_denoising_steps", g.max_denoising_steps);
  g.t_min = rd.number("t_min", g.t_min);
  g.t_max = rd.number("t_max", g.t_max);
  g.stability_threshold = rd.integer("stability_threshold", g.stability_threshold, false, 0);
  g.confidence_threshold = rd.number("confidence_threshold", g.confidence_threshold);
  g.eos_token_ids = rd.id_list("eos_token_id", g.eos_token_ids);
  g.pad_token_id = rd.integer("pad_token_id", g.pad_token_id, false, 0);
  if (rd.has("sampler_config")) {
    const json& sc = root["sampler_config"];
    if (!sc.is_object()) fail("{}: sampler_config must be an object", source);
    g.entropy_bound = Reader{sc, source + ": sampler_config"}.number("entropy_bound", g.entropy_bound);
  }
  return g;
}

GenerationConfig load_generation_config(const std::string& model_dir) {
  std::string path = (std::filesystem::path(model_dir) / "generation_config.json").string();
  if (!std::filesystem::exists(path)) return GenerationConfig{};
  return parse_generation_config_json(read_text_file(path), path);
}

ModelConfig diffusiongemma_26b_a4b_config() {
  ModelConfig c;
  c.vocab_size = 262144;
  c.hidden_size = 2816;
  c.intermediate_size = 2112;
  c.moe_intermediate_size = 704;
  c.num_layers = 30;
  c.num_heads = 16;
  c.num_experts = 128;
  c.top_k_experts = 8;
  c.sliding_window = 1024;
  c.canvas_length = 256;
  for (int l = 0; l < 30; ++l) {
    LayerShape s;
    if (l % 6 == 5) {
      s.kind = LayerKind::Full, s.head_dim = 512, s.n_kv_heads = 2, s.has_v_proj = false;
      s.rope = {1e6f, 64, 512.0f};
    } else {
      s.kind = LayerKind::Sliding, s.head_dim = 256, s.n_kv_heads = 8, s.has_v_proj = true;
      s.rope = {1e4f, 128, 256.0f};
    }
    c.layers.push_back(s);
  }
  return c;
}

}  // namespace dg
