#include "diffusion/generate.h"

#include <algorithm>

#include "util/error.h"

namespace dg::diffusion {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::Stop: return "stop";
    case FinishReason::Length: return "length";
    case FinishReason::Cancelled: return "cancelled";
    case FinishReason::BlockLimit: return "block_limit";
  }
  return "?";
}

double GenerationResult::tokens_per_forward() const {
  if (forwards == 0) return 0;
  return double(ids.size() + (stop_token >= 0 ? 1 : 0)) / double(forwards);
}

std::vector<int> GenerationResult::steps_per_block() const {
  std::vector<int> v;
  for (const auto& b : blocks)
    if (!b.discarded) v.push_back(b.steps);
  return v;
}

namespace {

struct BlockOutcome {
  std::vector<int32_t> tokens;  // committed canvas: the last executed step's argmax
  std::vector<RowStats> rows;   // that step's row statistics (for the confidence trim)
  int steps = 0;
  StopReason reason = StopReason::None;
};

// Denoises one canvas of length L. Stream order per block (what the fixture script replays): L canvas ids, then per
// step [categorical mode: V Gumbel uniforms per accepted row, ascending position] + L renoise ids, the renoise ids
// drawn for every position (HF draws a whole random canvas and keeps it only where not accepted), the last step
// included.
BlockOutcome run_block(Backend& backend, int L, Rng& rng, const GenerationOptions& o, int block, int attempt,
                       const Observers& obs, const CancelToken* cancel) {
  const int V = backend.config().vocab_size;
  const int N = o.max_steps;
  BlockOutcome out;
  std::vector<int32_t> canvas(L), next(L), argmax(L), frozen_tok(L, 0);
  std::vector<uint8_t> mask(L), frozen(L, 0);
  for (int i = 0; i < L; ++i) canvas[i] = rng.uniform_token(V);

  StopTracker tracker(o);
  DenoiseRequest req;
  DenoiseResult res;
  for (int k = 1; k <= N; ++k) {
    if (cancel && cancel->cancelled()) {
      out.reason = StopReason::Cancelled;
      return out;
    }
    const int cur = N - k + 1;
    const float T = schedule_temperature(cur, N, o.t_min, o.t_max);
    req.canvas = canvas;
    req.temperature = T;
    req.self_condition = k > 1 ? SelfCondition::PreviousStep
                               : (o.first_step_sc ? SelfCondition::CanvasEmbedding : SelfCondition::None);
    req.want_logits = o.denoiser == Denoiser::Categorical;
    req.more_steps = k < N;  // an early stop (StopTracker) after this step makes the hint wrong: time, not results
    backend.denoise(req, res);
    DG_CHECK(int(res.rows.size()) == L, "backend {} returned {} rows for a canvas of {}", backend.name(),
             res.rows.size(), L);
    if (req.want_logits)
      DG_CHECK(res.logits.size() == size_t(L) * size_t(V), "backend {} returned {} logits, expected {}x{}",
               backend.name(), res.logits.size(), L, V);
    for (int i = 0; i < L; ++i) {
      argmax[i] = res.rows[i].argmax;
      DG_CHECK(argmax[i] >= 0 && argmax[i] < V, "row {} argmax {} outside [0, {})", i, argmax[i], V);
    }

    entropy_bound_accept(res.rows, o.entropy_bound, mask);
    if (o.freeze)
      for (int i = 0; i < L; ++i) mask[i] |= frozen[i];
    int accepted = 0;
    for (int i = 0; i < L; ++i) {
      if (!mask[i]) continue;
      ++accepted;
      int32_t tok;
      if (o.freeze && frozen[i])
        tok = frozen_tok[i];
      else if (o.denoiser == Denoiser::Categorical)
        tok = gumbel_max_sample(res.logits.data() + size_t(i) * size_t(V), V, T, rng);
      else
        tok = argmax[i];
      if (o.freeze && !frozen[i]) frozen[i] = 1, frozen_tok[i] = tok;
      next[i] = tok;
    }
    for (int i = 0; i < L; ++i) {
      const int32_t noise = rng.uniform_token(V);
      if (!mask[i]) next[i] = noise;
    }

    const float mean_h = mean_entropy(res.rows);
    StopReason reason = tracker.observe(k, argmax, mask, mean_h);
    if (reason == StopReason::None && k == N) reason = StopReason::MaxSteps;
    out.steps = k;
    if (obs.on_step)
      obs.on_step(StepEvent{block, attempt, k, cur, T, accepted, mean_h, argmax, mask, reason});
    canvas.swap(next);
    if (reason != StopReason::None) {
      out.reason = reason;
      break;
    }
  }
  out.tokens = argmax;
  if (o.freeze)  // legacy A/B semantics: a frozen position commits the token it froze with
    for (int i = 0; i < L; ++i)
      if (frozen[i]) out.tokens[i] = frozen_tok[i];
  out.rows = std::move(res.rows);
  return out;
}

bool contains(const std::vector<int32_t>& v, int32_t x) { return std::find(v.begin(), v.end(), x) != v.end(); }

}  // namespace

