#pragma once
// --backend cpu|cuda|auto for every command that runs the model. auto = cuda when this build has the CUDA backend
// and a usable GPU is present, else cpu (with a note on stderr saying why).
#include <functional>
#include <memory>
#include <string>

#include "backend/backend.h"
#include "model/weights.h"

namespace dg::cli {

using BackendFactory = std::function<std::unique_ptr<Backend>()>;

// Returns "cpu" or "cuda"; throws dg::Error for an unknown name or an unavailable cuda.
std::string resolve_backend(const std::string& requested);
// `model` must outlive the factory and every backend it makes. sc_sparse: CudaOptions::sc_sparse (`--sc-sparse`,
// approximate survivor SC on the CUDA backend); refused for the CPU backend.
BackendFactory make_backend_factory(const std::string& requested, const LoadedModel& model, int cpu_threads,
                                    bool sc_sparse = false);

}  // namespace dg::cli
