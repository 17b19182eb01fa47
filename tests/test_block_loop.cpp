// The block loop over a scripted backend: the exact RNG/accept/renoise trajectory, SC modes, temperatures, stops,
// stop-id trimming, exact max_new_tokens, block chaining through prefill, re-roll, confidence trim, observers, cancel.
#include <gtest/gtest.h>

#include <cmath>

#include "diffusion/generate.h"
#include "fake_backend.h"
#include "util/error.h"

using namespace dg;
using namespace dg::diffusion;
using dg::testing::FakeBackend;
using dg::testing::make_row;

namespace {

const std::vector<int32_t> kPrompt = {2, 105, 7, 8, 9};

// A per-row rule: (call index, row, request, kv_len) -> RowStats.
using RowRule = std::function<RowStats(int call, int row, const DenoiseRequest& req, int64_t kv)>;

FakeBackend::Script rows_by(RowRule rule) {
  return [rule](const DenoiseRequest& req, int call, int64_t kv, DenoiseResult& res) {
    for (size_t i = 0; i < req.canvas.size(); ++i) res.rows[i] = rule(call, int(i), req, kv);
  };
}

// Argmax tokens that depend on the canvas (so the RNG matters) and never hit a stop or pad id; every row has
// entropy 0.5, so only the lowest-ranked row is accepted and no early stop can fire.
RowStats echo_row(int call, int i, const DenoiseRequest& req, int64_t) {
  return make_row(200 + int32_t((int64_t(req.canvas[i]) * 31 + i + call) % 700), 0.5f);
}

GenerationOptions base_options(int max_new, int steps) {
  GenerationOptions o;
  o.max_new_tokens = max_new;
  o.max_steps = steps;
  return o;
}

}  // namespace

TEST(BlockLoop, MaxNewTokensFiveReturnsExactlyFive) {
  FakeBackend be(1000, 16, rows_by(echo_row));
  auto r = generate(be, kPrompt, base_options(5, 3));
  EXPECT_EQ(r.ids.size(), 5u);
  EXPECT_EQ(r.stop_token, -1);
  EXPECT_EQ(r.finish, FinishReason::Length);
  ASSERT_EQ(r.blocks.size(), 1u);
  EXPECT_EQ(r.blocks[0].canvas_length, 16);  // the canvas stays full size; only the output is cut
  ASSERT_EQ(be.prefills.size(), 1u);         // the prompt; the last canvas is never encoded
  EXPECT_EQ(be.prefills[0], kPrompt);
}

TEST(BlockLoop, ChainsCanvasesThroughPrefillAndCutsTheLastOne) {
  FakeBackend be(1000, 16, rows_by(echo_row));
  auto r = generate(be, kPrompt, base_options(40, 3));
  ASSERT_EQ(r.ids.size(), 40u);
  EXPECT_EQ(r.steps_per_block(), (std::vector<int>{3, 3, 3}));
  ASSERT_EQ(be.prefills.size(), 3u);
  EXPECT_EQ(be.prefills[1], std::vector<int32_t>(r.ids.begin(), r.ids.begin() + 16));
  EXPECT_EQ(be.prefills[2], std::vector<int32_t>(r.ids.begin() + 16, r.ids.begin() + 32));
  ASSERT_EQ(be.calls.size(), 9u);
  for (int c = 0; c < 9; ++c) EXPECT_EQ(be.calls[c].kv_len, int64_t(kPrompt.size()) + 16 * (c / 3)) << c;
  EXPECT_EQ(r.forwards, 9);
  EXPECT_DOUBLE_EQ(r.tokens_per_forward(), 40.0 / 9.0);
}

