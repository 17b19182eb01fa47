// CUDA backend vs the CPU oracle on every tiny fixture: prefill K/V, denoise logits (no SC, external SC, previous-step
// SC), commit, and an honest truncate (the CPU oracle itself matches HF to 1e-6, see test_hf_parity.cpp).
//
// What is asserted, and why (measured on the H200, docs/BENCHMARKS.md): the random tiny models are chaotic under
// bf16 activations: each layer's own error is a few 1e-3 (LayerTrace, teacher-forced), but the decoder amplifies it
// layer over layer until denoise logits differ by O(1) and argmaxes flip. So accumulated CPU-vs-CUDA logits are
// printed, not asserted; every stage's own error (LayerTrace), the prompt K/V (causal, not amplified), chunked vs
// one-chunk prefill, row statistics and truncate semantics are asserted, and the accumulated logits bar of issue 5
// (cosine >= 0.999, argmax >= 99%) is asserted on a well-conditioned full-shape model against HF
// (test_cuda_fullshape.cpp).
#ifdef DIFFGEMMA_WITH_CUDA
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <utility>
#include <nlohmann/json.hpp>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_device.h"
#include "conditioned_case.h"
#include "model/weights.h"
#include "util/error.h"
#include "util/mmap_file.h"
#include "cuda_test_options.h"
#include "tiny_fixtures.h"

namespace dg {
namespace {

void expect_logits_close(const DenoiseResult& got, const DenoiseResult& want, int L, int V, const std::string& what) {
  ASSERT_EQ(got.logits.size(), want.logits.size()) << what;
  double md = 0, mr = 0;
  for (size_t i = 0; i < want.logits.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got.logits[i])) << what << " element " << i;
    md = std::max(md, double(std::fabs(got.logits[i] - want.logits[i])));
    mr = std::max(mr, double(std::fabs(want.logits[i])));
  }
  // Accumulated error through a chaotic tiny model: reported (see the top of the file), not asserted.
  int agree = 0;
  for (int r = 0; r < L; ++r) {
    agree += got.rows[size_t(r)].argmax == want.rows[size_t(r)].argmax;
    // the GPU row stats must describe the GPU's own logits exactly (dg::compute_row_stats semantics)
    RowStats own = compute_row_stats(got.logits.data() + size_t(r) * V, V, 0.8f);
    EXPECT_EQ(own.argmax, got.rows[size_t(r)].argmax) << what << " row " << r;
    EXPECT_NEAR(own.entropy, got.rows[size_t(r)].entropy, 1e-4 * std::max(1.0f, own.entropy));
  }
  std::printf("[parity] %-28s rel err %.3e  argmax %d/%d\n", what.c_str(), md / mr, agree, L);
}

// assert = false: print the worst layer only (accumulated through the decoder-fed commit; see the top of the file).
void expect_kv_close(const Backend& got, const Backend& want, const std::string& what, bool assert_close = true) {
  double worst = 0;
  for (int l = 0; l < want.config().num_layers; ++l) {
    KvSnapshot g = got.kv_snapshot(l), w = want.kv_snapshot(l);
    ASSERT_EQ(g.first_pos, w.first_pos) << what << " layer " << l;
    ASSERT_EQ(g.n, w.n) << what << " layer " << l;
    for (auto [gv, wv, name] : {std::tuple{&g.k, &w.k, "k"}, std::tuple{&g.v, &w.v, "v"}}) {
      ASSERT_EQ(gv->size(), wv->size());
      double md = 0, mr = 0;
      for (size_t i = 0; i < wv->size(); ++i) {
        md = std::max(md, double(std::fabs((*gv)[i] - (*wv)[i])));
        mr = std::max(mr, double(std::fabs((*wv)[i])));
      }
      worst = std::max(worst, md / mr);
      if (assert_close) {
        EXPECT_LE(md / mr, 2e-2) << what << " " << name << " layer " << l;
      }
    }
  }
  std::printf("[parity] %-28s kv worst rel err %.3e\n", what.c_str(), worst);
}

