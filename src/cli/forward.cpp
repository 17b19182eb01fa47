// diffgemma forward: one prefill + one denoise pass, printing the top-5 ids/logits per canvas row (debugging).
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <numeric>

#include "cli/backend_select.h"
#include "cli/command.h"
#include "model/weights.h"
#include "util/error.h"

namespace dg::cli {
namespace {

struct ForwardArgs {
  std::string model_dir, prompt_ids, canvas_ids, backend = "cpu";
  float temperature = 1.0f;
  int threads = 0;
  bool json = false;
};

int run_forward(const ForwardArgs& a) {
  auto prompt = parse_id_list(a.prompt_ids, "--prompt-ids");
  auto canvas = parse_id_list(a.canvas_ids, "--canvas-ids");
  if (canvas.empty()) fail("--canvas-ids: give at least one canvas token id");
  auto model = load_model(a.model_dir);
  auto backend = make_backend_factory(a.backend, *model, a.threads)();
  backend->prefill(prompt);
  DenoiseRequest req;
  req.canvas = canvas;
  req.temperature = a.temperature;
  req.want_logits = true;
  DenoiseResult res;
  backend->denoise(req, res);
  const int V = model->config.vocab_size, k = std::min(5, V);
  nlohmann::json rows = nlohmann::json::array();
  for (size_t r = 0; r < canvas.size(); ++r) {
    const float* row = res.logits.data() + r * size_t(V);
    std::vector<int> idx(static_cast<size_t>(V));
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                      [&](int x, int y) { return row[x] > row[y] || (row[x] == row[y] && x < y); });
    nlohmann::json top = nlohmann::json::array();
    for (int i = 0; i < k; ++i) top.push_back({{"id", idx[size_t(i)]}, {"logit", row[idx[size_t(i)]]}});
    rows.push_back({{"position", int64_t(prompt.size() + r)}, {"input_id", canvas[r]}, {"top", top},
                    {"entropy", res.rows[r].entropy}});
  }
  if (a.json) {
    std::printf("%s\n", nlohmann::json{{"kv_len", backend->kv_len()}, {"backend", backend->name()}, {"temperature", a.temperature}, {"rows", rows}}
                            .dump()
                            .c_str());
    return 0;
  }
  for (auto& r : rows) {
    std::printf("pos %5lld in %7d  H=%.4f |", (long long)r["position"].get<int64_t>(), r["input_id"].get<int>(),
                r["entropy"].get<double>());
    for (auto& t : r["top"]) std::printf(" %7d:%9.4f", t["id"].get<int>(), t["logit"].get<double>());
    std::printf("\n");
  }
  return 0;
}

CommandRegistrar reg("forward", "Prefill prompt ids, denoise one canvas, print the top-5 logits per row",
                     [](CLI::App& sub) -> Action {
                       auto a = std::make_shared<ForwardArgs>();
                       sub.add_option("-m,--model", a->model_dir, "Hugging Face snapshot directory")->required();
                       sub.add_option("--prompt-ids", a->prompt_ids, "Comma-separated prompt token ids")->required();
                       sub.add_option("--canvas-ids", a->canvas_ids, "Comma-separated canvas token ids")->required();
                       sub.add_option("--temperature", a->temperature, "Temperature for the reported entropy");
                       sub.add_option("--threads", a->threads, "CPU threads (0: all cores)");
                       sub.add_option("--backend", a->backend, "cpu (default), cuda or auto");
                       sub.add_flag("--json", a->json, "Print JSON");
                       return [a] { return run_forward(*a); };
                     });

}  // namespace
}  // namespace dg::cli