TEST(BlockLoop, CommitIsTheLastStepsArgmaxNotTheAcceptedCanvas) {
  FakeBackend be(1000, 8, rows_by([](int call, int i, const DenoiseRequest&, int64_t) {
                   return make_row(300 + call * 10 + i, 0.5f);
                 }));
  auto r = generate(be, kPrompt, base_options(8, 4));
  std::vector<int32_t> want;
  for (int i = 0; i < 8; ++i) want.push_back(300 + 30 + i);
  EXPECT_EQ(r.ids, want);
}

TEST(BlockLoop, ReplaysTheHfStepContractExactly) {
  // Rows with distinct entropies so the accept set is a real subset; the expected trajectory is rebuilt here from
  // the documented stream order: L canvas ids, then per step L renoise ids (all positions), across blocks.
  const int V = 1000, L = 8, N = 4;
  auto rule = [](int call, int i, const DenoiseRequest& req, int64_t) {
    return make_row(200 + int32_t((int64_t(req.canvas[i]) * 17 + call) % 700), 0.02f * float((i * 3 + call) % 8));
  };
  FakeBackend be(V, L, rows_by(rule));
  auto o = base_options(16, N);
  o.disable_extras();
  o.seed = 9;
  auto r = generate(be, kPrompt, o);
  ASSERT_EQ(be.calls.size(), 8u);

  Rng rng(9);
  std::vector<int32_t> canvas(L);
  for (auto& t : canvas) t = rng.uniform_token(V);
  int call = 0;
  for (int block = 0; block < 2; ++block) {
    std::vector<int32_t> argmax(L);
    for (int k = 1; k <= N; ++k, ++call) {
      const auto& c = be.calls[call];
      ASSERT_EQ(c.canvas, canvas) << "block " << block << " step " << k;
      EXPECT_EQ(c.temperature, schedule_temperature(N - k + 1, N, 0.4, 0.8));
      EXPECT_EQ(c.sc, k == 1 ? SelfCondition::None : SelfCondition::PreviousStep);
      EXPECT_FALSE(c.want_logits);
      DenoiseRequest req;
      req.canvas = c.canvas;
      std::vector<RowStats> rows;
      for (int i = 0; i < L; ++i) rows.push_back(rule(call, i, req, 0));
      std::vector<uint8_t> mask(L);
      entropy_bound_accept(rows, 0.1, mask);
      std::vector<int32_t> next(L);
      for (int i = 0; i < L; ++i) {
        argmax[i] = rows[i].argmax;
        const int32_t noise = rng.uniform_token(V);
        next[i] = mask[i] ? rows[i].argmax : noise;
      }
      canvas = next;
    }
    EXPECT_EQ(std::vector<int32_t>(r.ids.begin() + block * L, r.ids.begin() + (block + 1) * L), argmax);
    for (auto& t : canvas) t = rng.uniform_token(V);  // the next block's fresh canvas continues the stream
  }
}

TEST(BlockLoop, FirstStepSelfConditionsOnTheCanvasEmbeddingByDefault) {
  FakeBackend be(1000, 8, rows_by(echo_row));
  generate(be, kPrompt, base_options(16, 3));
  ASSERT_EQ(be.calls.size(), 6u);
  for (int c = 0; c < 6; ++c)
    EXPECT_EQ(be.calls[c].sc, c % 3 == 0 ? SelfCondition::CanvasEmbedding : SelfCondition::PreviousStep) << c;
}