// A tiny fixture's model plus the prompt and the two canvases of its reference case.
struct FixtureCase {
  std::unique_ptr<LoadedModel> model;
  std::vector<int32_t> prompt, canvas1, canvas2;
};

FixtureCase load_case(const std::string& name) {
  const std::string dir = std::string(DIFFGEMMA_FIXTURES_DIR) + "/" + name;
  auto cased = nlohmann::json::parse(read_text_file(dir + "/reference/case.json"));
  return {load_model(dir), cased["prompt_ids"].get<std::vector<int32_t>>(),
          cased["canvas1"].get<std::vector<int32_t>>(), cased["canvas2"].get<std::vector<int32_t>>()};
}

class CudaParity : public ::testing::TestWithParam<const char*> {};

TEST_P(CudaParity, MatchesCpuBackend) {
  auto info = cuda::query_device(0);
  if (!info.available) GTEST_SKIP() << "no GPU: " << info.reason;
  FixtureCase fc = load_case(GetParam());
  auto& model = fc.model;
  const auto &prompt = fc.prompt, &c1 = fc.canvas1, &c2 = fc.canvas2;
  auto cpu = make_cpu_backend(*model, 2);
  CudaOptions opt = cuda_test_options();
  opt.max_context = 1024;
  opt.prefill_chunk = 7;  // several chunks per prefill: chunking must not change the result
  opt.sliding_rewind = int64_t(c1.size());
  opt.progress = false;
  auto gpu = make_cuda_backend(*model, opt);
  const int L = int(c1.size()), V = model->config.vocab_size;

  cpu->prefill(prompt);
  gpu->prefill(prompt);
  expect_kv_close(*gpu, *cpu, std::string(GetParam()) + " prefill");
  {  // chunking must not change the result beyond GEMM summation order
    CudaOptions one = opt;
    one.prefill_chunk = 1024;
    auto whole = make_cuda_backend(*model, one);
    whole->prefill(prompt);
    expect_kv_close(*gpu, *whole, std::string(GetParam()) + " chunked vs whole");
  }

  DenoiseRequest req;
  req.canvas = c1;
  req.temperature = 0.8f;
  req.want_logits = true;
  DenoiseResult a, b;
  cpu->denoise(req, a);
  gpu->denoise(req, b);
  expect_logits_close(b, a, L, V, std::string(GetParam()) + " denoise");

  std::vector<float> sc = a.logits;
  for (auto& x : sc) x /= 0.8f;
  req.self_condition = SelfCondition::External;
  req.sc_logits = sc;
  cpu->denoise(req, a);
  gpu->denoise(req, b);
  expect_logits_close(b, a, L, V, std::string(GetParam()) + " external SC");

  req.self_condition = SelfCondition::PreviousStep;
  req.sc_logits = {};
  cpu->denoise(req, a);
  gpu->denoise(req, b);
  expect_logits_close(b, a, L, V, std::string(GetParam()) + " previous-step SC");

  req.self_condition = SelfCondition::CanvasEmbedding;
  cpu->denoise(req, a);
  gpu->denoise(req, b);
  expect_logits_close(b, a, L, V, std::string(GetParam()) + " canvas-embedding SC");

  cpu->prefill(c1);
  gpu->prefill(c1);
  // The committed canvas went through no decoder, but its tokens are random and the encoder is the same chaotic
  // stack: accumulated, reported (its own per-stage error is asserted by LayerTrace).
  expect_kv_close(*gpu, *cpu, std::string(GetParam()) + " commit", false);
  req.canvas = c2;
  req.self_condition = SelfCondition::None;
  cpu->denoise(req, a);
  gpu->denoise(req, b);
  expect_logits_close(b, a, L, V, std::string(GetParam()) + " after commit");

  // Rewind the commit: the ring keeps sliding_rewind extra slots, so this needs no recomputation.
  const int64_t back = int64_t(prompt.size());
  ASSERT_TRUE(gpu->can_truncate(back));
  EXPECT_FALSE(gpu->can_truncate(gpu->kv_len() + 1));
  gpu->truncate(back);
  cpu->truncate(back);
  expect_kv_close(*gpu, *cpu, std::string(GetParam()) + " truncate");  // back to the prompt's K/V
  req.canvas = c1;
  cpu->denoise(req, a);
  gpu->denoise(req, b);
  expect_logits_close(b, a, L, V, std::string(GetParam()) + " after truncate");
}


