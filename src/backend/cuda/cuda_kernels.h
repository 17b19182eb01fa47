#pragma once
// Launchers of the CUDA kernels of one DiffusionGemma layer step. Every pointer is device memory; every launcher
// checks its launch. Layouts are row-major; "bf16" activations, f32 wherever the CPU oracle needs the range
// (residual stream, norm statistics, softmax, router, logits). Each launcher has a CPU-oracle test in
// tests/test_cuda_kernels.cpp.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace dg::cuda {

using bf16 = __nv_bfloat16;
class Gemm;  // gemm.h

// ---- elementwise / row kernels (kernels_rows.cu) ----
// out[t, :] = E[ids[t], :] * scale (f32 out; the residual stream is f32).
void embed_scale(const int32_t* ids, int T, const bf16* E, int H, float scale, float* out, cudaStream_t s);
// dst[i] = src[i] for `words` 32-bit words, as a kernel (dst may be mapped pinned host memory: a CUDA graph then needs
// no memcpy node for it). Both 4-byte aligned.
void copy_words(const void* src, size_t words, void* dst, cudaStream_t s);
// Replaces each memset node of `graph` (cuBLASLt zeroes a few workspace bytes before some of its GEMMs) by a kernel
// node doing the same stores, with the same edges; returns how many. CudaOptions::graph_memset_kernels says why.
int memset_nodes_as_kernels(cudaGraph_t graph);
// A call timed as the engine's graphs launch it, right after a kernel: a graph of `pairs` (one-word copy_words from
// word[0] to word[1], call()) captured on s, replayed once to warm up, then `rounds` times; returns the best replay's
// milliseconds (call null: the copies alone, for the caller to subtract), or -1 when a call fails (returns false or
// throws) or the graph cannot be captured. memset_kernels: its memset nodes become kernel nodes first, as in the
// engine's graphs. For timing only (it synchronizes s).
float graph_after_copies_ms(cudaStream_t s, uint32_t* word, int pairs, int rounds, const std::function<bool()>& call,
                            bool memset_kernels);
// y = x * (mean(x^2) + eps)^-1/2 * w  (w == nullptr: no scale); one row of n per block. Any in/out types.
void rms_norm_f32_to_bf16(const float* x, int rows, int n, const float* w, float eps, bf16* y, cudaStream_t s);
void rms_norm_f32_to_f32(const float* x, int rows, int n, const float* w, float eps, float* y, cudaStream_t s);
// y = rms_norm(x * f; w) with f = (row_scale ? row_scale[r] : 1) * scale per row r: the same bits as scale_rows_f32 /
// scale_f32 in place then rms_norm_f32_to_bf16, in one pass where the width allows (x is left as it was then; other
// widths scale x in place).
void scaled_rms_norm_f32_to_bf16(float* x, int rows, int n, const float* row_scale, float scale, const float* w,
                                 float eps, bf16* y, cudaStream_t s);
// h = rms_norm(h + a; w): the same bits as add_bf16_to_f32 then rms_norm_f32_to_f32 in place, in one pass. With y2:
// also y2 = rms_norm(h; w2) of the new h, the same bits as rms_norm_f32_to_bf16 after it (the first layer's input
// norm in the SC prologue).
void add_then_rms_norm(float* h, const bf16* a, int rows, int n, const float* w, float eps, cudaStream_t s,
                       const float* w2 = nullptr, bf16* y2 = nullptr);
// The same with h's rows embedded in the pass (not read): h = rms_norm(E[ids] * escale + a; w), the same bits as
// embed_scale then add_then_rms_norm (the SC prologue of a PreviousStep step, whose embedding then needs no launch).
void embed_add_then_rms_norm(const int32_t* ids, const bf16* E, float escale, float* h, const bf16* a, int rows,
                             int n, const float* w, float eps, cudaStream_t s, const float* w2 = nullptr,
                             bf16* y2 = nullptr);
// h += rms_norm(a; w)  (post-attention residual add)
void add_rms_norm(float* h, const bf16* a, int rows, int n, const float* w, float eps, cudaStream_t s);
// From the residual h [T, H]: x1 = rms(h; w_pre) (dense MLP input), xe = rms(h; w_pre2) (expert input) and
// xr = rms_noscale(h) * router_scale * H^-0.5 (router input, f32).
void pre_ffn(const float* h, int rows, int n, const float* w_pre, const float* w_pre2, const float* router_scale,
             float eps, bf16* x1, bf16* xe, float* xr, cudaStream_t s);
// add_rms_norm(h, a; w_post) then pre_ffn(h; ...), in one kernel where the row fits the vector path (the same
// arithmetic in the same order as the two launches).
// a_part (with a_splits >= 1): a's rows are bf16(the in-order sum of a_splits split-K partials, a_part[(s rows + r)
// n + i]: dense_tma_splitk's output), the same bits dense_splits_to_bf16 would give; a is not read where the row
// fits the vector path, else it is written with those rows first.
void add_rms_norm_pre_ffn(float* h, const bf16* a, int rows, int n, const float* w_post, const float* w_pre,
                          const float* w_pre2, const float* router_scale, float eps, bf16* x1, bf16* xe, float* xr,
                          cudaStream_t s, const float* a_part = nullptr, int a_splits = 0);
// h = (h + rms(rms(m1; w1) + rms(m2; w2); w)) * scalar
void ffn_combine(float* h, const bf16* m1, const float* m2, int rows, int n, const float* w1, const float* w2,
                 const float* w, float eps, float scalar, cudaStream_t s);
