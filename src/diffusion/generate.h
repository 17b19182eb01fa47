#pragma once
// Block-autoregressive generation over a Backend (seed §7): denoise a canvas with the entropy-bound sampler, commit
// its final argmax through the encoder pass, repeat until a stop id, max_new_tokens, or cancellation.
#include <atomic>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "diffusion/options.h"
#include "diffusion/sampler.h"

namespace dg::diffusion {

// Set from any thread; the loop checks it before every denoise step.
class CancelToken {
 public:
  void cancel() { flag_.store(true, std::memory_order_relaxed); }
  bool cancelled() const { return flag_.load(std::memory_order_relaxed); }

 private:
  std::atomic<bool> flag_{false};
};

struct StepEvent {
  int block = 0;    // index of the block in this turn
  int attempt = 0;  // > 0 for a degenerate-first-block re-roll
  int step = 0;     // 1-based step within the block
  int cur_step = 0;  // steps remaining, HF's cur_step (max_steps .. 1)
  float temperature = 0;
  int accepted = 0;
  float mean_entropy = 0;
  std::span<const int32_t> argmax;         // this step's full-canvas argmax
  std::span<const uint8_t> accepted_mask;  // this step's accept set
  StopReason stop = StopReason::None;      // set on the block's last step
};

struct BlockStats {
  int block = 0;
  int attempt = 0;
  int canvas_length = 0;
  int steps = 0;
  StopReason stop_reason = StopReason::None;
  int tokens_committed = 0;  // tokens this block added to the output (incl. a stop token)
  bool discarded = false;    // a degenerate first block that was re-rolled
  bool trimmed = false;      // the commit-time confidence trim cut this block short
};

struct BlockEvent {
  BlockStats stats;
  std::span<const int32_t> tokens;  // the block's argmax canvas as committed (before stop/trim cuts)
};

struct Observers {
  std::function<void(const StepEvent&)> on_step;
  std::function<void(const BlockEvent&)> on_block;
};

enum class FinishReason : uint8_t { Stop, Length, Cancelled, BlockLimit };
const char* finish_reason_name(FinishReason r);

struct GenerationResult {
  std::vector<int32_t> ids;  // generated tokens, stop token excluded, at most max_new_tokens (with the stop token)
  int32_t stop_token = -1;   // the stop id that ended the turn, or -1
  FinishReason finish = FinishReason::Length;
  std::vector<BlockStats> blocks;  // every denoised canvas, including discarded re-rolls
  int64_t forwards = 0;            // denoise calls
  // Output tokens (stop token included, as HF counts its EOS) per denoise forward.
  double tokens_per_forward() const;
  std::vector<int> steps_per_block() const;  // of the kept blocks
};

// Prefills `prompt` (appended to whatever the backend already holds), then generates. On return the backend's
// cache holds the prompt and every committed block except the last one (HF never encodes its final canvas); a
// session that continues the conversation must prefill `ids` itself. Throws dg::Error on invalid options.
GenerationResult generate(Backend& backend, std::span<const int32_t> prompt, const GenerationOptions& options,
                          const Observers& observers = {}, const CancelToken* cancel = nullptr);

}  // namespace dg::diffusion
