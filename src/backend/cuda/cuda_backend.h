#pragma once
// The CUDA backend: bf16 weights resident on one GPU, bf16 KV cache in fixed per-layer regions, bf16 activations
// with an f32 residual stream, f32 router / softmax / logits / sampler statistics.
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "model/weights.h"

namespace dg {

// Where a denoise step's device time goes (`diffgemma bench --breakdown`): while `enabled`, each denoise records a
// CUDA event after every stage and adds the time since the previous event to that stage (summed over layers).
// Costs one event record per stage (~0.4k per step), so the plain step timing runs with it off.
struct CudaStageTimes {
  bool enabled = false;
  int steps = 0;
  std::vector<std::pair<std::string, double>> ms;  // stage name -> ms summed over layers and steps
  void reset() { steps = 0, ms.clear(); }
};

// Which self-conditioning path the PreviousStep steps took (CudaOptions::sc_stats; `diffgemma bench --sc-sparse`).
struct CudaScStats {
  int64_t sparse_steps = 0;  // survivor gather
  int64_t dense_steps = 0;   // exact GEMM through the whole table (sc_sparse on, but a row failed the bounds)
  int max_survivors = 0;     // largest survivor count of a row seen (over all steps' rows)
  double max_tail = 0;       // largest dropped mass of a row seen
  void reset() { *this = CudaScStats{}; }
};

// Host-side cost of the whole-step graph path (`diffgemma bench` reports it): how long each cudaGraphLaunch call
// took on the calling thread. The device starts a launched graph only as the call returns, so the first launch's
// time is part of every step's wall (the second's runs while the first graph computes).
struct CudaHostTimes {
  std::vector<double> graph_launch_us;
  std::vector<double> head_launch_us;  // CudaOptions::split_step_head: the SC GEMM's graph, launched before the rest
  void reset() { graph_launch_us.clear(), head_launch_us.clear(); }
};

// The fused expert launch's token-tile mode over the PreviousStep denoise steps (CudaOptions::tile_stats; `diffgemma
// bench` reports it), and how concentrated the last denoise step's routing was.
struct CudaExpertTileStats {
  int64_t one_tile_steps = 0;
  int64_t two_tile_steps = 0;
  int last_heavy = 0;  // (layer, expert) pairs with more than 32 rows in the last denoise step
  std::vector<int> last_heavy_per_layer;  // the same by layer
  void reset() { *this = CudaExpertTileStats{}; }
};

struct CudaOptions {
  int device = 0;
  // Positions the full-attention layers can hold (prompt + committed canvases); prefill beyond it fails clearly.
  int64_t max_context = 32768 + 1024;
  // Sliding layers keep a ring of (sliding_window - 1) + sliding_rewind slots, so a truncate of up to
  // sliding_rewind tokens needs no recomputation.
  int64_t sliding_rewind = 512;
  // Denoise passes run the full-attention layers' attention as two cuBLASLt GEMMs around one softmax kernel
  // (kernels_attention_gemm.cu; every canvas query sees the same keys) instead of the fused attention kernel, up to
  // gemm_attention_max_keys keys (cached + canvas); beyond, the fused kernel. Its scores and probabilities take
  // num_heads x canvas_length x min(max_context, gemm_attention_max_keys) x 6 bytes (201 MB at the defaults).
  // H200, full layer at kv 4096: 89.6 vs 138.9 us alone for attention_wgx_k (session 9), 90.6 vs 102.8 for the
  // cluster-pair attention_ws_k (session 28); at kv 32768 769.1 vs 619.6 us for the pair (the 32K step 18.82 vs
  // 18.07 ms), so the GEMM path stops at 8192 keys (the crossover by those two points: ~6.5-9.5K keys). A/B: bench
  // --no-gemm-attention, --gemm-attention-max-keys.
  bool gemm_attention = true;
  int gemm_attention_max_keys = 8192;
  int prefill_chunk = 4096;  // prefill runs in chunks of at most this many tokens (bounds the scratch arenas)
  bool progress = true;      // weight upload progress on stderr
  CudaStageTimes* stage_times = nullptr;  // not owned; see CudaStageTimes
  // Replay a denoise step's decoder layers as one CUDA graph (captured per canvas length and kv length); off runs
  // the same launches eagerly (A/B in `diffgemma bench --no-graphs`).
  bool cuda_graphs = true;
  // With cuda_graphs: a whole denoise step (ids upload, embedding, SC, the layers, lm_head, row statistics, the
  // statistics' download) as one CUDA graph, for the steps whose launches depend only on (rows, kv length, temperature,
  // SC mode): no trace or stage timing, no logits for the host, no sparse SC, no caller SC logits. The ids are read
  // from mapped pinned memory and the statistics written back by a kernel (no memcpy nodes). Bitwise the same as the
  // layers' graph; on the H200 (docs/BENCHMARKS.md, session 12) 0.00-0.08 ms faster a 4K step in each of four calls
  // (fewer host launches a step). A/B: bench --layer-graph.
  bool whole_step_graph = true;
  // With whole_step_graph: a PreviousStep step runs as two graphs, its SC GEMM (probs @ E, ~0.5 ms, reads nothing the
  // host writes for the step) first and the rest second. The device starts a graph only as its cudaGraphLaunch call
  // returns, and that call takes ~5-25 us on the host for the ~560-node step (CudaHostTimes): launched first, the
  // one-GEMM head starts after a call of a few us, and the body's long call runs while the head computes. The same
  // launches in the same order, so bitwise the same results. A/B: bench --one-step-graph.
  bool split_step_head = true;
  // With split_step_head: a step whose request says more steps follow (DenoiseRequest::more_steps) launches the next
  // step's SC GEMM graph right behind its own graph, and the host waits only for its own graph: the GEMM (it reads
  // only this step's probs) runs while the host samples, stages the next canvas and launches the next step, so the GPU
  // does not sit idle between steps. A next call that is not a PreviousStep step of the same rows leaves the GEMM's
  // output unused (~0.5 ms of GPU time at the full shape, spent before that call's work starts). The same launches in
  // the same stream order: bitwise the same results. A/B: bench --no-sc-ahead.
  bool sc_head_ahead = true;
  // With whole_step_graph: a prefill captures every step graph captured before again for its new KV length while its
  // own work runs on the GPU (the commit between two blocks: the next block's first steps then find their graphs
  // instead of capturing them, ~2.3 ms each on an H100 host, with the GPU idle). The same graphs: bitwise the same
  // results. A/B: bench --no-graph-prewarm.
  bool prewarm_step_graphs = true;
  // With whole_step_graph: the step's temperature is read from device memory when the graph runs (copied from mapped
  // pinned memory on a side branch at the graph's start), so one captured step serves every temperature. Without it
  // the temperature is a launch argument and part of the graph's key: the block loop's schedule changes T every step,
  // so every step re-captured and patched the ~560-launch graph on the host. A/B: bench --temperature-in-key.
  bool device_temperature = true;
  // With cuda_graphs: each memset node of a captured graph (cuBLASLt zeroes a 4-byte workspace word before some of
  // its GEMMs: the full layers' pointer-array S GEMM, lm_head) becomes a kernel node with the same stores and edges
  // (cuda::memset_nodes_as_kernels). The session-12 profile showed the step idle ~12-14 us after each such memset
  // node before its GEMM started, against ~2 us after a kernel. A/B: bench --graph-memset-nodes.
  bool graph_memset_kernels = true;
  // Canvas-sized passes (denoise, commit) run the experts as two strided-batched cuBLASLt GEMMs over every expert
  // padded to 2 x mean rows (moe_group_padded; rows past that through the grouped kernels), gate/up kept in f32
  // before the activation exactly as the grouped kernels do. On the H200 (docs/BENCHMARKS.md 2026-11-30) it cuts the
  // 4K step from 21.8 to 20.4 ms and passes the same parity checks. Off: the grouped kernels for every pass
  // (A/B: `diffgemma bench --grouped-experts`). Prefill chunks always use the grouped kernels.
  bool padded_experts = true;
  // Run a layer's dense MLP (then the experts' few overflow rows) on a second stream, concurrently with its router
  // and experts (A/B: bench --no-overlap). dense_mlp_sms > 0 plans those GEMMs for that many SMs, leaving the rest
  // to the main stream: cuBLASLt's Hopper kernels otherwise take every SM (each block holding a whole SM's registers
  // and shared memory), and the router's small kernels wait for them. H200, 4K step, cuBLASLt's router chain: 18.35
  // ms on all SMs, 18.06 / 18.06 / 18.10 / 18.07 on 33 / 48 / 66 / 80 (docs/BENCHMARKS.md, session 5); with
  // fused_router and dynamic_expert_tiles: 17.58 / 17.51 / 17.42 / 17.49 / 17.52 / 17.49 on 56 / 66 / 66 / 80 / 100 /
  // all (session 6); 0: all SMs.
  bool overlap_dense_mlp = true;
  int dense_mlp_sms = 66;
  // With overlap_dense_mlp: the dense MLP's down GEMM queued on the side stream after the assignment and the overflow
  // rows instead of before them (see CudaBackend::layer). A/B: bench --dense-down-first.
  bool dense_down_last = true;
  // With overlap_dense_mlp: the experts' overflow rows (the gather and the two grouped GEMMs of rows past 32 an
  // expert; almost always none) on a third stream forked from the side stream after the assignment and joined before
  // the combine, instead of on the side stream ahead of the dense down GEMM. Their blocks (110 KB of shared memory)
  // cannot sit beside the expert kernel's, so they start only as it drains; queued ahead of the dense down GEMM they
  // held it back by their launches even with no rows to do. Same results. A/B: bench --overflow-on-side.
  bool overflow_stream = true;
  // With dense_down_last: that GEMM planned for every SM rather than dense_mlp_sms (it runs after the experts, where
  // nothing else needs SMs; on 66 SMs it took 12.3 us in the session-15 profile, 7.1 alone on all). A/B: bench
  // --dense-down-side-plan.
  bool dense_down_all_sms = true;
  // Denoise passes keep the experts' output rows (the down projections the combine weighs and sums) in bf16 instead
  // of f32 (cuda::ExpertRows): the expert launch writes, and the combine reads, half the bytes. HF's bf16 model rounds
  // these rows to bf16 too; encoder passes (prefill, commit) keep f32, so the KV cache they write is unchanged. H200,
  // same call (docs/BENCHMARKS.md, session 15): 4K step 15.46-15.53 against 15.67-15.74 ms, 15.60 against 15.76 in
  // the final call. A/B: bench --f32-expert-rows.
  bool bf16_expert_rows = true;
  // Denoise passes keep the fused expert launch's outputs in L2 until the combine has read them, a mask: 1 its bf16 y
  // rows and 2 its act rows stored with an evict_last policy (cuda::TmaExpertsPlan::rows_evict_last), 4 the combine
  // dropping each y line once read (moe_combine_ffn's discard_y: never written back). Their write-backs otherwise
  // land in the middle of the weight stream. The same results either way. H100, same-call pairs (docs/BENCHMARKS.md,
  // session 31): 4K step -0.09 ms; 1 | 2 without the discard +0.3 ms (pinned dirty lines crowd the stream's L2).
  // A/B: bench --expert-rows-l2 MASK.
  int expert_rows_l2 = 7;
  // Denoise passes' full layers on the GEMM attention: the softmax drops each f32 score line from L2 once it has read
  // it (cuda::softmax_rows_to_bf16's discard_scores). A layer's S is 71 MB at kv 4096, more than L2 holds; its dirty
  // lines would otherwise be written back during the PV GEMM and the layer's expert stream. The same results either
  // way. H100, same call (docs/BENCHMARKS.md, session 32): with the sliding layers' split partials dropped the same
  // way (cuda::set_attention_discard_partials) 4K step -0.09 ms, the partials alone -0.04. A/B: bench
  // --keep-attn-scores.
  bool discard_attention_scores = true;
  // Denoise passes run the sliding layers' qkv projection and every layer's o_proj on our Hopper GEMM
  // (kernels_dense_tma.cu: split-K f32 partials that qkv_norm_rope / add_rms_norm_pre_ffn add up as they read them,
  // launched with PDL so the weight stream starts during the predecessor's tail) instead of cuBLASLt, which cannot
  // be PDL-launched. Only where the split-K grid fills the GPU in one wave with at least two splits (the full layers'
  // qkv, 72 weight tiles, stays on cuBLASLt). dense_tma_cluster: blocks a cluster (1 or 2) that share the token
  // loads. Off: slower than cuBLASLt (H200, session 16: qkv 23.1 vs 19.8 us alone, o_proj 16.0 vs 14.0; 4K step
  // 15.78 vs 15.59 ms in the same call; docs/PERFORMANCE.md). Same math either way (the parity tests pass with it on).
  // A/B: bench --dense-tma, --dense-tma-cluster.
  bool dense_tma = false;
  int dense_tma_cluster = 1;
  // The next step's SC probs written by the row-statistics pass itself, unnormalized against cap / T, with the
  // per-row factor applied to the SC GEMM's output (softcap_row_stats' probs_row_scale), instead of a second pass that
  // reads the 268 MB of logits again (the full shape). Same math to bf16 rounding (the probs are rounded at another
  // scale). A/B: bench --no-fused-sc-probs.
  bool fused_sc_probs = true;
  // The lm_head writes its logits in bf16 (as HF's bf16 lm_head does before its f32 softcap, and as the seed keeps
  // logits), and the row statistics read them (softcap_row_stats' logits_bf16; the capped logits, where something
  // reads them, are still f32). H200 (session 26): the lm_head 450.6 vs 482.2 us alone, the statistics pass 105.8 vs
  // 103.7, but the 4K step the same (15.06-15.09 vs 15.07-15.09 ms in alternating runs), and the rounding moved the
  // well-conditioned tiny-c generation off the f32 CPU oracle's by one token: off. A/B: bench --bf16-logits.
  bool bf16_logits = false;
  // With overlap_dense_mlp and the masked gate_up: the side stream's assignment (moe_assign_padded) as one block of
  // 256 threads instead of 1024, so that it fits beside the expert kernel's blocks (their registers leave ~23K an SM)
  // and runs while the experts stream instead of after them. Same results. H200, 4K step (docs/BENCHMARKS.md,
  // session 11): 16.26 / 16.23 against 16.46 / 16.45 ms. A/B: bench --wide-assignment.
  bool narrow_assignment = true;
  // With overlap_dense_mlp: the side stream at the device's highest priority (kept in the decoder graph's kernel
  // nodes), so that the dense MLP's blocks are placed before the gate_up blocks still waiting for an SM, and its
  // second GEMM need not wait for gate_up's blocks to exit. A/B: bench --dense-mlp-priority.
  bool dense_mlp_priority = false;
  // Canvas-sized passes with padded experts route in two launches of our own (router_top_k: the f32 router GEMM's
  // split partials, then top-k, which also leaves each expert's tokens as a bit mask) instead of cuBLASLt's split-K
  // GEMM + its reduce + route_top_k; with the gathered TMA gate_up, that kernel reads the masks and the assignment
  // runs beside it. A/B: bench --cublas-router. History in docs/BENCHMARKS.md (session 6): with the assignment still
  // in the router's last block, alone slower, with dynamic_expert_tiles and dense_mlp_sms 66 the 4K step 17.41-17.57
  // against 17.61-17.63 ms and a commit 16.5 against 17.0 ms.
  bool fused_router = true;
  // Canvas-sized padded passes with 32 rows per expert (the real model: 256 tokens, top 8 of 128) on Hopper (sm_90a
  // image): gate_up on our TMA + wgmma kernel (kernels_experts_tma.cu) instead of cuBLASLt, with the GELU-tanh * up in
  // its epilogue (no f32 gate/up, no moe_gelu_mul_padded). It is PDL-launched and streams its first weight tiles
  // before waiting for the gather, which hides the launch gap and pipeline ramp that a cuBLASLt GEMM (never
  // PDL-launched) leaves. H200, same call: 4K step 18.38 vs 18.57 ms with cuBLASLt (docs/BENCHMARKS.md, session 5).
  // A/B: bench --cublas-experts. Elsewhere (other GPUs, other shapes) the cuBLASLt path runs.
  bool tma_experts = true;
  // Prefill chunks longer than a canvas (the grouped expert path, ~256 rows an expert at 4096 tokens) on the wgmma
  // expert kernels (kernels_experts_prefill.cu) instead of the grouped mma.sync ones, on Hopper (sm_90a image).
  // Not bitwise the grouped kernels (another f32 summation order). A/B: bench --no-prefill-tma-experts.
  bool prefill_tma_experts = true;
  // With prefill_tma_experts: the blocks claim their work items from a counter instead of striding over them, so
  // those that start late (their SMs held by the dense MLP's GEMMs on the side stream) take fewer. Same results,
  // bitwise. A/B: bench --static-prefill-items.
  bool prefill_item_counter = true;
  // With tma_experts: gate_up reads each expert's token rows straight from the expert input (moe_assign_padded's
  // slot_token) instead of a gathered copy, so no gather kernel sits between the router and the experts. Same
  // results, bitwise. H200, same call: 4K step 17.64 / 17.63 ms against 18.14 with the gather (docs/BENCHMARKS.md,
  // session 5). A/B: bench --no-tma-gather.
  bool tma_gather_rows = true;
  // With tma_gather_rows: after each block's first tile, gate_up's tiles come from an atomic counter instead of a
  // fixed stride, so the blocks that start late (on the SMs the dense MLP's GEMMs hold) take fewer tiles instead of
  // ending the kernel late. Same results, bitwise. A/B: bench --static-expert-tiles.
  bool dynamic_expert_tiles = true;
  // With tma_experts: the down GEMM on the TMA kernel too. Off: it measured 0.3 ms a step slower than cuBLASLt down
  // (4.39 vs 4.09 ms summed over the layers; bench --tma-experts-down).
  bool tma_experts_down = false;
  // With tma_experts and overlap_dense_mlp: > 0 runs the TMA expert kernels on this many SMs, one block each (an
  // 8-stage ring), so that the dense MLP (planned for dense_mlp_sms) runs beside them instead of queueing behind
  // them (measured slower on the H200 without PDL, 19.5-21.4 against 19.3 ms a 4K step; bench --expert-sms).
  int expert_sms = 0;
  // With tma_experts: each block of the TMA expert kernels also prefetches this many further 64-wide k slices of its
  // first tile's weights into L2 before its griddepcontrol.wait (bench --tma-l2-prefetch; 0 = none).
  int tma_experts_l2_prefetch = 0;
  // cuda::TmaExpertsPlan::prewait_stages (-1: the whole ring before the wait). A/B: bench --tma-prewait-stages.
  int tma_experts_prewait_stages = -1;
  // cuda::TmaExpertsPlan::claim_ahead (the fused expert launch's producers claim their next tile that many stages
  // before the current one's last). A/B: bench --expert-claim-ahead.
  int tma_experts_claim_ahead = 3;
  // cuda::TmaExpertsPlan::first_tile_stride. A/B: bench --expert-first-stride.
  int tma_experts_first_stride = 1;
  // With tma_experts (sms 0): the TMA kernels' grid (0: two blocks per SM) and ring stages (3, 4 or 5), for A/B
  // (bench --tma-grid / --tma-stages); cuda::TmaExpertsPlan explains them.
  // With the packed weights, three 3-stage blocks an SM measured 0.04-0.1 ms a step faster than two of 4 stages
  // (16.23-16.28 vs 16.32-16.36 ms, three calls; session 10); with the 2D boxes they were not (session 6).
  int tma_experts_grid = 0;
  int tma_experts_stages = 3;
  // With dynamic_expert_tiles and the masked gate_up: gate_up and down as one persistent TMA launch
  // (cuda::moe_experts_fused_tma_masked) instead of gate_up then cuBLASLt's down GEMM. A/B: bench --no-fused-experts.
  // With the 2D-box weights it was 0.05-0.2 ms a step slower (the side stream's dense down GEMM and the assignment
  // wait for its end; docs/BENCHMARKS.md, session 7); with both weight sets packed (below) it is 0.06-0.2 ms faster
  // (369.9 vs 374.9 us a layer alone; session 10).
  bool fused_experts = true;
  // The fused expert launch serves up to 64 rows an expert (two token tiles over the same staged weights) instead of
  // 32, so that only rows past 64 go through the overflow kernels, which read an expert's weights a second time
  // (TmaExpertsPlan::two_token_tiles). A/B: bench --expert-token-tiles 2. With the bench's canvas of 16 / 4 / 1
  // distinct tokens the 4K step took 15.59 / 16.03 / 16.02 ms against 16.12 / 17.59 / 18.28, but with a uniform random
  // canvas (no expert past 32 rows) 0.2 ms longer (docs/BENCHMARKS.md, session 24): forced off by default, chosen
  // per step instead (below).
  bool expert_two_token_tiles = false;
  // Without expert_two_token_tiles, a denoise step with SelfCondition::PreviousStep (the same canvas as the previous
  // denoise step, whose routing it mostly repeats) takes two token tiles when that previous step had at least this
  // many (layer, expert) pairs with more than 32 rows (moe_assign_padded counts them into mapped memory); 0 = never.
  // Each mode has its own captured graphs, so switching costs no capture. The choice depends only on the previous
  // step, as the step's SC input already does: generation stays deterministic. A/B: bench --expert-token-tiles
  // 1 / 2 / auto, --two-tile-heavy N. With the bench's synthetic weights at the 4K step (docs/BENCHMARKS.md, session
  // 25): a uniform random canvas has 0-1 such pairs (one tile 0.24 ms faster), a canvas of 64 distinct tokens 9 (one
  // tile 0.05 ms faster), 32 distinct 30 (two tiles 0.22 ms faster), 4 distinct 146 (1.6 ms faster). The two modes'
  // logits were bitwise equal at the full-shape fixture (CudaFullShape.ExpertTwoTokenTilesMatchOneTile).
  int auto_two_token_tiles_heavy = 12;
  // L2 promotion (bytes: 0, 128, 256) of the TMA expert kernels' weight maps. A/B: bench --tma-l2-promotion. At 0
  // the TMA down kernel alone drops from 140.9 to 132.3 us (cuBLASLt's speed), gate_up rises 242.8 -> 247.8, and no
  // combination was faster per step than this default (docs/BENCHMARKS.md, session 8).
  int tma_weight_l2_promotion = 256;
  // Weights option (upload_cuda_weights / synthetic_cuda_weights; backends over shared weights follow what these
  // were built with): where the TMA gate_up kernel can run (sm_90a, 32 padded rows per expert, H and I multiples of
  // 64), store the experts' gate_up weights packed (cuda/expert_layout.h), each of the kernel's 16 KB ring stages
  // contiguous and pre-swizzled, so that one 1D bulk copy fills it instead of two 2D tensor-map boxes (4.46-4.49
  // against 4.18-4.27 TB/s for a bare ring on the H200: tools/gpu/microbench/stream_bench.cu). The grouped kernels
  // (prefill, overflow rows) read the packed layout too; a padded pass that cannot take the TMA path runs grouped
  // instead of cuBLASLt (which needs the checkpoint layout). Same results, bitwise. A/B: bench --no-pack-gate-up.
  bool pack_expert_gate_up = true;
  // The same for the experts' down weights (weights option): the down GEMM of canvas passes then runs in the fused
  // launch or on the TMA kernel (as with tma_experts_down, its rows counted from the router's masks), never on
  // cuBLASLt. A/B: bench --no-pack-down. (On the separate TMA down kernel it is no faster than cuBLASLt's down GEMM:
  // 130.8 vs 133.1 us alone, the step 0.05-0.15 ms slower; session 10.)
  bool pack_expert_down = true;
  // Sparse SC soft embedding (approximate, off by default): a PreviousStep step sums p_i E[i, :] over each row's
  // survivors only (z_i >= max_z - 10, i.e. p_i >= e^-10 p_max; p_i the same bf16 values the exact path reads)
  // instead of the dense GEMM of the probs through the whole [V, H] table (~0.58 ms). The step falls back to the
  // exact path when any row of the previous step had more than sc_sparse_max_survivors survivors, more than
  // kScTileSlots in one 8192-token tile, or dropped more than sc_sparse_max_tail probability mass, or when all rows
  // together had more than sc_sparse_max_total survivors: the gather reads H bf16 per survivor, ~0.37 ms at 1024
  // per row on the H200 (tools/gpu/microbench/rowstats_bench.cu), where the exact GEMM takes ~0.45. `--sc-sparse`.
  bool sc_sparse = false;
  int sc_sparse_max_survivors = 2048;
  int64_t sc_sparse_max_total = 131072;
  double sc_sparse_max_tail = 1e-3;
  CudaHostTimes* host_times = nullptr;  // not owned; see CudaHostTimes
  CudaScStats* sc_stats = nullptr;  // not owned; counts the path of every PreviousStep step while sc_sparse
  CudaExpertTileStats* tile_stats = nullptr;  // not owned; see CudaExpertTileStats
};

// A model's weights on the GPU (bf16; norms, router and scales f32), uploaded once and read-only after: any number
// of backends on that GPU can share them (server session slots each add only a KV cache and scratch, ~3 GiB at the
// default max_context, where the weights are ~48 GiB). `options.device` and `progress` are used.
class CudaWeights;
std::shared_ptr<CudaWeights> upload_cuda_weights(const LoadedModel& model, const CudaOptions& options = {});
std::shared_ptr<CudaWeights> synthetic_cuda_weights(const ModelConfig& config, uint64_t seed,
                                                    const CudaOptions& options = {});
// A backend (KV cache, scratch, streams) over shared weights, on the same device.
std::unique_ptr<Backend> make_cuda_backend(std::shared_ptr<const CudaWeights> weights, const CudaOptions& options = {});
// One backend with its own weights. `model` must outlive the call only (its weights are uploaded as bf16).
std::unique_ptr<Backend> make_cuda_backend(const LoadedModel& model, const CudaOptions& options = {});
// Synthetic weights generated on the GPU from `seed` (benchmarks at full size without a checkpoint).
std::unique_ptr<Backend> make_cuda_backend_synthetic(const ModelConfig& config, uint64_t seed,
                                                     const CudaOptions& options = {});

}  // namespace dg
