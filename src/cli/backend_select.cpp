#include "cli/backend_select.h"

#include <CLI/CLI.hpp>

#include <cstdio>
#include <memory>
#include <mutex>

#include "backend/cpu/cpu_backend.h"
#include "util/error.h"
#ifdef DIFFGEMMA_WITH_CUDA
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_device.h"
#endif

namespace dg::cli {

std::string resolve_backend(const std::string& requested) {
  if (requested == "cpu") return "cpu";
  if (requested != "cuda" && requested != "auto")
    fail("--backend must be cpu, cuda or auto (got '{}')", requested);
#ifdef DIFFGEMMA_WITH_CUDA
  cuda::DeviceInfo dev = cuda::query_device(0);
  if (dev.available) return "cuda";
  if (requested == "cuda") fail("--backend cuda: {}; use --backend cpu", dev.reason);
  std::fprintf(stderr, "note: using the CPU backend (%s)\n", dev.reason.c_str());
#else
  if (requested == "cuda") fail("--backend cuda: this binary was built without CUDA (configure with nvcc present)");
#endif
  return "cpu";
}

void add_backend_options(CLI::App& sub, BackendArgs& args) {
  sub.add_option("--backend", args.backend, "cpu, cuda or auto (cuda when a GPU is present)");
  sub.add_flag("--sc-sparse", args.sc_sparse,
               "CUDA: approximate self-conditioning over each row's survivor tokens (p >= e^-10 p_max), exact "
               "fallback per step when a row has too many or drops > 1e-3 mass");
}

BackendFactory make_backend_factory(const std::string& requested, const LoadedModel& model, int cpu_threads,
                                    bool sc_sparse, int64_t max_context) {
  const std::string name = resolve_backend(requested);
#ifdef DIFFGEMMA_WITH_CUDA
  if (name == "cuda") {
    CudaOptions o;
    o.sc_sparse = sc_sparse;
    if (max_context > 0) o.max_context = max_context + 2 * int64_t(model.config.canvas_length);
    // Every backend of this factory (a server's session slots, a re-prefilled slot) shares one upload of the
    // weights, made by the first call; the factory and the backends keep it alive.
    struct Shared {
      std::mutex mu;
      std::shared_ptr<CudaWeights> weights;
    };
    auto shared = std::make_shared<Shared>();
    return [&model, o, shared] {
      std::lock_guard<std::mutex> lock(shared->mu);
      if (!shared->weights) shared->weights = upload_cuda_weights(model, o);
      return make_cuda_backend(shared->weights, o);
    };
  }
#endif
  if (sc_sparse) fail("--sc-sparse needs the CUDA backend (the {} backend was selected)", name);
  return [&model, cpu_threads] { return make_cpu_backend(model, cpu_threads); };
}

}  // namespace dg::cli
