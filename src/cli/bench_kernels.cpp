// `diffgemma bench-kernels`: every CUDA kernel launcher of a layer step (and the cuBLASLt GEMMs beside them) timed
// alone at the full-size model's shapes, on synthetic inputs: the per-kernel timing entries that go with the kernel
// tests (tests/test_cuda_kernels.cpp). Each launcher runs `reps` times back to back on one stream with programmatic
// dependent launch off (so no launch overlaps its predecessor) and reports the mean time a call, with the bytes it
// must move and the FLOPs it must do turned into GB/s and TFLOP/s. Inputs that fit in L2 stay warm from call to call,
// as in the engine; the weight-streaming kernels (experts, GEMMs over the embedding table) do not fit.
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "util/error.h"

#ifdef DIFFGEMMA_WITH_CUDA
#include <cuda_runtime.h>

#include <nlohmann/json.hpp>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_device.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/pdl.h"
#include "model/config.h"
#endif

namespace dg::cli {
namespace {

struct BenchKernelsArgs {
  int reps = 20;
  int kv = 4096;
  std::string filter;  // substring of the entry names to run (empty: all)
  bool json = false;
  // Each call inside one captured graph right after a one-word copy kernel, as the engine's step graphs launch them,
  // less the same graph without the calls (the lm_head: ~526 us that way in the GEMM tuner, 482 in eager calls).
  bool in_graph = false;
};

#ifdef DIFFGEMMA_WITH_CUDA
using cuda::bf16;
using cuda::Dt;

// Device buffers owned for the run; filled with uniform values so that no kernel sees NaN or denormal garbage.
class Arena {
 public:
  ~Arena() {
    for (void* p : blocks_) cudaFree(p);
  }
  template <class T>
  T* take(size_t n) {
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
    blocks_.push_back(p);
    return static_cast<T*>(p);
  }
  bf16* bf16s(size_t n, float scale, float offset = 0.0f) {
    bf16* p = take<bf16>(n);
    cuda::fill_uniform_bf16(p, n, ++seed_, scale, offset, nullptr);
    return p;
  }
  float* f32s(size_t n, float scale, float offset = 0.0f) {
    float* p = take<float>(n);
    cuda::fill_uniform_f32(p, n, ++seed_, scale, offset, nullptr);
    return p;
  }

