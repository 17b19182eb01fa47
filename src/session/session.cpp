#include "session/session.h"

#include <algorithm>

#include "util/error.h"

namespace dg::session {

size_t common_prefix(std::span<const int32_t> a, std::span<const int32_t> b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

SessionPool::SessionPool(BackendFactory factory, int slots, Logger log)
    : factory_(std::move(factory)), log_(std::move(log)) {
  if (slots < 1) fail("session slots must be >= 1 (got {})", slots);
  slots_.resize(size_t(slots));
}

void SessionPool::log(const std::string& line) const {
  if (log_) log_(line);
}

void SessionPool::reset() {
  for (auto& s : slots_) {
    if (s.backend) s.backend->truncate(0);
    s.tokens.clear();
  }
}

SessionPool::Slot& SessionPool::prepare(std::span<const int32_t> prompt, TurnStats& stats) {
  if (prompt.empty()) fail("cannot generate from an empty prompt");
  int best = 0, lru = 0;
  size_t best_lcp = 0;
  for (int i = 0; i < slots(); ++i) {
    const Slot& s = slots_[size_t(i)];
    const size_t lcp = common_prefix(s.tokens, prompt);
    const bool extends = lcp == s.tokens.size() && lcp > 0;
    const Slot& b = slots_[size_t(best)];
    const bool best_extends = best_lcp == b.tokens.size() && best_lcp > 0;
    if (lcp > best_lcp || (lcp == best_lcp && extends && !best_extends)) {
      best = i;
      best_lcp = lcp;
    }
    // Empty slots first, then the stalest.
    const Slot& l = slots_[size_t(lru)];
    if ((s.tokens.empty() && !l.tokens.empty()) || (s.tokens.empty() == l.tokens.empty() && s.last_used < l.last_used))
      lru = i;
  }
  const Slot& cand = slots_[size_t(best)];
  const bool extends = best_lcp > 0 && best_lcp == cand.tokens.size();
  const bool salvage = best_lcp >= kSalvageMinTokens || 2 * best_lcp >= prompt.size();
  if (!extends && !salvage && best != lru) {
    best = lru;
    best_lcp = common_prefix(slots_[size_t(lru)].tokens, prompt);
  }
  Slot& slot = slots_[size_t(best)];
  slot.last_used = ++clock_;
  if (!slot.backend) slot.backend = factory_();
  DG_CHECK(slot.backend->kv_len() == int64_t(slot.tokens.size()), "slot {} holds {} KV rows but logs {} tokens",
           best, slot.backend->kv_len(), slot.tokens.size());

  // generate() needs at least one token to prefill; an identical repeat re-encodes the last prompt token.
  int64_t keep = int64_t(std::min(best_lcp, prompt.size() - 1));
  const int64_t cached = slot.backend->kv_len();
  if (cached > keep) {
    if (slot.backend->can_truncate(keep)) {
      slot.backend->truncate(keep);
    } else {
      log(format("session: slot {} cannot rewind {} -> {} tokens; re-prefilling {} prompt tokens", best, cached,
                 keep, prompt.size()));
      slot.backend = factory_();
      stats.reprefill = true;
      keep = 0;
    }
    stats.truncated_tokens = cached - keep;
  }
  slot.tokens.resize(size_t(keep));
  stats.slot = best;
  stats.reused_tokens = keep;
  stats.prefilled_tokens = int64_t(prompt.size()) - keep;
  return slot;
}

void SessionPool::finish_turn(Slot& slot, std::span<const int32_t> prompt, const diffusion::GenerationResult& result,
                              bool commit_tail) {
  Backend& be = *slot.backend;
  slot.tokens.assign(prompt.begin(), prompt.end());
  // Every committed block but the last is in the cache, and those blocks are exactly the leading output ids.
  const int64_t committed = be.kv_len() - int64_t(prompt.size());
  std::vector<int32_t> output(result.ids);
  if (result.stop_token >= 0) output.push_back(result.stop_token);
  if (committed < 0 || committed > int64_t(output.size())) {
    // Not the layout generate() documents: keep only what is certain (the prompt) rather than guess.
    log(format("session: cache holds {} tokens after a turn of {} prompt + {} output; rewinding to the prompt",
               be.kv_len(), prompt.size(), output.size()));
    be.truncate(int64_t(prompt.size()));
    if (!commit_tail) return;
    be.prefill(output);
    slot.tokens.insert(slot.tokens.end(), output.begin(), output.end());
    return;
  }
  slot.tokens.insert(slot.tokens.end(), output.begin(), output.begin() + committed);
  if (!commit_tail || committed == int64_t(output.size())) return;
  std::span<const int32_t> tail(output.data() + committed, output.size() - size_t(committed));
  be.prefill(tail);
  slot.tokens.insert(slot.tokens.end(), tail.begin(), tail.end());
}

Turn SessionPool::generate(std::span<const int32_t> prompt, const diffusion::GenerationOptions& options,
                           const diffusion::Observers& observers, const diffusion::CancelToken* cancel) {
  Turn turn;
  Slot& slot = prepare(prompt, turn.stats);
  const size_t keep = slot.tokens.size();
  try {
    turn.result = diffusion::generate(*slot.backend, prompt.subspan(keep), options, observers, cancel);
  } catch (...) {
    // The cache may hold a partial prefill; only the reused prefix is known to be valid.
    if (slot.backend->kv_len() > int64_t(keep)) slot.backend->truncate(int64_t(keep));
    throw;
  }
  // A cancelled turn's output never enters the conversation: the client never saw it end.
  finish_turn(slot, prompt, turn.result, turn.result.finish != diffusion::FinishReason::Cancelled);
  return turn;
}

Turn SessionPool::replay(std::span<const int32_t> prompt, std::span<const int32_t> output, int32_t stop_token) {
  Turn turn;
  Slot& slot = prepare(prompt, turn.stats);
  slot.backend->prefill(prompt.subspan(slot.tokens.size()));
  turn.result.ids.assign(output.begin(), output.end());
  turn.result.stop_token = stop_token;
  turn.result.finish = stop_token >= 0 ? diffusion::FinishReason::Stop : diffusion::FinishReason::Length;
  finish_turn(slot, prompt, turn.result, true);
  return turn;
}

}  // namespace dg::session