// act[r, i] = gelu_tanh(gu[r, i]) * gu[r, I + i]   (gu: [rows, 2I])
void gelu_mul(const bf16* gu, int rows, int I, bf16* act, cudaStream_t s);
// h += a (f32), used for the SC signal: e += sc
void add_bf16_to_f32(float* h, const bf16* a, size_t n, cudaStream_t s);

// qkv: [T, (nh + 2 nkv) D] (or [T, (nh + nkv) D] when v_from_k: full layers reuse raw k as v).
// q = rope(rms(q; qw)), k = rope(rms(k; kw)), v = rms_noscale(v); positions pos0 + t.
// inv_freq: [D/2] f32, zeros for pass-through slots.
// qkv_part (with splits >= 1): qkv's values are bf16(the in-order sum of `splits` split-K partials, qkv_part[(s T +
// t) width + c]: dense_tma_splitk's output), as dense_splits_to_bf16 would give them; qkv is not read at D 256 / 512,
// else it is written with those values first.
void qkv_norm_rope(const bf16* qkv, int T, int nh, int nkv, int D, bool v_from_k, const float* qw, const float* kw,
                   const float* inv_freq, int64_t pos0, float eps, bf16* q, bf16* k, bf16* v, cudaStream_t s,
                   const float* qkv_part = nullptr, int splits = 0);

// A/B (bench --qkv-rope-warps): at most this many warps a block of qkv_norm_rope's vector kernel (one warp a row of
// q / k / v heads; default 32: a token's 32 sliding or 20 full-layer rows in one pass; before session 13: 16).
void set_qkv_rope_max_warps(int n);

// Copies the new K/V rows of positions [pos0, pos0 + T) into a cache region of `cap` slots (slot = pos % cap);
// only the last min(T, cap) rows are written (earlier ones would be overwritten anyway).
void kv_write(const bf16* k_new, const bf16* v_new, int T, int row, int64_t pos0, bf16* k_cache, bf16* v_cache,
              int64_t cap, cudaStream_t s);

// In place: logits = cap * tanh(logits / cap) (to ~1e-6 cap absolute: softcap_rs in kernels_rows.cu) and per-row
// stats of z = logits / T (dg::compute_row_stats: argmax with ties -> lower index, max_z, logsumexp, entropy with
// double accumulation). probs != nullptr: also probs = bf16(expf(z - max_z) * inv_sum), softmax(z) as bf16 (the next
// step's SC input). Bitwise deterministic.
// scratch: device memory of softcap_row_stats_scratch_bytes(rows, V) bytes (per-tile partials), owned by the caller;
// two calls must not share it concurrently.
struct DeviceRowStats {
  int32_t argmax;
  float max_z, logsumexp, entropy;
  float inv_sum;  // float(1 / sum_i exp(z_i - max_z)), the factor of the probs above
  // Written by sc_survivors only (softcap_row_stats sets -1, 0, 0): the row's survivors (z >= max_z - 10), the
  // probability mass of the other tokens, and 1 when a tile had more survivors than its kScTileSlots.
  int32_t survivors;
  float tail_mass;
  int32_t tile_overflow;
};
size_t softcap_row_stats_scratch_bytes(int rows, int V);
// write_capped false: the logits are left as they were (the stats and probs are the same bits), which saves the
// pass a write of the whole [rows, V] f32 block when nothing reads the capped logits afterwards.
// probs_row_scale != nullptr (with probs): the probs come out of the statistics pass itself, unnormalized, with
// softmax(z) = probs_row_scale[r] * probs[r, :] (probs[r, i] = bf16(exp(z_i - cap / T)); a row whose max is too far
// below cap / T gets the normalized probs above and scale 1). One pass over the logits instead of two; a GEMM of the
// probs is then scaled per row afterwards.
// stats_mirror != nullptr: the stats are written there too (e.g. mapped host memory, in place of a copy after).
// temperature_dev != nullptr: the kernels read the temperature from this device float when they run (1 / T and
// cap / T rounded on the device as the host rounds them: the same bits as passing it), and `temperature` only picks
// the division variant (softcap_row_stats_variant). A captured step then serves every temperature of its variant.
// logits_bf16 != nullptr: the raw logits are these bf16 values (an lm_head with bf16 output, as HF's), and `logits`
// (f32, may be null when write_capped is false) only receives the capped values; the results are the same bits as
// f32 logits holding the same values.
void softcap_row_stats(float* logits, int rows, int V, float softcap, float temperature, DeviceRowStats* stats,
                       void* scratch, cudaStream_t s, bf16* probs = nullptr, bool write_capped = true,
                       float* probs_row_scale = nullptr, DeviceRowStats* stats_mirror = nullptr,
                       const float* temperature_dev = nullptr, const bf16* logits_bf16 = nullptr);
// Which kernels softcap_row_stats launches for (softcap, temperature), apart from the shapes: 1 where divisions by
// cap and T are done by reciprocal (every temperature in [2^-24, 2^24] with cap in [1, 2^24]), 0 otherwise.
int softcap_row_stats_variant(float softcap, float temperature);
// probs[r, :] = softmax(logits[r, :] / temperature) as bf16 (temperature 1 for already-tempered input).
void softmax_rows_bf16(const float* logits, int rows, int V, float temperature, bf16* probs, cudaStream_t s);
// out = in * scale (f32, in place allowed)
void scale_f32(const float* in, size_t n, float scale, float* out, cudaStream_t s);
// out[r, :] = in[r, :] * (row_scale[r] * scale) for r < rows, n columns (f32, in place allowed)
void scale_rows_f32(const float* in, int rows, int n, const float* row_scale, float scale, float* out,
                    cudaStream_t s);