// ---- Layer trace: where does CUDA leave the CPU oracle? -------------------------------------------------------------
// For each call, three runs: the CPU oracle (accumulated error "acc" = CPU vs CUDA from the same tokens), the CUDA
// backend, and a second CPU backend teacher-forced with the CUDA residual at every stage (LayerTrace::replay), so
// its stage s + 1 is computed in f32 from CUDA's stage s: "iso" = one stage's own error. A bug shows as a large iso
// error at one stage; bf16 rounding amplified by a chaotic model shows as small iso errors everywhere with acc
// growing from stage to stage. The iso errors (and iso logits) are what this test asserts; acc is printed.

struct Err {
  double max_rel = 0, rms_rel = 0;  // max|d| / max|ref|, ||d|| / ||ref||
  int bad_rows = 0;                 // rows whose own max|d| / max|ref row| > 5e-2
};

Err compare(const std::vector<float>& got, const std::vector<float>& want, int row) {
  Err e;
  double md = 0, mr = 0, sd = 0, sr = 0;
  for (size_t r0 = 0; r0 < want.size(); r0 += size_t(row)) {
    double rd = 0, rr = 0;
    for (size_t i = r0; i < r0 + size_t(row); ++i) {
      const double d = double(got[i]) - want[i];
      rd = std::max(rd, std::fabs(d));
      rr = std::max(rr, std::fabs(double(want[i])));
      sd += d * d;
      sr += double(want[i]) * want[i];
    }
    e.bad_rows += rd > 5e-2 * rr;
    md = std::max(md, rd);
    mr = std::max(mr, rr);
  }
  e.max_rel = md / std::max(mr, 1e-30);
  e.rms_rel = std::sqrt(sd / std::max(sr, 1e-30));
  return e;
}

// argmax agreement of got vs want over the rows whose want top-1 - top-2 margin exceeds twice the row's max |d|
// (below that a flip is allowed by the error itself); returns {agree, counted}.
std::pair<int, int> decisive_agreement(const std::vector<float>& got, const std::vector<float>& want, int L, int V) {
  int agree = 0, counted = 0;
  for (int r = 0; r < L; ++r) {
    const float* g = got.data() + size_t(r) * V;
    const float* w = want.data() + size_t(r) * V;
    int ga = 0, wa = 0;
    float top1 = -INFINITY, top2 = -INFINITY, md = 0;
    for (int i = 0; i < V; ++i) {
      if (g[i] > g[ga]) ga = i;
      if (w[i] > w[wa]) wa = i;
      if (w[i] > top1) top2 = top1, top1 = w[i];
      else if (w[i] > top2) top2 = w[i];
      md = std::max(md, std::fabs(g[i] - w[i]));
    }
    if (top1 - top2 <= 2 * md) continue;
    ++counted;
    agree += ga == wa;
  }
  return {agree, counted};
}

struct Triple {
  std::unique_ptr<Backend> cpu, iso, gpu;
  LayerTrace tc, ti, tg;
  int H = 0, V = 0;
  std::string name;

