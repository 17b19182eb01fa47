#pragma once
// --backend cpu|cuda|auto for every command that runs the model. auto = cuda when this build has the CUDA backend
// and a usable GPU is present, else cpu (with a note on stderr saying why).
#include <functional>
#include <memory>
#include <string>

#include "backend/backend.h"

namespace CLI {
class App;
}
#include "model/weights.h"

namespace dg::cli {

using BackendFactory = std::function<std::unique_ptr<Backend>()>;

// What a model-running command's user picks: --backend and --sc-sparse (the commands that run generation).
struct BackendArgs {
  std::string backend = "auto";
  bool sc_sparse = false;
};
void add_backend_options(CLI::App& sub, BackendArgs& args);

// Returns "cpu" or "cuda"; throws dg::Error for an unknown name or an unavailable cuda.
std::string resolve_backend(const std::string& requested);
// `model` must outlive the factory and every backend it makes. sc_sparse: CudaOptions::sc_sparse (`--sc-sparse`,
// approximate survivor SC on the CUDA backend); refused for the CPU backend. max_context > 0: the most positions a
// request can reach (a server's --ctx-size); CUDA KV caches are sized for it plus two canvases instead of the
// default 33K, so more session slots fit. CUDA backends of one factory share one upload of the weights.
BackendFactory make_backend_factory(const std::string& requested, const LoadedModel& model, int cpu_threads,
                                    bool sc_sparse = false, int64_t max_context = 0);

}  // namespace dg::cli
