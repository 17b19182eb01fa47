#pragma once
// Conversations with KV reuse (seed "KV-reuse-first serving"). A pool of slots, each a Backend with its own KV
// cache and the exact token log that cache holds. A turn is routed to the slot whose log shares the longest common
// prefix (LCP) with the new prompt; the divergent tail is truncated and only the new tokens are prefilled. When the
// backend cannot truncate that far back, the slot is re-prefilled from scratch and the decision is logged.
//
// After a finished turn the slot's log is prompt + output + stop token, all of it in the KV cache: generate() leaves
// its last block uncommitted, so the pool prefills that tail itself, which makes the next turn (whose rendered
// history starts with exactly these tokens when the output re-tokenizes the same) a pure extension.
//
// Routing: a slot the prompt extends (its whole log is a prefix of the prompt) always wins. A slot that would have to
// be cut back is salvaged only when the shared prefix is substantial (>= kSalvageMinTokens, or at least half of the
// prompt); otherwise the turn takes an empty or the least recently used slot, so one conversation's new thread does
// not evict another conversation that merely shares the chat template's opening tokens.
//
// Not thread-safe: one engine thread owns the pool (DESIGN.md "Threading").
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "diffusion/generate.h"

namespace dg::session {

struct TurnStats {
  int slot = -1;
  int64_t reused_tokens = 0;     // prompt tokens served from the cache
  int64_t prefilled_tokens = 0;  // prompt tokens run through the encoder for this turn
  int64_t truncated_tokens = 0;  // cached tokens dropped because the prompt diverged from them
  bool reprefill = false;        // the cache could not be cut back to the LCP and was rebuilt
};

struct Turn {
  diffusion::GenerationResult result;
  TurnStats stats;
};

class SessionPool {
 public:
  static constexpr size_t kSalvageMinTokens = 256;

  using BackendFactory = std::function<std::unique_ptr<Backend>()>;
  using Logger = std::function<void(const std::string&)>;

  // Backends are created lazily, on a slot's first use. slots >= 1.
  SessionPool(BackendFactory factory, int slots, Logger log = {});

  // Routes `prompt`, prefills what the chosen slot lacks and generates. The prompt must not be empty.
  Turn generate(std::span<const int32_t> prompt, const diffusion::GenerationOptions& options,
                const diffusion::Observers& observers = {}, const diffusion::CancelToken* cancel = nullptr);

  // Test hook: a turn whose output is `output` (+ `stop_token` if >= 0) instead of a generation. The cache ends in
  // exactly the state a generated turn with that output leaves, so continuation and reuse can be tested with
  // chosen model output (tool calls) on random-weight fixtures.
  Turn replay(std::span<const int32_t> prompt, std::span<const int32_t> output, int32_t stop_token);

  // Drops every conversation (the backends stay allocated).
  void reset();

  int slots() const { return int(slots_.size()); }
  // The token log slot `i` holds in its KV cache (empty before its first use).
  const std::vector<int32_t>& tokens(int slot) const { return slots_.at(size_t(slot)).tokens; }

 private:
  struct Slot {
    std::unique_ptr<Backend> backend;
    std::vector<int32_t> tokens;
    uint64_t last_used = 0;
  };
  // Picks a slot and brings its cache to a prefix of `prompt` (leaving at least one prompt token to prefill).
  Slot& prepare(std::span<const int32_t> prompt, TurnStats& stats);
  // After generate(): reconciles the slot's log with its cache and commits the uncommitted tail of the output.
  void finish_turn(Slot& slot, std::span<const int32_t> prompt, const diffusion::GenerationResult& result,
                   bool commit_tail);
  void log(const std::string& line) const;

  BackendFactory factory_;
  Logger log_;
  std::vector<Slot> slots_;
  uint64_t clock_ = 0;
};

// Length of the longest common prefix.
size_t common_prefix(std::span<const int32_t> a, std::span<const int32_t> b);

}  // namespace dg::session