GenerationResult generate(Backend& backend, std::span<const int32_t> prompt, const GenerationOptions& o,
                          const Observers& obs, const CancelToken* cancel) {
  const ModelConfig& mc = backend.config();
  o.validate(mc);
  if (prompt.empty() && backend.kv_len() == 0)
    fail("generate: the prompt is empty and the backend holds no context; pass at least one token (e.g. <bos> = {})",
         mc.bos_token_id);
  for (size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] < 0 || prompt[i] >= mc.vocab_size)
      fail("generate: prompt token {} at index {} is outside the vocabulary [0, {})", prompt[i], i, mc.vocab_size);
  if (!prompt.empty()) backend.prefill(prompt);

  GenerationResult result;
  Rng rng(o.seed);
  const int L_full = mc.canvas_length;
  const int n_canvases = (o.max_new_tokens + L_full - 1) / L_full;
  // A trimmed block commits fewer than L tokens; the seed doubles the block budget so trims cannot starve the turn.
  const int max_blocks = o.conf_trim > 0 ? 2 * n_canvases : n_canvases;
  int remaining = o.max_new_tokens;

  for (int block = 0;; ++block) {
    if (block >= max_blocks) {
      result.finish = FinishReason::BlockLimit;
      break;
    }
    BlockOutcome out;
    BlockStats st;
    for (int attempt = 0;; ++attempt) {
      // Re-rolls shrink the canvas 256 -> 128 -> 64 -> 64: a shorter canvas escapes the empty-reply attractor.
      const int L = attempt == 0 ? L_full : std::max(L_full >> attempt, std::max(1, L_full / 4));
      out = run_block(backend, L, rng, o, block, attempt, obs, cancel);
      result.forwards += out.steps;
      st = BlockStats{block, attempt, L, out.steps, out.reason, 0, false, false};
      if (out.reason == StopReason::Cancelled) {
        result.blocks.push_back(st);
        result.finish = FinishReason::Cancelled;
        return result;
      }
      const bool degenerate = block == 0 && attempt < o.empty_reply_retries &&
                              (contains(o.stop_ids, out.tokens[0]) || out.tokens[0] == o.pad_id);
      if (!degenerate) break;
      st.discarded = true;
      result.blocks.push_back(st);
      if (obs.on_block) obs.on_block(BlockEvent{st, out.tokens});
    }

    const int L = int(out.tokens.size());
    const int avail = std::min(L, remaining);  // exact max_new_tokens: never look past the budget
    int stop_at = -1;
    for (int i = 0; i < avail && stop_at < 0; ++i)
      if (contains(o.stop_ids, out.tokens[i])) stop_at = i;

    // Dup-tier trim (seed §9 #11): an unresolved row that copies a neighbour is where a canvas ran out of
    // resolution; cutting there lets the tail re-denoise against committed context. Row 0 is exempt so every
    // block commits at least one token.
    int cut = -1;
    if (o.conf_trim > 0 && block + 1 < max_blocks) {
      const int limit = stop_at >= 0 ? stop_at : avail;
      for (int i = 1; i < limit && cut < 0; ++i) {
        const bool dup = out.tokens[i] == out.tokens[i - 1] || (i + 1 < L && out.tokens[i] == out.tokens[i + 1]);
        if (dup && row_pmax(out.rows[i]) < float(o.conf_trim)) cut = i;
      }
    }

    int n;
    if (cut >= 0) {
      n = cut;
      st.trimmed = true;
    } else if (stop_at >= 0) {
      n = stop_at;
    } else {
      n = avail;
    }
    result.ids.insert(result.ids.end(), out.tokens.begin(), out.tokens.begin() + n);
    st.tokens_committed = n + (cut < 0 && stop_at >= 0 ? 1 : 0);
    result.blocks.push_back(st);
    if (obs.on_block) obs.on_block(BlockEvent{st, out.tokens});

    if (cut < 0 && stop_at >= 0) {
      result.stop_token = out.tokens[stop_at];
      result.finish = FinishReason::Stop;
      break;
    }
    remaining -= n;
    if (remaining == 0) {
      result.finish = FinishReason::Length;
      break;
    }
    if (cancel && cancel->cancelled()) {
      result.finish = FinishReason::Cancelled;
      break;
    }
    backend.prefill(std::span<const int32_t>(out.tokens.data(), size_t(n)));
  }
  return result;
}

}  // namespace dg::diffusion