  // Stage s >= 1 up to num_layers is layer s - 1's output. A row of it may differ by O(0.1-1) without a bug when the
  // two backends routed it to different experts, which bf16 rounding can cause only at a router near-tie: the CPU's
  // k-th vs (k+1)-th logit gap within twice the row's router-logit difference (otherwise no ranking can swap).
  // Such rows are counted and excluded; every other row must match to a stage's own bf16 error.
  void report_stages(const std::string& what, int T) {
    const int n = int(tg.stages.size()), nl = gpu->config().num_layers;
    const int E = gpu->config().num_experts, K = gpu->config().top_k_experts;
    ASSERT_EQ(int(tc.stages.size()), n) << what;
    ASSERT_EQ(int(ti.stages.size()), n) << what;
    ASSERT_EQ(int(tg.experts.size()), nl) << what;
    ASSERT_EQ(int(ti.experts.size()), nl) << what;
    for (int s = 0; s < n; ++s) {
      Err a = compare(tg.stages[size_t(s)], tc.stages[size_t(s)], H);
      const auto& g = tg.stages[size_t(s)];
      const auto& w = ti.stages[size_t(s)];
      const int l = s - 1;
      const bool routed = l >= 0 && l < nl;
      int flips = 0, unexplained = 0;
      double md = 0, mr = 0, flip_err = 0, worst_ratio = 0;
      for (int r = 0; r < T; ++r) {
        double rd = 0, rr = 0;
        for (int i = 0; i < H; ++i) {
          rd = std::max(rd, std::fabs(double(g[size_t(r) * H + i]) - w[size_t(r) * H + i]));
          rr = std::max(rr, std::fabs(double(w[size_t(r) * H + i])));
        }
        bool flip = false;
        if (routed) {
          std::vector<int32_t> eg(tg.experts[size_t(l)].begin() + r * K, tg.experts[size_t(l)].begin() + (r + 1) * K);
          std::vector<int32_t> ec(ti.experts[size_t(l)].begin() + r * K, ti.experts[size_t(l)].begin() + (r + 1) * K);
          std::sort(eg.begin(), eg.end());
          std::sort(ec.begin(), ec.end());
          flip = eg != ec;
          if (flip) {
            const float* rc = ti.router_logits[size_t(l)].data() + size_t(r) * E;
            const float* rg = tg.router_logits[size_t(l)].data() + size_t(r) * E;
            std::vector<float> sorted(rc, rc + E);
            std::sort(sorted.begin(), sorted.end(), std::greater<float>());
            double delta = 0;
            for (int e = 0; e < E; ++e) delta = std::max(delta, std::fabs(double(rc[e]) - rg[e]));
            const double gap = double(sorted[size_t(K) - 1]) - sorted[size_t(K)];
            worst_ratio = std::max(worst_ratio, gap / std::max(2 * delta + 1e-6, 1e-30));
            unexplained += gap > 2 * delta + 1e-6;  // no rounding can reorder a gap wider than that
          }
        }
        if (flip) {
          ++flips;
          flip_err = std::max(flip_err, rd / std::max(rr, 1e-30));
          continue;
        }
        md = std::max(md, rd);
        mr = std::max(mr, rr);
      }
      const double iso = md / std::max(mr, 1e-30);
      std::printf("[trace] %-7s %-14s stage %2d  acc max %.2e rms %.2e bad %2d/%d | iso max %.2e (%d routing flips at "
                  "near-ties: row err <= %.2e, gap/(2 delta) <= %.2f)\n", name.c_str(), what.c_str(), s, a.max_rel,
                  a.rms_rel, a.bad_rows, T, iso, flips, flip_err, worst_ratio);
      // One stage in bf16 activations (f32 residual, f32 router): max-element error measured <= 2.5e-2 on the
      // H200 (typically a few 1e-3); a wrong stage is O(0.1-1) on most rows.
      EXPECT_LE(iso, 5e-2) << name << " " << what << " stage " << s << " own error (rows routed alike)";
      EXPECT_EQ(unexplained, 0) << name << " " << what << " stage " << s << ": routing differs away from a near-tie";
    }
  }
  void report_kv(const std::string& what) {
    for (int l = 0; l < gpu->config().num_layers; ++l) {
      KvSnapshot g = gpu->kv_snapshot(l), c = cpu->kv_snapshot(l), i = iso->kv_snapshot(l);
      ASSERT_EQ(g.n, c.n);
      ASSERT_EQ(g.n, i.n);
      const int row = g.n_kv_heads * g.head_dim;
      Err ak = compare(g.k, c.k, row), av = compare(g.v, c.v, row), ik = compare(g.k, i.k, row),
          iv = compare(g.v, i.v, row);
      std::printf("[trace] %-7s %-14s kv layer %d (%s)  acc k %.2e v %.2e | iso k %.2e v %.2e\n", name.c_str(),
                  what.c_str(), l, gpu->config().layers[size_t(l)].kind == LayerKind::Sliding ? "sliding" : "full",
                  ak.max_rel, av.max_rel, ik.max_rel, iv.max_rel);
      EXPECT_LE(ik.max_rel, 2e-2) << name << " " << what << " k layer " << l;
      EXPECT_LE(iv.max_rel, 2e-2) << name << " " << what << " v layer " << l;
    }
  }
  void prefill(std::span<const int32_t> ids, const std::string& what) {
    cpu->prefill(ids);
    gpu->prefill(ids);
    iso->prefill(ids);
    report_stages(what, int(ids.size()));
    report_kv(what);
  }
  void denoise(const DenoiseRequest& req, const std::string& what, std::vector<float>* cpu_logits = nullptr) {
    const int L = int(req.canvas.size());
    DenoiseResult c, g, i;
    cpu->denoise(req, c);
    gpu->denoise(req, g);
    iso->denoise(req, i);
    report_stages(what, L);
    Err a = compare(g.logits, c.logits, V), e = compare(g.logits, i.logits, V);
    auto [aa, an] = decisive_agreement(g.logits, c.logits, L, V);
    auto [ia, in] = decisive_agreement(g.logits, i.logits, L, V);
    int raw = 0;
    for (int r = 0; r < L; ++r) raw += g.rows[size_t(r)].argmax == c.rows[size_t(r)].argmax;
    std::printf("[trace] %-7s %-14s logits    acc max %.2e argmax %d/%d (decisive %d/%d) | iso max %.2e decisive "
                "%d/%d\n", name.c_str(), what.c_str(), a.max_rel, raw, L, aa, an, e.max_rel, ia, in);
    EXPECT_LE(e.max_rel, 2e-2) << name << " " << what << " lm_head + softcap own error";
    EXPECT_EQ(ia, in) << name << " " << what << " decisive argmax disagreement on the lm_head's own error";
    for (int r = 0; r < L; ++r) {  // the GPU row stats describe the GPU's own logits
      RowStats own = compute_row_stats(g.logits.data() + size_t(r) * V, V, req.temperature);
      EXPECT_EQ(own.argmax, g.rows[size_t(r)].argmax) << name << " " << what << " row " << r;
      EXPECT_NEAR(own.entropy, g.rows[size_t(r)].entropy, 1e-4 * std::max(1.0f, own.entropy));
    }
    if (cpu_logits) *cpu_logits = std::move(c.logits);
  }
};

