// CUDA backend vs HF transformers on a checkpoint with the full 26B-A4B layer shapes (2 layers: one sliding, one
// full; 128 experts, vocab 262144) and gentle random weights, so the comparison is well conditioned.
// Issue 5 asks for logits cosine >= 0.999 and argmax agreement >= 99%. Measured on the H200 (docs/BENCHMARKS.md):
// HF's own bf16 run reaches only cosine 0.990-0.993 against its f32 run on this model (top-8 of 128 routing flips at
// near-ties under bf16 rounding; the fixture script WARNs about it), so 0.999 is not attainable by any bf16 engine
// here. Asserted instead: against the exact-math reference (HF f32) the CUDA backend is at least as close as HF bf16
// is (the cosine floor stored in case.json), argmax agreement >= 99% on decisive rows against both HF runs, and the
// K/V caches at least as close to HF f32 as HF bf16's own.
// The checkpoint is ~5 GB and is generated on the GPU machine, never committed:
//   HF_HUB_OFFLINE=1 python3 tools/reference/make_fullshape_fixture.py --out /tmp/fullshape
//   DIFFGEMMA_FULLSHAPE_DIR=/tmp/fullshape diffgemma_tests --gtest_filter='CudaFullShape.*'
// (tools/gpu/run_all.sh does both). Skips without the variable or without a GPU.
#ifdef DIFFGEMMA_WITH_CUDA
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_device.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "util/mmap_file.h"