// Device-side synthetic weights: uniform in [offset - scale, offset + scale) from a counter hash of (seed, i).
void fill_uniform_bf16(bf16* p, size_t n, uint64_t seed, float scale, float offset, cudaStream_t s);
void fill_uniform_f32(float* p, size_t n, uint64_t seed, float scale, float offset, cudaStream_t s);

// ---- sparse self-conditioning (kernels_sc.cu) ----
// The SC soft embedding probs @ E restricted to each row's "survivors", the tokens with z >= max_z - kScWindow
// (f32 compare; i.e. p >= e^-10 p_max), an approximation that drops the tail. p of a survivor is exactly the bf16
// value softcap_row_stats writes to probs (bf16(expf(z - max_z) * inv_sum)), held as f32.
// Survivors are compacted per tile of kScTile tokens into kScTileSlots slots each, in ascending token id.
constexpr int kScTile = 8192;
constexpr int kScTileSlots = 512;
constexpr float kScWindow = 10.0f;
inline int sc_tiles(int V) { return (V + kScTile - 1) / kScTile; }
struct ScSurvivorBuffers {
  int32_t* ids;     // [rows, sc_tiles(V), kScTileSlots]
  float* p;         // [rows, sc_tiles(V), kScTileSlots]
  int32_t* counts;  // [rows, sc_tiles(V)] survivors of the tile (may exceed kScTileSlots: then only the first kept)
  double* tail;     // [rows, sc_tiles(V)] sum of the tile's non-survivor p (f32 p before the bf16 rounding, double sum)
};
// From the capped logits [rows, V] at `temperature` and the stats softcap_row_stats wrote for them (max_z, inv_sum):
// compacts the survivors and sets stats[r].survivors / tail_mass / tile_overflow (tail: fixed-order double sum).
void sc_survivors(const float* logits, int rows, int V, float temperature, DeviceRowStats* stats,
                  const ScSurvivorBuffers& b, cudaStream_t s);
// Whether a row's survivors (after sc_survivors) may stand in for its full softmax: no tile overflowed, at least one
// and at most max_survivors survivors, dropped mass <= max_tail (a NaN mass fails).
inline bool sc_sparse_row_ok(const DeviceRowStats& d, int max_survivors, double max_tail) {
  return d.tile_overflow == 0 && d.survivors >= 1 && d.survivors <= max_survivors && double(d.tail_mass) <= max_tail;
}
// out[r, :] = sum over the row's kept survivors in ascending token id of p * E[id, :] (f32, sequential per column:
// deterministic). E: [V, H] bf16, H % 8 == 0.
void sc_gather_sum(const ScSurvivorBuffers& b, int rows, int V, const bf16* E, int H, float* out, cudaStream_t s);

// ---- attention (kernels_attention.cu) ----
// Queries: q [T, nh, D] at positions q_pos0 + t. Keys: the concatenation of n_old cached keys (ring of cap slots,
// key j at position first_pos + j in slot (first_pos + j) % cap) and T_new new keys [T_new, nkv, D] at positions
// first_pos + n_old + j. Causal: key visible iff k_pos <= q_pos and (window == 0 or q_pos - k_pos < window);
// otherwise every key is visible. Raw dot products (no 1/sqrt(D)), f32 online softmax. out [T, nh, D].
struct AttentionArgs {
  const bf16* q;
  int T, nh, nkv, D;
  const bf16 *k_cache, *v_cache;
  int64_t cap, first_pos, n_old;
  const bf16 *k_new, *v_new;
  int T_new;
  int64_t q_pos0;
  bool causal;
  int64_t window;
  bf16* out;
};
void attention(const AttentionArgs& a, cudaStream_t s);
// A/B (bench --attn-splits): the split-KV count of the launches whose grid is small enough to split (at most half
// the SMs), in place of "as many as fill the SMs"; still capped by the key tiles and the workspace. 0: automatic.
// Process-wide, like set_pdl; results stay deterministic for a given count.
void set_attention_splits(int n);
// A/B (bench --no-attn-tma): attention_ws_k's contiguous K / V tiles by TMA (on, the default) or all by cp.async.
// The results are bitwise the same.
void set_attention_tma(bool on);
// A/B (bench --no-attn-key-runs): attention_ws_k's non-causal (denoise) launches tile the keys by cache-ring run and
// fresh rows, every tile one TMA box (on, the default), or by key index (off: tiles across the ring's wrap or the
// cache / fresh boundary load by cp.async). Not bitwise the same as each other: the keys are summed in another order.
void set_attention_key_runs(bool on);
// A/B (bench --no-attn-q-tma): attention_ws_k's Q rows by TMA from its producer (on, the default, where the group size
// divides 64) or by the consumers' own cp.async. The results are bitwise the same.
void set_attention_q_tma(bool on);
// A/B (bench --no-attn-ws512): head dim 512 on attention_ws_k in cluster pairs of half-D blocks (on, the default on
// sm_90a) or on attention_wgx_k. Not bitwise the same (another summation order inside the tensor cores' products).
void set_attention_ws512(bool on);
// A/B (bench --no-attn-discard-partials): the split-KV combine of head dim 256 (attention_combine256_k) drops each
// split's f32 partial O lines from L2 once it has read them (on, the default; discard.global.L2: never written back
// to DRAM). They are dead after the combine (~17 MB a sliding denoise layer); the results are bitwise the same.
void set_attention_discard_partials(bool on);