TEST_P(CudaParity, LayerTrace) {
  auto info = cuda::query_device(0);
  if (!info.available) GTEST_SKIP() << "no GPU: " << info.reason;
  FixtureCase fc = load_case(GetParam());
  auto& model = fc.model;
  const auto &prompt = fc.prompt, &c1 = fc.canvas1, &c2 = fc.canvas2;
  Triple t;
  t.name = GetParam();
  t.H = model->config.hidden_size;
  t.V = model->config.vocab_size;
  t.cpu = make_cpu_backend(*model, 2);
  t.iso = make_cpu_backend(*model, 2);
  CudaOptions opt = cuda_test_options();
  opt.max_context = 1024;
  opt.prefill_chunk = 1024;  // one chunk per prefill: stages are per call (chunking is checked by MatchesCpuBackend)
  opt.sliding_rewind = int64_t(c1.size());
  opt.progress = false;
  t.gpu = make_cuda_backend(*model, opt);
  t.ti.replay = &t.tg.stages;
  t.cpu->set_layer_trace(&t.tc);
  t.gpu->set_layer_trace(&t.tg);
  t.iso->set_layer_trace(&t.ti);

  t.prefill(prompt, "prefill");
  DenoiseRequest req;
  req.canvas = c1;
  req.temperature = 0.8f;
  req.want_logits = true;
  std::vector<float> sc;
  t.denoise(req, "denoise", &sc);
  for (auto& x : sc) x /= 0.8f;
  req.self_condition = SelfCondition::External;
  req.sc_logits = sc;
  t.denoise(req, "external SC");
  req.self_condition = SelfCondition::PreviousStep;
  req.sc_logits = {};
  t.denoise(req, "previous SC");
  req.self_condition = SelfCondition::CanvasEmbedding;
  t.denoise(req, "canvas SC");
  t.prefill(c1, "commit");
  req.canvas = c2;
  req.self_condition = SelfCondition::None;
  t.denoise(req, "after commit");
  const int64_t back = int64_t(prompt.size());
  t.gpu->truncate(back);
  t.cpu->truncate(back);
  t.iso->truncate(back);
  req.canvas = c1;
  t.denoise(req, "after truncate");
}