TEST(BlockLoop, CategoricalModeDrawsGumbelForAcceptedRowsBeforeTheRenoise) {
  const int V = 50, L = 6, N = 3;
  auto script = [](const DenoiseRequest& req, int call, int64_t, DenoiseResult& res) {
    const size_t L = req.canvas.size();
    res.logits.resize(L * V);
    for (size_t i = 0; i < L; ++i) {
      for (int v = 0; v < V; ++v)
        res.logits[i * V + v] = float(((v * 7 + int(i) * 3 + call) % 11)) * (i < 3 ? 2.0f : 0.3f);
      res.rows[i] = compute_row_stats(res.logits.data() + i * V, V, req.temperature);
    }
  };
  FakeBackend be(V, L, script);
  auto o = base_options(L, N);
  o.disable_extras();
  o.denoiser = Denoiser::Categorical;
  o.stop_ids = {};
  o.entropy_bound = 2.0;  // accept a few rows
  o.seed = 4;
  auto r = generate(be, std::vector<int32_t>{2, 3}, o);
  ASSERT_EQ(be.calls.size(), size_t(N));
  EXPECT_TRUE(be.calls[0].want_logits);

  Rng rng(4);
  std::vector<int32_t> canvas(L);
  for (auto& t : canvas) t = rng.uniform_token(V);
  int accepted_total = 0;
  for (int k = 1; k <= N; ++k) {
    ASSERT_EQ(be.calls[k - 1].canvas, canvas) << k;
    DenoiseRequest req;
    req.canvas = canvas;
    req.temperature = be.calls[k - 1].temperature;
    DenoiseResult res;
    res.rows.resize(L);
    script(req, k - 1, 0, res);
    std::vector<uint8_t> mask(L);
    accepted_total += entropy_bound_accept(res.rows, o.entropy_bound, mask);
    std::vector<int32_t> next(L);
    for (int i = 0; i < L; ++i)
      if (mask[i]) next[i] = gumbel_max_sample(res.logits.data() + i * V, V, req.temperature, rng);
    for (int i = 0; i < L; ++i) {
      const int32_t noise = rng.uniform_token(V);
      if (!mask[i]) next[i] = noise;
    }
    canvas = next;
  }
  EXPECT_GT(accepted_total, N);  // the draws were exercised beyond the always-accepted row
  EXPECT_EQ(r.ids.size(), size_t(L));
}

TEST(BlockLoop, ConfidentStopEndsTheBlockOnTheSecondStep) {
  FakeBackend be(1000, 8, rows_by([](int, int i, const DenoiseRequest&, int64_t) {
                   return make_row(400 + i, 0.001f);
                 }));
  auto o = base_options(24, 10);
  o.disable_extras();
  auto r = generate(be, kPrompt, o);
  EXPECT_EQ(r.steps_per_block(), (std::vector<int>{2, 2, 2}));
  for (const auto& b : r.blocks) EXPECT_EQ(b.stop_reason, StopReason::Confident);
}

// DenoiseRequest::more_steps says another PreviousStep step of the same canvas follows: every step of a block but
// its max_steps-th (a backend may start that step's SC work early). An early stop makes the hint wrong, which costs a
// backend time only: the next call is then a commit and another block's first step, not a PreviousStep step.
TEST(BlockLoop, MoreStepsHintsEveryStepButTheBlocksLast) {
  FakeBackend be(1000, 16, rows_by(echo_row));
  generate(be, kPrompt, base_options(40, 3));
  ASSERT_EQ(be.calls.size(), 9u);
  for (int c = 0; c < 9; ++c) EXPECT_EQ(be.calls[c].more_steps, c % 3 != 2) << c;
  for (int c = 0; c + 1 < 9; ++c) {
    if (be.calls[c].more_steps) {
      EXPECT_EQ(be.calls[c + 1].sc, SelfCondition::PreviousStep) << c;
    }
  }

  FakeBackend early(1000, 8, rows_by([](int, int i, const DenoiseRequest&, int64_t) {
                      return make_row(400 + i, 0.001f);
                    }));
  auto o = base_options(16, 10);
  o.disable_extras();
  auto r = generate(early, kPrompt, o);
  ASSERT_EQ(r.steps_per_block(), (std::vector<int>{2, 2}));  // the confident stop fires on each block's second step
  ASSERT_EQ(early.calls.size(), 4u);
  for (const auto& c : early.calls) EXPECT_TRUE(c.more_steps);  // 2 < max_steps: the hint could not know
}