 private:
  std::vector<void*> blocks_;
  uint64_t seed_ = 100;
};

struct Entry {
  std::string name, shape;
  double bytes = 0, flops = 0;      // what one call must move / compute (for the rates)
  std::function<void(cudaStream_t)> run;
};

int run_bench_kernels(const BenchKernelsArgs& args) {
  if (args.reps < 1) fail("--reps must be >= 1, got {}", args.reps);
  if (args.kv < 1024) fail("--kv must be >= 1024 (the sliding window), got {}", args.kv);
  const cuda::DeviceInfo dev = cuda::query_device(0);
  if (!dev.available) fail("bench-kernels needs a CUDA GPU: {}", dev.reason);
  const ModelConfig c = diffusiongemma_26b_a4b_config();
  const int T = c.canvas_length, H = c.hidden_size, E = c.num_experts, K = c.top_k_experts;
  const int Ie = c.moe_intermediate_size, Id = c.intermediate_size, V = c.vocab_size, nh = c.num_heads;
  const int W1 = c.sliding_window - 1, kv = args.kv;
  const float eps = c.rms_norm_eps;
  const LayerShape& sl = c.layers[0];
  const LayerShape& fl = c.layers[5];
  cuda::set_pdl(false);
  cudaStream_t s = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Arena ar;
  cuda::Gemm gemm;
  std::vector<Entry> entries;
  auto add = [&](std::string name, std::string shape, double bytes, double flops, std::function<void(cudaStream_t)> f) {
    entries.push_back({std::move(name), std::move(shape), bytes, flops, std::move(f)});
  };
  const std::string tH = std::to_string(T) + "x" + std::to_string(H);

  // ---- activations of one canvas pass ----
  float* h = ar.f32s(size_t(T) * H, 1.0f);
  bf16* a_bf = ar.bf16s(size_t(T) * H, 1.0f);
  bf16 *x1 = ar.take<bf16>(size_t(T) * H), *xe = ar.bf16s(size_t(T) * H, 1.0f);
  float* xr = ar.f32s(size_t(T) * H, 1.0f);
  float* w_h = ar.f32s(H, 0.25f, 1.0f);  // norm weights
  float* rscale = ar.f32s(H, 0.25f, 1.0f);
  bf16* embed = ar.bf16s(size_t(V) * H, 0.05f);
  std::vector<int32_t> ids_h(static_cast<size_t>(T));
  for (int t = 0; t < T; ++t) ids_h[size_t(t)] = (t * 7919 + 13) % V;
  int32_t* ids = ar.take<int32_t>(T);
  CUDA_CHECK(cudaMemcpy(ids, ids_h.data(), ids_h.size() * sizeof(int32_t), cudaMemcpyHostToDevice));

  add("embed_scale", std::to_string(T) + " ids, H " + std::to_string(H), double(T) * H * 6, 0,
      [=](cudaStream_t st) { cuda::embed_scale(ids, T, embed, H, 53.0f, h, st); });
  // The whole-step graph's statistics download: a canvas of DeviceRowStats into mapped pinned host memory.
  const size_t stat_words = size_t(T) * sizeof(cuda::DeviceRowStats) / 4;
  uint32_t* stats_host = nullptr;
  uint32_t* stats_mapped = nullptr;
  CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&stats_host), stat_words * 4, cudaHostAllocMapped));
  const std::unique_ptr<void, void (*)(void*)> stats_host_owner(stats_host, [](void* p) { cudaFreeHost(p); });
  CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&stats_mapped), stats_host, 0));
  const float* stats_src = h;
  add("copy_words", std::to_string(T) + " row stats to mapped host memory", double(stat_words) * 8, 0,
      [=](cudaStream_t st) { cuda::copy_words(stats_src, stat_words, stats_mapped, st); });
  add("rms_norm_f32_to_bf16", tH, double(T) * H * 6, 0,
      [=](cudaStream_t st) { cuda::rms_norm_f32_to_bf16(h, T, H, w_h, eps, x1, st); });
  add("add_rms_norm_pre_ffn", tH, double(T) * H * 18, 0, [=](cudaStream_t st) {
    cuda::add_rms_norm_pre_ffn(h, a_bf, T, H, w_h, w_h, w_h, rscale, eps, x1, xe, xr, st);
  });

  // ---- attention side, sliding and full layers ----
  for (const LayerShape* ls : {&sl, &fl}) {
    const bool sliding = ls->kind == LayerKind::Sliding;
    const int D = ls->head_dim, nkv = ls->n_kv_heads, nqkv = (nh + (ls->has_v_proj ? 2 : 1) * nkv) * D;
    const std::string tag = sliding ? " (sliding)" : " (full)";
    bf16* wqkv = ar.bf16s(size_t(nqkv) * H, 0.02f);
    bf16* qkv = ar.take<bf16>(size_t(T) * nqkv);
    bf16 *q = ar.take<bf16>(size_t(T) * nh * D), *kn = ar.take<bf16>(size_t(T) * nkv * D);
    bf16* vn = ar.take<bf16>(size_t(T) * nkv * D);
    float *qw = ar.f32s(D, 0.25f, 1.0f), *kw = ar.f32s(D, 0.25f, 1.0f);
    std::vector<float> inv_freq(size_t(D / 2), 0.0f);
    for (int i = 0; i < ls->rope.rotated_pairs && i < D / 2; ++i)  // as the engine's tables (model-reference §3)
      inv_freq[size_t(i)] = float(std::pow(double(ls->rope.theta), -2.0 * i / double(ls->rope.exponent_dim)));
    float* dfreq = ar.take<float>(inv_freq.size());
    CUDA_CHECK(cudaMemcpy(dfreq, inv_freq.data(), inv_freq.size() * sizeof(float), cudaMemcpyHostToDevice));
    add("GEMM qkv" + tag, std::to_string(T) + "x" + std::to_string(H) + " . " + std::to_string(nqkv) + "x" +
        std::to_string(H) + "^T", 2.0 * (double(nqkv) * H + double(T) * (H + nqkv)), 2.0 * T * H * nqkv,
        [=, &gemm](cudaStream_t st) { gemm.linear(x1, Dt::BF16, T, wqkv, Dt::BF16, nqkv, H, qkv, Dt::BF16, st); });
    add("qkv_norm_rope" + tag, std::to_string(T) + " x " + std::to_string(nqkv), 4.0 * T * nqkv, 0,
        [=](cudaStream_t st) {
          cuda::qkv_norm_rope(qkv, T, nh, nkv, D, !ls->has_v_proj, qw, kw, dfreq, kv, eps, q, kn, vn, st);
        });
    // the cache: the window's last W - 1 positions (sliding) or all kv (full), in a ring of cap slots
    const int64_t cap = sliding ? W1 : kv, n_old = sliding ? W1 : kv, first = sliding ? kv - W1 : 0;
    bf16* kc = ar.bf16s(size_t(cap) * nkv * D, 1.0f);
    bf16* vc = ar.bf16s(size_t(cap) * nkv * D, 1.0f);
    bf16* att = ar.take<bf16>(size_t(T) * nh * D);
    cuda::AttentionArgs at{};
    at.q = q, at.T = T, at.nh = nh, at.nkv = nkv, at.D = D;
    at.k_cache = kc, at.v_cache = vc, at.cap = cap, at.first_pos = first, at.n_old = n_old;
    at.k_new = kn, at.v_new = vn, at.T_new = T, at.q_pos0 = kv, at.causal = false;
    at.window = sliding ? c.sliding_window : 0, at.out = att;
    const double keys = double(n_old + T);
    add("attention" + tag, "denoise, " + std::to_string(T) + " queries x " + std::to_string(int64_t(keys)) +
        " keys, D " + std::to_string(D), 2.0 * keys * nkv * D * 2 + 4.0 * T * nh * D, 4.0 * T * nh * keys * D,
        [=](cudaStream_t st) { cuda::attention(at, st); });
    cuda::AttentionArgs pre = at;  // a commit: causal over [cache ; canvas], the canvas's K/V then written
    pre.causal = true;
    add("attention commit" + tag, "causal, " + std::to_string(T) + " queries", 2.0 * keys * nkv * D * 2,
        2.0 * T * nh * keys * D, [=](cudaStream_t st) { cuda::attention(pre, st); });
    if (D == 512) {  // the previous D = 512 kernel beside the default (cuda::set_attention_ws512)
      auto on_wgx = [](const cuda::AttentionArgs& args, cudaStream_t st) {
        cuda::set_attention_ws512(false);
        cuda::attention(args, st);
        cuda::set_attention_ws512(true);
      };
      add("attention" + tag + ", attention_wgx_k", "denoise, as above", 2.0 * keys * nkv * D * 2 + 4.0 * T * nh * D,
          4.0 * T * nh * keys * D, [=](cudaStream_t st) { on_wgx(at, st); });
      add("attention commit" + tag + ", attention_wgx_k", "causal, as above", 2.0 * keys * nkv * D * 2,
          2.0 * T * nh * keys * D, [=](cudaStream_t st) { on_wgx(pre, st); });
    }
    // The denoise attention as cuBLASLt GEMMs around a softmax (CudaOptions::gemm_attention: the engine's path for
    // the full layers; the sliding layers keep the fused kernel), over n_keys contiguous key rows.
    const int n_keys = int(n_old + T), n_cols = cuda::gemm_attention_key_columns(n_keys);
    bf16* kg = ar.bf16s(size_t(n_cols) * nkv * D, 1.0f);
    bf16* vg = ar.bf16s(size_t(n_cols) * nkv * D, 1.0f);
    float* S = ar.take<float>(size_t(nh) * T * n_cols);
    bf16* P = ar.take<bf16>(size_t(nh) * T * n_cols);
    void** ptrs = ar.take<void*>(cuda::gemm_attention_pointer_count(nh));
    const cuda::GemmAttentionArgs ga{q, nh, nkv, D, kg, vg, S, P, T, n_cols, att, ptrs};
    cuda::set_gemm_attention_pointers(ga, s);
    add(std::string("attention GEMMs") + tag + (sliding ? ", not the engine's" : ", the engine's"),
        "S = QK^T, softmax, PV over " + std::to_string(n_keys) + " keys",
        2.0 * keys * nkv * D * 2 + 12.0 * nh * T * n_cols, 4.0 * T * nh * keys * D,
        [=, &gemm](cudaStream_t st) { cuda::gemm_attention(gemm, ga, T, n_keys, st); });
    if (!sliding)  // CudaOptions::discard_attention_scores: each score line dropped from L2 once the softmax read it
      add("attention GEMMs" + tag + ", scores discarded", "as above, S's lines discarded by the softmax",
          2.0 * keys * nkv * D * 2 + 12.0 * nh * T * n_cols, 4.0 * T * nh * keys * D,
          [=, &gemm](cudaStream_t st) { cuda::gemm_attention(gemm, ga, T, n_keys, st, /*discard_scores=*/true); });
    add("softmax_rows_to_bf16" + tag, std::to_string(nh * T) + " rows x " + std::to_string(n_keys),
        6.0 * nh * T * n_cols, 0,
        [=](cudaStream_t st) { cuda::softmax_rows_to_bf16(S, n_cols, T, nh, T, n_keys, n_cols, P, st); });
    add("kv_write" + tag, std::to_string(T) + " rows of " + std::to_string(nkv * D), 8.0 * T * nkv * D, 0,
        [=](cudaStream_t st) { cuda::kv_write(kn, vn, T, nkv * D, kv, kc, vc, cap, st); });
    bf16* wo = ar.bf16s(size_t(H) * nh * D, 0.02f);
    add("GEMM o_proj" + tag, std::to_string(T) + "x" + std::to_string(nh * D) + " . " + std::to_string(H) + "x" +
        std::to_string(nh * D) + "^T", 2.0 * (double(H) * nh * D + double(T) * (nh * D + H)), 2.0 * T * H * nh * D,
        [=, &gemm](cudaStream_t st) { gemm.linear(att, Dt::BF16, T, wo, Dt::BF16, H, nh * D, a_bf, Dt::BF16, st); });
    // The same two GEMMs on kernels_dense_tma.cu (split-K f32 partials; the engine's readers add them up as they
    // load them, here dense_splits_to_bf16 stands in for that), clusters of 1 and 2.
    if (cuda::dense_tma_supported(T, nqkv, H) && cuda::dense_tma_supported(T, H, nh * D)) {
      for (const int cl : {1, 2}) {
        const int cluster = cuda::dense_tma_cluster(cl);
        if (cluster != cl) continue;
        const std::string ctag = ", cluster " + std::to_string(cl);
        const int sq = cuda::dense_tma_splits(nqkv, H, cl), so = cuda::dense_tma_splits(H, nh * D, cl);
        float* part = ar.take<float>(size_t(std::max(sq * nqkv, so * H)) * T);
        const cuda::TmaMap wq = cuda::dense_tma_weight_map(wqkv, nqkv, H), xq = cuda::dense_tma_token_map(x1, T, H, cl);
        const cuda::TmaMap wom = cuda::dense_tma_weight_map(wo, H, nh * D);
        const cuda::TmaMap xo = cuda::dense_tma_token_map(att, T, nh * D, cl);
        const double qb = 2.0 * (double(nqkv) * H + double(T) * (H + nqkv)), qf = 2.0 * T * H * nqkv;
        const double ob = 2.0 * (double(H) * nh * D + double(T) * (nh * D + H)), of = 2.0 * T * H * nh * D;
        add("GEMM qkv dense TMA" + tag + ctag, std::to_string(sq) + " splits", qb, qf,
            [=](cudaStream_t st) { cuda::dense_tma_splitk(wq, xq, T, nqkv, H, sq, cl, part, st); });
        add("GEMM qkv dense TMA + splits to bf16" + tag + ctag, std::to_string(sq) + " splits", qb, qf,
            [=](cudaStream_t st) {
              cuda::dense_tma_splitk(wq, xq, T, nqkv, H, sq, cl, part, st);
              cuda::dense_splits_to_bf16(part, sq, T, nqkv, qkv, st);
            });
        add("GEMM o_proj dense TMA" + tag + ctag, std::to_string(so) + " splits", ob, of,
            [=](cudaStream_t st) { cuda::dense_tma_splitk(wom, xo, T, H, nh * D, so, cl, part, st); });
        add("GEMM o_proj dense TMA + splits to bf16" + tag + ctag, std::to_string(so) + " splits", ob, of,
            [=](cudaStream_t st) {
              cuda::dense_tma_splitk(wom, xo, T, H, nh * D, so, cl, part, st);
              cuda::dense_splits_to_bf16(part, so, T, H, a_bf, st);
            });
      }
    }
  }

  // ---- dense MLP ----
  bf16* dgu = ar.bf16s(size_t(2 * Id) * H, 0.02f);
  bf16* ddn = ar.bf16s(size_t(H) * Id, 0.02f);
  bf16 *gu = ar.take<bf16>(size_t(T) * 2 * Id), *actd = ar.take<bf16>(size_t(T) * Id);
  bf16* m1 = ar.take<bf16>(size_t(T) * H);
  add("GEMM dense gate_up", std::to_string(T) + "x" + std::to_string(H) + " . " + std::to_string(2 * Id) + "x" +
      std::to_string(H) + "^T", 2.0 * (2.0 * Id * H + double(T) * (H + 2 * Id)), 2.0 * T * H * 2 * Id,
      [=, &gemm](cudaStream_t st) { gemm.linear(x1, Dt::BF16, T, dgu, Dt::BF16, 2 * Id, H, gu, Dt::BF16, st); });
  add("gelu_mul (dense)", std::to_string(T) + " x " + std::to_string(Id), 6.0 * T * Id, 0,
      [=](cudaStream_t st) { cuda::gelu_mul(gu, T, Id, actd, st); });
  add("GEMM dense down", std::to_string(T) + "x" + std::to_string(Id) + " . " + std::to_string(H) + "x" +
      std::to_string(Id) + "^T", 2.0 * (double(H) * Id + double(T) * (Id + H)), 2.0 * T * H * Id,
      [=, &gemm](cudaStream_t st) { gemm.linear(actd, Dt::BF16, T, ddn, Dt::BF16, H, Id, m1, Dt::BF16, st); });

  // ---- router and assignment ----
  const int M = cuda::moe_padded_rows_per_expert(T, K, E);
  float* router_w = ar.f32s(size_t(E) * H, 1.0f / std::sqrt(float(H)));
  float* pes = ar.f32s(E, 0.25f, 1.0f);
  float* rl = ar.take<float>(size_t(T) * E);
  float* partial = ar.take<float>(cuda::router_partial_floats(T, H));
  unsigned* tiles = ar.take<unsigned>(2 + size_t(E));  // gate_up's tile counters (+ the fused kernel's counts)
  CUDA_CHECK(cudaMemset(tiles, 0, (2 + size_t(E)) * sizeof(unsigned)));
  unsigned* masks = ar.take<unsigned>(cuda::expert_mask_words(T, E));
  int32_t* idx = ar.take<int32_t>(size_t(T) * K);
  float* wk = ar.take<float>(size_t(T) * K);
  // room for the fused expert launch's layout too (cuda::kFusedExpertRows an expert)
  const size_t rows_all = size_t(E) * std::max(M, cuda::kFusedExpertRows) + size_t(T) * K;
  int32_t *ovf = ar.take<int32_t>(size_t(E) + 1), *spos = ar.take<int32_t>(size_t(T) * K);
  int32_t *meta = ar.take<int32_t>(2 * size_t(E) + 1), *slot = ar.take<int32_t>(size_t(E) * M);
  const double router_bytes = double(T) * H * 4 + double(E) * H * 4;
  add("router_top_k (engine)", tH + " . " + std::to_string(E) + "x" + std::to_string(H) + "^T f32, top " +
      std::to_string(K) + ", expert masks", router_bytes, 2.0 * T * H * E, [=](cudaStream_t st) {
        cuda::router_top_k(xr, T, H, router_w, E, K, pes, partial, rl, idx, wk, masks, st);
      });
  for (bool tc : {true, false})
    add(std::string("router_top_k: partials GEMM alone, ") + (tc ? "3xTF32 (--router-tc)" : "f32 FMA (engine)"),
        "352 blocks of 32 tokens x 128 experts x 64 k", router_bytes, 2.0 * T * H * E, [=](cudaStream_t st) {
          cuda::set_router_tensor_cores(tc);
          cuda::router_top_k_stage(cuda::RouterStage::Partials, xr, T, H, router_w, E, K, pes, partial, rl, idx, wk,
                                   masks, st);
          cuda::set_router_tensor_cores(false);
        });
  add("router_top_k: route alone", "split sums, top-k, expert masks", 4.0 * double(cuda::router_partial_floats(T, H)), 0,
      [=](cudaStream_t st) {
        cuda::router_top_k_stage(cuda::RouterStage::Route, xr, T, H, router_w, E, K, pes, partial, rl, idx, wk, masks,
                                 st);
      });
  add("router via cuBLASLt (--cublas-router)", "f32 GEMM + route_top_k + moe_assign_padded", router_bytes,
      2.0 * T * H * E, [=, &gemm](cudaStream_t st) {
        gemm.linear(xr, Dt::F32, T, router_w, Dt::F32, E, H, rl, Dt::F32, st);
        cuda::route_top_k(rl, T, E, K, pes, idx, wk, st);
        cuda::moe_assign_padded(idx, T, K, E, M, ovf, spos, meta, slot, st);
      });
  add("route_top_k", std::to_string(T) + " x " + std::to_string(E) + " logits", double(T) * E * 4, 0,
      [=](cudaStream_t st) { cuda::route_top_k(rl, T, E, K, pes, idx, wk, st); });
  add("moe_assign_padded", std::to_string(T * K) + " pairs, M " + std::to_string(M), double(T) * K * 12, 0,
      [=](cudaStream_t st) { cuda::moe_assign_padded(idx, T, K, E, M, ovf, spos, meta, slot, st); });
  // the routing every entry below runs on (and a realistic one: top-8 of random logits)
  cuda::router_top_k(xr, T, H, router_w, E, K, pes, partial, rl, idx, wk, masks, s);
  cuda::moe_assign_padded(idx, T, K, E, M, ovf, spos, meta, slot, s);
  bf16* xs = ar.take<bf16>(rows_all * H);
  add("moe_gather", std::to_string(T * K) + " rows of " + std::to_string(H), double(T) * K * H * 4, 0,
      [=](cudaStream_t st) { cuda::moe_gather(spos, T, K, xe, H, xs, st); });
  cuda::moe_gather(spos, T, K, xe, H, xs, s);

  // ---- experts (canvas: padded to M rows; prefill chunks: grouped) ----
  bf16* wgu = ar.bf16s(size_t(E) * 2 * Ie * H, 1.0f / std::sqrt(float(H)));
  bf16* wdn = ar.bf16s(size_t(E) * H * Ie, 1.0f / std::sqrt(float(Ie)));
  bf16* acte = ar.bf16s(rows_all * Ie, 1.0f);
  float* y = ar.take<float>(std::max(rows_all * H, size_t(E) * M * 2 * Ie));
  const double gu_bytes = double(E) * 2 * Ie * H * 2, dn_bytes = double(E) * H * Ie * 2;
  const double gu_flops = 2.0 * T * K * H * 2 * Ie, dn_flops = 2.0 * T * K * H * Ie;
  const std::string pad = std::to_string(E) + " experts x " + std::to_string(M) + " rows";
  // Packed copies of the weights where the shapes allow (the engine's layout: CudaOptions::pack_expert_gate_up /
  // pack_expert_down; one 1D bulk copy a ring stage in the TMA kernels). The TMA kernels' shapes always allow it.
  bf16 *wgu_packed = nullptr, *wdn_packed = nullptr;
  if (cuda::expert_gate_up_packable(H, Ie)) {
    wgu_packed = ar.take<bf16>(size_t(E) * 2 * Ie * H);
    cuda::pack_expert_gate_up(wgu, wgu_packed, E, H, Ie, s);
  }
  if (cuda::expert_down_packable(H, Ie)) {
    wdn_packed = ar.take<bf16>(size_t(E) * H * Ie);
    cuda::pack_expert_down(wdn, wdn_packed, E, H, Ie, s);
  }
  if (cuda::experts_tma_supported(M, H, Ie)) {
    const cuda::TmaMap wgu_map = cuda::tma_map_bf16_rows(wgu, int64_t(E) * 2 * Ie, H, 64);
    const cuda::TmaMap wdn_map = cuda::tma_map_bf16_rows(wdn, int64_t(E) * H, Ie, 64);
    const cuda::TmaMap act_map = cuda::tma_map_bf16_rows(acte, int64_t(E) * M, Ie, M);
    const int32_t* valid = meta + 1 + E;
    add("gate_up TMA, tokens from the masks, tile counter, packed weights",
        pad + ", " + std::to_string(2 * Ie) + "x" + std::to_string(H), gu_bytes, gu_flops, [=](cudaStream_t st) {
          cuda::moe_gate_up_padded_tma_masked(wgu_map, xe, masks, T, E, H, Ie, acte, st,
                                              {.tile_counters = tiles, .gate_up_packed = wgu_packed});
        });
    add("gate_up TMA, tokens from the masks, tile counter, 2D boxes (--no-pack-gate-up)", pad, gu_bytes, gu_flops,
        [=](cudaStream_t st) {
          cuda::moe_gate_up_padded_tma_masked(wgu_map, xe, masks, T, E, H, Ie, acte, st, {.tile_counters = tiles});
        });
    add("gate_up + down fused TMA, packed gate_up only (--no-pack-down)", pad + ", one launch", gu_bytes + dn_bytes,
        gu_flops + dn_flops, [=](cudaStream_t st) {
          cuda::moe_experts_fused_tma_masked(wgu_map, wdn_map, xe, masks, T, E, H, Ie, acte, y, st,
                                             {.tile_counters = tiles, .gate_up_packed = wgu_packed});
        });
    add("down TMA, packed weights, rows from the masks (--no-fused-experts)", pad + ", " + std::to_string(H) + "x" +
        std::to_string(Ie), dn_bytes, dn_flops, [=](cudaStream_t st) {
          cuda::moe_down_padded_tma_masked(wdn_map, act_map, masks, T, E, H, Ie, y, st,
                                           {.down_packed = wdn_packed});
        });
    add("gate_up + down fused TMA, both packed (engine)", pad + ", one launch",
        gu_bytes + dn_bytes, gu_flops + dn_flops, [=](cudaStream_t st) {
          cuda::moe_experts_fused_tma_masked(
              wgu_map, wdn_map, xe, masks, T, E, H, Ie, acte, y, st,
              {.tile_counters = tiles, .gate_up_packed = wgu_packed, .down_packed = wdn_packed});
        });
    add("gate_up + down fused TMA, both packed, bf16 y (engine, denoise)", pad + ", one launch",
        gu_bytes + dn_bytes, gu_flops + dn_flops, [=](cudaStream_t st) {
          cuda::moe_experts_fused_tma_masked(
              wgu_map, wdn_map, xe, masks, T, E, H, Ie, acte, reinterpret_cast<bf16*>(y), st,
              {.tile_counters = tiles, .gate_up_packed = wgu_packed, .down_packed = wdn_packed});
        });
    add("gate_up TMA masked then down TMA masked, both packed (--no-fused-experts)", pad + ", two launches",
        gu_bytes + dn_bytes, gu_flops + dn_flops, [=](cudaStream_t st) {
          cuda::moe_gate_up_padded_tma_masked(wgu_map, xe, masks, T, E, H, Ie, acte, st,
                                              {.tile_counters = tiles, .gate_up_packed = wgu_packed});
          cuda::moe_down_padded_tma_masked(wdn_map, act_map, masks, T, E, H, Ie, y, st,
                                           {.down_packed = wdn_packed});
        });
    add("gate_up TMA, rows from x by slot_token, tile counter", pad, gu_bytes, gu_flops, [=](cudaStream_t st) {
      cuda::moe_gate_up_padded_tma_gathered(wgu_map, xe, slot, valid, E, H, Ie, acte, st, {.tile_counters = tiles});
    });
    add("gate_up TMA, rows from x, fixed stride", pad, gu_bytes, gu_flops, [=](cudaStream_t st) {
      cuda::moe_gate_up_padded_tma_gathered(wgu_map, xe, slot, valid, E, H, Ie, acte, st);
    });
    add("down TMA (--tma-experts-down)", pad + ", " + std::to_string(H) + "x" + std::to_string(Ie), dn_bytes,
        dn_flops, [=](cudaStream_t st) { cuda::moe_down_padded_tma(wdn_map, act_map, valid, E, H, Ie, y, st); });
    add("gate_up + down fused TMA, 2D boxes", pad + ", one launch", gu_bytes + dn_bytes, gu_flops + dn_flops,
        [=](cudaStream_t st) {
          cuda::moe_experts_fused_tma_masked(wgu_map, wdn_map, xe, masks, T, E, H, Ie, acte, y, st,
                                             {.tile_counters = tiles});
        });
    // The same kernels with the weight maps' L2 promotion off (CudaOptions::tma_weight_l2_promotion 0).
    const cuda::TmaMap wgu_map0 = cuda::tma_map_bf16_rows(wgu, int64_t(E) * 2 * Ie, H, 64, 0);
    const cuda::TmaMap wdn_map0 = cuda::tma_map_bf16_rows(wdn, int64_t(E) * H, Ie, 64, 0);
    add("gate_up TMA masked, tile counter, L2 promotion 0", pad, gu_bytes, gu_flops, [=](cudaStream_t st) {
      cuda::moe_gate_up_padded_tma_masked(wgu_map0, xe, masks, T, E, H, Ie, acte, st, {.tile_counters = tiles});
    });
    add("down TMA, L2 promotion 0", pad, dn_bytes, dn_flops,
        [=](cudaStream_t st) { cuda::moe_down_padded_tma(wdn_map0, act_map, valid, E, H, Ie, y, st); });
    add("gate_up + down fused TMA, L2 promotion 0", pad + ", one launch", gu_bytes + dn_bytes, gu_flops + dn_flops,
        [=](cudaStream_t st) {
          cuda::moe_experts_fused_tma_masked(wgu_map0, wdn_map0, xe, masks, T, E, H, Ie, acte, y, st,
                                             {.tile_counters = tiles});
        });
    add("gate_up TMA masked, packed, then cuBLASLt down (--no-fused-experts --no-pack-down)", pad + ", two launches", gu_bytes + dn_bytes,
        gu_flops + dn_flops, [=, &gemm](cudaStream_t st) {
          cuda::moe_gate_up_padded_tma_masked(wgu_map, xe, masks, T, E, H, Ie, acte, st,
                                              {.tile_counters = tiles, .gate_up_packed = wgu_packed});
          gemm.linear_batched(acte, Dt::BF16, M, wdn, Dt::BF16, H, Ie, y, Dt::F32, E, st);
        });
  }
  add("gate_up cuBLASLt strided-batched + gelu (--cublas-experts)", pad, gu_bytes, gu_flops,
      [=, &gemm](cudaStream_t st) {
        gemm.linear_batched(xs, Dt::BF16, M, wgu, Dt::BF16, 2 * Ie, H, y, Dt::F32, E, st);
        cuda::moe_gelu_mul_padded(y, E, M, Ie, meta, acte, st);
      });
  add("down cuBLASLt strided-batched (--no-fused-experts --no-pack-down)", pad + ", " + std::to_string(H) + "x" + std::to_string(Ie), dn_bytes,
      dn_flops, [=, &gemm](cudaStream_t st) {
        gemm.linear_batched(acte, Dt::BF16, M, wdn, Dt::BF16, H, Ie, y, Dt::F32, E, st);
      });
  add("moe_combine_ffn", tH + ", " + std::to_string(K) + " expert rows a token", double(T) * H * (4.0 * K + 4 + 4 + 2 + 2),
      0, [=](cudaStream_t st) {
        cuda::moe_combine_ffn(y, idx, wk, spos, T, K, h, m1, H, w_h, w_h, w_h, eps, 1.0f, st, w_h, x1);
      });
  add("moe_combine_ffn, bf16 expert rows (engine, denoise)", tH + ", " + std::to_string(K) + " expert rows a token",
      double(T) * H * (2.0 * K + 4 + 4 + 2 + 2), 0, [=](cudaStream_t st) {
        cuda::moe_combine_ffn(reinterpret_cast<const bf16*>(y), idx, wk, spos, T, K, h, m1, H, w_h, w_h, w_h, eps, 1.0f,
                              st, w_h, x1);
      });
  {
    // a prefill chunk: 4096 tokens through the grouped kernels
    const int Tp = 4096;
    std::vector<int32_t> pidx(size_t(Tp) * K);
    for (int t = 0; t < Tp; ++t)  // distinct experts per token (16 apart: E = 128 >= 8 x 16), spread over all
      for (int j = 0; j < K; ++j) pidx[size_t(t) * K + j] = ((t * 37) % 16 + j * 16 + (t / 16) * 5) % E;
    int32_t* didx = ar.take<int32_t>(pidx.size());
    CUDA_CHECK(cudaMemcpy(didx, pidx.data(), pidx.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    bf16* xp = ar.bf16s(size_t(Tp) * H, 1.0f);
    int32_t *off = ar.take<int32_t>(size_t(E) + 1), *sp2 = ar.take<int32_t>(pidx.size());
    bf16* xsp = ar.take<bf16>(pidx.size() * H);
    bf16* actp = ar.take<bf16>(pidx.size() * Ie);
    float* yp = ar.take<float>(pidx.size() * H);
    cuda::moe_group(didx, Tp, K, E, xp, H, off, sp2, xsp, s);
    const std::string gp = std::to_string(Tp) + " tokens, " + std::to_string(Tp * K) + " rows grouped";
    add("moe_group (prefill)", gp, double(Tp) * K * H * 4, 0,
        [=](cudaStream_t st) { cuda::moe_group(didx, Tp, K, E, xp, H, off, sp2, xsp, st); });
    add("moe_gate_up grouped (prefill)", gp, gu_bytes + double(Tp) * K * (H + Ie) * 2, 2.0 * Tp * K * H * 2 * Ie,
        [=](cudaStream_t st) { cuda::moe_gate_up(xsp, off, E, Tp * K, wgu, H, Ie, actp, st); });
    if (wgu_packed) {
      add("moe_gate_up grouped (prefill), packed weights (engine)", gp, gu_bytes + double(Tp) * K * (H + Ie) * 2,
          2.0 * Tp * K * H * 2 * Ie,
          [=](cudaStream_t st) { cuda::moe_gate_up(xsp, off, E, Tp * K, wgu_packed, H, Ie, actp, st, nullptr, true); });
    }
    add("moe_down grouped (prefill)", gp, dn_bytes + double(Tp) * K * (Ie * 2 + H * 4), 2.0 * Tp * K * H * Ie,
        [=](cudaStream_t st) { cuda::moe_down(actp, off, E, Tp * K, wdn, H, Ie, yp, st); });
    if (wdn_packed) {
      add("moe_down grouped (prefill), packed weights (engine)", gp,
          dn_bytes + double(Tp) * K * (Ie * 2 + H * 4), 2.0 * Tp * K * H * Ie,
          [=](cudaStream_t st) { cuda::moe_down(actp, off, E, Tp * K, wdn_packed, H, Ie, yp, st, nullptr, true); });
    }
    if (cuda::experts_prefill_supported(E, H, Ie)) {  // the wgmma kernels (CudaOptions::prefill_tma_experts)
      const cuda::TmaMap gu_map = cuda::tma_map_bf16_rows(wgu, int64_t(E) * 2 * Ie, H, 64);
      const cuda::TmaMap dn_map = cuda::tma_map_bf16_rows(wdn, int64_t(E) * H, Ie, 64);
      add("moe_gate_up_prefill_tma (prefill, wgmma)", gp, gu_bytes + double(Tp) * K * (H + Ie) * 2,
          2.0 * Tp * K * H * 2 * Ie, [=](cudaStream_t st) {
            cuda::moe_gate_up_prefill_tma(gu_map, nullptr, xsp, off, E, Tp * K, H, Ie, actp, st);
          });
      if (wgu_packed) {
        add("moe_gate_up_prefill_tma (prefill, wgmma), packed weights, static items", gp,
            gu_bytes + double(Tp) * K * (H + Ie) * 2, 2.0 * Tp * K * H * 2 * Ie, [=](cudaStream_t st) {
              cuda::moe_gate_up_prefill_tma(gu_map, wgu_packed, xsp, off, E, Tp * K, H, Ie, actp, st);
            });
        add("moe_gate_up_prefill_tma (prefill, wgmma), packed weights, item counter (engine)", gp,
            gu_bytes + double(Tp) * K * (H + Ie) * 2, 2.0 * Tp * K * H * 2 * Ie, [=](cudaStream_t st) {
              cuda::moe_gate_up_prefill_tma(gu_map, wgu_packed, xsp, off, E, Tp * K, H, Ie, actp, st, tiles);
            });
      }
      // the same weights (packed where the engine packs them) with and without the item counter
      add("moe_down_prefill_tma (prefill, wgmma), static items", gp, dn_bytes + double(Tp) * K * (Ie * 2 + H * 4),
          2.0 * Tp * K * H * Ie, [=](cudaStream_t st) {
            cuda::moe_down_prefill_tma(dn_map, wdn_packed, actp, off, E, Tp * K, H, Ie, yp, st);
          });
      add("moe_down_prefill_tma (prefill, wgmma), item counter (engine)", gp,
          dn_bytes + double(Tp) * K * (Ie * 2 + H * 4), 2.0 * Tp * K * H * Ie, [=](cudaStream_t st) {
            cuda::moe_down_prefill_tma(dn_map, wdn_packed, actp, off, E, Tp * K, H, Ie, yp, st, tiles);
          });
    }
  }

  // ---- logits, sampler statistics, SC ----
  float* logits = ar.f32s(size_t(T) * V, 20.0f);
  bf16* probs = ar.take<bf16>(size_t(T) * V);
  void* scratch = ar.take<char>(cuda::softcap_row_stats_scratch_bytes(T, V));
  cuda::DeviceRowStats* stats = ar.take<cuda::DeviceRowStats>(T);
  float* sig = ar.take<float>(size_t(T) * H);
  const double table = double(V) * H * 2;
  add("GEMM lm_head (tied)", tH + " . " + std::to_string(V) + "x" + std::to_string(H) + "^T -> f32", table +
      double(T) * V * 4, 2.0 * T * V * H, [=, &gemm](cudaStream_t st) {
        gemm.linear(x1, Dt::BF16, T, embed, Dt::BF16, V, H, logits, Dt::F32, st);
      });
  bf16* logits16 = ar.bf16s(size_t(T) * V, 20.0f);
  add("GEMM lm_head (tied), bf16 out (bf16_logits)", tH + " . " + std::to_string(V) + "x" + std::to_string(H) +
      "^T -> bf16", table + double(T) * V * 2, 2.0 * T * V * H, [=, &gemm](cudaStream_t st) {
        gemm.linear(x1, Dt::BF16, T, embed, Dt::BF16, V, H, probs, Dt::BF16, st);  // logits16 keeps its values
      });
  // The same product on kernels_dense_tma.cu with one split (its f32 output is the [T, V] logits as they are): how
  // far our own wgmma mainloop is from cuBLASLt's at a compute-bound shape, the first step towards an lm_head GEMM
  // with the row statistics in its epilogue (docs/PERFORMANCE.md).
  if (cuda::dense_tma_supported(T, V, H)) {
    for (const int cl : {1, 2}) {
      if (cuda::dense_tma_cluster(cl) != cl) continue;
      const cuda::TmaMap we = cuda::dense_tma_weight_map(embed, V, H), xe = cuda::dense_tma_token_map(x1, T, H, cl);
      add("GEMM lm_head dense TMA, cluster " + std::to_string(cl), "1 split, " + std::to_string(V / 128) + " tiles",
          table + double(T) * V * 4, 2.0 * T * V * H,
          [=](cudaStream_t st) { cuda::dense_tma_splitk(we, xe, T, V, H, 1, cl, logits, st); });
    }
  }
  add("softcap_row_stats + probs", std::to_string(T) + " x " + std::to_string(V), double(T) * V * 10, 0,
      [=](cudaStream_t st) { cuda::softcap_row_stats(logits, T, V, 30.0f, 0.8f, stats, scratch, st, probs); });
  float* probs_scale = ar.take<float>(T);
  // As the step runs them: the logits left uncapped (nothing reads them back), the probs from a second pass or fused
  add("softcap_row_stats + probs, logits kept", std::to_string(T) + " x " + std::to_string(V), double(T) * V * 10, 0,
      [=](cudaStream_t st) { cuda::softcap_row_stats(logits, T, V, 30.0f, 0.8f, stats, scratch, st, probs, false); });
  add("softcap_row_stats + fused probs, logits kept", std::to_string(T) + " x " + std::to_string(V),
      double(T) * V * 6, 0, [=](cudaStream_t st) {
        cuda::softcap_row_stats(logits, T, V, 30.0f, 0.8f, stats, scratch, st, probs, false, probs_scale);
      });
  add("softcap_row_stats + fused probs, bf16 logits", std::to_string(T) + " x " + std::to_string(V),
      double(T) * V * 4, 0, [=](cudaStream_t st) {
        cuda::softcap_row_stats(nullptr, T, V, 30.0f, 0.8f, stats, scratch, st, probs, false, probs_scale, nullptr,
                                nullptr, logits16);
      });
  add("softmax_rows_bf16", std::to_string(T) + " x " + std::to_string(V), double(T) * V * 6, 0,
      [=](cudaStream_t st) { cuda::softmax_rows_bf16(logits, T, V, 0.8f, probs, st); });
  add("GEMM SC soft embedding (probs . E)", std::to_string(T) + "x" + std::to_string(V) + " . " + std::to_string(V) +
      "x" + std::to_string(H), table + double(T) * V * 2, 2.0 * T * V * H, [=, &gemm](cudaStream_t st) {
        gemm.through_table(probs, Dt::BF16, T, embed, Dt::BF16, V, H, sig, Dt::F32, st);
      });
  // The same product over probs as the step's synthetic weights give them: near-uniform rows, every value within a
  // few binades of the others (the fused probs exp(z - cap / T) of flat logits). The entry above reads the
  // softmax_rows_bf16 entry's peaked rows; the two differ in operand values only (session 27: 408 us there against
  // 476-486 in the step and the GEMM tuner).
  bf16* flat_probs = ar.bf16s(size_t(T) * V, 0.5f * std::ldexp(1.0f, -50), std::ldexp(1.0f, -50));
  add("GEMM SC soft embedding, near-uniform probs", std::to_string(T) + "x" + std::to_string(V) + " . " +
      std::to_string(V) + "x" + std::to_string(H), table + double(T) * V * 2, 2.0 * T * V * H,
      [=, &gemm](cudaStream_t st) {
        gemm.through_table(flat_probs, Dt::BF16, T, embed, Dt::BF16, V, H, sig, Dt::F32, st);
      });
  CUDA_CHECK(cudaStreamSynchronize(s));

  // ---- time ----
  nlohmann::json out = nlohmann::json::array();
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  if (!args.json)
    std::printf("%s, %d SMs; kv %d; %d calls each%s, PDL off; mean per call\n\n| kernel | shape | us | GB/s | TFLOP/s "
                "|\n|---|---|---:|---:|---:|\n",
                dev.name.c_str(), dev.multiprocessors, kv, args.reps,
                args.in_graph ? " in a captured graph, each after a one-word copy kernel (the copies' time taken out)"
                              : "");
  auto* word = ar.take<uint32_t>(2);
  for (const Entry& en : entries) {
    if (!args.filter.empty() && en.name.find(args.filter) == std::string::npos) continue;
    for (int i = 0; i < 3; ++i) en.run(s);  // warm-up (and cuBLASLt plans)
    CUDA_CHECK(cudaStreamSynchronize(s));
    float ms = 0;
    if (args.in_graph) {
      // best of 3 replays, as the GEMM tuner times its candidates
      const float with = cuda::graph_after_copies_ms(s, word, args.reps, 3, [&] {
        en.run(s);
        return true;
      }, true);
      const float without = cuda::graph_after_copies_ms(s, word, args.reps, 3, nullptr, true);
      if (with < 0) {
        if (!args.json) std::printf("| %s | %s | not capturable | | |\n", en.name.c_str(), en.shape.c_str());
        continue;
      }
      ms = with - without;
    } else {
      CUDA_CHECK(cudaEventRecord(e0, s));
      for (int i = 0; i < args.reps; ++i) en.run(s);
      CUDA_CHECK(cudaEventRecord(e1, s));
      CUDA_CHECK(cudaEventSynchronize(e1));
      CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    }
    const double us = 1e3 * double(ms) / args.reps;
    const double gbs = en.bytes > 0 ? en.bytes / (us * 1e3) : 0, tfs = en.flops > 0 ? en.flops / (us * 1e6) : 0;
    if (args.json) {
      out.push_back({{"kernel", en.name}, {"shape", en.shape}, {"us", us}, {"gb_per_s", gbs}, {"tflop_per_s", tfs}});
    } else {
      std::printf("| %s | %s | %.1f | %s | %s |\n", en.name.c_str(), en.shape.c_str(), us,
                  en.bytes > 0 ? std::to_string(int(gbs + 0.5)).c_str() : "",
                  en.flops > 0 ? std::to_string(int(tfs + 0.5)).c_str() : "");
    }
  }
  CUDA_CHECK(cudaEventDestroy(e0));
  CUDA_CHECK(cudaEventDestroy(e1));
  CUDA_CHECK(cudaStreamDestroy(s));
  cuda::set_pdl(true);
  if (args.json)
    std::printf("%s\n", nlohmann::json{{"device", dev.name}, {"kv", kv}, {"reps", args.reps},
                                       {"in_graph", args.in_graph}, {"kernels", out}}.dump(1).c_str());
  return 0;
}
#endif

CommandRegistrar reg("bench-kernels",
                     "Time each CUDA kernel of a layer step alone at the full-size shapes (synthetic inputs)",
                     [](CLI::App& sub) -> Action {
                       auto a = std::make_shared<BenchKernelsArgs>();
                       sub.add_option("--reps", a->reps, "calls timed per kernel (mean reported)")
                           ->check(CLI::Range(1, 100000));
                       sub.add_option("--kv", a->kv, "KV length of the attention entries (>= 1024)");
                       sub.add_option("--filter", a->filter, "run only the entries whose name contains this");
                       sub.add_flag("--json", a->json, "print JSON instead of a table");
                       sub.add_flag("--in-graph", a->in_graph,
                                    "time each kernel's calls inside one captured graph, each after a one-word copy "
                                    "kernel (as the engine's step graphs launch them) instead of eagerly back to back");
                       return [=]() -> int {
#ifdef DIFFGEMMA_WITH_CUDA
                         return run_bench_kernels(*a);
#else
                         fail("diffgemma was built without CUDA: bench-kernels needs a GPU");
#endif
                       };
                     });

}  // namespace
}  // namespace dg::cli
