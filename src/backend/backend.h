#pragma once
// The Backend interface: everything the diffusion loop and sessions need from a device, nothing about how it is
// computed. Implementations: backend/cpu (f32, the oracle) and backend/cuda (bf16 kernels).
//
// Positions are implicit: prefill appends at [kv_len(), kv_len() + n); denoise places the canvas at
// [kv_len(), kv_len() + L) without writing the cache (the canvas occupies the positions it will have once committed).
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "model/config.h"

namespace dg {

// Statistics of one canvas row at temperature T, computed over z = logits / T (logits already softcapped).
struct RowStats {
  int32_t argmax = 0;      // lowest index among equal maxima
  float max_z = 0;         // max_i z_i
  float logsumexp = 0;     // log sum_i exp(z_i)
  float entropy = 0;       // -sum_i p_i log p_i in nats, p = softmax(z)
};

enum class SelfCondition : uint8_t {
  None,             // no SC signal (HF's first step): x = RMSNorm_noscale(embed)
  PreviousStep,     // softmax of the tempered logits kept from the previous denoise call on this backend
  External,         // softmax of DenoiseRequest::sc_logits (already tempered, [L, V])
  CanvasEmbedding,  // seed's first-step SC seed: the SC MLP reads the canvas's own scaled embedding
};

struct DenoiseRequest {
  std::span<const int32_t> canvas;
  float temperature = 1.0f;  // this step's T: row stats use logits/T and logits/T is kept for PreviousStep
  SelfCondition self_condition = SelfCondition::None;
  std::span<const float> sc_logits;  // for External only
  bool want_logits = false;          // also return the raw softcapped logits [L, V]
  // A hint: the caller expects to denoise this canvas again, with SelfCondition::PreviousStep, right after this step
  // (the block loop sets it for every step but a block's last). A backend may start that step's work that depends
  // only on this step's outputs before returning. A wrong hint costs time, never results.
  bool more_steps = false;
};

struct DenoiseResult {
  std::vector<RowStats> rows;  // one per canvas position
  std::vector<float> logits;   // [L, V] softcapped (not tempered) when want_logits; else empty
};

// The cached K/V of one layer as f32, for parity tests and debugging. Positions [first_pos, first_pos + n).
struct KvSnapshot {
  int64_t first_pos = 0;
  int64_t n = 0;
  int n_kv_heads = 0, head_dim = 0;
  std::vector<float> k, v;  // [n, n_kv_heads, head_dim]
};

// Debug capture of the f32 residual stream, [T, H] per stage, for cross-backend diffs (tests, tools). Stages of one
// prefill (captured only when it runs as one chunk): 0 = embedding * sqrt(H), l + 1 = after layer l. Stages of one
// denoise: 0 = layer-0 input (after the SC preamble and the no-scale norm), l + 1 = after layer l, num_layers + 1 =
// the final norm's output (the lm_head input).
struct LayerTrace {
  std::vector<std::vector<float>> stages;  // written by the backend (cleared at the start of each call)
  // Per layer of the call: the router logits [T, E] and the selected experts [T, K] (selection order), so a diff can
  // tell a routing flip at a near-tie (a discrete jump bf16 rounding may legitimately cause) from a wrong result.
  std::vector<std::vector<float>> router_logits;
  std::vector<std::vector<int32_t>> experts;
  // Teacher forcing (CPU backend only): when set, each stage s is replaced by (*replay)[s] right after it is recorded
  // (entries of the wrong size are ignored), so the recorded stage s + 1 carries only that one stage's own error
  // against the backend that produced `replay`, not the error accumulated before it.
  const std::vector<std::vector<float>>* replay = nullptr;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual const ModelConfig& config() const = 0;

  // Encoder pass (causal, sliding window W incl. self) over ids; appends their K/V. Used for the prompt and to
  // commit a finished canvas.
  virtual void prefill(std::span<const int32_t> ids) = 0;
  // Decoder pass (bidirectional) over the canvas; the cache is read-only. Sliding layers see the last W-1 cached
  // positions plus the whole canvas; full layers see everything.
  virtual void denoise(const DenoiseRequest& request, DenoiseResult& result) = 0;

  virtual int64_t kv_len() const = 0;
  // Whether the cache can be cut back to n tokens without recomputation (a sliding ring may have dropped them).
  virtual bool can_truncate(int64_t n) const = 0;
  virtual void truncate(int64_t n) = 0;  // throws dg::Error when !can_truncate(n)
  // Position-ordered FNV-1a hash of the live K/V (what attention can still read), as kv_snapshot reports it.
  // Equal within one backend type (the CUDA cache holds bf16, the CPU cache f32).
  virtual uint64_t kv_fingerprint() const;
  virtual KvSnapshot kv_snapshot(int layer) const = 0;
  // Debugging: capture (and on the CPU, replay) residual stages of the following calls; nullptr stops it.
  // Backends without the facility ignore it.
  virtual void set_layer_trace(LayerTrace* trace) { (void)trace; }
};

// Computes RowStats for one row of softcapped logits at temperature T (the CPU definition every backend matches).
RowStats compute_row_stats(const float* logits, int vocab, float temperature);

}  // namespace dg