// ---- denoise attention on cuBLASLt (kernels_attention_gemm.cu) ----
// A denoise pass's queries all see the same n keys (no mask), so per query head h (kv head h / (nh / nkv)):
// S_h = Q_h K^T in f32, P_h = bf16(softmax(S_h)) (max and sum in f32, normalized before the rounding), O_h = P_h V in
// bf16 (f32 accumulation). The two products are pointer-array batched cuBLASLt GEMMs over the key rows [0, n rounded
// up to kGemmAttentionKeyAlign): the rows past n must hold finite values (their P is 0).
struct GemmAttentionArgs {
  const bf16* q;       // [T, nh, D]
  int nh, nkv, D;
  const bf16 *k, *v;   // [rows, nkv, D]
  float* S;            // [nh][head_rows][ld] scores
  bf16* P;             // [nh][head_rows][ld] probabilities
  int head_rows, ld;   // head_rows >= every T; ld >= every n rounded up, ld % 8 == 0
  bf16* out;           // [T, nh, D]
  void** ptrs;         // device array of gemm_attention_pointer_count(nh) matrix pointers (set_gemm_attention_pointers)
};
constexpr int kGemmAttentionKeyAlign = 64;  // cuBLASLt's kernels ran ~5x slower at 1279 keys than at 1280 (H200)
int gemm_attention_key_columns(int n);      // n rounded up to kGemmAttentionKeyAlign
size_t gemm_attention_pointer_count(int nh);
// Writes a's batch pointers (they depend only on the buffers) into a.ptrs; synchronizes s.
void set_gemm_attention_pointers(const GemmAttentionArgs& a, cudaStream_t s);
// Attention of T queries over keys [0, n) on gemm's stream s (three launches: S GEMM, softmax, PV GEMM).
// discard_scores: softmax_rows_to_bf16's below (a.S is left undefined).
void gemm_attention(Gemm& gemm, const GemmAttentionArgs& a, int T, int n, cudaStream_t s, bool discard_scores = false);
// P[r, c] = bf16(exp(S[r, c] - max) / sum) for c < n (max, sum over c < n in f32), 0 for n <= c < n_cols; row r of
// group g at S + (g group_rows + r) ld (P likewise), r < rows. n_cols % 4 == 0, ld % 8 == 0.
// discard_scores (where S is 128-byte aligned, ld % 32 == 0 and n_cols % 32 == 0; ignored otherwise): each row's
// lines [0, n_cols) are dropped from L2 once read (discard.global.L2: never written back), so S's contents are
// undefined afterwards. P is the same bits either way.
void softmax_rows_to_bf16(const float* S, int ld, int rows, int groups, int group_rows, int n, int n_cols, bf16* P,
                          cudaStream_t s, bool discard_scores = false);
// A/B (bench --no-softmax-reverse): softmax_rows_to_bf16's blocks take the groups last first (on, the default: the
// rows the S GEMM wrote last, still in L2, are read first) or in order. The results are the same bits.
void set_softmax_rows_reverse(bool on);

// ---- MoE (kernels_moe.cu) ----
// Router over f32 logits [T, E]: softmax, top-k (higher prob first, ties -> lower index), renormalized,
// times per_expert_scale. idx/w: [T, k].
void route_top_k(const float* logits, int T, int E, int k, const float* per_expert_scale, int32_t* idx, float* w,
                 cudaStream_t s);
// The router of a canvas-sized pass in two launches, in place of the f32 GEMM + its split-K reduce + route_top_k:
// logits [T, E] = x [T, H] . W [E, H]^T in f32 (split over H; the splits added in a fixed order), route_top_k's rules
// on them (idx, w), and expert_masks [E][ceil(T / 32)]: bit t % 32 of word e ceil(T / 32) + t / 32 set iff token t
// chose expert e (the whole array is rewritten). partial: router_partial_floats(T, H) floats. Deterministic.
size_t router_partial_floats(int T, int H);
size_t expert_mask_words(int T, int E);
bool router_fused_supported(int E, int H, int k);
void router_top_k(const float* x, int T, int H, const float* W, int E, int k, const float* per_expert_scale,
                  float* partial, float* logits, int32_t* idx, float* w, unsigned* expert_masks, cudaStream_t s);
// router_top_k's partial logits as f32 FMAs on the CUDA cores (the default) or, after set_router_tensor_cores(true)
// (A/B: bench --router-tc), as 3xTF32 on the tensor cores (sm_80+). Process-wide, like
// set_pdl; either way deterministic, the two differing in the last bits.
void set_router_tensor_cores(bool on);
bool router_tensor_cores();
// router_top_k's route kernel: tokens a block, 2 (the default) or 8 (bench --route-tokens; process-wide, for A/B).
// The same results either way.
void set_route_tokens_per_block(int tokens);
int route_tokens_per_block();
// One of router_top_k's two launches, for timing them apart (bench-kernels): the partial logits, then the route
// (which reads the partials the first wrote).
enum class RouterStage { Partials, Route };
void router_top_k_stage(RouterStage stage, const float* x, int T, int H, const float* W, int E, int k,
                        const float* per_expert_scale, float* partial, float* logits, int32_t* idx, float* w,
                        unsigned* expert_masks, cudaStream_t s);
// xs[sorted_pos[pair]] = x[token of pair] for the T k pairs (moe_group_padded's second half); min_row > 0 copies
// only the pairs with sorted_pos >= min_row (E M: the overflow rows, when the padded rows are read straight from x).
void moe_gather(const int32_t* sorted_pos, int T, int k, const bf16* x, int H, bf16* xs, cudaStream_t s,
                int min_row = 0);