namespace dg {
namespace {

const TensorView& tensor(const SafetensorsFile& f, const std::string& name) {
  auto it = f.tensors().find(name);
  if (it == f.tensors().end()) ADD_FAILURE() << "ref.safetensors has no tensor " << name;
  return it->second;
}

std::vector<int64_t> to_i64(const TensorView& t) {
  EXPECT_EQ(t.dtype, DType::I64) << t.name;
  std::vector<int64_t> v(size_t(t.numel()));
  std::memcpy(v.data(), t.data, v.size() * 8);
  return v;
}

// Logits of one case vs the HF run `run` ("bf16" or "f32"): cosine over the stored columns of all rows (float64),
// argmax agreement over the rows whose HF top-1 margin is >= 0.05 (near-ties excluded and counted).
void compare_case(const SafetensorsFile& ref, const std::string& run, const std::string& c, const DenoiseResult& got,
                  int L, int V, double floor) {
  const std::string p = run + ".logits." + c;
  auto cols = to_i64(tensor(ref, p + ".cols"));
  auto vals = tensor(ref, p + ".vals").to_f32();
  auto argmax = to_i64(tensor(ref, p + ".argmax"));
  auto margin = tensor(ref, p + ".margin").to_f32();
  ASSERT_EQ(vals.size(), size_t(L) * cols.size());
  ASSERT_EQ(got.logits.size(), size_t(L) * V);
  double dot = 0, gg = 0, ww = 0, md = 0;
  for (int r = 0; r < L; ++r)
    for (size_t j = 0; j < cols.size(); ++j) {
      const double g = got.logits[size_t(r) * V + size_t(cols[j])], w = vals[size_t(r) * cols.size() + j];
      dot += g * w, gg += g * g, ww += w * w;
      md = std::max(md, std::fabs(g - w));
    }
  const double cosine = dot / std::sqrt(gg * ww);
  int agree = 0, counted = 0, all_agree = 0;
  for (int r = 0; r < L; ++r) {
    const bool same = got.rows[size_t(r)].argmax == argmax[size_t(r)];
    all_agree += same;
    if (margin[size_t(r)] < 0.05f) continue;
    ++counted;
    agree += same;
  }
  std::printf("[fullshape] %-7s vs HF %-4s cosine %.6f  max|d| %.4f  argmax %d/%d (margin >= 0.05; %d near-ties "
              "excluded; all rows %d/%d)  [HF bf16 vs f32: cosine %.6f]\n", c.c_str(), run.c_str(), cosine, md, agree,
              counted, L - counted, all_agree, L, floor);
  if (run == "f32")
    EXPECT_GE(cosine, floor) << c << ": further from HF f32 than HF's own bf16 run";
  else  // two bf16 engines, each ~0.99 from the exact result
    EXPECT_GE(cosine, 0.98) << c << " vs HF " << run;
  ASSERT_GT(counted, 0);
  EXPECT_GE(double(agree) / counted, 0.99) << c << " vs HF " << run << ": " << agree << " / " << counted;
}

double cosine(const std::vector<float>& a, const std::vector<float>& b) {
  double dot = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < a.size(); ++i) dot += double(a[i]) * b[i], aa += double(a[i]) * a[i], bb += double(b[i]) * b[i];
  return dot / std::sqrt(aa * bb);
}

void report_kv(const Backend& gpu, const SafetensorsFile& ref, const std::string& stage) {
  for (int l = 0; l < gpu.config().num_layers; ++l) {
    KvSnapshot s = gpu.kv_snapshot(l);
    for (auto [mine, name] : {std::pair{&s.k, "k"}, std::pair{&s.v, "v"}}) {
      const std::string key = stage + "." + name + "." + std::to_string(l);
      auto hb = tensor(ref, "bf16." + key).to_f32(), hf = tensor(ref, "f32." + key).to_f32();
      if (hb.size() != mine->size() || hf.size() != mine->size()) {
        ADD_FAILURE() << key << ": " << mine->size() << " vs HF " << hb.size() << " / " << hf.size();
        continue;
      }
      const double vs_f32 = cosine(*mine, hf), vs_bf16 = cosine(*mine, hb), floor = cosine(hb, hf);
      std::printf("[fullshape] %-7s kv %s layer %d: cosine vs HF f32 %.6f, vs HF bf16 %.6f  [HF bf16 vs f32 %.6f]\n",
                  stage.c_str(), name, l, vs_f32, vs_bf16, floor);
      EXPECT_GE(vs_f32, std::min(0.999, floor)) << key;
    }
  }
}

TEST(CudaFullShape, MatchesHfTransformers) {
  const char* dir_env = std::getenv("DIFFGEMMA_FULLSHAPE_DIR");
  if (!dir_env || !*dir_env)
    GTEST_SKIP() << "set DIFFGEMMA_FULLSHAPE_DIR (tools/reference/make_fullshape_fixture.py output)";
  auto info = cuda::query_device(0);
  if (!info.available) GTEST_SKIP() << "no GPU: " << info.reason;
  const std::string dir = dir_env;
  auto model = load_model(dir);
  auto cased = nlohmann::json::parse(read_text_file(dir + "/reference/case.json"));
  auto prompt = cased["prompt_ids"].get<std::vector<int32_t>>();
  auto c1 = cased["canvas1"].get<std::vector<int32_t>>(), c2 = cased["canvas2"].get<std::vector<int32_t>>();
  SafetensorsFile ref(dir + "/reference/ref.safetensors");
  auto floor = [&](const char* c) { return cased["stats"]["bf16_vs_f32"][c]["cosine"].get<double>(); };
  const int L = int(c1.size()), V = model->config.vocab_size;

  CudaOptions opt;
  opt.max_context = int64_t(prompt.size() + c1.size() + c2.size());
  opt.progress = false;
  auto gpu = make_cuda_backend(*model, opt);
  gpu->prefill(prompt);
  report_kv(*gpu, ref, "prefill");

  DenoiseRequest req;
  req.canvas = c1;
  req.temperature = 0.8f;
  req.want_logits = true;
  DenoiseResult out;
  gpu->denoise(req, out);
  for (const char* run : {"bf16", "f32"}) compare_case(ref, run, "nosc", out, L, V, floor("nosc"));

  // The SC input HF saw: bf16(logits_nosc / 0.8) of its bf16 run (already tempered: External).
  std::vector<float> sc = tensor(ref, "sc_input").to_f32();
  ASSERT_EQ(sc.size(), size_t(L) * V);
  req.self_condition = SelfCondition::External;
  req.sc_logits = sc;
  gpu->denoise(req, out);
  for (const char* run : {"bf16", "f32"}) compare_case(ref, run, "sc", out, L, V, floor("sc"));

  gpu->prefill(c1);
  report_kv(*gpu, ref, "commit");
  req.canvas = c2;
  req.self_condition = SelfCondition::None;
  req.sc_logits = {};
  gpu->denoise(req, out);
  for (const char* run : {"bf16", "f32"}) compare_case(ref, run, "commit", out, L, V, floor("commit"));
}

}  // namespace
}  // namespace dg
#endif  // DIFFGEMMA_WITH_CUDA
