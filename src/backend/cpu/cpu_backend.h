#pragma once
#include <memory>

#include "backend/backend.h"
#include "model/weights.h"

namespace dg {

// The f32 CPU reference backend (the oracle of the CUDA backend). `model` must outlive the backend.
// threads <= 0: DIFFGEMMA_THREADS or the hardware concurrency. Results are bit-identical for any thread count.
std::unique_ptr<Backend> make_cpu_backend(const LoadedModel& model, int threads = 0);

}  // namespace dg
