// diffgemma info -m DIR: config summary, layer pattern, parameter count and memory estimates.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "cli/backend_select.h"
#include "cli/command.h"
#include "model/weights.h"

namespace dg::cli {
namespace {

struct InfoArgs {
  std::string model_dir, backend = "auto";
  bool json = false;
};

int64_t expert_parameters(const ModelConfig& c) {
  return int64_t(c.num_layers) * c.num_experts * 3 * c.moe_intermediate_size * c.hidden_size;
}

// KV bytes per token at 2 bytes/element, counting only what attention can read (sliding layers are bounded).
int64_t kv_bytes_per_token(const ModelConfig& c) {
  int64_t b = 0;
  for (auto& l : c.layers)
    if (l.kind == LayerKind::Full) b += 2 * int64_t(l.n_kv_heads) * l.head_dim * 2;
  return b;
}

int64_t sliding_kv_bytes(const ModelConfig& c) {
  int64_t b = 0;
  for (auto& l : c.layers)
    if (l.kind == LayerKind::Sliding) b += 2 * int64_t(l.n_kv_heads) * l.head_dim * 2 * (c.sliding_window - 1);
  return b;
}

int run_info(const InfoArgs& a) {
  auto model = load_model(a.model_dir);  // also validates every tensor's presence and shape
  const ModelConfig& c = model->config;
  const GenerationConfig& g = model->generation;
  const int64_t params = c.parameter_count(), experts = expert_parameters(c), dense = params - experts;
  const double gib = 1024.0 * 1024.0 * 1024.0;
  nlohmann::json j = {
      {"model_dir", a.model_dir},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"layers", c.num_layers},
      {"layer_pattern", c.layer_pattern()},
      {"heads", c.num_heads},
      {"experts", c.num_experts},
      {"top_k_experts", c.top_k_experts},
      {"moe_intermediate_size", c.moe_intermediate_size},
      {"intermediate_size", c.intermediate_size},
      {"sliding_window", c.sliding_window},
      {"canvas_length", c.canvas_length},
      {"parameters", params},
      {"expert_parameters", experts},
      {"active_parameters_per_token",
       dense + int64_t(c.num_layers) * c.top_k_experts * 3 * c.moe_intermediate_size * c.hidden_size},
      {"memory_gib", {{"f32", params * 4 / gib}, {"bf16", params * 2 / gib},
                      {"bf16_dense_q4_experts", (dense * 2 + experts * 0.5 * (1 + 4.0 / 32)) / gib}}},
      {"kv_bytes_per_token_full_layers", kv_bytes_per_token(c)},
      {"kv_bytes_sliding_layers", sliding_kv_bytes(c)},
      {"generation", {{"max_new_tokens", g.max_new_tokens}, {"max_denoising_steps", g.max_denoising_steps},
                      {"entropy_bound", g.entropy_bound}, {"t_min", g.t_min}, {"t_max", g.t_max},
                      {"stability_threshold", g.stability_threshold},
                      {"confidence_threshold", g.confidence_threshold}, {"eos_token_id", g.eos_token_ids}}},
  };
  nlohmann::json layers = nlohmann::json::array();
  for (auto& l : c.layers)
    layers.push_back({{"kind", l.kind == LayerKind::Full ? "full" : "sliding"}, {"head_dim", l.head_dim},
                      {"kv_heads", l.n_kv_heads}, {"rope_theta", l.rope.theta},
                      {"rotated_pairs", l.rope.rotated_pairs}});
  j["layer_shapes"] = layers;
  j["backend"] = resolve_backend(a.backend);
  if (a.json) {
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("model         %s\n", a.model_dir.c_str());
  std::printf("vocab         %d   hidden %d   heads %d   layers %d (%s)\n", c.vocab_size, c.hidden_size, c.num_heads,
              c.num_layers, c.layer_pattern().c_str());
  for (size_t i = 0; i < c.layers.size(); ++i) {
    const LayerShape& l = c.layers[i];
    if (i > 0 && c.layers[i - 1].kind == l.kind && c.layers[i - 1].head_dim == l.head_dim) continue;
    std::printf("  %-7s layers: head_dim %d, kv heads %d, rope theta %g, %d rotated pairs%s\n",
                l.kind == LayerKind::Full ? "full" : "sliding", l.head_dim, l.n_kv_heads, double(l.rope.theta),
                l.rope.rotated_pairs, l.has_v_proj ? "" : ", V = K source");
  }
  std::printf("MoE           %d experts, top-%d, expert width %d; dense MLP width %d\n", c.num_experts,
              c.top_k_experts, c.moe_intermediate_size, c.intermediate_size);
  std::printf("window        %d   canvas %d   softcap %g\n", c.sliding_window, c.canvas_length,
              double(c.final_logit_softcapping));
  std::printf("parameters    %.3f B total, %.3f B in experts, %.3f B active per token\n", params / 1e9,
              experts / 1e9, j["active_parameters_per_token"].get<int64_t>() / 1e9);
  std::printf("memory        f32 %.2f GiB | bf16 %.2f GiB | bf16 + q4 experts %.2f GiB\n",
              j["memory_gib"]["f32"].get<double>(), j["memory_gib"]["bf16"].get<double>(),
              j["memory_gib"]["bf16_dense_q4_experts"].get<double>());
  std::printf("KV cache      %lld bytes/token (full layers) + %.1f MiB (sliding windows), 16-bit\n",
              (long long)kv_bytes_per_token(c), sliding_kv_bytes(c) / 1048576.0);
  std::printf("backend       %s\n", j["backend"].get<std::string>().c_str());
  std::printf("generation    %d steps max, entropy bound %g, T %g..%g, max_new_tokens %d\n", g.max_denoising_steps,
              double(g.entropy_bound), double(g.t_min), double(g.t_max), g.max_new_tokens);
  return 0;
}

CommandRegistrar reg("info", "Print a model's configuration, layer pattern, parameter count and memory estimate",
                     [](CLI::App& sub) -> Action {
                       auto a = std::make_shared<InfoArgs>();
                       sub.add_option("-m,--model", a->model_dir, "Hugging Face snapshot directory")->required();
                       sub.add_flag("--json", a->json, "Print JSON");
                       sub.add_option("--backend", a->backend, "cpu, cuda or auto: which one would run this model");
                       return [a] { return run_info(*a); };
                     });

}  // namespace
}  // namespace dg::cli