// Groups the T*k (token, slot) pairs by expert: offsets [E+1] (exclusive prefix of counts), sorted_pos[pair] =
// row of that pair in the grouped order, xs[row] = x[token of that pair]. idx: each token's k experts are distinct
// (route_top_k's are). Inside one expert's group the rows are in token order while E x ceil(T / 32) bits fit in
// ~46 KB of shared memory (T <= 2912 at E = 128); past that the order comes from atomics. Every row is computed
// independently, so results do not depend on it; in the padded grouping below the order decides which pairs
// overflow M, so canvas-sized passes get the same rows, and the same arithmetic, every run.
void moe_group(const int32_t* idx, int T, int k, int E, const bf16* x, int H, int32_t* offsets, int32_t* sorted_pos,
               bf16* xs, cudaStream_t s);
// The same grouping with every expert padded to M rows, for the strided-batched expert GEMMs (cuBLASLt streams the
// expert weights at ~4.1 TB/s where the grouped kernels below reach ~3.4 at decode shapes): pair -> row e M + slot
// for the first M pairs of expert e; further pairs ("overflow", rare) -> rows [ovf_offsets[e], ovf_offsets[e+1])
// after the E M padded rows, to be run through moe_gate_up / moe_down with ovf_offsets as their offsets. Padding rows
// are not written (each GEMM output row depends on its own input row only, and the combine never reads them).
// xs needs E M + T k rows. meta (2 E + 1 ints, may be null): meta[0] = number of experts with overflow rows,
// meta[1 ..] = those experts ascending (the expert list of moe_gate_up / moe_down over the overflow rows),
// meta[1 + E + e] = rows of expert e in its padded block (min(count, M), for moe_gelu_mul_padded).
void moe_group_padded(const int32_t* idx, int T, int k, int E, const bf16* x, int H, int M, int32_t* ovf_offsets,
                      int32_t* sorted_pos, bf16* xs, cudaStream_t s, int32_t* meta = nullptr);
// moe_group_padded's first half (no gather). slot_token (E M ints, may be null): slot_token[e M + slot] = the token
// of the pair in padded slot slot < rows of expert e (meta[1 + E + e]); other entries are left as they are. For
// moe_gate_up_padded_tma_gathered, which reads the token rows from x itself.
// threads: the single block's size (a multiple of 32, at most 1024); fewer lets it run beside a kernel that holds
// most of every SM's registers (the fused TMA experts leave ~23K), at the same results.
// heavy_experts (may be null): *heavy_experts = the number of experts with more than heavy_rows pairs (a plain store,
// so it may be mapped host memory: the backend's choice of token tiles for the next step reads it).
void moe_assign_padded(const int32_t* idx, int T, int k, int E, int M, int32_t* ovf_offsets, int32_t* sorted_pos,
                       int32_t* meta, int32_t* slot_token, cudaStream_t s, int threads = 1024, int heavy_rows = 0,
                       int32_t* heavy_experts = nullptr);
// act[r] = bf16(gelu_tanh(gu[r, 0:I]) * gu[r, I:2I]) for the padded rows that hold a pair (meta of
// moe_group_padded); the padding rows of act are left as they are (nothing reads them).
void moe_gelu_mul_padded(const float* gu, int E, int M, int I, const int32_t* meta, bf16* act, cudaStream_t s);
// M for moe_group_padded at T tokens top-k of E: twice the mean rows per expert, a multiple of 16, at least 16.
inline int moe_padded_rows_per_expert(int T, int k, int E) {
  const int mean = (T * k + E - 1) / E, m = 2 * mean > 16 ? 2 * mean : 16;
  return (m + 15) / 16 * 16;
}
// Hopper TMA descriptor (an opaque CUtensorMap), built once on the host and passed to kernels by value.
struct alignas(128) TmaMap {
  unsigned char bytes[128];
};
// (kernels_experts_tma.cu) Whether moe_gate_up_padded_tma / moe_down_padded_tma run here: an sm_90 device with the
// sm_90a image loaded, M == 32 padded rows per expert, H a multiple of 128, I of 64.
bool experts_tma_supported(int M, int H, int I);
// (tensor_map.cpp) 2D map over a row-major bf16 [rows, cols] matrix (cols a multiple of 64), boxes of 64 columns x
// box_rows rows, 128-byte swizzle. l2_promotion (0, 128 or 256 bytes): how far the L2 widens each box row's 128-byte
// fetch.
TmaMap tma_map_bf16_rows(const bf16* p, int64_t rows, int64_t cols, int box_rows, int l2_promotion = 256);
// (tensor_map.cpp) 3D map over a row-major bf16 [rows, heads, D] tensor (K / V rows of all heads), boxes of 64
// head-dim columns x box_heads heads x box_rows rows, 128-byte swizzle: one box is a 64-column chunk of box_rows rows
// of box_heads consecutive heads (row-major (row, head) order: a Q tile's rows), laid out as the attention kernels'
// swizzled tiles. Box rows past the tensor's end read as zeros.
TmaMap tma_map_bf16_heads(const bf16* p, int64_t rows, int heads, int D, int box_rows, int box_heads = 1);