// The conditioned fixture (tiny-c), its generation options and prompt, and the tests' CUDA options for it.
struct ConditionedCuda {
  std::unique_ptr<LoadedModel> model;
  diffusion::GenerationOptions o;
  std::vector<int32_t> prompt;
  CudaOptions opt;
};
ConditionedCuda conditioned_cuda() {
  ConditionedCuda c;
  c.model = load_model(conditioned::fixture_dir());
  c.o = conditioned::options(*c.model);
  c.prompt = conditioned::prompt();
  c.opt = cuda_test_options();
  c.opt.max_context = 1024;
  c.opt.progress = false;
  return c;
}

// ---- Well-conditioned fixture: generation identical --------------------------------------------------------------
// tiny-c has no near-ties (ConditionedFixture.GenerationHasNoNearTies measures the margins on the CPU), so unlike
// the chaotic tiny-{a,b,v,g} the bf16 backend must reproduce the f32 generation exactly: issue 5's "generation
// identical where the CPU run has no near-ties". The single denoise is held to the accumulated logits bar too.
TEST(CudaParity, ConditionedGenerationIdentical) {
  auto info = cuda::query_device(0);
  if (!info.available) GTEST_SKIP() << "no GPU: " << info.reason;
  auto [model, o, prompt, opt] = conditioned_cuda();
  {  // one denoise after the prompt: accumulated error through the whole stack, asserted here
    auto cpu = make_cpu_backend(*model, 2);
    auto gpu = make_cuda_backend(*model, opt);
    cpu->prefill(prompt);
    gpu->prefill(prompt);
    std::vector<int32_t> canvas;
    for (int i = 0; i < model->config.canvas_length; ++i) canvas.push_back(int32_t(5 + (i * 53) % 240));
    DenoiseRequest req;
    req.canvas = canvas;
    req.temperature = 0.8f;
    req.want_logits = true;
    DenoiseResult a, b;
    cpu->denoise(req, a);
    gpu->denoise(req, b);
    const int L = int(canvas.size()), V = model->config.vocab_size;
    Err e = compare(b.logits, a.logits, V);
    int agree = 0;
    for (int r = 0; r < L; ++r) agree += a.rows[size_t(r)].argmax == b.rows[size_t(r)].argmax;
    std::printf("[parity] tiny-c denoise rel err %.3e (rms %.3e) argmax %d/%d\n", e.max_rel, e.rms_rel, agree, L);
    EXPECT_LE(e.max_rel, 2e-2);
    EXPECT_EQ(agree, L);
  }
  auto cpu = make_cpu_backend(*model, 2);
  auto gpu = make_cuda_backend(*model, opt);
  auto rc = diffusion::generate(*cpu, prompt, o);
  auto rg = diffusion::generate(*gpu, prompt, o);
  std::string ids;
  for (int32_t t : rg.ids) ids += std::to_string(t) + " ";
  std::printf("[parity] tiny-c generate: cpu %zu ids / %lld forwards, cuda %zu ids / %lld forwards; cuda ids: %s\n",
              rc.ids.size(), (long long)rc.forwards, rg.ids.size(), (long long)rg.forwards, ids.c_str());
  EXPECT_EQ(rg.ids, rc.ids);
  EXPECT_EQ(rg.steps_per_block(), rc.steps_per_block());
  EXPECT_EQ(rg.stop_token, rc.stop_token);
  EXPECT_EQ(rg.finish, rc.finish);
  EXPECT_EQ(rg.forwards, rc.forwards);
}

