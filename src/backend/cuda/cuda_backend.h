#pragma once
// The CUDA backend: bf16 weights resident on one GPU, bf16 KV cache in fixed per-layer regions, bf16 activations
// with an f32 residual stream, f32 router / softmax / logits / sampler statistics.
#include <cstdint>
#include <memory>

#include "backend/backend.h"
#include "model/weights.h"

namespace dg {

struct CudaOptions {
  int device = 0;
  // Positions the full-attention layers can hold (prompt + committed canvases); prefill beyond it fails clearly.
  int64_t max_context = 32768 + 1024;
  // Sliding layers keep a ring of (sliding_window - 1) + sliding_rewind slots, so a truncate of up to
  // sliding_rewind tokens needs no recomputation.
  int64_t sliding_rewind = 512;
  int prefill_chunk = 4096;  // prefill runs in chunks of at most this many tokens (bounds the scratch arenas)
  bool progress = true;      // weight upload progress on stderr
};

// `model` must outlive the backend; its weights are uploaded once (as bf16) and not read again.
std::unique_ptr<Backend> make_cuda_backend(const LoadedModel& model, const CudaOptions& options = {});
// Synthetic weights generated on the GPU from `seed` (benchmarks at full size without a checkpoint).
std::unique_ptr<Backend> make_cuda_backend_synthetic(const ModelConfig& config, uint64_t seed,
                                                     const CudaOptions& options = {});

}  // namespace dg
