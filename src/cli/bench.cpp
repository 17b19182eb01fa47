// `diffgemma bench`: ms per denoise step and prefill tok/s on the GPU, with synthetic full-size weights generated on
// the device (no checkpoint needed) or a real checkpoint (-m DIR). Timed with CUDA events after warm-up; medians.
#include <algorithm>
#include <array>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cli/command.h"
#include "util/error.h"

#ifdef DIFFGEMMA_WITH_CUDA
#include <cuda_runtime.h>

#include <nlohmann/json.hpp>

#include <chrono>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_device.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/pdl.h"
#include "diffusion/generate.h"
#include "model/weights.h"
#endif

namespace dg::cli {
namespace {

struct BenchArgs {
  std::string model_dir;  // empty: synthetic full-size weights
  uint64_t seed = 1;
  int reps = 10;
  std::string contexts = "512,4096,32768", prefills = "4096,32768";
  bool json = false, breakdown = false, no_graphs = false, grouped_experts = false, tune_gemm = false;
  bool no_overlap = false, cublas_router = false, no_pdl = false, untuned_gemm = false;
  std::vector<std::string> gemm_untable, gemm_configs;
  int dense_mlp_sms = -1;  // -1: CudaOptions' default
  bool cublas_experts = false, tma_experts_down = false, no_tma_gather = false, static_expert_tiles = false;
  bool no_prefill_tma_experts = false, static_prefill_items = false;
  int attn_splits = 0;
  int qkv_rope_warps = 0;  // 0: the default (cuda::set_qkv_rope_max_warps)
  std::string experts_timeline;  // CSV path: the fused expert kernel's tiles in one extra step (diagnostics)
  bool no_attn_tma = false;  // cuda::set_attention_tma(false)
  bool no_attn_key_runs = false;  // cuda::set_attention_key_runs(false)
  bool no_attn_q_tma = false;     // cuda::set_attention_q_tma(false)
  bool no_attn_ws512 = false;     // cuda::set_attention_ws512(false)
  bool no_attn_discard_partials = false;  // cuda::set_attention_discard_partials(false)
  bool no_softmax_reverse = false;  // cuda::set_softmax_rows_reverse(false)
  bool no_gemm_attention = false;  // CudaOptions::gemm_attention = false
  int gemm_attention_max_keys = 0;  // > 0: CudaOptions::gemm_attention_max_keys
  bool no_fused_sc_probs = false;  // CudaOptions::fused_sc_probs = false
  bool bf16_logits = false;        // CudaOptions::bf16_logits = true
  bool router_tc = false;
  int route_tokens = 2;  // cuda::set_route_tokens_per_block
  int expert_rows_l2 = 7;  // CudaOptions::expert_rows_l2
  bool keep_attn_scores = false;  // CudaOptions::discard_attention_scores = false
  bool layer_graph = false;  // CudaOptions::whole_step_graph off
  bool one_step_graph = false;  // CudaOptions::split_step_head off
  bool no_sc_ahead = false;     // CudaOptions::sc_head_ahead off
  bool no_graph_prewarm = false;  // CudaOptions::prewarm_step_graphs off
  bool temperature_in_key = false;  // CudaOptions::device_temperature off
  bool first_step = false;          // also time a canvas's first step after prefills
  int canvas_distinct = 0;          // > 0: the timed canvas holds this many distinct tokens (0: uniform random)
  bool graph_memset_nodes = false;  // CudaOptions::graph_memset_kernels off
  bool dense_mlp_priority = false;
  int expert_sms = 0, tma_l2_prefetch = 0, tma_grid = 0, tma_prewait = -1, claim_ahead = 3, first_stride = 1;
  int tma_stages = 3;  // CudaOptions::tma_experts_stages' default
  bool no_fused_experts = false;
  std::string expert_token_tiles = "auto";  // 1, 2 (CudaOptions::expert_two_token_tiles) or auto
  int two_tile_heavy = 0;  // 0: CudaOptions::auto_two_token_tiles_heavy's default
  bool no_pack_gate_up = false, no_pack_down = false, dense_down_first = false, wide_assignment = false,
       overflow_on_side = false, dense_down_side_plan = false, f32_expert_rows = false, dense_tma = false;
  int dense_tma_cluster = 1;  // CudaOptions::dense_tma_cluster
  int tma_l2_promotion = 256;  // CudaOptions::tma_weight_l2_promotion
  int fixed_steps = 16, e2e_prompt = 4096, e2e_tokens = 256;
  bool sc_sparse = false;  // CudaOptions::sc_sparse
};

#ifdef DIFFGEMMA_WITH_CUDA
std::vector<int> parse_sizes(const std::string& s) {
  std::vector<int> v;
  for (int32_t x : parse_id_list(s, "size list")) v.push_back(int(x));
  return v;
}

struct Timer {
  cudaEvent_t a, b;
  Timer() { cudaEventCreate(&a), cudaEventCreate(&b); }
  ~Timer() { cudaEventDestroy(a), cudaEventDestroy(b); }
  template <class F>
  double ms(F&& f) {
    cudaEventRecord(a);
    f();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    return t;
  }
};

// "MxNxK" (a GEMM shape as gemm_tuned.inc writes m, n, k) at the front of s; used: the characters it took.
bool scan_gemm_shape(const std::string& s, std::array<int, 3>& mnk, int& used) {
  used = 0;
  return std::sscanf(s.c_str(), "%dx%dx%d%n", &mnk[0], &mnk[1], &mnk[2], &used) == 3;
}

// --gemm-untable and --gemm-config into the GEMM planner.
void apply_gemm_ab_options(const BenchArgs& args) {
  std::vector<std::array<int, 3>> skip;
  for (const std::string& shape : args.gemm_untable) {
    std::array<int, 3> mnk{};
    int used = 0;
    if (!scan_gemm_shape(shape, mnk, used) || used != int(shape.size()))
      fail("--gemm-untable: '{}' is not a shape MxNxK (e.g. 4352x256x512)", shape);
    skip.push_back(mnk);
  }
  cuda::set_gemm_table_skip(std::move(skip));
  std::vector<std::pair<std::array<int, 3>, std::array<int64_t, 9>>> configs;
  for (const std::string& spec : args.gemm_configs) {
    std::array<int, 3> mnk{};
    std::array<long long, 9> c{};
    int used = 0, rest = 0;
    if (!scan_gemm_shape(spec, mnk, used) ||
        std::sscanf(spec.c_str() + used, "=%lld,%lld,%lld,%lld,%lld,%lld,%lld,%lld,%lld%n", &c[0], &c[1], &c[2], &c[3],
                    &c[4], &c[5], &c[6], &c[7], &c[8], &rest) != 9 ||
        used + rest != int(spec.size()))
      fail("--gemm-config: '{}' is not MxNxK=c0,c1,...,c8 (e.g. 2816x256x2112=66,27,1,0,0,2,35,0,2)", spec);
    std::array<int64_t, 9> config{};
    for (size_t i = 0; i < 9; ++i) config[i] = c[i];
    configs.emplace_back(mnk, config);
  }
  cuda::set_gemm_config_override(std::move(configs));
}

void write_experts_timeline(const std::string& path, const std::vector<cuda::ExpertsTimelineRecord>& recs) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) fail("--experts-timeline: cannot write '{}'", path);
  std::fprintf(f, "block,sm,tile,t_req,t0,t1\n");
  for (const auto& r : recs)
    std::fprintf(f, "%d,%d,%d,%llu,%llu,%llu\n", r.block, r.sm, r.tile, r.t_req, r.t0, r.t1);
  if (std::fclose(f) != 0) fail("--experts-timeline: error writing '{}'", path);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// --breakdown: the stage times of the timed calls, per call (into node[name] and, under `title`, to stderr).
void report_breakdown(const CudaStageTimes& st, nlohmann::json& node, const std::string& title) {
  const int calls = std::max(1, st.steps);
  double sum = 0;
  for (const auto& [name, ms] : st.ms) {
    node[name] = ms / calls;
    sum += ms / calls;
  }
  std::fprintf(stderr, "%s\n", title.c_str());
  for (const auto& [name, ms] : st.ms)
    std::fprintf(stderr, "  %-28s %8.3f  %5.1f%%\n", name.c_str(), ms / calls,
                 100.0 * ms / calls / std::max(sum, 1e-9));
  std::fprintf(stderr, "  %-28s %8.3f\n", "sum of stages", sum);
}

int run_bench(const BenchArgs& args) {
  // GEMM tuning times cuBLASLt candidates at each shape's first call, which cannot happen inside a graph capture.
  const bool no_graphs = args.no_graphs || args.tune_gemm;
  const std::vector<int> contexts = parse_sizes(args.contexts), prefills = parse_sizes(args.prefills);
  cuda::set_gemm_tuning(args.tune_gemm);
  cuda::set_gemm_table(!args.untuned_gemm);
  apply_gemm_ab_options(args);
  cuda::set_pdl(!args.no_pdl);
  cuda::set_attention_splits(args.attn_splits);
  cuda::set_qkv_rope_max_warps(args.qkv_rope_warps);
  cuda::set_attention_tma(!args.no_attn_tma);
  cuda::set_attention_key_runs(!args.no_attn_key_runs);
  cuda::set_attention_q_tma(!args.no_attn_q_tma);
  cuda::set_attention_ws512(!args.no_attn_ws512);
  cuda::set_attention_discard_partials(!args.no_attn_discard_partials);
  cuda::set_softmax_rows_reverse(!args.no_softmax_reverse);
  cuda::set_router_tensor_cores(args.router_tc);
  cuda::set_route_tokens_per_block(args.route_tokens);
  auto info = cuda::query_device(0);
  if (!info.available) fail("bench needs a CUDA GPU: {}", info.reason);
  int max_ctx = 0;
  for (int c : contexts) max_ctx = std::max(max_ctx, c);
  for (int p : prefills) max_ctx = std::max(max_ctx, p);
  if (args.fixed_steps > 0) max_ctx = std::max(max_ctx, args.e2e_prompt + args.e2e_tokens);
  CudaOptions opt;
  opt.max_context = max_ctx + 1024;
  CudaStageTimes stages;
  if (args.breakdown) opt.stage_times = &stages;
  opt.cuda_graphs = !no_graphs;
  opt.whole_step_graph = !args.layer_graph;
  opt.split_step_head = !args.one_step_graph;
  opt.sc_head_ahead = !args.no_sc_ahead;
  opt.prewarm_step_graphs = !args.no_graph_prewarm;
  opt.device_temperature = !args.temperature_in_key;
  opt.padded_experts = !args.grouped_experts;
  opt.overlap_dense_mlp = !args.no_overlap;
  opt.fused_router = !args.cublas_router;
  opt.gemm_attention = !args.no_gemm_attention;
  if (args.gemm_attention_max_keys > 0) opt.gemm_attention_max_keys = args.gemm_attention_max_keys;
  opt.fused_sc_probs = !args.no_fused_sc_probs;
  opt.bf16_logits = args.bf16_logits;
  if (args.dense_mlp_sms >= 0) opt.dense_mlp_sms = args.dense_mlp_sms;
  opt.tma_experts = !args.cublas_experts;
  opt.prefill_tma_experts = !args.no_prefill_tma_experts;
  opt.prefill_item_counter = !args.static_prefill_items;
  opt.tma_experts_down = args.tma_experts_down;
  opt.tma_gather_rows = !args.no_tma_gather;
  opt.dynamic_expert_tiles = !args.static_expert_tiles;
  opt.dense_mlp_priority = args.dense_mlp_priority;
  opt.expert_sms = args.expert_sms;
  opt.tma_experts_l2_prefetch = args.tma_l2_prefetch;
  opt.tma_experts_prewait_stages = args.tma_prewait;
  opt.tma_experts_claim_ahead = args.claim_ahead;
  opt.tma_experts_first_stride = args.first_stride;
  opt.fused_experts = !args.no_fused_experts;
  opt.expert_two_token_tiles = args.expert_token_tiles == "2";
  if (args.two_tile_heavy > 0) opt.auto_two_token_tiles_heavy = args.two_tile_heavy;
  if (args.expert_token_tiles != "auto") opt.auto_two_token_tiles_heavy = 0;
  opt.pack_expert_gate_up = !args.no_pack_gate_up;
  opt.pack_expert_down = !args.no_pack_down;
  opt.dense_down_last = !args.dense_down_first;
  opt.overflow_stream = !args.overflow_on_side;
  opt.dense_down_all_sms = !args.dense_down_side_plan;
  opt.bf16_expert_rows = !args.f32_expert_rows;
  opt.expert_rows_l2 = args.expert_rows_l2;
  opt.discard_attention_scores = !args.keep_attn_scores;
  opt.dense_tma = args.dense_tma;
  opt.dense_tma_cluster = args.dense_tma_cluster;
  opt.graph_memset_kernels = !args.graph_memset_nodes;
  opt.narrow_assignment = !args.wide_assignment;
  opt.tma_weight_l2_promotion = args.tma_l2_promotion;
  opt.tma_experts_grid = args.tma_grid;
  opt.tma_experts_stages = args.tma_stages;
  CudaHostTimes host_times;
  opt.host_times = &host_times;
  CudaScStats sc_stats;
  opt.sc_sparse = args.sc_sparse;
  opt.sc_stats = &sc_stats;
  CudaExpertTileStats tile_stats;
  opt.tile_stats = &tile_stats;
  std::unique_ptr<LoadedModel> model;
  std::unique_ptr<Backend> be;
  Timer timer;
  double load_ms = timer.ms([&] {
    if (args.model_dir.empty()) {
      be = make_cuda_backend_synthetic(diffusiongemma_26b_a4b_config(), args.seed, opt);
    } else {
      model = load_model(args.model_dir);
      be = make_cuda_backend(*model, opt);
    }
  });
  const ModelConfig& cfg = be->config();
  std::mt19937 rng{uint32_t(args.seed)};
  auto random_ids = [&](int n) {
    std::vector<int32_t> ids(static_cast<size_t>(n));
    for (auto& x : ids) x = int32_t(rng() % uint32_t(cfg.vocab_size));
    return ids;
  };
  const int L = cfg.canvas_length;
  nlohmann::json out;
  out["device"] = info.name;
  out["weights"] =
      args.model_dir.empty() ? "synthetic full-size (seed " + std::to_string(args.seed) + ")" : args.model_dir;
  out["load_ms"] = load_ms;
  out["reps"] = args.reps;
  out["cuda_graphs"] = !no_graphs;
  out["whole_step_graph"] = !args.layer_graph;
  out["split_step_head"] = !args.one_step_graph;
  out["sc_head_ahead"] = !args.no_sc_ahead;
  out["prewarm_step_graphs"] = !args.no_graph_prewarm;
  out["device_temperature"] = !args.temperature_in_key;
  out["canvas_distinct"] = args.canvas_distinct;
  out["graph_memset_kernels"] = !args.graph_memset_nodes;
  out["overlap_dense_mlp"] = !args.no_overlap;
  out["dense_mlp_sms"] = opt.dense_mlp_sms;
  out["pdl"] = !args.no_pdl;
  out["full_layer_denoise_attention"] =
      opt.gemm_attention ? "cuBLASLt S = QK^T, softmax, PV up to " + std::to_string(opt.gemm_attention_max_keys) +
                               " keys, the fused kernel beyond"
                         : std::string("the fused kernel");
  out["router"] = opt.fused_router ? "router_top_k (two launches, expert masks)" : "cuBLASLt f32 GEMM + top-k + assign";
  out["experts"] = args.grouped_experts ? "grouped kernels"
                   : args.cublas_experts ? "padded strided-batched cuBLASLt"
                   : args.tma_experts_down ? "padded: TMA + wgmma gate_up + down (PDL) where supported"
                                           : "padded: TMA + wgmma gate_up (PDL) where supported, cuBLASLt down";
  out["expert_sms"] = args.expert_sms;
  out["tma_l2_prefetch"] = args.tma_l2_prefetch;
  out["tma_prewait_stages"] = args.tma_prewait;
  out["expert_claim_ahead"] = args.claim_ahead;
  out["expert_first_stride"] = args.first_stride;
  out["fused_experts"] = !args.no_fused_experts;
  out["expert_token_tiles"] = args.expert_token_tiles;
  out["two_tile_heavy"] = opt.auto_two_token_tiles_heavy;
  out["pack_expert_gate_up"] = !args.no_pack_gate_up;
  out["pack_expert_down"] = !args.no_pack_down;
  out["dense_down_last"] = !args.dense_down_first;
  out["overflow_stream"] = !args.overflow_on_side;
  out["dense_down_all_sms"] = !args.dense_down_side_plan;
  out["bf16_expert_rows"] = !args.f32_expert_rows;
  out["dense_tma"] = args.dense_tma;
  out["fused_sc_probs"] = !args.no_fused_sc_probs;
  out["bf16_logits"] = args.bf16_logits;
  out["dense_tma_cluster"] = args.dense_tma_cluster;
  out["narrow_assignment"] = !args.wide_assignment;
  out["tma_l2_promotion"] = args.tma_l2_promotion;
  out["tma_gather_rows"] = !args.no_tma_gather;
  out["prefill_tma_experts"] = !args.no_prefill_tma_experts;
  out["prefill_item_counter"] = opt.prefill_item_counter;
  out["dynamic_expert_tiles"] = opt.dynamic_expert_tiles;
  out["attention_splits"] = args.attn_splits;
  out["qkv_rope_warps"] = args.qkv_rope_warps;
  out["attention_tma"] = !args.no_attn_tma;
  out["attention_key_runs"] = !args.no_attn_key_runs;
  out["attention_q_tma"] = !args.no_attn_q_tma;
  out["attention_ws512"] = !args.no_attn_ws512;
  out["attention_discard_partials"] = !args.no_attn_discard_partials;
  out["softmax_rows_reverse"] = !args.no_softmax_reverse;
  out["router_tensor_cores"] = args.router_tc;
  out["route_tokens_per_block"] = args.route_tokens;
  out["expert_rows_l2"] = args.expert_rows_l2;
  out["discard_attention_scores"] = !args.keep_attn_scores;
  out["dense_mlp_priority"] = opt.dense_mlp_priority;
  out["tma_grid"] = args.tma_grid;
  out["tma_stages"] = args.tma_stages;
  out["sc"] = args.sc_sparse ? "sparse survivors (exact fallback per step)" : "exact (probs @ E GEMM)";

  // Prefill throughput from an empty cache (one untimed warm-up at the smallest size first).
  be->prefill(random_ids(std::min(512, prefills.empty() ? 512 : prefills[0])));
  for (int p : prefills) {
    std::vector<double> t;
    auto ids = random_ids(p);
    for (int r = 0; r < (p > 8192 ? 1 : 3); ++r) {
      be->truncate(0);
      t.push_back(timer.ms([&] { be->prefill(ids); }));
    }
    double ms = median(t);
    out["prefill"][std::to_string(p)] = {{"ms", ms}, {"tok_per_s", p / (ms / 1e3)}};
    std::fprintf(stderr, "prefill %6d tokens: %9.1f ms  %9.0f tok/s\n", p, ms, p / (ms / 1e3));
    if (args.breakdown) {  // one more prefill with a CUDA event after every stage (one stream: no dense-MLP overlap)
      stages.reset();
      stages.enabled = true;
      be->truncate(0);
      be->prefill(ids);
      stages.enabled = false;
      report_breakdown(stages, out["prefill"][std::to_string(p)]["breakdown_ms"],
                       fmt::format("prefill {:6d} breakdown (ms, summed over layers and chunks):", p));
    }
  }

  for (int ctx : contexts) {
    be->truncate(0);
    be->prefill(random_ids(ctx));
    DenoiseRequest req;
    auto canvas = random_ids(L);
    if (args.canvas_distinct > 0)  // a canvas of few distinct tokens: the routing concentrates on fewer experts
      for (auto& id : canvas) id = canvas[size_t(uint32_t(id) % uint32_t(args.canvas_distinct))];
    req.canvas = canvas;
    req.temperature = 0.8f;
    // The steps of one block, as the block loop runs them: each but the last says another step follows
    // (DenoiseRequest::more_steps; CudaOptions::sc_head_ahead queues the next step's SC GEMM behind it).
    req.more_steps = true;
    DenoiseResult res;
    be->denoise(req, res);  // first step: no SC
    req.self_condition = SelfCondition::PreviousStep;
    for (int w = 0; w < 2; ++w) be->denoise(req, res);
    std::vector<double> t;
    host_times.reset();
    tile_stats.reset();
    for (int r = 0; r < args.reps; ++r) {
      req.more_steps = r + 1 < args.reps;
      t.push_back(timer.ms([&] { be->denoise(req, res); }));
    }
    const CudaExpertTileStats timed_tiles = tile_stats;
    const double step = median(t);
    const double launch_us = host_times.graph_launch_us.empty() ? 0.0 : median(host_times.graph_launch_us);
    const double head_us = host_times.head_launch_us.empty() ? 0.0 : median(host_times.head_launch_us);
    if (!args.experts_timeline.empty() && ctx == contexts.front()) {
      // One more step with the fused expert kernel's tile timeline on; the backend's graphs are keyed by whether a
      // timeline records, so the step is captured afresh with the timeline's kernel instantiation. (Until session 32
      // a new temperature forced that re-capture, which the temperature on the device had quietly stopped doing:
      // the file came out empty.)
      cuda::experts_timeline_begin(size_t(1) << 20);
      DenoiseRequest tl_req = req;
      tl_req.temperature = 0.8125f;
      be->denoise(tl_req, res);
      const auto recs = cuda::experts_timeline_end();
      write_experts_timeline(args.experts_timeline, recs);
      std::fprintf(stderr, "experts timeline: %zu records -> %s\n", recs.size(), args.experts_timeline.c_str());
    }
    if (args.breakdown) {  // extra steps with a CUDA event after every stage; the step time above is without them
      stages.reset();
      stages.enabled = true;
      for (int r = 0; r < args.reps; ++r) be->denoise(req, res);
      stages.enabled = false;
      report_breakdown(
          stages, out["denoise"][std::to_string(ctx)]["breakdown_ms"],
          fmt::format("kv {:6d} breakdown (ms per step, summed over layers; {} steps):", ctx, stages.steps));
    }
    // --first-step: a canvas's first step as the block loop runs it (SC from the canvas embedding), alone and right
    // after a commit (prefill) of 256 tokens and after the whole context's prefill (session 23: some machines ran the
    // end-to-end run's first step ~4 ms longer than the timed ones; others did not).
    if (args.first_step) {
      DenoiseRequest first = req;
      first.self_condition = SelfCondition::CanvasEmbedding;
      be->denoise(first, res);  // capture
      std::vector<double> alone, after;
      auto more = random_ids(L);
      for (int r = 0; r < 3; ++r) {
        alone.push_back(timer.ms([&] { be->denoise(first, res); }));
        be->prefill(more);
        be->truncate(ctx);
        after.push_back(timer.ms([&] { be->denoise(first, res); }));
      }
      // and after the whole context's prefill from an empty cache, as a generation's first canvas runs it
      std::vector<double> pre, after_all;
      auto whole = random_ids(ctx);
      for (int r = 0; r < 2; ++r) {
        be->truncate(0);
        pre.push_back(timer.ms([&] { be->prefill(whole); }));
        after_all.push_back(timer.ms([&] { be->denoise(first, res); }));
      }
      out["denoise"][std::to_string(ctx)]["first_step_ms"] = median(alone);
      out["denoise"][std::to_string(ctx)]["first_step_after_prefill_ms"] = median(after);
      out["denoise"][std::to_string(ctx)]["first_step_after_context_prefill_ms"] = median(after_all);
      std::fprintf(stderr, "kv %6d: a canvas's first step (canvas-embedding SC) %.2f ms, right after a 256-token prefill "
                   "%.2f ms, right after the context's prefill from empty (%.1f ms) %.2f ms\n",
                   ctx, median(alone), median(after), median(pre), median(after_all));
      be->denoise(req, res);  // the PreviousStep mode's previous rows again
    }
    // Commit of one canvas (encoder pass over 256 tokens), then rewind it.
    std::vector<double> tc;
    auto commit = random_ids(L);
    for (int r = 0; r < 3; ++r) {
      tc.push_back(timer.ms([&] { be->prefill(commit); }));
      be->truncate(ctx);
    }
    const double commit_ms = median(tc);
    const double e2e = L / ((16 * step + commit_ms) / 1e3);
    auto& d = out["denoise"][std::to_string(ctx)];
    d["step_ms"] = step;
    d["step_ms_min"] = *std::min_element(t.begin(), t.end());
    d["commit_ms"] = commit_ms;
    d["graph_launch_us"] = launch_us;
    d["head_graph_launch_us"] = head_us;
    d["tok_per_s_16_steps"] = e2e;
    d["expert_tiles"] = {{"one_tile_steps", timed_tiles.one_tile_steps},
                         {"two_tile_steps", timed_tiles.two_tile_steps},
                         {"heavy_experts", timed_tiles.last_heavy}};
    std::fprintf(stderr,
                 "kv %6d: denoise step %7.2f ms (min %.2f; graph launch call %.1f us, SC head's %.1f), commit 256 "
                 "%7.2f ms, 16 steps/canvas %7.0f tok/s; timed steps on two token tiles %lld/%lld (experts past 32 "
                 "rows: %d)\n",
                 ctx, step, *std::min_element(t.begin(), t.end()), launch_us, head_us, commit_ms, e2e,
                 static_cast<long long>(timed_tiles.two_tile_steps),
                 static_cast<long long>(timed_tiles.one_tile_steps + timed_tiles.two_tile_steps),
                 timed_tiles.last_heavy);
    if (timed_tiles.last_heavy > 0) {  // where the routing concentrates (a per-layer choice would follow this)
      d["expert_tiles"]["heavy_experts_per_layer"] = timed_tiles.last_heavy_per_layer;
      std::string per_layer;
      for (int n : timed_tiles.last_heavy_per_layer) per_layer += " " + std::to_string(n);
      std::fprintf(stderr, "kv %6d: experts past 32 rows by layer:%s\n", ctx, per_layer.c_str());
    }
  }

  // End to end through the block loop: prompt prefill, then every canvas at exactly --fixed-steps denoise steps
  // (no early stop, no stop token), host sampler and commits included: HF's "prompt + N tokens at 16 steps" run.
  if (args.fixed_steps > 0) {
    diffusion::GenerationOptions o;
    o.max_new_tokens = args.e2e_tokens;
    o.seed = args.seed;
    o.fixed_steps(args.fixed_steps);
    o.validate(cfg);
    auto prompt = random_ids(args.e2e_prompt);
    std::vector<double> t;
    int64_t forwards = 0;
    // Where the run's time goes: each step's end (the observer runs right after the backend's denoise returns), so the
    // first interval holds the prompt's prefill and the first step, the others one step and the host's sampler work.
    std::vector<std::chrono::steady_clock::time_point> step_ends;
    diffusion::Observers obs;
    obs.on_step = [&](const diffusion::StepEvent&) { step_ends.push_back(std::chrono::steady_clock::now()); };
    double first_ms = 0;
    std::vector<double> intervals;
    for (int r = 0; r < 3; ++r) {  // the first run is the warm-up (graph capture at these kv lengths)
      be->truncate(0);
      step_ends.clear();
      const auto t0 = std::chrono::steady_clock::now();
      auto res = diffusion::generate(*be, prompt, o, obs);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (r > 0) t.push_back(ms);
      forwards = res.forwards;
      if (r == 2 && !step_ends.empty()) {
        first_ms = std::chrono::duration<double, std::milli>(step_ends.front() - t0).count();
        for (size_t i = 1; i < step_ends.size(); ++i)
          intervals.push_back(std::chrono::duration<double, std::milli>(step_ends[i] - step_ends[i - 1]).count());
      }
    }
    const double ms = median(t);
    out["end_to_end"] = {{"prompt", args.e2e_prompt}, {"tokens", args.e2e_tokens},
                         {"steps_per_canvas", args.fixed_steps}, {"forwards", forwards},
                         {"ms", ms}, {"tok_per_s", args.e2e_tokens / (ms / 1e3)}};
    if (!intervals.empty()) {
      out["end_to_end"]["step_interval_ms"] = intervals;
      out["end_to_end"]["prefill_and_first_step_ms"] = first_ms;
      std::fprintf(stderr, "end to end, last run: prompt prefill + first step %.1f ms; later steps %.2f ms median "
                   "(min %.2f, max %.2f) from one step's end to the next\n", first_ms, median(intervals),
                   *std::min_element(intervals.begin(), intervals.end()),
                   *std::max_element(intervals.begin(), intervals.end()));
      std::fprintf(stderr, "  steps 2..%zu (ms):", intervals.size() + 1);
      for (double v : intervals) std::fprintf(stderr, " %.2f", v);
      std::fprintf(stderr, "\n");
    }
    std::fprintf(stderr, "end to end: %d-token prompt + %d tokens at %d steps per canvas: %.1f ms (%lld forwards), "
                 "%.0f tok/s\n", args.e2e_prompt, args.e2e_tokens, args.fixed_steps, ms,
                 static_cast<long long>(forwards), args.e2e_tokens / (ms / 1e3));
  }

  // Which SC path the PreviousStep steps took. The synthetic weights give near-flat logits (every row far over the
  // survivor bounds), so there every step falls back to the exact path: say so instead of implying a speedup.
  if (args.sc_sparse) {
    out["sc_steps"] = {{"sparse", sc_stats.sparse_steps}, {"exact_fallback", sc_stats.dense_steps},
                       {"max_survivors_per_row", sc_stats.max_survivors}, {"max_dropped_mass", sc_stats.max_tail}};
    std::fprintf(stderr, "SC: sparse survivors on %lld steps, exact fallback on %lld (largest row: %d survivors, "
                 "dropped mass %.3g)%s\n", static_cast<long long>(sc_stats.sparse_steps),
                 static_cast<long long>(sc_stats.dense_steps), sc_stats.max_survivors, sc_stats.max_tail,
                 sc_stats.sparse_steps == 0 ? ": every step fell back (near-flat logits), the timings are the exact path's"
                                            : "");
  }

  if (args.tune_gemm) {  // one line per shape, deduplicated, ready for src/backend/cuda/gemm_tuned.inc
    std::vector<std::string> lines = cuda::gemm_tune_report();
    std::sort(lines.begin(), lines.end());
    lines.erase(std::unique(lines.begin(), lines.end()), lines.end());
    out["gemm_tuning"] = lines;
    std::fprintf(stderr, "GEMM tuning (%s; for src/backend/cuda/gemm_tuned.inc):\n", info.name.c_str());
    for (auto& l : lines) std::fprintf(stderr, "%s\n", l.c_str());
  }

  if (args.json) {
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    std::printf("device: %s\nweights: %s\nexperts: %s\nSC: %s\n\n", info.name.c_str(),
                out["weights"].get<std::string>().c_str(), out["experts"].get<std::string>().c_str(),
                out["sc"].get<std::string>().c_str());
    if (out.contains("sc_steps"))
      std::printf("SC steps: %lld sparse, %lld exact fallback\n\n", static_cast<long long>(sc_stats.sparse_steps),
                  static_cast<long long>(sc_stats.dense_steps));
    std::printf("| kv context | denoise step (ms) | commit 256 (ms) | tok/s at 16 steps |\n|---:|---:|---:|---:|\n");
    for (int ctx : contexts) {
      auto& d = out["denoise"][std::to_string(ctx)];
      std::printf("| %d | %.2f | %.2f | %.0f |\n", ctx, d["step_ms"].get<double>(), d["commit_ms"].get<double>(),
                  d["tok_per_s_16_steps"].get<double>());
    }
    std::printf("\n| prefill tokens | ms | tok/s |\n|---:|---:|---:|\n");
    for (int p : prefills) {
      auto& d = out["prefill"][std::to_string(p)];
      std::printf("| %d | %.1f | %.0f |\n", p, d["ms"].get<double>(), d["tok_per_s"].get<double>());
    }
    if (out.contains("end_to_end")) {
      auto& d = out["end_to_end"];
      std::printf("\n| end to end | ms | tok/s |\n|---|---:|---:|\n| %d-token prompt + %d tokens, %d steps/canvas | %.1f | "
                  "%.0f |\n", d["prompt"].get<int>(), d["tokens"].get<int>(), d["steps_per_canvas"].get<int>(),
                  d["ms"].get<double>(), d["tok_per_s"].get<double>());
    }
  }
  return 0;
}
#endif

CommandRegistrar reg("bench", "Time denoise steps and prefill on the GPU (synthetic full-size weights or -m DIR)",
                     [](CLI::App& sub) -> Action {
                       auto a = std::make_shared<BenchArgs>();
                       sub.add_option("-m,--model", a->model_dir, "checkpoint directory (default: synthetic weights)");
                       sub.add_option("--seed", a->seed, "seed of the synthetic weights and inputs");
                       sub.add_option("--reps", a->reps, "timed denoise steps per context (median reported)");
                       sub.add_option("--contexts", a->contexts, "KV lengths for the denoise timing, comma-separated");
                       sub.add_option("--prefill", a->prefills, "prefill sizes, comma-separated");
                       sub.add_flag("--json", a->json, "print JSON instead of tables");
                       sub.add_flag("--breakdown", a->breakdown,
                                    "also time each stage of a denoise step and of each prefill (CUDA events, "
                                    "summed over layers)");
                       sub.add_flag("--no-graphs", a->no_graphs, "launch the decoder layers eagerly (no CUDA graph)");
                       sub.add_option("--fixed-steps", a->fixed_steps,
                                      "end-to-end run with exactly this many denoise steps per canvas (0: skip)")
                           ->check(CLI::NonNegativeNumber);
                       sub.add_option("--e2e-prompt", a->e2e_prompt, "prompt tokens of the end-to-end run")
                           ->check(CLI::PositiveNumber);
                       sub.add_option("--e2e-tokens", a->e2e_tokens, "generated tokens of the end-to-end run")
                           ->check(CLI::PositiveNumber);
                       sub.add_flag("--grouped-experts", a->grouped_experts,
                                    "A/B: canvas passes through the grouped expert kernels instead of the padded "
                                    "strided-batched GEMMs (CudaOptions::padded_experts = false)");
                       sub.add_flag("--sc-sparse", a->sc_sparse,
                                    "approximate SC: gather only each row's survivors (p >= e^-10 p_max) instead of "
                                    "the GEMM through the whole table; a step falls back to it when a row has too "
                                    "many survivors or drops > 1e-3 mass (CudaOptions::sc_sparse)");
                       sub.add_flag("--no-overlap", a->no_overlap,
                                    "A/B: the dense MLP on the main stream (CudaOptions::overlap_dense_mlp = false)");
                       sub.add_flag("--no-pdl", a->no_pdl,
                                    "A/B: launch without programmatic dependent launch (src/backend/cuda/launch.cuh)");
                       sub.add_flag("--cublas-router", a->cublas_router,
                                    "A/B: the router as cuBLASLt's f32 GEMM + its reduce + top-k + assignment "
                                    "instead of two launches of our own (CudaOptions::fused_router = false)");
                       sub.add_flag("--cublas-experts", a->cublas_experts,
                                    "A/B: the padded path's gate_up on cuBLASLt + a GELU pass instead of the TMA + "
                                    "wgmma kernel (CudaOptions::tma_experts = false)");
                       sub.add_flag("--no-prefill-tma-experts", a->no_prefill_tma_experts,
                                    "A/B: prefill chunks' expert GEMMs on the grouped mma.sync kernels instead of "
                                    "the wgmma ones (CudaOptions::prefill_tma_experts = false)");
                       sub.add_flag("--static-prefill-items", a->static_prefill_items,
                                    "A/B: the prefill expert kernels' blocks stride over their work items instead "
                                    "of claiming them from a counter (CudaOptions::prefill_item_counter = false)");
                       sub.add_flag("--no-tma-gather", a->no_tma_gather,
                                    "A/B: the TMA gate_up reads a gathered copy of the token rows (the gather kernel "
                                    "before it) instead of the expert input itself (CudaOptions::tma_gather_rows)");
                       sub.add_flag("--static-expert-tiles", a->static_expert_tiles,
                                    "A/B: the gathered TMA gate_up's blocks stride over its tiles instead of taking "
                                    "them from an atomic counter (CudaOptions::dynamic_expert_tiles = false)");
                       sub.add_flag("--dense-mlp-priority", a->dense_mlp_priority,
                                    "A/B: the dense MLP's stream at the highest priority "
                                    "(CudaOptions::dense_mlp_priority)");
                       sub.add_option("--experts-timeline", a->experts_timeline,
                                      "diagnostics: after the first context's timed steps, one more step with the "
                                      "fused expert kernel's per-tile %globaltimer records, written to this CSV "
                                      "(block, sm, tile, t_req, t0, t1 in ns; tile -1: block entry and PDL wait)");
                       sub.add_flag("--graph-memset-nodes", a->graph_memset_nodes,
                                    "A/B: keep cuBLASLt's memset nodes in the captured graphs instead of kernel nodes "
                                    "(CudaOptions::graph_memset_kernels = false)");
                       sub.add_flag("--no-sc-ahead", a->no_sc_ahead,
                                    "A/B: a step's SC GEMM launched at its own start instead of queued behind the "
                                    "previous step (CudaOptions::sc_head_ahead = false)");
                       sub.add_flag("--no-graph-prewarm", a->no_graph_prewarm,
                                    "A/B: a prefill leaves the step graphs for the next denoise step to capture at "
                                    "the new KV length (CudaOptions::prewarm_step_graphs = false)");
                       sub.add_flag("--layer-graph", a->layer_graph,
                                    "A/B: only the layers of a denoise step as one CUDA graph, the rest launched "
                                    "from the host (CudaOptions::whole_step_graph = false)");
                       sub.add_flag("--one-step-graph", a->one_step_graph,
                                    "A/B: a PreviousStep step's SC GEMM inside the step's one graph instead of a "
                                    "graph launched ahead of it (CudaOptions::split_step_head = false)");
                       sub.add_flag("--first-step", a->first_step,
                                    "also time a canvas's first step (canvas-embedding SC) alone, after a 256-token "
                                    "prefill and after the context's prefill from an empty cache");
                       sub.add_option("--canvas-distinct", a->canvas_distinct,
                                      "the timed denoise canvas drawn from this many distinct tokens (default 0: "
                                      "uniform random), to see what a concentrated routing (experts past their padded "
                                      "rows) costs")
                           ->check(CLI::Range(0, 1 << 20));
                       sub.add_flag("--temperature-in-key", a->temperature_in_key,
                                    "A/B: the whole-step graph takes the temperature as a launch argument, so each "
                                    "new temperature re-captures it (CudaOptions::device_temperature = false)");
                       sub.add_option("--route-tokens", a->route_tokens,
                                      "A/B: tokens a block of the router's route kernel, 2 or 8 "
                                      "(cuda::set_route_tokens_per_block)")
                           ->check(CLI::IsMember({2, 8}));
                       sub.add_option("--expert-rows-l2", a->expert_rows_l2,
                                      "A/B: denoise passes keep the expert launch's outputs in L2, a mask: 1 bf16 y rows "
                                      "stored evict_last, 2 act rows stored evict_last, 4 the combine discards each y "
                                      "line it read; 0 none (CudaOptions::expert_rows_l2, default 7)")
                           ->check(CLI::Range(0, 7));
                       sub.add_flag("--keep-attn-scores", a->keep_attn_scores,
                                    "A/B: the full layers' denoise softmax leaves the f32 scores in L2 instead of "
                                    "dropping each line once read (CudaOptions::discard_attention_scores = false)");
                       sub.add_flag("--router-tc", a->router_tc,
                                    "A/B: the router's partial logits as 3xTF32 on the tensor cores instead of f32 "
                                    "FMAs (cuda::set_router_tensor_cores)");
                       sub.add_flag("--no-fused-sc-probs", a->no_fused_sc_probs,
                                    "A/B: the SC probs by a second pass over the logits instead of the row-statistics "
                                    "pass (CudaOptions::fused_sc_probs = false)");
                       sub.add_flag("--bf16-logits", a->bf16_logits,
                                    "A/B: the lm_head writes bf16 logits (as HF's) instead of f32 "
                                    "(CudaOptions::bf16_logits)");
                       sub.add_flag("--no-gemm-attention", a->no_gemm_attention,
                                    "A/B: the full layers' denoise attention on the fused kernel instead of two "
                                    "cuBLASLt GEMMs around a softmax (CudaOptions::gemm_attention = false)");
                       sub.add_option("--gemm-attention-max-keys", a->gemm_attention_max_keys,
                                      "A/B: the most keys (cached + canvas) a full layer's denoise attention runs on "
                                      "the GEMM path; beyond, the fused kernel (CudaOptions::gemm_attention_max_keys)")
                           ->check(CLI::Range(1, 1 << 24));
                       sub.add_flag("--no-attn-tma", a->no_attn_tma,
                                    "A/B: the sliding attention kernel's K / V tiles all by cp.async instead of TMA "
                                    "(cuda::set_attention_tma)");
                       sub.add_flag("--no-attn-key-runs", a->no_attn_key_runs,
                                    "A/B: the sliding denoise attention's keys tiled by key index (tiles across the "
                                    "ring's wrap or the cache / canvas boundary load by cp.async) instead of by "
                                    "ring run, every tile one TMA box (cuda::set_attention_key_runs)");
                       sub.add_flag("--no-attn-discard-partials", a->no_attn_discard_partials,
                                    "A/B: the split-KV attention combine (head dim 256) leaves the f32 partial rows "
                                    "in L2 instead of dropping them once read (cuda::set_attention_discard_partials)");
                       sub.add_flag("--no-attn-q-tma", a->no_attn_q_tma,
                                    "A/B: the sliding attention kernel's Q rows by its consumers' cp.async instead of "
                                    "TMA (cuda::set_attention_q_tma)");
                       sub.add_flag("--no-attn-ws512", a->no_attn_ws512,
                                    "A/B: head dim 512 (the full layers' prefill and commit, and their denoise with "
                                    "--no-gemm-attention) on attention_wgx_k instead of the warp-specialized "
                                    "cluster pairs (cuda::set_attention_ws512)");
                       sub.add_flag("--no-softmax-reverse", a->no_softmax_reverse,
                                    "A/B: the full layers' attention softmax over the heads in order instead of last "
                                    "head first (cuda::set_softmax_rows_reverse)");
                       sub.add_option("--attn-splits", a->attn_splits,
                                      "A/B: split-KV count of the attention launches that split (0: as many as fill "
                                      "the SMs; cuda::set_attention_splits)")
                           ->check(CLI::Range(0, 16));
                       sub.add_option("--qkv-rope-warps", a->qkv_rope_warps,
                                      "A/B: at most this many warps a block of the q/k norm + rope kernel (0: the "
                                      "default, 32; cuda::set_qkv_rope_max_warps)")
                           ->check(CLI::Range(0, 32));
                       sub.add_flag("--tma-experts-down", a->tma_experts_down,
                                    "A/B: the down GEMM on the TMA + wgmma kernel too (CudaOptions::tma_experts_down)");
                       sub.add_option("--expert-sms", a->expert_sms,
                                      "run the TMA expert kernels on this many SMs, beside the dense "
                                      "MLP (with --dense-mlp-sms; 0: all SMs)")
                           ->check(CLI::NonNegativeNumber);
                       sub.add_option("--tma-l2-promotion", a->tma_l2_promotion,
                                      "L2 promotion in bytes (0, 128, 256) of the TMA expert kernels' weight maps "
                                      "(CudaOptions::tma_weight_l2_promotion)")
                           ->check(CLI::IsMember({0, 128, 256}));
                       sub.add_option("--expert-token-tiles", a->expert_token_tiles,
                                      "token tiles of 32 rows an expert in the fused expert launch: 2 serves up to "
                                      "64 rows an expert with its weights read once (concentrated routing; "
                                      "CudaOptions::expert_two_token_tiles), 1 sends rows past 32 to the overflow "
                                      "kernels, auto (default) takes 2 for a step whose previous step had at least "
                                      "--two-tile-heavy experts past 32 rows")
                           ->check(CLI::IsMember({"1", "2", "auto"}));
                       sub.add_option("--two-tile-heavy", a->two_tile_heavy,
                                      "with --expert-token-tiles auto: (layer, expert) pairs past 32 rows in the "
                                      "previous step that switch a step to two token tiles "
                                      "(CudaOptions::auto_two_token_tiles_heavy)")
                           ->check(CLI::PositiveNumber);
                       sub.add_flag("--no-fused-experts", a->no_fused_experts,
                                    "A/B: gate_up then a separate down GEMM (cuBLASLt, or the TMA kernel on packed "
                                    "weights) instead of one persistent TMA launch (CudaOptions::fused_experts)");
                       sub.add_flag("--no-pack-gate-up", a->no_pack_gate_up,
                                    "A/B: the experts' gate_up weights in the checkpoint layout, read by 2D "
                                    "tensor-map boxes, instead of packed stages read by 1D bulk copies "
                                    "(CudaOptions::pack_expert_gate_up)");
                       sub.add_flag("--dense-down-first", a->dense_down_first,
                                    "A/B: the dense MLP's down GEMM queued on the side stream before the assignment "
                                    "and the overflow rows (CudaOptions::dense_down_last)");
                       sub.add_flag("--overflow-on-side", a->overflow_on_side,
                                    "A/B: the experts' overflow rows on the side stream ahead of the dense down "
                                    "GEMM instead of on their own stream (CudaOptions::overflow_stream off)");
                       sub.add_flag("--dense-down-side-plan", a->dense_down_side_plan,
                                    "A/B: the dense MLP's down GEMM planned for --dense-mlp-sms SMs like its up "
                                    "GEMM instead of for every SM (CudaOptions::dense_down_all_sms off)");
                       sub.add_flag("--dense-tma", a->dense_tma,
                                    "A/B: denoise passes' qkv and o_proj GEMMs on the split-K Hopper kernel instead "
                                    "of cuBLASLt (CudaOptions::dense_tma)");
                       sub.add_option("--dense-tma-cluster", a->dense_tma_cluster,
                                      "blocks a cluster of the split-K qkv / o_proj kernel, 1 or 2 "
                                      "(CudaOptions::dense_tma_cluster)")
                           ->check(CLI::IsMember({1, 2}));
                       sub.add_flag("--f32-expert-rows", a->f32_expert_rows,
                                    "A/B: denoise passes keep the experts' output rows in f32 instead of bf16 "
                                    "(CudaOptions::bf16_expert_rows off)");
                       sub.add_flag("--wide-assignment", a->wide_assignment,
                                    "A/B: the side stream's assignment as one 1024-thread block, which waits for "
                                    "the expert kernel's end (CudaOptions::narrow_assignment off)");
                       sub.add_flag("--no-pack-down", a->no_pack_down,
                                    "A/B: the experts' down weights in the checkpoint layout (2D tensor-map boxes "
                                    "in the fused launch; cuBLASLt with --no-fused-experts) instead of packed "
                                    "(CudaOptions::pack_expert_down)");
                       sub.add_option("--tma-l2-prefetch", a->tma_l2_prefetch,
                                      "k slices of each TMA expert block's first weight tile prefetched into "
                                      "L2 before the PDL wait, beyond the ring's stages (0: none)")
                           ->check(CLI::NonNegativeNumber);
                       sub.add_option("--tma-prewait-stages", a->tma_prewait,
                                      "ring stages of each TMA expert block's first tile requested before the PDL "
                                      "wait (-1: all; CudaOptions::tma_experts_prewait_stages)")
                           ->check(CLI::Range(-1, 64));
                       sub.add_option("--expert-claim-ahead", a->claim_ahead,
                                      "stages before its current tile's last at which a fused expert block claims "
                                      "its next tile (1: at the end, as before session 13; "
                                      "CudaOptions::tma_experts_claim_ahead)")
                           ->check(CLI::Range(1, 64));
                       sub.add_option("--expert-first-stride", a->first_stride,
                                      "block b of the fused expert launch starts on tile (b * this) mod grid "
                                      "(1: tile b; CudaOptions::tma_experts_first_stride)")
                           ->check(CLI::Range(1, 100000));
                       sub.add_option("--tma-grid", a->tma_grid,
                                      "blocks of the TMA expert kernels (0: as many as fit on every SM; CudaOptions::tma_experts_grid)")
                           ->check(CLI::NonNegativeNumber);
                       sub.add_option("--tma-stages", a->tma_stages,
                                      "ring stages of the TMA expert kernels' blocks (CudaOptions::tma_experts_stages)")
                           ->check(CLI::IsMember({3, 4, 5}));
                       sub.add_option("--dense-mlp-sms", a->dense_mlp_sms,
                                      "plan the concurrent dense MLP's GEMMs for this many SMs (0: all; default: "
                                      "CudaOptions' 66)")
                           ->check(CLI::NonNegativeNumber);
                       sub.add_flag("--untuned-gemm", a->untuned_gemm,
                                    "A/B: cuBLASLt's heuristic first pick for every GEMM instead of the pinned table "
                                    "(src/backend/cuda/gemm_tuned.inc)");
                       sub.add_option("--gemm-untable", a->gemm_untable,
                                      "A/B: cuBLASLt's heuristic first pick for these GEMM shapes (MxNxK as in "
                                      "gemm_tuned.inc; repeatable) instead of their pinned configurations");
                       sub.add_option("--gemm-config", a->gemm_configs,
                                      "A/B: this cuBLASLt configuration for a GEMM shape, MxNxK=c0,...,c8 (the nine "
                                      "values of a gemm_tuned.inc entry; repeatable)");
                       sub.add_flag("--tune-gemm", a->tune_gemm,
                                    "time every cuBLASLt candidate of each GEMM shape (graphs off) and print the "
                                    "fastest as lines for src/backend/cuda/gemm_tuned.inc");
                       return [=]() -> int {
#ifdef DIFFGEMMA_WITH_CUDA
                         return run_bench(*a);
#else
                         fail("diffgemma was built without CUDA: bench needs the CUDA backend");
#endif
                       };
                     });

}  // namespace
}  // namespace dg::cli