TEST(BlockLoop, MaxStepsIsTheStopReasonWhenNothingElseFires) {
  FakeBackend be(1000, 8, rows_by(echo_row));
  auto r = generate(be, kPrompt, base_options(8, 5));
  ASSERT_EQ(r.blocks.size(), 1u);
  EXPECT_EQ(r.blocks[0].steps, 5);
  EXPECT_EQ(r.blocks[0].stop_reason, StopReason::MaxSteps);
}

TEST(BlockLoop, StopIdTrimsAndEndsTheTurn) {
  FakeBackend be(1000, 16, rows_by([](int call, int i, const DenoiseRequest& req, int64_t kv) {
                   if (kv > 5 && i == 3) return make_row(106, 0.5f);
                   return echo_row(call, i, req, kv);
                 }));
  auto r = generate(be, kPrompt, base_options(100, 2));
  EXPECT_EQ(r.ids.size(), 16u + 3u);
  EXPECT_EQ(r.stop_token, 106);
  EXPECT_EQ(r.finish, FinishReason::Stop);
  EXPECT_EQ(r.blocks.size(), 2u);
  EXPECT_EQ(r.blocks[1].tokens_committed, 4);
  EXPECT_EQ(be.prefills.size(), 2u);
  EXPECT_DOUBLE_EQ(r.tokens_per_forward(), 20.0 / 4.0);
}

TEST(BlockLoop, StopIdPastTheBudgetIsIgnoredAndAtTheBudgetCounts) {
  auto at = [](int pos) {
    return rows_by([pos](int call, int i, const DenoiseRequest& req, int64_t kv) {
      return i == pos ? make_row(50, 0.5f) : echo_row(call, i, req, kv);
    });
  };
  FakeBackend late(1000, 16, at(5));
  auto r1 = generate(late, kPrompt, base_options(5, 2));
  EXPECT_EQ(r1.ids.size(), 5u);
  EXPECT_EQ(r1.stop_token, -1);
  FakeBackend last(1000, 16, at(4));
  auto r2 = generate(last, kPrompt, base_options(5, 2));
  EXPECT_EQ(r2.ids.size(), 4u);
  EXPECT_EQ(r2.stop_token, 50);
  EXPECT_EQ(r2.finish, FinishReason::Stop);
}

TEST(BlockLoop, SameSeedSameOutputDifferentSeedDifferentCanvas) {
  auto run = [](uint64_t seed) {
    FakeBackend be(1000, 16, rows_by(echo_row));
    auto o = base_options(40, 4);
    o.seed = seed;
    auto r = generate(be, kPrompt, o);
    return std::make_pair(r.ids, be.calls);
  };
  auto [a_ids, a_calls] = run(123);
  auto [b_ids, b_calls] = run(123);
  auto [c_ids, c_calls] = run(124);
  EXPECT_EQ(a_ids, b_ids);
  ASSERT_EQ(a_calls.size(), b_calls.size());
  for (size_t i = 0; i < a_calls.size(); ++i) EXPECT_EQ(a_calls[i].canvas, b_calls[i].canvas);
  EXPECT_NE(a_calls[0].canvas, c_calls[0].canvas);
  EXPECT_NE(a_ids, c_ids);
}

