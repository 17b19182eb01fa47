// Per-step rules of the entropy-bound sampler: RNG, temperature schedule, accept rule, Gumbel draws, stop rules,
// option validation. Every threshold is probed at the boundary and one float step away from it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "diffusion/options.h"
#include "diffusion/rng.h"
#include "diffusion/sampler.h"
#include "fake_backend.h"
#include "util/error.h"

using namespace dg;
using namespace dg::diffusion;
using dg::testing::make_row;

namespace {

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

std::vector<uint8_t> accept(const std::vector<float>& entropies, double bound) {
  std::vector<RowStats> rows;
  for (float h : entropies) rows.push_back(make_row(0, h));
  std::vector<uint8_t> mask(rows.size());
  entropy_bound_accept(rows, bound, mask);
  return mask;
}

template <class F>
void expect_error_naming(F&& f, const std::string& field) {
  try {
    f();
    ADD_FAILURE() << "expected a dg::Error naming " << field;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(Rng, MatchesTheSeedLcg) {
  // Expected values from python big-int arithmetic: state = (state * 6966169279 + 1039523323) mod 2^64, start seed+1.
  Rng r(0);
  EXPECT_EQ(r.next_u32(), 1u);
  EXPECT_EQ(r.next_u32(), 99832574u);
  EXPECT_EQ(r.next_u32(), 1806711590u);
  EXPECT_EQ(r.next_u32(), 3679581957u);
}

TEST(Rng, TokenIdIsMultiplyShiftOfHigh32Bits) {
  Rng a(42), b(42);
  EXPECT_EQ(a.uniform_token(512), 0);        // u32 = 69
  EXPECT_EQ(b.uniform_token(262144), 0);
  EXPECT_EQ(a.uniform_token(512), 262);      // u32 = 2198511578
  EXPECT_EQ(b.uniform_token(262144), 134186);
  EXPECT_EQ(a.uniform_token(512), 449);      // u32 = 3771479198
  EXPECT_EQ(b.uniform_token(262144), 230192);
}

TEST(Rng, SameSeedSameStreamDifferentSeedDifferentStream) {
  Rng a(7), b(7), c(8);
  bool differs = false;
  for (int i = 0; i < 100; ++i) {
    uint32_t x = a.next_u32();
    EXPECT_EQ(x, b.next_u32());
    differs |= x != c.next_u32();
  }
  EXPECT_TRUE(differs);
}

TEST(Rng, OpenUnitIntervalNeverHitsTheEnds) {
  Rng r(1);
  for (int i = 0; i < 10000; ++i) {
    double u = r.uniform_open01();
    ASSERT_GT(u, 0.0);
    ASSERT_LT(u, 1.0);
  }
}

TEST(Temperature, CountsDownWithHfsFloat32TensorRounding) {
  // Bit patterns of HF's T with cur_step an int32 tensor: f32(f32(0.4) + f32(f32(0.8 - 0.4) * f32(cur / 48))),
  // computed in python with struct-packed float32 rounding.
  EXPECT_EQ(float_bits(schedule_temperature(48, 48, 0.4, 0.8)), 1061997773u);  // 0.8f
  EXPECT_EQ(float_bits(schedule_temperature(47, 48, 0.4, 0.8)), 1061857963u);
  EXPECT_EQ(float_bits(schedule_temperature(1, 48, 0.4, 0.8)), 1053888785u);   // 0.408333f, never 0.4
  // cur = 2 is where rounding the all-double formula once would give 1054168405 instead.
  EXPECT_EQ(float_bits(schedule_temperature(2, 48, 0.4, 0.8)), 1054168406u);
}

TEST(Temperature, DecimalDoubleRecoversTheJsonLiteral) {
  EXPECT_EQ(decimal_double(0.4f), 0.4);
  EXPECT_EQ(decimal_double(0.8f), 0.8);
  EXPECT_EQ(decimal_double(0.005f), 0.005);
  EXPECT_NE(double(0.4f), 0.4);  // why the helper exists
}

TEST(AcceptRule, LowestEntropyAlwaysAcceptedEvenAboveTheBound) {
  EXPECT_EQ(accept({7.0f, 5.0f, 9.0f}, 0.1), (std::vector<uint8_t>{0, 1, 0}));
}

TEST(AcceptRule, SumOfStrictlyLowerRanksFiresAtTheBoundNotJustAbove) {
  // sorted 0.25, 0.25, 0.5, 1.0 -> cumsum - current = 0, 0.25, 0.5, 1.0
  const std::vector<float> h = {1.0f, 0.25f, 0.5f, 0.25f};
  EXPECT_EQ(accept(h, 0.5), (std::vector<uint8_t>{0, 1, 1, 1}));
  EXPECT_EQ(accept(h, double(std::nextafter(0.5f, 0.0f))), (std::vector<uint8_t>{0, 1, 0, 1}));
  EXPECT_EQ(accept(h, 1.0), (std::vector<uint8_t>{1, 1, 1, 1}));
}

TEST(AcceptRule, ComparesInFloat32LikeTorch) {
  // Rank 2 has cumsum - current = 0.2f - 0.1f = 0.1f, which is > 0.1 in double but <= float(0.1): it is accepted
  // only because the bound is narrowed to float32, as torch compares a float tensor with a python scalar.
  EXPECT_EQ(accept({0.1f, 0.0f, 0.1f}, 0.1), (std::vector<uint8_t>{1, 1, 1}));
}

TEST(AcceptRule, TiesAreBrokenByPosition) {
  // All equal: ranks follow positions, so the first two (cumsum - current = 0, 0.3) are in and the third is out.
  EXPECT_EQ(accept({0.3f, 0.3f, 0.3f}, 0.3), (std::vector<uint8_t>{1, 1, 0}));
}

TEST(AcceptRule, ReturnsTheCount) {
  std::vector<RowStats> rows = {make_row(0, 0.01f), make_row(0, 0.02f), make_row(0, 3.0f)};
  std::vector<uint8_t> mask(3);
  EXPECT_EQ(entropy_bound_accept(rows, 0.1, mask), 3);  // 0, 0.01, 0.03 <= 0.1
}

TEST(RowHelpers, MeanEntropyAndPmax) {
  std::vector<RowStats> rows = {make_row(0, 0.25f), make_row(0, 0.75f, 0.5f)};
  EXPECT_FLOAT_EQ(mean_entropy(rows), 0.5f);
  EXPECT_NEAR(row_pmax(rows[1]), 0.5f, 1e-7);
}

TEST(Gumbel, ConsumesOneUniformPerVocabEntryAndIsDeterministic) {
  std::vector<float> logits = {0.1f, 2.0f, -1.0f, 0.5f, 1.5f};
  Rng a(3), b(3), c(3);
  int32_t x = gumbel_max_sample(logits.data(), 5, 0.7f, a);
  EXPECT_EQ(x, gumbel_max_sample(logits.data(), 5, 0.7f, b));
  for (int i = 0; i < 5; ++i) c.next_u32();
  EXPECT_EQ(a.state(), c.state());
}

TEST(Gumbel, DrawsFromTheTemperedSoftmax) {
  // logits / T = {0, log 3}: p = {1/4, 3/4}.
  const float T = 0.5f;
  std::vector<float> logits = {0.0f, float(std::log(3.0) * T)};
  Rng r(11);
  int ones = 0;
  const int n = 40000;
  for (int i = 0; i < n; ++i) ones += gumbel_max_sample(logits.data(), 2, T, r);
  EXPECT_NEAR(double(ones) / n, 0.75, 0.01);
}

TEST(Gumbel, OverwhelmingLogitAlwaysWins) {
  std::vector<float> logits(100, 0.0f);
  logits[37] = 30.0f;
  Rng r(5);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(gumbel_max_sample(logits.data(), 100, 0.4f, r), 37);
}

namespace {

GenerationOptions hf_options() {
  GenerationOptions o;
  o.disable_extras();
  return o;
}

struct Tracker {
  GenerationOptions o;
  StopTracker t{o};
  int step = 0;
  explicit Tracker(GenerationOptions opt) : o(std::move(opt)) {}
  StopReason feed(std::vector<int32_t> argmax, float mean_h, std::vector<uint8_t> mask = {1, 0, 0}) {
    return t.observe(++step, argmax, mask, mean_h);
  }
};

}  // namespace

TEST(StopRules, ConfidentNeedsThePreviousArgmaxAndStrictlyLowEntropy) {
  Tracker k(hf_options());  // stability 1, confidence 0.005
  EXPECT_EQ(k.feed({5, 6, 7}, 0.0f), StopReason::None);  // no history on the first step
  EXPECT_EQ(k.feed({5, 6, 7}, 0.005f), StopReason::None);  // at the threshold: strict <
  EXPECT_EQ(k.feed({5, 6, 7}, std::nextafter(0.005f, 0.0f)), StopReason::Confident);
}

TEST(StopRules, ConfidentResetsWhenTheArgmaxChanges) {
  Tracker k(hf_options());
  EXPECT_EQ(k.feed({5, 6, 7}, 0.0f), StopReason::None);
  EXPECT_EQ(k.feed({5, 6, 8}, 0.0f), StopReason::None);
  EXPECT_EQ(k.feed({5, 6, 8}, 0.0f), StopReason::Confident);
}

TEST(StopRules, StabilityZeroStopsOnTheFirstConfidentStep) {
  auto o = hf_options();
  o.stability_threshold = 0;
  Tracker k(o);
  EXPECT_EQ(k.feed({1, 2, 3}, 0.001f), StopReason::Confident);
}

TEST(StopRules, StabilityTwoNeedsTwoIdenticalPredecessors) {
  auto o = hf_options();
  o.stability_threshold = 2;
  Tracker k(o);
  EXPECT_EQ(k.feed({1, 2, 3}, 0.0f), StopReason::None);
  EXPECT_EQ(k.feed({1, 2, 3}, 0.0f), StopReason::None);  // one predecessor only
  EXPECT_EQ(k.feed({1, 2, 3}, 0.0f), StopReason::Confident);
}

TEST(StopRules, PlateauFiresOnTheEighthIdenticalMaskNotTheSeventh) {
  GenerationOptions o;  // seed defaults: plateau 8 @ 0.05
  o.entropy_stop = 0;
  Tracker k(o);
  for (int i = 1; i <= 7; ++i) EXPECT_EQ(k.feed({i, 0, 0}, 0.04f), StopReason::None) << i;  // argmax keeps moving
  EXPECT_EQ(k.feed({8, 0, 0}, 0.04f), StopReason::Plateau);
}

TEST(StopRules, PlateauNeedsEntropyStrictlyBelowItsThreshold) {
  GenerationOptions o;
  o.entropy_stop = 0;
  Tracker k(o);
  for (int i = 1; i <= 12; ++i) EXPECT_EQ(k.feed({i, 0, 0}, 0.05f), StopReason::None) << i;
  EXPECT_EQ(k.feed({13, 0, 0}, std::nextafter(0.05f, 0.0f)), StopReason::Plateau);
}

TEST(StopRules, PlateauRunRestartsWhenTheMaskChanges) {
  GenerationOptions o;
  o.entropy_stop = 0;
  Tracker k(o);
  for (int i = 1; i <= 7; ++i) k.feed({i, 0, 0}, 0.01f);
  EXPECT_EQ(k.feed({8, 0, 0}, 0.01f, {1, 1, 0}), StopReason::None);
  EXPECT_EQ(k.t.plateau_run(), 1);
}

TEST(StopRules, EntropyOnlyFiresFromStepTwelveNotEleven) {
  GenerationOptions o;
  o.plateau_steps = 0;
  Tracker k(o);
  for (int i = 1; i <= 11; ++i) EXPECT_EQ(k.feed({i, 0, 0}, 0.01f), StopReason::None) << i;
  EXPECT_EQ(k.feed({12, 0, 0}, 0.01f), StopReason::EntropyOnly);
}

TEST(StopRules, EntropyOnlyNeedsEntropyStrictlyBelowItsThreshold) {
  GenerationOptions o;
  o.plateau_steps = 0;
  Tracker k(o);
  for (int i = 1; i <= 12; ++i) EXPECT_EQ(k.feed({i, 0, 0}, 0.05f), StopReason::None) << i;
  EXPECT_EQ(k.feed({13, 0, 0}, std::nextafter(0.05f, 0.0f)), StopReason::EntropyOnly);
}

TEST(StopRules, ExtrasOffNeverFireOnTheirOwn) {
  Tracker k(hf_options());
  for (int i = 1; i <= 40; ++i) EXPECT_EQ(k.feed({i, 0, 0}, 0.01f), StopReason::None) << i;
}

TEST(StopRules, PadGateBlocksEveryEarlyStopOnAnAllPadArgmax) {
  GenerationOptions o;
  Tracker gated(o);
  for (int i = 1; i <= 20; ++i) EXPECT_EQ(gated.feed({0, 0, 0}, 0.0f), StopReason::None) << i;
  // Confident, plateau and entropy-only were all due; the first non-pad argmax releases them (plateau fires first).
  EXPECT_EQ(gated.feed({0, 0, 9}, 0.0f), StopReason::Plateau);
  o.pad_gate = false;
  Tracker open(o);
  open.feed({0, 0, 0}, 0.0f);
  EXPECT_EQ(open.feed({0, 0, 0}, 0.0f), StopReason::Confident);
}

TEST(Options, FromConfigCarriesTheCheckpointValues) {
  GenerationConfig gc;
  gc.max_new_tokens = 77;
  gc.max_denoising_steps = 9;
  gc.entropy_bound = 0.25f;
  gc.t_min = 0.3f;
  gc.t_max = 0.9f;
  gc.stability_threshold = 2;
  gc.confidence_threshold = 0.01f;
  gc.eos_token_ids = {1, 106};
  gc.pad_token_id = 3;
  auto o = GenerationOptions::from_config(gc);
  EXPECT_EQ(o.max_new_tokens, 77);
  EXPECT_EQ(o.max_steps, 9);
  EXPECT_EQ(o.entropy_bound, 0.25);
  EXPECT_EQ(o.t_min, 0.3);
  EXPECT_EQ(o.t_max, 0.9);
  EXPECT_EQ(o.stability_threshold, 2);
  EXPECT_EQ(o.confidence_threshold, 0.01);
  EXPECT_EQ(o.stop_ids, (std::vector<int32_t>{1, 106}));
  EXPECT_EQ(o.pad_id, 3);
  EXPECT_TRUE(o.first_step_sc);
  EXPECT_EQ(o.empty_reply_retries, 3);
}

TEST(Options, DisableExtrasIsHfSemantics) {
  GenerationOptions o;
  o.disable_extras();
  EXPECT_FALSE(o.first_step_sc);
  EXPECT_EQ(o.plateau_steps, 0);
  EXPECT_FALSE(o.pad_gate);
  EXPECT_EQ(o.entropy_stop, 0);
  EXPECT_EQ(o.empty_reply_retries, 0);
  EXPECT_EQ(o.conf_trim, 0);
}

TEST(Options, ValidationNamesTheField) {
  ModelConfig mc;
  mc.vocab_size = 100;
  mc.canvas_length = 16;
  auto with = [&](auto edit) {
    GenerationOptions o;
    o.stop_ids = {1};
    edit(o);
    return [o, &mc] { o.validate(mc); };
  };
  EXPECT_NO_THROW(with([](GenerationOptions&) {})());
  expect_error_naming(with([](auto& o) { o.max_new_tokens = 0; }), "max_new_tokens");
  expect_error_naming(with([](auto& o) { o.max_steps = -1; }), "max_steps");
  expect_error_naming(with([](auto& o) { o.entropy_bound = 0; }), "entropy_bound");
  expect_error_naming(with([](auto& o) { o.entropy_bound = NAN; }), "entropy_bound");
  expect_error_naming(with([](auto& o) { o.t_min = -0.1; }), "t_min");
  expect_error_naming(with([](auto& o) { o.t_max = 0.4; }), "t_max");
  expect_error_naming(with([](auto& o) { o.stability_threshold = -1; }), "stability_threshold");
  expect_error_naming(with([](auto& o) { o.confidence_threshold = 0; }), "confidence_threshold");
  expect_error_naming(with([](auto& o) { o.stop_ids = {100}; }), "stop_ids");
  expect_error_naming(with([](auto& o) { o.pad_id = -1; }), "pad_id");
  expect_error_naming(with([](auto& o) { o.plateau_steps = -2; }), "plateau_steps");
  expect_error_naming(with([](auto& o) { o.entropy_stop = -1; }), "entropy_stop");
  expect_error_naming(with([](auto& o) { o.entropy_stop_min_steps = 0; }), "entropy_stop_min_steps");
  expect_error_naming(with([](auto& o) { o.empty_reply_retries = 9; }), "empty_reply_retries");
  expect_error_naming(with([](auto& o) { o.conf_trim = 1.5; }), "conf_trim");
  EXPECT_NO_THROW(with([](auto& o) { o.t_min = 0; })());  // cur >= 1 keeps T > 0
}

TEST(Options, SamplerNames) {
  EXPECT_EQ(parse_denoiser("seed"), Denoiser::Argmax);
  EXPECT_EQ(parse_denoiser("hf"), Denoiser::Categorical);
  expect_error_naming([] { parse_denoiser("greedy"); }, "sampler");
}
