// Sessions: LCP routing, rewind of a divergent tail, and KV reuse that changes nothing but the work done.
// Real CPU backend on tests/fixtures/tiny-v; every reused turn is compared with a cold run of the same prompt.
#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.h"
#include "diffusion/generate.h"
#include "model/weights.h"
#include "session/session.h"
#include "util/error.h"

namespace dg {
namespace {

const LoadedModel& tiny_v() {
  static auto model = load_model(std::string(DIFFGEMMA_FIXTURES_DIR) + "/tiny-v");
  return *model;
}

diffusion::GenerationOptions small_options(uint64_t seed) {
  auto o = diffusion::GenerationOptions::from_config(tiny_v().generation);
  o.seed = seed;
  o.max_new_tokens = 40;  // > one canvas of 32: the second block is the uncommitted one
  o.max_steps = 2;
  // Random weights seldom produce a stop id; keeping every block full exercises the commit/finalize path.
  o.stop_ids = {};
  return o;
}

std::vector<int32_t> cold(std::span<const int32_t> prompt, const diffusion::GenerationOptions& o) {
  auto be = make_cpu_backend(tiny_v());
  return diffusion::generate(*be, prompt, o).ids;
}

session::SessionPool make_pool(int slots, std::vector<std::string>* log = nullptr) {
  return session::SessionPool([] { return make_cpu_backend(tiny_v()); }, slots,
                              [log](const std::string& line) {
                                if (log) log->push_back(line);
                              });
}

TEST(Session, CommonPrefix) {
  std::vector<int32_t> a{1, 2, 3, 4}, b{1, 2, 9}, c{};
  EXPECT_EQ(session::common_prefix(a, b), 2u);
  EXPECT_EQ(session::common_prefix(a, a), 4u);
  EXPECT_EQ(session::common_prefix(a, c), 0u);
}

TEST(Session, ThreeTurnsPrefillOnlyNewTokensAndMatchColdRuns) {
  auto pool = make_pool(1);
  std::vector<int32_t> prompt = {2, 105, 2364, 107, 9259, 236764, 1217, 106, 107, 105, 4368, 107};
  const std::vector<std::vector<int32_t>> user_turns = {
      {},  // turn 1 is the prompt itself
      {106, 107, 105, 2364, 107, 3689, 563, 496, 106, 107, 105, 4368, 107},
      {106, 107, 105, 2364, 107, 19058, 106, 107, 105, 4368, 107}};
  for (size_t t = 0; t < user_turns.size(); ++t) {
    SCOPED_TRACE(testing::Message() << "turn " << t + 1);
    const size_t cached = pool.tokens(0).size();
    if (t > 0) {
      prompt = pool.tokens(0);  // the conversation so far, exactly as cached
      prompt.insert(prompt.end(), user_turns[t].begin(), user_turns[t].end());
    }
    const auto o = small_options(1000 + t);
    const session::Turn turn = pool.generate(prompt, o);
    EXPECT_EQ(turn.stats.reused_tokens, int64_t(cached));
    EXPECT_EQ(turn.stats.prefilled_tokens, int64_t(prompt.size() - cached));
    EXPECT_EQ(turn.stats.truncated_tokens, 0);
    EXPECT_FALSE(turn.stats.reprefill);
    if (t > 0) {
      EXPECT_EQ(turn.stats.prefilled_tokens, int64_t(user_turns[t].size()));
    }
    ASSERT_EQ(turn.result.ids.size(), 40u);
    EXPECT_EQ(turn.result.ids, cold(prompt, o)) << "KV reuse changed the output";
    // The whole turn, including the block generate() leaves uncommitted, is now in the cache.
    std::vector<int32_t> expect = prompt;
    expect.insert(expect.end(), turn.result.ids.begin(), turn.result.ids.end());
    EXPECT_EQ(pool.tokens(0), expect);
  }
}

TEST(Session, DivergentTailIsTruncatedNotReprefilled) {
  auto pool = make_pool(1);
  const std::vector<int32_t> a = {2, 105, 2364, 107, 9259, 1217, 106, 107, 105, 4368, 107};
  const auto o = small_options(7);
  pool.generate(a, o);
  const size_t cached = pool.tokens(0).size();
  // An edited last user message: shares 5 tokens, then differs.
  std::vector<int32_t> b(a.begin(), a.begin() + 5);
  b.insert(b.end(), {3689, 563, 106, 107, 105, 4368, 107});
  const auto turn = pool.generate(b, o);
  EXPECT_EQ(turn.stats.reused_tokens, 5);
  EXPECT_EQ(turn.stats.truncated_tokens, int64_t(cached - 5));
  EXPECT_EQ(turn.stats.prefilled_tokens, int64_t(b.size() - 5));
  EXPECT_EQ(turn.result.ids, cold(b, o));
}

TEST(Session, IdenticalRepeatReencodesOneTokenAndMatches) {
  auto pool = make_pool(1);
  const std::vector<int32_t> a = {2, 105, 2364, 107, 9259, 106, 107, 105, 4368, 107};
  auto o = small_options(3);
  o.max_new_tokens = 8;
  const auto first = pool.generate(a, o);
  const auto again = pool.generate(a, o);
  EXPECT_EQ(again.stats.reused_tokens, int64_t(a.size() - 1));
  EXPECT_EQ(again.stats.prefilled_tokens, 1);
  EXPECT_EQ(first.result.ids, again.result.ids);
}

TEST(Session, RoutesEachConversationToItsOwnSlot) {
  auto pool = make_pool(2);
  auto o = small_options(11);
  o.max_new_tokens = 8;
  const std::vector<int32_t> a = {2, 105, 2364, 107, 1001, 1002, 106, 107, 105, 4368, 107};
  const std::vector<int32_t> b = {2, 105, 2364, 107, 2001, 2002, 2003, 106, 107, 105, 4368, 107};
  const auto ta = pool.generate(a, o);
  const auto tb = pool.generate(b, o);
  EXPECT_NE(ta.stats.slot, tb.stats.slot) << "a new conversation must not evict the only other one";
  std::vector<int32_t> a2 = pool.tokens(ta.stats.slot);
  a2.insert(a2.end(), {106, 107, 105, 2364, 107, 1003, 106, 107, 105, 4368, 107});
  const auto ta2 = pool.generate(a2, o);
  EXPECT_EQ(ta2.stats.slot, ta.stats.slot);
  EXPECT_EQ(ta2.stats.reused_tokens, int64_t(a.size() + 8));
  EXPECT_EQ(ta2.result.ids, cold(a2, o));
}

TEST(Session, CancelledTurnLeavesOnlyThePromptAndCommittedBlocks) {
  auto pool = make_pool(1);
  const std::vector<int32_t> a = {2, 105, 2364, 107, 9259, 106, 107, 105, 4368, 107};
  diffusion::CancelToken cancel;
  cancel.cancel();
  const auto turn = pool.generate(a, small_options(5), {}, &cancel);
  EXPECT_EQ(turn.result.finish, diffusion::FinishReason::Cancelled);
  EXPECT_TRUE(turn.result.ids.empty());
  EXPECT_EQ(pool.tokens(0), a);
  // The next turn still routes to it and reuses the prompt.
  const auto next = pool.generate(a, small_options(5));
  EXPECT_EQ(next.stats.reused_tokens, int64_t(a.size() - 1));
}

TEST(Session, ReplayPutsInjectedOutputInTheCacheLikeAGeneratedTurn) {
  auto pool = make_pool(1);
  const std::vector<int32_t> a = {2, 105, 2364, 107, 9259, 106, 107, 105, 4368, 107};
  const std::vector<int32_t> out = {100, 200, 300};
  const auto turn = pool.replay(a, out, 106);
  EXPECT_EQ(turn.result.finish, diffusion::FinishReason::Stop);
  std::vector<int32_t> expect = a;
  expect.insert(expect.end(), {100, 200, 300, 106});
  EXPECT_EQ(pool.tokens(0), expect);
}

TEST(Session, RejectsEmptyPromptAndZeroSlots) {
  EXPECT_THROW(make_pool(0), dg::Error);
  auto pool = make_pool(1);
  EXPECT_THROW(pool.generate(std::vector<int32_t>{}, small_options(1)), dg::Error);
}

}  // namespace
}  // namespace dg