TEST(BlockLoop, ObserversSeeEveryStepAndBlock) {
  FakeBackend be(1000, 8, rows_by([](int call, int i, const DenoiseRequest& req, int64_t kv) {
                   // block 1 converges (confident at step 2); blocks 0 and 2 run to max steps
                   if (kv == 13) return make_row(500 + i, 0.0f);
                   return echo_row(call, i, req, kv);
                 }));
  std::vector<StepEvent> steps;
  std::vector<std::vector<int32_t>> argmaxes;
  std::vector<BlockStats> blocks;
  Observers obs;
  obs.on_step = [&](const StepEvent& e) {
    steps.push_back(e);
    argmaxes.emplace_back(e.argmax.begin(), e.argmax.end());
  };
  obs.on_block = [&](const BlockEvent& e) { blocks.push_back(e.stats); };
  auto o = base_options(24, 4);
  o.disable_extras();
  auto r = generate(be, kPrompt, o, obs);
  ASSERT_EQ(int64_t(steps.size()), r.forwards);
  ASSERT_EQ(steps.size(), 4u + 2u + 4u);
  const int want_step[] = {1, 2, 3, 4, 1, 2, 1, 2, 3, 4};
  const int want_block[] = {0, 0, 0, 0, 1, 1, 2, 2, 2, 2};
  for (size_t i = 0; i < steps.size(); ++i) {
    EXPECT_EQ(steps[i].step, want_step[i]) << i;
    EXPECT_EQ(steps[i].block, want_block[i]) << i;
    EXPECT_EQ(steps[i].cur_step, 4 - want_step[i] + 1) << i;
    EXPECT_EQ(steps[i].temperature, be.calls[i].temperature) << i;
    EXPECT_EQ(steps[i].accepted, want_block[i] == 1 ? 8 : 1) << i;  // zero-entropy rows are all accepted
    EXPECT_EQ(int(steps[i].accepted_mask.size()), 8);
  }
  EXPECT_EQ(steps[5].stop, StopReason::Confident);
  EXPECT_EQ(steps[5].mean_entropy, 0.0f);
  EXPECT_EQ(steps[3].stop, StopReason::MaxSteps);
  EXPECT_EQ(steps[2].stop, StopReason::None);
  EXPECT_FLOAT_EQ(steps[0].mean_entropy, 0.5f);
  ASSERT_EQ(blocks.size(), 3u);
  EXPECT_EQ(blocks[1].steps, 2);
  EXPECT_EQ(blocks[1].stop_reason, StopReason::Confident);
  EXPECT_EQ(blocks[2].tokens_committed, 8);
  EXPECT_EQ(std::vector<int32_t>(r.ids.begin() + 8, r.ids.begin() + 16), argmaxes[5]);
}

TEST(BlockLoop, CancelBetweenStepsStopsBeforeTheNextForward) {
  FakeBackend be(1000, 8, rows_by(echo_row));
  CancelToken cancel;
  Observers obs;
  obs.on_step = [&](const StepEvent& e) {
    if (e.step == 3) cancel.cancel();
  };
  auto r = generate(be, kPrompt, base_options(100, 10), obs, &cancel);
  EXPECT_EQ(r.finish, FinishReason::Cancelled);
  EXPECT_EQ(be.calls.size(), 3u);
  EXPECT_EQ(r.forwards, 3);
  EXPECT_TRUE(r.ids.empty());
}

TEST(BlockLoop, CancelBetweenBlocksKeepsTheCommittedBlocks) {
  FakeBackend be(1000, 8, rows_by(echo_row));
  CancelToken cancel;
  Observers obs;
  obs.on_block = [&](const BlockEvent&) { cancel.cancel(); };
  auto r = generate(be, kPrompt, base_options(100, 2), obs, &cancel);
  EXPECT_EQ(r.finish, FinishReason::Cancelled);
  EXPECT_EQ(r.ids.size(), 8u);
  EXPECT_EQ(be.calls.size(), 2u);
  EXPECT_EQ(be.prefills.size(), 1u);
}

