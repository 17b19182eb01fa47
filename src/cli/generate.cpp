// diffgemma generate: block-diffusion generation (src/diffusion) on the CPU or CUDA backend; text or ids in,
// text/JSON out. --prompt is wrapped in the chat template as one user turn unless --raw.
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "cli/backend_select.h"
#include "cli/command.h"
#include "diffusion/generate.h"
#include "model/weights.h"
#include "server/text_stream.h"
#include "text/chat_template.h"
#include "text/output_parser.h"
#include "text/tokenizer.h"
#include "util/error.h"

namespace dg::cli {
namespace {

struct GenerateArgs {
  std::string model_dir, prompt, prompt_ids, sampler = "seed", stop_ids, system;
  uint64_t seed = 0;
  int threads = 0;
  bool raw = false, thinking = false;
  BackendArgs engine;
  bool json = false, hf_exact = false, no_first_step_sc = false, no_pad_gate = false, freeze = false, trace = false;
  // Knobs that override generation_config.json / the seed defaults only when given.
  int max_new_tokens = 0, max_steps = 0, stability_threshold = 0, plateau_steps = 0, entropy_stop_min_steps = 0,
      empty_reply_retries = 0;
  double entropy_bound = 0, t_min = 0, t_max = 0, confidence_threshold = 0, plateau_entropy = 0, entropy_stop = 0,
         conf_trim = 0;
  std::vector<std::pair<CLI::Option*, std::function<void(diffusion::GenerationOptions&)>>> overrides;
};

diffusion::GenerationOptions build_options(const LoadedModel& model, const GenerateArgs& a) {
  auto o = diffusion::GenerationOptions::from_config(model.generation);
  if (a.hf_exact) o.disable_extras();  // first, so explicit knobs below can turn single extras back on
  o.seed = a.seed;
  o.denoiser = diffusion::parse_denoiser(a.sampler);
  for (const auto& [opt, apply] : a.overrides)
    if (opt->count() > 0) apply(o);
  if (a.no_first_step_sc) o.first_step_sc = false;
  if (a.no_pad_gate) o.pad_gate = false;
  if (a.freeze) o.freeze = true;
  if (!a.stop_ids.empty()) o.stop_ids = parse_id_list(a.stop_ids == "none" ? "" : a.stop_ids, "--stop-ids");
  o.validate(model.config);
  return o;
}

int run_generate(const GenerateArgs& a) {
  if (a.prompt.empty() == a.prompt_ids.empty()) fail("generate: give exactly one of --prompt TEXT or --prompt-ids");
  auto model = load_model(a.model_dir);
  const auto options = build_options(*model, a);

  // The tokenizer is needed for --prompt; for --prompt-ids it only adds "text" to the output when present.
  std::optional<text::Tokenizer> tok;
  std::string tok_error;
  try {
    tok.emplace(text::Tokenizer::from_model_dir(a.model_dir));
  } catch (const Error& e) {
    tok_error = e.what();
  }
  std::vector<int32_t> prompt;
  if (!a.prompt.empty()) {
    if (!tok) fail("generate: --prompt needs a tokenizer in {} ({}); pass --prompt-ids instead", a.model_dir, tok_error);
    if (a.raw) {
      prompt = tok->encode(a.prompt, /*add_special_tokens=*/true);
    } else {
      nlohmann::json messages = nlohmann::json::array();
      if (!a.system.empty()) messages.push_back({{"role", "system"}, {"content", a.system}});
      messages.push_back({{"role", "user"}, {"content", a.prompt}});
      text::ChatRenderOptions ro;
      ro.enable_thinking = a.thinking;
      prompt = server::encode_chat_segments(*tok, text::render_chat_segments(messages, nullptr, ro));
    }
  } else {
    prompt = parse_id_list(a.prompt_ids, "--prompt-ids");
  }

  auto backend = make_backend_factory(a.engine.backend, *model, a.threads, a.engine.sc_sparse)();
  diffusion::Observers obs;
  if (a.trace)
    obs.on_step = [](const diffusion::StepEvent& e) {
      std::fprintf(stderr, "block %d%s step %2d T=%.4f accepted %4d mean H %.5f%s%s\n", e.block,
                   e.attempt ? " (re-roll)" : "", e.step, double(e.temperature), e.accepted, double(e.mean_entropy),
                   e.stop == diffusion::StopReason::None ? "" : " stop: ",
                   e.stop == diffusion::StopReason::None ? "" : diffusion::stop_reason_name(e.stop));
    };
  auto r = diffusion::generate(*backend, prompt, options, obs);

  std::optional<std::string> text;
  if (tok) text = tok->decode(r.ids);
  if (a.json) {
    nlohmann::json blocks = nlohmann::json::array();
    for (const auto& b : r.blocks)
      blocks.push_back({{"steps", b.steps},
                        {"stop_reason", diffusion::stop_reason_name(b.stop_reason)},
                        {"canvas_length", b.canvas_length},
                        {"tokens", b.tokens_committed},
                        {"discarded", b.discarded},
                        {"trimmed", b.trimmed}});
    nlohmann::json out = {{"ids", r.ids},
                          {"text", text ? nlohmann::json(*text) : nlohmann::json(nullptr)},
                          {"stop_token", r.stop_token >= 0 ? nlohmann::json(r.stop_token) : nlohmann::json(nullptr)},
                          {"finish_reason", diffusion::finish_reason_name(r.finish)},
                          {"blocks", blocks},
                          {"forwards", r.forwards},
                          {"tokens_per_forward", r.tokens_per_forward()},
                          {"backend", backend->name()},
                          {"prompt_tokens", prompt.size()}};
    if (text && !a.raw) {
      text::ParsedOutput parsed = text::parse_output(*text);
      out["content"] = parsed.content;
      out["reasoning"] = parsed.reasoning;
      nlohmann::json calls = nlohmann::json::array();
      for (const auto& c : parsed.tool_calls) calls.push_back({{"name", c.name}, {"arguments", nlohmann::json::parse(c.arguments.dump())}});
      out["tool_calls"] = calls;
    }
    std::printf("%s\n", out.dump().c_str());
    return 0;
  }
  if (text) {
    std::printf("%s\n", text->c_str());
  } else {
    for (size_t i = 0; i < r.ids.size(); ++i) std::printf(i ? ",%d" : "%d", r.ids[i]);
    std::printf("\n");
  }
  std::fprintf(stderr, "%zu tokens, finish %s, %lld forwards, %.2f tokens/forward, steps per block:", r.ids.size(),
               diffusion::finish_reason_name(r.finish), (long long)r.forwards, r.tokens_per_forward());
  for (int s : r.steps_per_block()) std::fprintf(stderr, " %d", s);
  std::fprintf(stderr, "\n");
  return 0;
}

template <class T>
void knob(CLI::App& sub, GenerateArgs& a, const std::string& name, T& slot, const std::string& help,
          T diffusion::GenerationOptions::*field) {
  CLI::Option* opt = sub.add_option(name, slot, help);
  a.overrides.emplace_back(opt, [&slot, field](diffusion::GenerationOptions& o) { o.*field = slot; });
}

CommandRegistrar reg(
    "generate", "Generate with block diffusion (entropy-bound sampler)",
    [](CLI::App& sub) -> Action {
      auto a = std::make_shared<GenerateArgs>();
      using O = diffusion::GenerationOptions;
      sub.add_option("-m,--model", a->model_dir, "Hugging Face snapshot directory")->required();
      sub.add_option("--prompt", a->prompt, "Prompt text, sent as one user turn through the chat template");
      sub.add_flag("--raw", a->raw, "Tokenize --prompt as is (with <bos>), without the chat template");
      sub.add_option("--system", a->system, "System message for the chat template");
      sub.add_flag("--thinking", a->thinking, "Render the chat template with enable_thinking");
      add_backend_options(sub, a->engine);
      sub.add_option("--prompt-ids", a->prompt_ids, "Comma-separated prompt token ids, e.g. 2,105,2364");
      sub.add_option("--seed", a->seed, "Seed of the canvas/renoise stream (same seed, same output)");
      sub.add_option("--sampler", a->sampler, "seed: argmax denoiser (default); hf: categorical draws as HF");
      sub.add_option("--threads", a->threads, "CPU threads (0: all cores); output does not depend on it");
      sub.add_flag("--json", a->json, "Print {ids, text, blocks, tokens_per_forward, ...} as JSON");
      sub.add_flag("--trace", a->trace, "Print every denoising step to stderr");
      sub.add_flag("--hf-exact", a->hf_exact,
                   "HF semantics: no first-step SC seed, plateau/pad-gate/entropy-only stops, re-roll or trim");
      knob(sub, *a, "--max-new-tokens", a->max_new_tokens, "Exact output budget", &O::max_new_tokens);
      knob(sub, *a, "--max-steps", a->max_steps, "Denoising steps per canvas (max_denoising_steps)", &O::max_steps);
      knob(sub, *a, "--entropy-bound", a->entropy_bound, "Accept-rule bound in nats", &O::entropy_bound);
      knob(sub, *a, "--t-min", a->t_min, "Temperature at the last step", &O::t_min);
      knob(sub, *a, "--t-max", a->t_max, "Temperature at the first step", &O::t_max);
      knob(sub, *a, "--stability-threshold", a->stability_threshold, "Confident stop: identical argmax steps",
           &O::stability_threshold);
      knob(sub, *a, "--confidence-threshold", a->confidence_threshold, "Confident stop: mean entropy below",
           &O::confidence_threshold);
      knob(sub, *a, "--plateau-steps", a->plateau_steps, "Plateau stop: identical accept masks (0: off)",
           &O::plateau_steps);
      knob(sub, *a, "--plateau-entropy", a->plateau_entropy, "Plateau stop: mean entropy below", &O::plateau_entropy);
      knob(sub, *a, "--entropy-stop", a->entropy_stop, "Entropy-only stop: mean entropy below (0: off)",
           &O::entropy_stop);
      knob(sub, *a, "--entropy-stop-min-steps", a->entropy_stop_min_steps, "Entropy-only stop: earliest step",
           &O::entropy_stop_min_steps);
      knob(sub, *a, "--empty-reply-retries", a->empty_reply_retries, "Re-rolls of a degenerate first block",
           &O::empty_reply_retries);
      knob(sub, *a, "--conf-trim", a->conf_trim, "Commit-time trim threshold on p_max (0: off)", &O::conf_trim);
      sub.add_option("--stop-ids", a->stop_ids, "Comma-separated stop ids replacing eos_token_id ('none': no stops)");
      sub.add_flag("--no-first-step-sc", a->no_first_step_sc, "Step 1 without self-conditioning (HF)");
      sub.add_flag("--no-pad-gate", a->no_pad_gate, "Allow early stops on an all-pad argmax");
      sub.add_flag("--freeze", a->freeze, "Legacy A/B: accepted positions keep their token for the block");
      return [a] { return run_generate(*a); };
    });

}  // namespace
}  // namespace dg::cli