// Backends over one upload of the weights (server session slots) are independent: interleaved generations on two
// of them give, bit for bit, what a backend with its own weights gives for each alone.
TEST(CudaParity, SharedWeightsBackendsIndependent) {
  auto info = cuda::query_device(0);
  if (!info.available) GTEST_SKIP() << "no GPU: " << info.reason;
  auto model = load_model(conditioned::fixture_dir());
  const auto o = conditioned::options(*model);
  const auto prompt_a = conditioned::prompt();
  std::vector<int32_t> prompt_b(prompt_a.rbegin(), prompt_a.rend());
  CudaOptions opt = cuda_test_options();
  opt.max_context = 1024;
  opt.progress = false;
  auto alone_a = diffusion::generate(*make_cuda_backend(*model, opt), prompt_a, o);
  auto alone_b = diffusion::generate(*make_cuda_backend(*model, opt), prompt_b, o);

  auto weights = upload_cuda_weights(*model, opt);
  auto slot_a = make_cuda_backend(weights, opt), slot_b = make_cuda_backend(weights, opt);
  auto first_b = diffusion::generate(*slot_b, prompt_b, o);  // slot b runs first, then a, then b again
  auto shared_a = diffusion::generate(*slot_a, prompt_a, o);
  slot_b->truncate(0);
  auto shared_b = diffusion::generate(*slot_b, prompt_b, o);
  EXPECT_EQ(shared_a.ids, alone_a.ids);
  EXPECT_EQ(shared_a.forwards, alone_a.forwards);
  EXPECT_EQ(first_b.ids, alone_b.ids);
  EXPECT_EQ(shared_b.ids, alone_b.ids);
  EXPECT_EQ(shared_b.forwards, alone_b.forwards);
  {  // and the logits of one denoise, bitwise
    std::vector<int32_t> canvas;
    for (int i = 0; i < model->config.canvas_length; ++i) canvas.push_back(int32_t(7 + (i * 31) % 200));
    DenoiseRequest req;
    req.canvas = canvas;
    req.temperature = 0.8f;
    req.want_logits = true;
    auto own = make_cuda_backend(*model, opt);
    own->prefill(prompt_a);
    slot_a->truncate(0);
    slot_a->prefill(prompt_a);
    DenoiseResult x, y;
    own->denoise(req, x);
    slot_a->denoise(req, y);
    ASSERT_EQ(x.logits.size(), y.logits.size());
    EXPECT_EQ(0, std::memcmp(x.logits.data(), y.logits.data(), x.logits.size() * sizeof(float)));
  }
  CudaOptions other = opt;
  other.device = 1;
  EXPECT_THROW(make_cuda_backend(weights, other), Error) << "a backend on another device than its weights";
}