TEST(BlockLoop, DegenerateFirstBlockIsReRolledWithShrinkingCanvases) {
  FakeBackend be(1000, 16, rows_by([](int call, int i, const DenoiseRequest& req, int64_t kv) {
                   if (i == 0 && kv == 5 && req.canvas.size() >= 8) return make_row(1, 0.5f);  // empty reply
                   return echo_row(call, i, req, kv);
                 }));
  auto r = generate(be, kPrompt, base_options(10, 2));
  ASSERT_EQ(r.blocks.size(), 4u);
  EXPECT_EQ(r.blocks[0].canvas_length, 16);
  EXPECT_TRUE(r.blocks[0].discarded);
  EXPECT_EQ(r.blocks[1].canvas_length, 8);
  EXPECT_TRUE(r.blocks[1].discarded);
  EXPECT_EQ(r.blocks[2].canvas_length, 4);
  EXPECT_FALSE(r.blocks[2].discarded);
  EXPECT_EQ(r.blocks[2].attempt, 2);
  EXPECT_EQ(r.blocks[3].canvas_length, 16);  // later blocks are full size
  EXPECT_EQ(r.ids.size(), 10u);
  EXPECT_EQ(r.steps_per_block(), (std::vector<int>{2, 2}));
  EXPECT_EQ(r.forwards, 8);
  ASSERT_EQ(be.prefills.size(), 2u);
  EXPECT_EQ(be.prefills[1].size(), 4u);
  EXPECT_EQ(be.calls[6].kv_len, int64_t(kPrompt.size()) + 4);
}

TEST(BlockLoop, ReRollShrinks256To128To64ThenGivesUp) {
  FakeBackend be(1000, 256, rows_by([](int, int i, const DenoiseRequest&, int64_t) {
                   return make_row(i == 0 ? 106 : 300, 0.5f);
                 }));
  auto r = generate(be, kPrompt, base_options(300, 1));
  ASSERT_EQ(r.blocks.size(), 4u);
  EXPECT_EQ(r.blocks[0].canvas_length, 256);
  EXPECT_EQ(r.blocks[1].canvas_length, 128);
  EXPECT_EQ(r.blocks[2].canvas_length, 64);
  EXPECT_EQ(r.blocks[3].canvas_length, 64);
  EXPECT_FALSE(r.blocks[3].discarded);
  EXPECT_TRUE(r.ids.empty());
  EXPECT_EQ(r.stop_token, 106);
}

TEST(BlockLoop, NoReRollWhenDisabledOrAfterTheFirstBlock) {
  auto eos_first_in = [](int64_t at_kv) {
    return rows_by([at_kv](int call, int i, const DenoiseRequest& req, int64_t kv) {
      if (i == 0 && kv == at_kv) return make_row(1, 0.5f);
      return echo_row(call, i, req, kv);
    });
  };
  FakeBackend off(1000, 8, eos_first_in(5));
  auto o = base_options(20, 1);
  o.empty_reply_retries = 0;
  auto r1 = generate(off, kPrompt, o);
  EXPECT_EQ(r1.blocks.size(), 1u);
  EXPECT_TRUE(r1.ids.empty());
  FakeBackend later(1000, 8, eos_first_in(13));
  auto r2 = generate(later, kPrompt, base_options(20, 1));
  EXPECT_EQ(r2.blocks.size(), 2u);
  EXPECT_EQ(r2.ids.size(), 8u);
  EXPECT_EQ(r2.stop_token, 1);
}

namespace {
// Block 0: row 5 duplicates row 6 with p_max `p5`; everything else distinct and confident.
RowRule dup_rows(float p5, bool dup = true) {
  return [=](int call, int i, const DenoiseRequest& req, int64_t kv) {
    if (kv != 5) return echo_row(call, i, req, kv);
    if (i == 5) return make_row(dup ? 606 : 605, 0.5f, p5);
    if (i == 6) return make_row(606, 0.5f, 0.99f);
    return make_row(700 + i, 0.5f, 0.99f);
  };
}
}  // namespace

TEST(BlockLoop, ConfidenceTrimCutsAtTheFirstUnsureDuplicateRow) {
  FakeBackend be(1000, 16, rows_by(dup_rows(0.5f)));
  auto r = generate(be, kPrompt, base_options(20, 1));
  ASSERT_GE(r.blocks.size(), 2u);
  EXPECT_TRUE(r.blocks[0].trimmed);
  EXPECT_EQ(r.blocks[0].tokens_committed, 5);
  EXPECT_EQ(be.prefills[1].size(), 5u);
  EXPECT_EQ(be.calls[1].kv_len, 10);
  EXPECT_EQ(r.ids.size(), 20u);
}