// (kernels_dense_tma.cu) Dense GEMM of canvas-sized passes on Hopper, as split-K f32 partial sums:
//   part[(s T + t) N + n] = sum over k in split s of x[t][k] w[n][k],  s < splits, t < T <= 256,
// the splits cutting K / 64 k slices into nearly equal contiguous ranges. Readers add part[s] for s = 0, 1, ... in
// that order (qkv_norm_rope / add_rms_norm_pre_ffn with partials, dense_splits_to_bf16). w = dense_tma_weight_map(W,
// N, K), x = dense_tma_token_map(X, T, K, cluster); cluster 2: blocks in pairs that share the token loads (multicast;
// falls back to 1 where clusters cannot run). Launched with PDL: the weights of the first stages are requested before
// the predecessor has completed. Needs N % 256 == 0, K % 64 == 0, 1 <= splits <= K / 64.
bool dense_tma_supported(int T, int N, int K);
int dense_tma_cluster(int cluster);  // the cluster size dense_tma_splitk would use for `cluster`
// The most splits that still fit one wave of blocks on this GPU (at least 1).
int dense_tma_splits(int N, int K, int cluster);
TmaMap dense_tma_weight_map(const bf16* w, int N, int K);
TmaMap dense_tma_token_map(const bf16* x, int T, int K, int cluster);
void dense_tma_splitk(const TmaMap& w, const TmaMap& x, int T, int N, int K, int splits, int cluster, float* part,
                      cudaStream_t s);
// out[t][n] = bf16(sum over s in order of part[(s T + t) N + n]).
void dense_splits_to_bf16(const float* part, int splits, int T, int N, bf16* out, cudaStream_t s);
// The padded path's expert GEMMs on TMA + wgmma, for the rows t < rows[e] of each expert's 32-row block (rows =
// meta + 1 + E of moe_group_padded); other rows of the outputs are not written. Same arithmetic as the cuBLASLt f32
// GEMMs (+ moe_gelu_mul_padded) up to the order of the f32 sums.
//   gate_up: act[e 32 + t] = bf16(gelu_tanh(gate) * up), w = tma_map_bf16_rows(Wgu, E 2I, H, 64),
//            xs = tma_map_bf16_rows(xs, E 32, H, 32)
//   down:    y[e 32 + t] = act . Wd[e]^T (f32), w = tma_map_bf16_rows(Wd, E H, I, 64), act = tma_map_bf16_rows(act,
//            E 32, I, 32)
// How the TMA expert kernels are laid out on the GPU (TmaExpertsPlan{} = the default); the result never depends on
// it (every output element is summed by one block in a fixed k order).
// One tile of a TMA expert kernel as its block's consumer saw it (experts_timeline_begin): %globaltimer ns when the
// consumer asked for the tile (t_req), had its first stage (t0) and had stored it (t1). tile -1: the block's entry
// (t_req = t0) and the return of its griddepcontrol.wait (t1).
struct ExpertsTimelineRecord {
  int block, sm, tile, pad;
  unsigned long long t_req, t0, t1;
};
// Diagnostics (bench --experts-timeline): from begin on, every TMA expert launch appends its tiles' records (up to
// `capacity` in all); end synchronizes the device, returns them and stops recording.
void experts_timeline_begin(size_t capacity);
std::vector<ExpertsTimelineRecord> experts_timeline_end();
// Whether a timeline is recording (between begin and end): a captured graph holds the kernel instantiation of its
// capture time, so graphs are keyed by this too.
bool experts_timeline_recording();

