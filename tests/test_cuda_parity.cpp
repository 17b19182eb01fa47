// CUDA backend vs the CPU oracle on every tiny fixture: prefill K/V, denoise logits (no SC, external SC, previous-step
// SC), commit, and an honest truncate. bf16 weights and activations on the GPU: relative error <= 2e-2 and argmax
// agreement >= 99% (the CPU oracle itself matches HF to 1e-6, see test_hf_parity.cpp).
#ifdef DIFFGEMMA_WITH_CUDA
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_device.h"
#include "model/weights.h"
#include "util/mmap_file.h"

namespace dg {
namespace {

const char* kFixtures[] = {"tiny-a", "tiny-b", "tiny-v"};

void expect_logits_close(const DenoiseResult& got, const DenoiseResult& want, int L, int V, const std::string& what) {
  ASSERT_EQ(got.logits.size(), want.logits.size()) << what;
  double md = 0, mr = 0;
  for (size_t i = 0; i < want.logits.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got.logits[i])) << what << " element " << i;
    md = std::max(md, double(std::fabs(got.logits[i] - want.logits[i])));
    mr = std::max(mr, double(std::fabs(want.logits[i])));
  }
  EXPECT_LE(md / mr, 2e-2) << what << ": max|d| " << md << " max|ref| " << mr;
  int agree = 0;
  for (int r = 0; r < L; ++r) {
    agree += got.rows[size_t(r)].argmax == want.rows[size_t(r)].argmax;
    EXPECT_NEAR(got.rows[size_t(r)].entropy, want.rows[size_t(r)].entropy,
                0.05 * std::max(1.0f, want.rows[size_t(r)].entropy)) << what << " row " << r;
    // the GPU row stats must describe the GPU's own logits exactly (dg::compute_row_stats semantics)
    RowStats own = compute_row_stats(got.logits.data() + size_t(r) * V, V, 0.8f);
    EXPECT_EQ(own.argmax, got.rows[size_t(r)].argmax) << what << " row " << r;
    EXPECT_NEAR(own.entropy, got.rows[size_t(r)].entropy, 1e-4 * std::max(1.0f, own.entropy));
  }
  EXPECT_GE(double(agree) / L, 0.99) << what << ": argmax agreement " << agree << " / " << L;
  std::printf("[parity] %-28s rel err %.3e  argmax %d/%d\n", what.c_str(), md / mr, agree, L);
}

void expect_kv_close(const Backend& got, const Backend& want, const std::string& what) {
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
      EXPECT_LE(md / mr, 2e-2) << what << " " << name << " layer " << l;
    }
  }
}

class CudaParity : public ::testing::TestWithParam<const char*> {};

TEST_P(CudaParity, MatchesCpuBackend) {
  auto info = cuda::query_device(0);
  if (!info.available) GTEST_SKIP() << "no GPU: " << info.reason;
  const std::string dir = std::string(DIFFGEMMA_FIXTURES_DIR) + "/" + GetParam();
  auto model = load_model(dir);
  auto cased = nlohmann::json::parse(read_text_file(dir + "/reference/case.json"));
  auto prompt = cased["prompt_ids"].get<std::vector<int32_t>>();
  auto c1 = cased["canvas1"].get<std::vector<int32_t>>(), c2 = cased["canvas2"].get<std::vector<int32_t>>();
  auto cpu = make_cpu_backend(*model, 2);
  CudaOptions opt;
  opt.max_context = 1024;
  opt.prefill_chunk = 7;  // several chunks per prefill: chunking must not change the result
  opt.sliding_rewind = int64_t(c1.size());
  opt.progress = false;
  auto gpu = make_cuda_backend(*model, opt);
  const int L = int(c1.size()), V = model->config.vocab_size;

  cpu->prefill(prompt);
  gpu->prefill(prompt);
  expect_kv_close(*gpu, *cpu, std::string(GetParam()) + " prefill");

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
  expect_kv_close(*gpu, *cpu, std::string(GetParam()) + " commit");
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
  expect_kv_close(*gpu, *cpu, std::string(GetParam()) + " truncate");
  req.canvas = c1;
  cpu->denoise(req, a);
  gpu->denoise(req, b);
  expect_logits_close(b, a, L, V, std::string(GetParam()) + " after truncate");
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaParity, ::testing::ValuesIn(kFixtures),
                         [](const auto& info) { return std::string(info.param).replace(4, 1, "_"); });

}  // namespace
}  // namespace dg
#endif  // DIFFGEMMA_WITH_CUDA