TEST(BlockLoop, ConfidenceTrimIsStrictlyBelowTauAndNeedsADuplicate) {
  const float p = 0.7f;
  const float at = dg::diffusion::row_pmax(make_row(606, 0.5f, p));
  auto run = [](RowRule rule, double tau) {
    FakeBackend be(1000, 16, rows_by(rule));
    auto o = base_options(16, 1);
    o.conf_trim = tau;
    return generate(be, kPrompt, o).blocks[0];
  };
  EXPECT_FALSE(run(dup_rows(p), double(at)).trimmed);
  EXPECT_TRUE(run(dup_rows(p), double(std::nextafter(at, 1.0f))).trimmed);
  EXPECT_FALSE(run(dup_rows(p, /*dup=*/false), 0.9).trimmed);
  EXPECT_FALSE(run(dup_rows(p), 0.0).trimmed);  // off
}

TEST(BlockLoop, FreezeKeepsTheFirstAcceptedTokenOnlyWhenAsked) {
  auto rule = [](int call, int i, const DenoiseRequest&, int64_t) {
    return make_row(300 + call * 10 + i, i == 0 ? 0.0f : 0.5f);  // row 0 is always the accepted one
  };
  FakeBackend frozen(1000, 8, rows_by(rule));
  auto o = base_options(8, 3);
  o.freeze = true;
  auto r1 = generate(frozen, kPrompt, o);
  EXPECT_EQ(frozen.calls[2].canvas[0], 300);
  EXPECT_EQ(r1.ids[0], 300);
  EXPECT_EQ(r1.ids[1], 301);  // row 1 (cumsum - current = 0) froze too
  EXPECT_EQ(r1.ids[2], 322);
  FakeBackend free(1000, 8, rows_by(rule));
  o.freeze = false;
  auto r2 = generate(free, kPrompt, o);
  EXPECT_EQ(free.calls[2].canvas[0], 310);
  EXPECT_EQ(r2.ids[0], 320);
}

TEST(BlockLoop, RejectsBadInputsWithAMessage) {
  FakeBackend be(1000, 8, rows_by(echo_row));
  auto o = base_options(0, 3);
  EXPECT_THROW(generate(be, kPrompt, o), Error);
  EXPECT_THROW(generate(be, std::vector<int32_t>{2, 1000}, base_options(8, 3)), Error);
  EXPECT_THROW(generate(be, std::vector<int32_t>{}, base_options(8, 3)), Error);
  EXPECT_TRUE(be.calls.empty());
}

// fixed_steps(N): even rows that would stop at once (one-hot, stop ids everywhere) run N steps per canvas and the
// turn fills max_new_tokens, so a benchmark's step count is exactly blocks x N.
TEST(BlockLoop, FixedStepsRunsEveryCanvasToTheEnd) {
  FakeBackend be(1000, 8, rows_by([](int, int, const DenoiseRequest&, int64_t) { return make_row(1, 0.0f); }));
  GenerationOptions o = base_options(20, 5);
  o.fixed_steps(5);
  auto r = generate(be, kPrompt, o);
  EXPECT_EQ(r.ids.size(), 20u);
  EXPECT_EQ(r.stop_token, -1);
  EXPECT_EQ(r.forwards, 3 * 5);
  EXPECT_EQ(r.steps_per_block(), (std::vector<int>{5, 5, 5}));
  // the same rows with the defaults stop after one step on the stop id
  GenerationOptions d = base_options(20, 5);
  FakeBackend be2(1000, 8, rows_by([](int, int, const DenoiseRequest&, int64_t) { return make_row(1, 0.0f); }));
  auto r2 = generate(be2, kPrompt, d);
  EXPECT_LT(r2.forwards, 15);
}