// The experts' output rows y (the down projections, before the combine weighs and sums them): f32, or bf16 where
// the engine asks for it (denoise passes: the expert launch writes, and the combine reads, half the bytes; HF's bf16
// model rounds these rows to bf16 as well). Every kernel that writes y rounds the same f32 sum, so a bf16 y is
// bitwise the bf16 rounding (to nearest even) of the f32 one. Converts from either pointer type.
struct ExpertRows {
  void* p = nullptr;
  bool is_bf16 = false;
  ExpertRows() = default;
  ExpertRows(std::nullptr_t) {}                   // NOLINT(google-explicit-constructor)
  ExpertRows(float* f) : p(f), is_bf16(false) {}  // NOLINT(google-explicit-constructor): a pointer by another name
  ExpertRows(bf16* b) : p(b), is_bf16(true) {}    // NOLINT(google-explicit-constructor)
};
struct ExpertRowsIn {
  const void* p = nullptr;
  bool is_bf16 = false;
  ExpertRowsIn() = default;
  ExpertRowsIn(const float* f) : p(f), is_bf16(false) {}  // NOLINT(google-explicit-constructor)
  ExpertRowsIn(const bf16* b) : p(b), is_bf16(true) {}    // NOLINT(google-explicit-constructor)
  ExpertRowsIn(ExpertRows y) : p(y.p), is_bf16(y.is_bf16) {}  // NOLINT(google-explicit-constructor)
};
struct TmaExpertsPlan {
  // > 0 (below the device's SM count): at most that many blocks, one per SM with an 8-stage ring, leaving the other
  // SMs to a concurrent stream (the dense MLP). 0: two blocks per SM.
  int sms = 0;
  // With sms == 0: the grid (0: as many blocks as fit an SM's shared memory, three of 3 stages or two of 4 or 5, on
  // every SM; capped at the tile count). Blocks stride over the tiles, so a grid that divides the tile count evenly
  // leaves no partly idle last round (gate_up at the real shape: 1408 tiles).
  int grid = 0;
  // With sms == 0: ring stages per block, 3, 4 or 5 (two 5-stage or three 3-stage blocks fit an SM's shared memory;
  // with 3 stages the grid may be up to three blocks per SM).
  int stages = 4;
  // > 0: each block also prefetches that many further 64-wide k slices of its first tile's weights into L2 before
  // griddepcontrol.wait.
  int l2_prefetch_slices = 0;
  // >= 0: at most this many of the first tile's ring stages are requested before griddepcontrol.wait (-1: the whole
  // ring). Those early reads overlap the predecessor, but they also compete with it for DRAM.
  int prewait_stages = -1;
  // moe_gate_up_padded_tma_gathered only: two zeroed unsigneds (left zeroed; not shared by concurrent launches) for
  // tiles handed out by an atomic counter after each block's first, instead of the fixed stride, so that blocks
  // that start late (their SMs busy with another stream's kernels) take fewer tiles. Null: the fixed stride.
  unsigned* tile_counters = nullptr;
  // With tile_counters, the gathered producer: a block claims (and reads the expert masks / counts of) its next tile
  // when it issues the stage this many before its current tile's last one (1: right after the last one, as before
  // session 13; 0 is taken as 1). Earlier claims hide those dependent L2 round trips from the consumers; later ones
  // leave the last tiles to whichever block frees up first.
  int claim_ahead = 3;
  // > 1 and coprime to the grid: block b's first tile is (b * first_tile_stride) mod grid instead of b, so that the
  // first round's tiles, which all start together, are not in the blocks' (SMs') order. Same results.
  int first_tile_stride = 1;
  // Non-null: the experts' gate_up / down weights in the packed layouts (expert_layout.h, pack_expert_gate_up /
  // pack_expert_down), each ring stage of those tiles one 1D bulk copy from here; the matching tensor map is then not
  // read. Bitwise the same results (the stages land in shared memory byte for byte as the 2D boxes do).
  const bf16* gate_up_packed = nullptr;
  const bf16* down_packed = nullptr;
  // moe_experts_fused_tma_masked only: up to kFusedExpertRows (64) rows an expert in its launch instead of 32 (see
  // there); its act / y then have that many padded rows an expert.
  bool two_token_tiles = false;
  // Which of the launch's outputs are stored with an L2 evict_last policy, a mask: 1 a bf16 y (ExpertRows), 2 act
  // (gate_up's output, which the down tiles read back). Kept in L2 until the combine reads them, so that their
  // write-backs do not cut into the weight stream (CudaOptions::expert_rows_l2). The same bits either way.
  int rows_evict_last = 0;
};
// Whether expert weights of these shapes have a packed layout (expert_layout.h): gate_up needs H and I multiples of
// 64, down H a multiple of 128 and I of 64.
bool expert_gate_up_packable(int H, int I);
bool expert_down_packable(int H, int I);
// The checkpoint layouts (gate_up [E, 2I, H], down [E, H, I]) -> packed [same size] (expert_layout.h). src and dst
// must not overlap.
void pack_expert_gate_up(const bf16* src, bf16* dst, int E, int H, int I, cudaStream_t s);
void pack_expert_down(const bf16* src, bf16* dst, int E, int H, int I, cudaStream_t s);
// Launched with PDL (launch.cuh): each block requests its first ring stages' weights (constants) before
// griddepcontrol.wait, everything else after it. The weight buffers must not be written by the stream's preceding
// kernels (they never are: they are the checkpoint's).
void moe_gate_up_padded_tma(const TmaMap& w, const TmaMap& xs, const int32_t* rows, int E, int H, int I, bf16* act,
                            cudaStream_t s, const TmaExpertsPlan& plan = {});
// gate_up with the token rows read straight from x [T, H] (bf16, the expert input before any gather): slot t of
// expert e holds token slot_token[e 32 + t] (moe_assign_padded) for t < rows[e]. The same results, bitwise, as
// moe_gate_up_padded_tma on moe_gather's copy of x, without that copy: no gather kernel between the assignment and
// the experts.
void moe_gate_up_padded_tma_gathered(const TmaMap& w, const bf16* x, const int32_t* slot_token, const int32_t* rows,
                                     int E, int H, int I, bf16* act, cudaStream_t s, const TmaExpertsPlan& plan = {});
// The same with each expert's tokens read from router_top_k's expert_masks of T tokens (T <= 1024): slot t of
// expert e holds its t-th token in ascending order, the slots moe_assign_padded gives (so act's rows match the
// sorted_pos that the combine and the down GEMM's consumers use), for t < min(tokens of e, 32). Needs no assignment
// kernel before it: the assignment can run beside it.
void moe_gate_up_padded_tma_masked(const TmaMap& w, const bf16* x, const unsigned* expert_masks, int T, int E, int H,
                                   int I, bf16* act, cudaStream_t s, const TmaExpertsPlan& plan = {});
void moe_down_padded_tma(const TmaMap& w, const TmaMap& act, const int32_t* rows, int E, int H, int I, ExpertRows y,
                         cudaStream_t s, const TmaExpertsPlan& plan = {});
// The same with each expert's row count from router_top_k's expert_masks of T tokens (min(tokens of e, 32), the
// count moe_assign_padded gives), so that it needs no assignment kernel before it.
void moe_down_padded_tma_masked(const TmaMap& w, const TmaMap& act, const unsigned* expert_masks, int T, int E, int H,
                                int I, ExpertRows y, cudaStream_t s, const TmaExpertsPlan& plan = {});