// CudaOptions::whole_step_graph: a whole denoise step as one CUDA graph gives, bit for bit, what the layers' graph
// with eager launches around it gives: a whole generation, then single steps over three SC modes, three temperatures
// and two KV lengths (every change of key re-captures; a repeat replays), with the temperature read from device
// memory (one graph for all of them) and as a launch argument (a graph per temperature), and with a PreviousStep
// step's SC GEMM as a graph of its own launched ahead of the rest (split_step_head) or inside the one graph, and
// queued behind the previous step (sc_head_ahead: every single step below says more steps follow, so the head is
// used by the PreviousStep steps and left unused by the CanvasEmbedding step and the prefill). The second round's
// prefill captures every step graph again for its KV length while it runs (prewarm_step_graphs), so those steps
// replay graphs captured in the middle of queued work.
TEST(CudaParity, WholeStepGraphMatchesLayerGraph) {
  auto info = cuda::query_device(0);
  if (!info.available) GTEST_SKIP() << "no GPU: " << info.reason;
  auto [model, o, prompt, layers] = conditioned_cuda();
  layers.whole_step_graph = false;
  const std::tuple<bool, bool, bool> variants[] = {
      {true, true, true}, {true, true, false}, {true, false, false}, {false, true, true}};
  for (const auto& [device_temperature, split_step_head, sc_head_ahead] : variants) {
    SCOPED_TRACE(::testing::Message() << "device_temperature " << device_temperature << ", split_step_head "
                                      << split_step_head << ", sc_head_ahead " << sc_head_ahead);
    CudaOptions whole = layers;
    whole.whole_step_graph = true;
    // on: one captured step for every temperature below (they differ from step to step, as in the block loop)
    whole.device_temperature = device_temperature;
    whole.split_step_head = split_step_head;
    whole.sc_head_ahead = sc_head_ahead;
    auto ga = make_cuda_backend(*model, layers), gb = make_cuda_backend(*model, whole);
    const auto gen_a = diffusion::generate(*ga, prompt, o);
    const auto gen_b = diffusion::generate(*gb, prompt, o);
    EXPECT_EQ(gen_a.ids, gen_b.ids);
    EXPECT_EQ(gen_a.forwards, gen_b.forwards);

    std::vector<int32_t> canvas;
    const int vocab = model->config.vocab_size;  // the conditioned fixture's vocabulary is small (256)
    for (int i = 0; i < model->config.canvas_length; ++i) canvas.push_back(int32_t((5 + i * 37) % vocab));
    const std::vector<int32_t> more(prompt.begin(), prompt.begin() + std::min<ptrdiff_t>(9, ptrdiff_t(prompt.size())));
    ga->truncate(0), gb->truncate(0);
    ga->prefill(prompt), gb->prefill(prompt);
    struct Step {
      SelfCondition sc;
      float temperature;
    };
    const Step steps[] = {{SelfCondition::None, 0.8f},         {SelfCondition::PreviousStep, 0.8f},
                          {SelfCondition::PreviousStep, 0.8f}, {SelfCondition::PreviousStep, 0.5f},
                          {SelfCondition::CanvasEmbedding, 1.0f}, {SelfCondition::PreviousStep, 1.0f}};
    for (int round = 0; round < 2; ++round) {
      if (round == 1) ga->prefill(more), gb->prefill(more);  // a longer KV: every graph re-captured
      for (size_t i = 0; i < std::size(steps); ++i) {
        DenoiseRequest req;
        req.canvas = canvas;
        req.temperature = steps[i].temperature;
        req.self_condition = steps[i].sc;
        req.more_steps = true;
        DenoiseResult x, y;
        ga->denoise(req, x);
        gb->denoise(req, y);
        ASSERT_EQ(x.rows.size(), y.rows.size());
        for (size_t r = 0; r < x.rows.size(); ++r) {
          SCOPED_TRACE(::testing::Message() << "round " << round << " step " << i << " row " << r);
          EXPECT_EQ(x.rows[r].argmax, y.rows[r].argmax);
          EXPECT_EQ(0, std::memcmp(&x.rows[r], &y.rows[r], sizeof(RowStats)));
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaParity, ::testing::ValuesIn(kTinyFixtures), tiny_fixture_test_name);

}  // namespace
}  // namespace dg
#endif  // DIFFGEMMA_WITH_CUDA