// gate_up (as moe_gate_up_padded_tma_masked) and down (as moe_down_padded_tma on its act) in one persistent launch:
// the tiles of both come from one counter, gate_up's first, so blocks that run out of gate_up tiles go on to down
// tiles instead of idling through gate_up's last round and the launch gap before a separate down GEMM. A down tile of
// expert e waits until all of e's gate_up tiles are stored (per-expert counts, release / acquire); it is handed out
// only after every gate_up tile, so the wait is short and cannot deadlock. plan.tile_counters: 2 + E zeroed
// unsigneds, left zeroed.
// With plan.two_token_tiles its padded layout has kFusedExpertRows (64) rows an expert, not 32: slot t of expert e is
// row e 64 + t of act and y, for t < min(tokens of e, 64) (moe_assign_padded with M = kFusedExpertRows gives the same
// slots, and the overflow rows past them). An expert with more than 32 rows takes a second token tile over the same
// staged weights, so its weights are still read once (the overflow kernels would read them again). Slots below 32 are
// bitwise the two kernels' rows; slots 32-63 are computed the same way, in the same k order. Its one-tile path is a
// little slower (~3 us a layer at the canvas shape), so it pays only where experts pass 32 rows (concentrated routing).
constexpr int kFusedExpertRows = 64;
void moe_experts_fused_tma_masked(const TmaMap& w_gate_up, const TmaMap& w_down, const bf16* x,
                                  const unsigned* expert_masks, int T, int E, int H, int I, bf16* act, ExpertRows y,
                                  cudaStream_t s, const TmaExpertsPlan& plan = {});
// Test support (kernels_experts_tma.cu): a PDL-launched kernel that triggers its dependents at once, sleeps
// delay_us, then copies src0 -> dst0 and src1 -> dst1 (bytes): a predecessor that writes its outputs late, so that a
// PDL kernel after it which read them before griddepcontrol.wait would see stale data.
void delayed_copy_for_test(const void* src0, void* dst0, size_t bytes0, const void* src1, void* dst1, size_t bytes1,
                           int delay_us, cudaStream_t s);
// Grouped expert GEMMs over rows grouped by expert (offsets [E+1], rows [0, P)):
//   act[r, :] = gelu_tanh(xs[r] . Wgu[e, 0:I]^T) * (xs[r] . Wgu[e, I:2I]^T)     Wgu: [E, 2I, H]
//   y[r, :] = act[r] . Wd[e]^T                                                 Wd:  [E, H, I]  (f32 or bf16 out)
// expert_list (may be null): only the experts meta[1 .. meta[0]] of moe_group_padded (its overflow rows), run by
// a small fixed grid whatever their number, instead of one block column per expert.
// packed: Wgu / Wd in the packed layouts of pack_expert_gate_up / pack_expert_down (bitwise the same results).
void moe_gate_up(const bf16* xs, const int32_t* offsets, int E, int P, const bf16* Wgu, int H, int I, bf16* act,
                 cudaStream_t s, const int32_t* expert_list = nullptr, bool packed = false);
void moe_down(const bf16* act, const int32_t* offsets, int E, int P, const bf16* Wd, int H, int I, ExpertRows y,
              cudaStream_t s, const int32_t* expert_list = nullptr, bool packed = false);
// (kernels_experts_prefill.cu) The same two GEMMs for prefill chunks (many rows an expert) on wgmma: w = the
// weights' TMA map (tma_map_bf16_rows, box 64 rows: [E 2I, H] for gate_up, [E H, I] for down), w_packed = the same
// weights packed (pack_expert_gate_up / pack_expert_down; null: the map is read). Each output is one f32 sum in a
// fixed k order (deterministic; not bitwise moe_gate_up / moe_down, whose summation order differs).
// experts_prefill_supported: an sm_90 device with the sm_90a image, E <= 512, H a multiple of 128, I of 64.
// item_counters (may be null): two zeroed unsigneds, left zeroed; the blocks then claim their work items from them
// instead of striding over the items (the same results, bitwise), so that blocks starting late take fewer items.
bool experts_prefill_supported(int E, int H, int I);
void moe_gate_up_prefill_tma(const TmaMap& w, const bf16* w_packed, const bf16* xs, const int32_t* offsets, int E,
                             int P, int H, int I, bf16* act, cudaStream_t s, unsigned* item_counters = nullptr);
void moe_down_prefill_tma(const TmaMap& w, const bf16* w_packed, const bf16* act, const int32_t* offsets, int E,
                          int P, int H, int I, ExpertRows y, cudaStream_t s, unsigned* item_counters = nullptr);
// out[t] = sum over the token's k slots in ascending expert id of w[t, j] * y[sorted_pos[t*k + j]]   (f32)
void moe_combine(ExpertRowsIn y, const int32_t* idx, const float* w, const int32_t* sorted_pos, int T, int k, int H,
                 float* out, cudaStream_t s);
// moe_combine into m2, then ffn_combine(h, m1, m2, ...), in one kernel (m2 never reaches global memory).
// x_next (may be null): also rms_norm_f32_to_bf16(h; w_next) of the new h, the next layer's input (same arithmetic).
// discard_y (a bf16 y only, H % 64 == 0, y 128-byte aligned; ignored otherwise): every y line the combine reads is
// dropped from L2 afterwards (discard.global.L2: never written back to DRAM). y's contents are then undefined, so
// only where nothing reads y again (a denoise pass's layer; CudaOptions::expert_rows_l2).
void moe_combine_ffn(ExpertRowsIn y, const int32_t* idx, const float* w, const int32_t* sorted_pos, int T, int k,
                     float* h, const bf16* m1, int H, const float* w1, const float* w2, const float* w_post, float eps,
                     float scalar, cudaStream_t s, const float* w_next = nullptr, bf16* x_next = nullptr,
                     bool discard_y = false);

}  // namespace dg::cuda
