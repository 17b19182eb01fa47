// CUDA backend: the layer body of backend/cpu/cpu_backend.cpp, step for step, on the GPU.
#include "backend/cuda/cuda_backend.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/gemm.h"
#include "util/dtype.h"
#include "util/error.h"

namespace dg {
namespace {

using cuda::bf16;
using cuda::Dt;

// Bump allocator over one cudaMalloc; a dry pass (base == nullptr) only measures, so the whole footprint is known
// and checked against free memory before anything is allocated.
struct Arena {
  char* base = nullptr;
  size_t used = 0;
  template <class T>
  T* take(size_t n) {
    size_t off = (used + 255) / 256 * 256;
    used = off + n * sizeof(T);
    return base ? reinterpret_cast<T*>(base + off) : nullptr;
  }
};

struct DevLayer {
  LayerShape shape;
  int nqkv = 0;
  bf16 *wqkv, *wo, *dense_gu, *dense_down, *exp_gu, *exp_down;
  float *q_norm, *k_norm, *input_norm, *post_attn, *pre_ff, *post_ff1, *pre_ff2, *post_ff2, *post_ff;
  float *router_w, *router_scale, *pes, *inv_freq;
  float enc_scalar = 1, dec_scalar = 1;
  bf16 *kc, *vc;
  int64_t cap = 0;
  void** attn_ptrs = nullptr;  // full layers with gemm_attention_: the denoise attention's batch pointers
  cuda::TmaMap exp_gu_map{}, exp_down_map{};  // over exp_gu / exp_down for the TMA expert kernels (use_tma_experts_)
  // CudaOptions::dense_tma: the split counts of the qkv / o_proj GEMMs of denoise passes on dense_tma_splitk (0:
  // cuBLASLt) and their weight maps
  int qkv_splits = 0, o_splits = 0;
  cuda::TmaMap wqkv_map{}, wo_map{};
  bool gu_packed = false;  // exp_gu in the packed layout (CudaOptions::pack_expert_gate_up, cuda/expert_layout.h)
  bool dn_packed = false;  // exp_down likewise (CudaOptions::pack_expert_down)
};

struct Scratch {
  int32_t* ids;
  float *h, *xr, *rl, *wk, *sig, *logits;
  bf16* logits16;  // the lm_head's bf16 logits (CudaOptions::bf16_logits), else null
  float* y;     // the experts' output rows, f32 or (denoise passes, CudaOptions::bf16_expert_rows) bf16
  float* gu32;  // the padded cuBLASLt path's f32 gate/up, before its GELU pass
  bf16 *x, *x1, *xe, *qkv, *q, *kn, *vn, *att, *a, *gu, *actd, *m1, *xs, *acte, *probs;
  int32_t *idx, *offsets, *sorted_pos, *moe_meta;
  int32_t* slot_token;  // [E M]: the token in each padded expert slot (moe_assign_padded), for the gathered gate_up
  float* router_partial;      // router_top_k's split partials (canvas-sized passes)
  float* dense_part;          // dense_tma_splitk's split-K partials (CudaOptions::dense_tma), else null
  unsigned* expert_masks;      // router_top_k's token bit masks of each expert
  unsigned* expert_tile_counters;  // gate_up's tile counters (CudaOptions::dynamic_expert_tiles): zeroed once, left
                                   // zeroed by every launch
  unsigned* prefill_item_counters;  // the prefill expert kernels' item counters (CudaOptions::prefill_item_counter),
                                    // the same contract
  cuda::DeviceRowStats* stats;
  void* row_stats_scratch;     // softcap_row_stats partials
  float* probs_scale;          // [canvas] the probs' row factors (CudaOptions::fused_sc_probs)
  float* temperature;          // [1] the captured step's temperature (CudaOptions::device_temperature)
  cuda::ScSurvivorBuffers sc;  // sparse SC survivors (CudaOptions::sc_sparse only)
  float* attn_S;               // gemm attention: [nh][canvas_length][attn_ld] scores
  bf16* attn_P;                // and probabilities
};

}  // namespace

// Device weights: one arena, filled once (upload from a LoadedModel, or synthesized on the GPU), read-only after;
// shared by every CudaBackend made from it.
class CudaWeights {
 public:
  CudaWeights(const LoadedModel* model, const ModelConfig& cfg, uint64_t seed, const CudaOptions& opt)
      : cfg_(cfg), device_(opt.device), progress_(opt.progress) {
    CUDA_CHECK(cudaSetDevice(opt.device));
    if (cfg_.hidden_size % 8 || cfg_.moe_intermediate_size % 8 || cfg_.intermediate_size % 8)
      fail("CUDA backend: hidden/intermediate sizes must be multiples of 8 (got {}, {}, {})", cfg_.hidden_size,
           cfg_.intermediate_size, cfg_.moe_intermediate_size);
    for (auto& ls : cfg_.layers)
      if (ls.head_dim % 16) fail("CUDA backend: head_dim {} is not a multiple of 16", ls.head_dim);
    const int H = cfg_.hidden_size, Ie = cfg_.moe_intermediate_size, E = cfg_.num_experts;
    const bool tma_ok = cuda::experts_tma_supported(
        cuda::moe_padded_rows_per_expert(cfg_.canvas_length, cfg_.top_k_experts, E), H, Ie);
    pack_gate_up_ = opt.pack_expert_gate_up && tma_ok && cuda::expert_gate_up_packable(H, Ie);
    pack_down_ = opt.pack_expert_down && tma_ok && cuda::expert_down_packable(H, Ie);
    // Packing goes through one layer's gate_up worth of scratch (down is half of it), freed after the upload.
    const size_t pack_scratch =
        pack_gate_up_ || pack_down_ ? size_t(E) * 2 * size_t(Ie) * size_t(H) * sizeof(bf16) : 0;
    Arena dry;
    layout(dry);
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    const size_t need = dry.used + pack_scratch + (size_t(64) << 20);
    if (need > free_b)
      fail("the model's weights need {:.2f} GiB of GPU memory as bf16 (with {:.2f} GiB of upload scratch) but only "
           "{:.2f} of {:.2f} GiB are free",
           double(need) / (1 << 30), double(pack_scratch) / (1 << 30), double(free_b) / (1 << 30),
           double(total_b) / (1 << 30));
    CUDA_CHECK(cudaMalloc(&arena_.base, dry.used));
    layout(arena_);
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    try {
      if (model)
        upload(*model);
      else
        synthesize(seed);
      if (pack_gate_up_ || pack_down_) pack_experts(pack_scratch);
    } catch (...) {
      cudaStreamDestroy(stream_);
      cudaFree(arena_.base);
      throw;
    }
    CUDA_CHECK(cudaStreamDestroy(stream_));
    stream_ = nullptr;
  }
  ~CudaWeights() { cudaFree(arena_.base); }
  CudaWeights(const CudaWeights&) = delete;
  CudaWeights& operator=(const CudaWeights&) = delete;

  // Public to CudaBackend (this class is opaque outside this file): read-only once constructed.
  void layout(Arena& ar) {
    const size_t H = size_t(cfg_.hidden_size), V = size_t(cfg_.vocab_size), Id = size_t(cfg_.intermediate_size);
    const size_t Ie = size_t(cfg_.moe_intermediate_size), E = size_t(cfg_.num_experts), nh = size_t(cfg_.num_heads);
    embed_ = ar.take<bf16>(V * H);
    final_norm_ = ar.take<float>(H);
    sc_pre_norm_ = ar.take<float>(H);
    sc_gu_ = ar.take<bf16>(2 * Id * H);
    sc_down_ = ar.take<bf16>(H * Id);
    layers_.resize(size_t(cfg_.num_layers));
    for (int l = 0; l < cfg_.num_layers; ++l) {
      DevLayer& L = layers_[size_t(l)];
      L.shape = cfg_.layers[size_t(l)];
      const size_t D = size_t(L.shape.head_dim), nkv = size_t(L.shape.n_kv_heads);
      L.nqkv = int((nh + (L.shape.has_v_proj ? 2 : 1) * nkv) * D);
      L.wqkv = ar.take<bf16>(size_t(L.nqkv) * H);
      L.wo = ar.take<bf16>(H * nh * D);
      L.dense_gu = ar.take<bf16>(2 * Id * H);
      L.dense_down = ar.take<bf16>(H * Id);
      L.exp_gu = ar.take<bf16>(E * 2 * Ie * H);
      L.exp_down = ar.take<bf16>(E * H * Ie);
      L.q_norm = ar.take<float>(D);
      L.k_norm = ar.take<float>(D);
      for (float** p : {&L.input_norm, &L.post_attn, &L.pre_ff, &L.post_ff1, &L.pre_ff2, &L.post_ff2, &L.post_ff,
                        &L.router_scale})
        *p = ar.take<float>(H);
      L.router_w = ar.take<float>(E * H);
      L.pes = ar.take<float>(E);
      L.inv_freq = ar.take<float>(D / 2);
    }
  }

  // Every layer's exp_gu / exp_down (pack_gate_up_ / pack_down_) from the checkpoint layout into the packed one,
  // through `scratch_bytes` of scratch.
  void pack_experts(size_t scratch_bytes) {
    const int H = cfg_.hidden_size, Ie = cfg_.moe_intermediate_size, E = cfg_.num_experts;
    const size_t gu_bytes = size_t(E) * 2 * size_t(Ie) * size_t(H) * sizeof(bf16), dn_bytes = gu_bytes / 2;
    void* raw = nullptr;
    CUDA_CHECK(cudaMalloc(&raw, scratch_bytes));
    const std::unique_ptr<void, cudaError_t (*)(void*)> owner(raw, cudaFree);
    bf16* tmp = static_cast<bf16*>(raw);
    for (DevLayer& L : layers_) {
      if (pack_gate_up_) {
        CUDA_CHECK(cudaMemcpyAsync(tmp, L.exp_gu, gu_bytes, cudaMemcpyDeviceToDevice, stream_));
        cuda::pack_expert_gate_up(tmp, L.exp_gu, E, H, Ie, stream_);
        L.gu_packed = true;
      }
      if (pack_down_) {
        CUDA_CHECK(cudaMemcpyAsync(tmp, L.exp_down, dn_bytes, cudaMemcpyDeviceToDevice, stream_));
        cuda::pack_expert_down(tmp, L.exp_down, E, H, Ie, stream_);
        L.dn_packed = true;
      }
    }
    CUDA_CHECK(cudaStreamSynchronize(stream_));  // before the scratch is freed
  }

  void inv_freqs(DevLayer& L, std::vector<float>& f) {
    const RopeParams& rp = L.shape.rope;
    f.assign(size_t(L.shape.head_dim / 2), 0.0f);
    for (int i = 0; i < rp.rotated_pairs; ++i)
      f[size_t(i)] = float(1.0 / std::pow(double(rp.theta), 2.0 * i / double(rp.exponent_dim)));
  }

  // Converts host tensors through one pinned staging buffer, chunk by chunk.
  struct Stager {
    cudaStream_t stream;
    void* pinned = nullptr;
    size_t bytes = size_t(64) << 20;
    size_t done = 0, total = 0;
    bool progress = true;
    int last_pct = -1;
    std::vector<float> tmp;
    explicit Stager(cudaStream_t s, size_t total_bytes, bool show) : stream(s), total(total_bytes), progress(show) {
      CUDA_CHECK(cudaMallocHost(&pinned, bytes));
    }
    ~Stager() { cudaFreeHost(pinned); }
    void put(const TensorView& t, void* dst, Dt dt, size_t elem_offset = 0) {
      const size_t n = size_t(t.numel()), es = dt == Dt::BF16 ? 2 : 4, per = bytes / es;
      const size_t src_es = dtype_size(t.dtype);
      for (size_t i = 0; i < n; i += per) {
        const size_t m = std::min(per, n - i);
        CUDA_CHECK(cudaStreamSynchronize(stream));  // the staging buffer is free again
        const uint8_t* src = t.data + i * src_es;
        if (dt == Dt::BF16 && t.dtype == DType::BF16) {
          std::memcpy(pinned, src, m * 2);
        } else {
          tmp.resize(m);
          convert_to_f32(t.dtype, src, tmp.data(), m);
          if (dt == Dt::F32) {
            std::memcpy(pinned, tmp.data(), m * 4);
          } else {
            auto* o = static_cast<uint16_t*>(pinned);
            for (size_t j = 0; j < m; ++j) o[j] = f32_to_bf16(tmp[j]);
          }
        }
        CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst) + (elem_offset + i) * es, pinned, m * es,
                                   cudaMemcpyHostToDevice, stream));
        done += m * src_es;
        int pct = total ? int(100.0 * double(done) / double(total)) : 100;
        if (progress && pct != last_pct && pct % 5 == 0) {
          std::fprintf(stderr, "\rcuda: uploading weights %3d%% (%.1f / %.1f GiB)", pct, double(done) / (1 << 30),
                       double(total) / (1 << 30));
          last_pct = pct;
        }
      }
    }
  };

  void upload(const LoadedModel& m) {
    const ModelWeights& w = m.weights;
    size_t total = 0;
    for (auto& [name, t] : m.checkpoint->all()) total += t->nbytes;
    Stager st(stream_, total, progress_);
    const size_t H = size_t(cfg_.hidden_size), Id = size_t(cfg_.intermediate_size), nh = size_t(cfg_.num_heads);
    st.put(*w.embed, embed_, Dt::BF16);
    st.put(*w.final_norm, final_norm_, Dt::F32);
    st.put(*w.sc_pre_norm, sc_pre_norm_, Dt::F32);
    st.put(*w.sc_gate, sc_gu_, Dt::BF16);
    st.put(*w.sc_up, sc_gu_, Dt::BF16, Id * H);
    st.put(*w.sc_down, sc_down_, Dt::BF16);
    std::vector<float> f;
    for (int l = 0; l < cfg_.num_layers; ++l) {
      DevLayer& L = layers_[size_t(l)];
      const LayerWeights& lw = w.layers[size_t(l)];
      const size_t D = size_t(L.shape.head_dim), nkv = size_t(L.shape.n_kv_heads);
      st.put(*lw.q_proj, L.wqkv, Dt::BF16);
      st.put(*lw.k_proj, L.wqkv, Dt::BF16, nh * D * H);
      if (lw.v_proj) st.put(*lw.v_proj, L.wqkv, Dt::BF16, (nh + nkv) * D * H);
      st.put(*lw.o_proj, L.wo, Dt::BF16);
      st.put(*lw.mlp_gate, L.dense_gu, Dt::BF16);
      st.put(*lw.mlp_up, L.dense_gu, Dt::BF16, Id * H);
      st.put(*lw.mlp_down, L.dense_down, Dt::BF16);
      st.put(*lw.experts_gate_up, L.exp_gu, Dt::BF16);
      st.put(*lw.experts_down, L.exp_down, Dt::BF16);
      st.put(*lw.q_norm, L.q_norm, Dt::F32);
      st.put(*lw.k_norm, L.k_norm, Dt::F32);
      st.put(*lw.input_norm, L.input_norm, Dt::F32);
      st.put(*lw.post_attn_norm, L.post_attn, Dt::F32);
      st.put(*lw.pre_ff_norm, L.pre_ff, Dt::F32);
      st.put(*lw.post_ff_norm_1, L.post_ff1, Dt::F32);
      st.put(*lw.pre_ff_norm_2, L.pre_ff2, Dt::F32);
      st.put(*lw.post_ff_norm_2, L.post_ff2, Dt::F32);
      st.put(*lw.post_ff_norm, L.post_ff, Dt::F32);
      st.put(*lw.router_proj, L.router_w, Dt::F32);
      st.put(*lw.router_scale, L.router_scale, Dt::F32);
      st.put(*lw.per_expert_scale, L.pes, Dt::F32);
      L.enc_scalar = lw.encoder_layer_scalar->to_f32()[0];
      L.dec_scalar = lw.decoder_layer_scalar->to_f32()[0];
      inv_freqs(L, f);
      CUDA_CHECK(cudaStreamSynchronize(stream_));
      CUDA_CHECK(cudaMemcpy(L.inv_freq, f.data(), f.size() * 4, cudaMemcpyHostToDevice));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (progress_) std::fprintf(stderr, "\n");
  }

  void synthesize(uint64_t seed) {
    const size_t H = size_t(cfg_.hidden_size), V = size_t(cfg_.vocab_size), Id = size_t(cfg_.intermediate_size);
    const size_t Ie = size_t(cfg_.moe_intermediate_size), E = size_t(cfg_.num_experts), nh = size_t(cfg_.num_heads);
    uint64_t k = seed * 1000003ull;
    auto wb = [&](bf16* p, size_t n, size_t fan_in) {
      cuda::fill_uniform_bf16(p, n, ++k, float(1.0 / std::sqrt(double(fan_in))), 0.0f, stream_);
    };
    auto nf = [&](float* p, size_t n) { cuda::fill_uniform_f32(p, n, ++k, 0.25f, 1.0f, stream_); };
    cuda::fill_uniform_bf16(embed_, V * H, ++k, 0.05f, 0.0f, stream_);
    nf(final_norm_, H);
    nf(sc_pre_norm_, H);
    wb(sc_gu_, 2 * Id * H, H);
    wb(sc_down_, H * Id, Id);
    std::vector<float> f;
    for (auto& L : layers_) {
      const size_t D = size_t(L.shape.head_dim);
      wb(L.wqkv, size_t(L.nqkv) * H, H);
      wb(L.wo, H * nh * D, nh * D);
      wb(L.dense_gu, 2 * Id * H, H);
      wb(L.dense_down, H * Id, Id);
      wb(L.exp_gu, E * 2 * Ie * H, H);
      wb(L.exp_down, E * H * Ie, Ie);
      for (float* p : {L.q_norm, L.k_norm}) nf(p, D);
      for (float* p : {L.input_norm, L.post_attn, L.pre_ff, L.post_ff1, L.pre_ff2, L.post_ff2, L.post_ff, L.router_scale})
        nf(p, H);
      cuda::fill_uniform_f32(L.router_w, E * H, ++k, 1.0f / std::sqrt(float(H)), 0.0f, stream_);
      nf(L.pes, E);
      inv_freqs(L, f);
      CUDA_CHECK(cudaMemcpy(L.inv_freq, f.data(), f.size() * 4, cudaMemcpyHostToDevice));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  ModelConfig cfg_;
  int device_ = 0;
  bool progress_ = true;
  cudaStream_t stream_ = nullptr;  // uploads only
  Arena arena_;
  bf16 *embed_ = nullptr, *sc_gu_ = nullptr, *sc_down_ = nullptr;
  float *final_norm_ = nullptr, *sc_pre_norm_ = nullptr;
  bool pack_gate_up_ = false;     // CudaOptions::pack_expert_gate_up where the shapes and the GPU allow it
  bool pack_down_ = false;        // CudaOptions::pack_expert_down likewise
  std::vector<DevLayer> layers_;  // weight pointers only (no KV)
};

namespace {

enum class Pass { Encoder, Decoder };

// Stages of a denoise step (or a prefill: its embedding, then the layers' stages) for CudaStageTimes (the time since
// the previous mark goes to the named stage).
enum Stage : int {
  kStEmbedSc, kStAttnProj, kStAttention, kStOProj, kStDenseMlp, kStRouter, kStGroup, kStGateUp, kStDown,
  kStCombine, kStLmHead, kStRowStats, kNumStages
};
constexpr const char* kStageNames[kNumStages] = {
    "embed + SC", "norm + qkv + rope", "attention", "o_proj + norm", "dense MLP", "router", "moe group",
    "expert gate_up", "expert down", "moe combine + ffn", "final norm + lm_head", "softcap + row stats + D2H"};

class CudaBackend final : public Backend {
 public:
  CudaBackend(std::shared_ptr<const CudaWeights> weights, const CudaOptions& opt)
      : weights_(std::move(weights)), cfg_(weights_->cfg_), opt_(opt) {
    if (opt.device != weights_->device_)
      fail("CudaOptions::device {} differs from the device {} that holds the shared weights", opt.device,
           weights_->device_);
    CUDA_CHECK(cudaSetDevice(opt.device));
    layers_ = weights_->layers_;  // weight pointers; the KV regions are this backend's (layout)
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    if (opt.dense_mlp_priority) {  // numerically lowest = most urgent
      int least = 0, greatest = 0;
      CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      CUDA_CHECK(cudaStreamCreateWithPriority(&side_, cudaStreamNonBlocking, greatest));
    } else {
      CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
    }
    CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&grouped_, cudaEventDisableTiming));
    CUDA_CHECK(cudaStreamCreateWithFlags(&overflow_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&assigned_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&overflowed_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&step_fork_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&temperature_ready_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&step_done_, cudaEventDisableTiming));
    tm_ = std::max(opt.prefill_chunk, cfg_.canvas_length);
    if (opt.sliding_rewind < 0) fail("CudaOptions::sliding_rewind must be >= 0");
    if (opt.tma_weight_l2_promotion != 0 && opt.tma_weight_l2_promotion != 128 && opt.tma_weight_l2_promotion != 256)
      fail("CudaOptions::tma_weight_l2_promotion must be 0, 128 or 256 (bytes), got {}", opt.tma_weight_l2_promotion);
    if (opt.sc_sparse && !(opt.sc_sparse_max_survivors > 0))
      fail("CudaOptions::sc_sparse_max_survivors must be > 0, got {}", opt.sc_sparse_max_survivors);
    if (opt.sc_sparse && !(opt.sc_sparse_max_total > 0))
      fail("CudaOptions::sc_sparse_max_total must be > 0, got {}", opt.sc_sparse_max_total);
    if (opt.sc_sparse && !(opt.sc_sparse_max_tail >= 0 && opt.sc_sparse_max_tail < 1))
      fail("CudaOptions::sc_sparse_max_tail must be in [0, 1), got {}", opt.sc_sparse_max_tail);

    if (opt.gemm_attention && !(opt.gemm_attention_max_keys >= 1))
      fail("CudaOptions::gemm_attention_max_keys must be >= 1, got {}", opt.gemm_attention_max_keys);
    gemm_attention_ = opt.gemm_attention;
    attn_ld_ = cuda::gemm_attention_key_columns(
        int(std::min<int64_t>(opt.max_context, std::max(1, opt.gemm_attention_max_keys))));

    if (opt.dense_tma_cluster != 1 && opt.dense_tma_cluster != 2)
      fail("CudaOptions::dense_tma_cluster must be 1 or 2, got {}", opt.dense_tma_cluster);
    plan_dense_tma();
    Arena dry;
    layout(dry);
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    const size_t need = dry.used + (size_t(96) << 20);  // + cuBLASLt workspace and driver slack
    if (need > free_b)
      fail("CUDA backend needs {:.2f} GiB of GPU memory (KV cache for {} positions and scratch, beside the weights) "
           "but only {:.2f} of {:.2f} GiB are free; lower --max-context / prefill chunk / --sessions or free the GPU",
           double(need) / (1 << 30), opt.max_context, double(free_b) / (1 << 30), double(total_b) / (1 << 30));
    CUDA_CHECK(cudaMalloc(&arena_.base, dry.used));
    layout(arena_);
    CUDA_CHECK(cudaMemset(s_.expert_tile_counters, 0, (2 + size_t(cfg_.num_experts)) * sizeof(unsigned)));
    CUDA_CHECK(cudaMemset(s_.prefill_item_counters, 0, 2 * sizeof(unsigned)));
    for (DevLayer& L : layers_) {
      if (!L.attn_ptrs) continue;
      const size_t bytes = kv_rows(L) * size_t(L.shape.n_kv_heads) * size_t(L.shape.head_dim) * sizeof(bf16);
      CUDA_CHECK(cudaMemset(L.kc, 0, bytes));
      CUDA_CHECK(cudaMemset(L.vc, 0, bytes));
      cuda::set_gemm_attention_pointers(gemm_attention_args(L), stream_);
    }
    {
      const int H = cfg_.hidden_size, Ie = cfg_.moe_intermediate_size, E = cfg_.num_experts;
      const int M = cuda::moe_padded_rows_per_expert(cfg_.canvas_length, cfg_.top_k_experts, E);
      use_tma_experts_ = opt_.padded_experts && opt_.tma_experts && cuda::experts_tma_supported(M, H, Ie);
      use_prefill_tma_ = opt_.prefill_tma_experts && cuda::experts_prefill_supported(E, H, Ie);
      if (use_tma_experts_ || use_prefill_tma_) {
        for (DevLayer& L : layers_) {
          const int promo = opt_.tma_weight_l2_promotion;
          L.exp_gu_map = cuda::tma_map_bf16_rows(L.exp_gu, int64_t(E) * 2 * Ie, H, 64, promo);
          L.exp_down_map = cuda::tma_map_bf16_rows(L.exp_down, int64_t(E) * H, Ie, 64, promo);
        }
      }
      if (use_tma_experts_) {
        xs_map_ = cuda::tma_map_bf16_rows(s_.xs, int64_t(E) * M, H, M);
        acte_map_ = cuda::tma_map_bf16_rows(s_.acte, int64_t(E) * M, Ie, M);
      }  // else (not sm_90, or not 32 padded rows per expert): the cuBLASLt expert GEMMs
    }
    for (DevLayer& L : layers_) {
      const int H = cfg_.hidden_size, nhD = cfg_.num_heads * L.shape.head_dim;
      if (L.qkv_splits > 0) L.wqkv_map = cuda::dense_tma_weight_map(L.wqkv, L.nqkv, H);
      if (L.o_splits > 0) L.wo_map = cuda::dense_tma_weight_map(L.wo, H, nhD);
    }
    gemm_ = std::make_unique<cuda::Gemm>();
    // its own workspace: runs concurrently with gemm_
    gemm_side_ = std::make_unique<cuda::Gemm>(size_t(64) << 20, opt_.dense_mlp_sms);
    // The dense down GEMM queued last (dense_down_last) starts as the expert kernel drains, alone on the GPU: planned
    // for every SM (CudaOptions::dense_down_all_sms), with a workspace of its own (it is on the side stream).
    if (opt_.overlap_dense_mlp && opt_.dense_down_last && opt_.dense_down_all_sms)
      gemm_tail_ = std::make_unique<cuda::Gemm>(size_t(16) << 20);
    // Mapped: a whole-step graph reads the ids and writes the row statistics there from its kernels (no memcpy nodes).
    CUDA_CHECK(cudaHostAlloc(&host_ids_, size_t(tm_) * sizeof(int32_t), cudaHostAllocMapped));
    CUDA_CHECK(cudaHostAlloc(&host_stats_, size_t(cfg_.canvas_length) * sizeof(cuda::DeviceRowStats),
                             cudaHostAllocMapped));
    CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped_ids_), host_ids_, 0));
    CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped_stats_), host_stats_, 0));
    CUDA_CHECK(cudaHostAlloc(&host_temperature_, sizeof(float), cudaHostAllocMapped));
    CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped_temperature_), host_temperature_, 0));
    CUDA_CHECK(cudaHostAlloc(&host_heavy_, size_t(cfg_.num_layers) * sizeof(int32_t), cudaHostAllocMapped));
    CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped_heavy_), host_heavy_, 0));
    std::fill_n(host_heavy_, cfg_.num_layers, 0);
  }

  ~CudaBackend() override {
    cudaStreamSynchronize(stream_);
    for (auto ev : events_) cudaEventDestroy(ev);
    if (graph_exec_) cudaGraphExecDestroy(graph_exec_);
    for (StepGraph& g : step_graphs_)
      if (g.exec) cudaGraphExecDestroy(g.exec);
    if (sc_head_.exec) cudaGraphExecDestroy(sc_head_.exec);
    gemm_.reset();
    gemm_side_.reset();
    gemm_tail_.reset();
    cudaEventDestroy(fork_);
    cudaEventDestroy(join_);
    cudaEventDestroy(grouped_);
    cudaEventDestroy(assigned_);
    cudaEventDestroy(overflowed_);
    cudaEventDestroy(step_fork_);
    cudaEventDestroy(temperature_ready_);
    cudaEventDestroy(step_done_);
    cudaStreamDestroy(overflow_);
    cudaStreamDestroy(side_);
    cudaFree(arena_.base);
    cudaFreeHost(host_ids_);
    cudaFreeHost(host_stats_);
    cudaFreeHost(host_temperature_);
    cudaFreeHost(host_heavy_);
    cudaStreamDestroy(stream_);
  }

  std::string name() const override { return "cuda"; }
  const ModelConfig& config() const override { return cfg_; }
  int64_t kv_len() const override { return kv_len_; }

  bool can_truncate(int64_t n) const override {
    if (n < 0 || n > kv_len_) return false;
    const int64_t W1 = cfg_.sliding_window - 1;
    for (auto& L : layers_) {
      if (L.shape.kind != LayerKind::Sliding) continue;
      const int64_t oldest = std::max<int64_t>(0, kv_len_ - L.cap), needed = std::max<int64_t>(0, n - W1);
      if (n > 0 && needed < oldest) return false;
    }
    return true;
  }
  void truncate(int64_t n) override {
    if (!can_truncate(n))
      fail("cannot truncate the CUDA KV cache to {} tokens: it holds {}, and the sliding rings keep only {} rewind "
           "positions", n, kv_len_, opt_.sliding_rewind);
    kv_len_ = n;
  }

  KvSnapshot kv_snapshot(int layer) const override {
    if (layer < 0 || layer >= cfg_.num_layers) fail("kv_snapshot: layer {} out of range [0, {})", layer, cfg_.num_layers);
    const DevLayer& L = layers_[size_t(layer)];
    KvSnapshot s;
    s.n_kv_heads = L.shape.n_kv_heads;
    s.head_dim = L.shape.head_dim;
    s.first_pos = L.shape.kind == LayerKind::Sliding ? std::max<int64_t>(0, kv_len_ - (cfg_.sliding_window - 1)) : 0;
    s.n = kv_len_ - s.first_pos;
    const size_t row = size_t(s.n_kv_heads) * s.head_dim;
    std::vector<uint16_t> kb(size_t(L.cap) * row), vb(kb.size());
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    CUDA_CHECK(cudaMemcpy(kb.data(), L.kc, kb.size() * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(vb.data(), L.vc, vb.size() * 2, cudaMemcpyDeviceToHost));
    s.k.resize(size_t(s.n) * row);
    s.v.resize(s.k.size());
    for (int64_t p = 0; p < s.n; ++p) {
      const size_t slot = size_t((s.first_pos + p) % L.cap);
      for (size_t i = 0; i < row; ++i) {
        s.k[size_t(p) * row + i] = bf16_to_f32(kb[slot * row + i]);
        s.v[size_t(p) * row + i] = bf16_to_f32(vb[slot * row + i]);
      }
    }
    return s;
  }

  void prefill(std::span<const int32_t> ids) override {
    if (ids.empty()) return;
    // A queued SC head (CudaOptions::sc_head_ahead) is left unused: the next PreviousStep step runs its own. (embed's
    // stage_ids waits for the whole stream.)
    sc_head_pending_ = false;
    if (kv_len_ + int64_t(ids.size()) > opt_.max_context)
      fail("prefill of {} tokens would bring the context to {} positions; the CUDA backend was sized for {} "
           "(CudaOptions::max_context / --max-context)", ids.size(), kv_len_ + int64_t(ids.size()), opt_.max_context);
    check_ids(ids);
    // Stages are only meaningful for a prefill that runs as one chunk.
    const bool tracing = trace_ && ids.size() <= size_t(opt_.prefill_chunk);
    if (trace_) trace_->stages.clear(), trace_->router_logits.clear(), trace_->experts.clear();
    two_tiles_now_ = opt_.expert_two_token_tiles;
    // CudaStageTimes covers a prefill too (bench --breakdown): every chunk's stages, summed.
    timing_ = opt_.stage_times && opt_.stage_times->enabled && !trace_;
    n_marks_ = 0;
    for (size_t done = 0; done < ids.size();) {
      const int T = int(std::min<size_t>(size_t(opt_.prefill_chunk), ids.size() - done));
      embed(ids.subspan(done, size_t(T)));
      mark(kStEmbedSc);
      if (tracing) trace_stage(s_.h, T);
      for (int l = 0; l < cfg_.num_layers; ++l) {
        layer(l, Pass::Encoder, T);
        if (tracing) trace_stage(s_.h, T);
      }
      kv_len_ += T;
      done += size_t(T);
    }
    if (timing_) {
      CUDA_CHECK(cudaStreamSynchronize(stream_));
      collect_marks();
      timing_ = false;
    }
    if (!trace_) prewarm_step_graphs();
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  // CudaOptions::prewarm_step_graphs: while the prefill just queued runs on the GPU, every whole-step graph captured
  // before is captured again for the new KV length (same rows, SC mode, token tiles, temperature variant), so that
  // the next denoise steps find their graphs instead of capturing them with the GPU idle (~2.3 ms each on an H100
  // host: a block's first two steps after its commit). Capture only records: the queued prefill keeps running.
  void prewarm_step_graphs() {
    if (!opt_.prewarm_step_graphs || !opt_.whole_step_graph || !opt_.cuda_graphs) return;
    const bool tiles = two_tiles_now_;
    for (size_t i = 0; i < step_graphs_.size(); ++i) {
      StepGraph& g = step_graphs_[i];
      if (!g.exec || g.key.rows <= 0 || g.key.kv_len == kv_len_ || g.key.timeline ||
          kv_len_ + g.key.rows > opt_.max_context)
        continue;
      DenoiseRequest req;
      req.self_condition = SelfCondition(i / 2);
      req.temperature = g.temperature;
      two_tiles_now_ = (i % 2) != 0;
      StepGraphKey key = g.key;
      key.kv_len = kv_len_;
      // Only an optimization: a capture that fails here leaves the graph invalid (capture_step_graph), and the next
      // denoise step that needs it captures it again and reports the error there. The prefill has succeeded.
      try {
        capture_step_graph(g, key, req, g.key.rows);
      } catch (const std::exception&) {
      }
    }
    two_tiles_now_ = tiles;
  }

  void denoise(const DenoiseRequest& req, DenoiseResult& out) override {
    const int L = int(req.canvas.size()), V = cfg_.vocab_size;
    if (L == 0) fail("denoise: empty canvas");
    if (L > cfg_.canvas_length) fail("denoise: canvas of {} tokens exceeds canvas_length {}", L, cfg_.canvas_length);
    if (!(req.temperature > 0)) fail("denoise: temperature must be > 0, got {}", req.temperature);
    if (kv_len_ + L > opt_.max_context)
      fail("denoise at {} cached positions + {} canvas exceeds the CUDA backend's max_context {}", kv_len_, L,
           opt_.max_context);
    check_ids(req.canvas);
    timing_ = opt_.stage_times && opt_.stage_times->enabled;
    n_marks_ = 0;
    // The previous step queued this step's SC GEMM behind it (CudaOptions::sc_head_ahead): it serves a PreviousStep
    // step of the same rows; any other call leaves its output unused, and so does a timed step (its stage marks
    // bracket the GEMM it runs itself).
    const bool head_ready =
        sc_head_pending_ && !timing_ && req.self_condition == SelfCondition::PreviousStep && sc_head_.key.rows == L;
    if (req.self_condition == SelfCondition::PreviousStep && prev_rows_ != L)
      fail("denoise: SelfCondition::PreviousStep needs a previous denoise of the same canvas length ({} vs {})",
           prev_rows_, L);
    if (req.self_condition == SelfCondition::External && int64_t(req.sc_logits.size()) != int64_t(L) * V)
      fail("denoise: sc_logits has {} values, expected {} x {}", req.sc_logits.size(), L, V);
    stage_ids(req.canvas, /*behind_head=*/head_ready);
    sc_head_pending_ = false;
    prev_rows_ = 0;  // the logits buffer is about to hold this step's logits (the SC input, if any, is read first)
    choose_token_tiles(req);
    if (whole_step_graph_applies(req)) {
      launch_step_graph(req, L, head_ready);
    } else {
      enqueue_denoise(req, L, /*capturing=*/false, /*sc_ahead=*/head_ready);
    }
    prev_sc_sparse_ok_ = false;
    if (req.want_logits) {
      out.logits.resize(size_t(L) * V);
      CUDA_CHECK(cudaMemcpyAsync(out.logits.data(), s_.logits, out.logits.size() * 4, cudaMemcpyDeviceToHost, stream_));
    } else {
      out.logits.clear();
    }
    wait_for(/*step_only=*/sc_head_pending_);  // this call's work, not the SC GEMM it may have queued behind it
    if (timing_) collect_marks();
    timing_ = false;
    prev_heavy_ = std::accumulate(host_heavy_, host_heavy_ + cfg_.num_layers, 0);
    if (opt_.tile_stats) {
      opt_.tile_stats->last_heavy = prev_heavy_;
      opt_.tile_stats->last_heavy_per_layer.assign(host_heavy_, host_heavy_ + cfg_.num_layers);
    }
    out.rows.resize(size_t(L));
    for (int r = 0; r < L; ++r) {
      const auto& d = host_stats_[r];
      out.rows[size_t(r)] = RowStats{d.argmax, d.max_z, d.logsumexp, d.entropy};
    }
    if (opt_.sc_sparse) {
      bool ok = true;
      int64_t total = 0;
      for (int r = 0; r < L; ++r) {
        const auto& d = host_stats_[r];
        ok = ok && cuda::sc_sparse_row_ok(d, opt_.sc_sparse_max_survivors, opt_.sc_sparse_max_tail);
        total += d.survivors;
        if (opt_.sc_stats) {
          opt_.sc_stats->max_survivors = std::max(opt_.sc_stats->max_survivors, int(d.survivors));
          opt_.sc_stats->max_tail = std::max(opt_.sc_stats->max_tail, double(d.tail_mass));
        }
      }
      prev_sc_sparse_ok_ = ok && total <= opt_.sc_sparse_max_total;
    }
    prev_rows_ = L;
  }

  void set_layer_trace(LayerTrace* trace) override { trace_ = trace; }

  // The fused expert launch's token tiles for this denoise step (CudaOptions::auto_two_token_tiles_heavy), from the
  // previous denoise step's heavy experts. The previous step is done (stage_ids): the tally is cleared for this step's
  // assignment kernels to fill (a pass that does not run them leaves 0).
  void choose_token_tiles(const DenoiseRequest& req) {
    const bool previous = req.self_condition == SelfCondition::PreviousStep;
    two_tiles_now_ = opt_.expert_two_token_tiles || (previous && opt_.auto_two_token_tiles_heavy > 0 &&
                                                     prev_heavy_ >= opt_.auto_two_token_tiles_heavy);
    std::fill_n(host_heavy_, cfg_.num_layers, 0);
    if (opt_.tile_stats && previous)
      ++(two_tiles_now_ ? opt_.tile_stats->two_tile_steps : opt_.tile_stats->one_tile_steps);
  }

  // Captures what `enqueue` launches on stream_ (and the streams it forks) into `exec`: patched in place when the
  // topology is unchanged (cudaGraphExecUpdate), else instantiated afresh.
  void capture_graph(cudaGraphExec_t& exec, const std::function<void()>& enqueue) {
    cudaGraph_t graph = nullptr;
    // Relaxed: the attention launcher may raise a kernel's shared-memory limit (cudaFuncSetAttribute) mid-capture.
    CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed));
    try {
      enqueue();
    } catch (...) {
      if (cudaStreamEndCapture(stream_, &graph) == cudaSuccess && graph) cudaGraphDestroy(graph);
      (void)cudaGetLastError();
      throw;
    }
    CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    if (opt_.graph_memset_kernels) {
      try {
        cuda::memset_nodes_as_kernels(graph);
      } catch (...) {
        cudaGraphDestroy(graph);
        throw;
      }
    }
    cudaGraphExecUpdateResultInfo info{};
    if (!exec || cudaGraphExecUpdate(exec, graph, &info) != cudaSuccess) {
      (void)cudaGetLastError();  // a failed update is not sticky; instantiate afresh
      if (exec) CUDA_CHECK(cudaGraphExecDestroy(exec));
      exec = nullptr;
      // With dense_mlp_priority the side stream's kernel nodes keep the priority they were captured with.
      const cudaError_t e =
          cudaGraphInstantiate(&exec, graph, opt_.dense_mlp_priority ? cudaGraphInstantiateFlagUseNodePriority : 0);
      cudaGraphDestroy(graph);
      CUDA_CHECK(e);
    } else {
      CUDA_CHECK(cudaGraphDestroy(graph));
    }
  }

  // The decoder layers of a denoise step, ~40 launches each (1.2k per step), replayed as one CUDA graph so the GPU
  // does not wait on per-launch gaps. The kernels take kv_len_ (ring offsets, positions) by value, so one graph
  // serves all steps of one canvas at one (rows, kv_len); a new pair re-captures and patches the executable in
  // place (cudaGraphExecUpdate: no re-instantiation unless the topology changed). Traced and stage-timed steps
  // launch eagerly: they synchronize or record events between stages.
  void decoder_layers(int L) {
    if (trace_ || timing_ || !opt_.cuda_graphs) {
      for (int l = 0; l < cfg_.num_layers; ++l) {
        layer(l, Pass::Decoder, L);
        if (trace_) trace_stage(s_.h, L);
      }
      return;
    }
    const bool timeline = cuda::experts_timeline_recording();
    if (!graph_exec_ || graph_rows_ != L || graph_kv_ != kv_len_ || graph_two_tiles_ != two_tiles_now_ ||
        graph_timeline_ != timeline) {
      graph_rows_ = -1;  // stays invalid if the capture below throws
      capture_graph(graph_exec_, [&] {
        for (int l = 0; l < cfg_.num_layers; ++l) layer(l, Pass::Decoder, L);
      });
      graph_rows_ = L, graph_kv_ = kv_len_, graph_two_tiles_ = two_tiles_now_, graph_timeline_ = timeline;
    }
    CUDA_CHECK(cudaGraphLaunch(graph_exec_, stream_));
  }

 private:
  // CudaStageTimes: records an event attributed to `stage`. Events come from a pool grown on first use, so later
  // timed steps allocate nothing.
  void mark(int stage) {
    if (!timing_) return;
    if (n_marks_ == events_.size()) {
      cudaEvent_t ev;
      CUDA_CHECK(cudaEventCreate(&ev));
      events_.push_back(ev);
      mark_stage_.push_back(0);
    }
    CUDA_CHECK(cudaEventRecord(events_[n_marks_], stream_));
    mark_stage_[n_marks_++] = stage;
  }
  void collect_marks() {
    CudaStageTimes& st = *opt_.stage_times;
    if (st.ms.empty())
      for (const char* n : kStageNames) st.ms.emplace_back(n, 0.0);
    for (size_t i = 1; i < n_marks_; ++i) {
      if (mark_stage_[i] < 0) continue;  // a prefill chunk's start: the host's wait before it is no stage's
      float t = 0;
      CUDA_CHECK(cudaEventElapsedTime(&t, events_[i - 1], events_[i]));
      st.ms[size_t(mark_stage_[i])].second += t;
    }
    ++st.steps;
  }

  // Debug path only: synchronizes the stream.
  void trace_stage(const float* dev, int T) {
    std::vector<float> v(size_t(T) * size_t(cfg_.hidden_size));
    CUDA_CHECK(cudaMemcpyAsync(v.data(), dev, v.size() * 4, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    trace_->stages.push_back(std::move(v));
  }

  void check_ids(std::span<const int32_t> ids) const {
    for (size_t t = 0; t < ids.size(); ++t)
      if (ids[t] < 0 || ids[t] >= cfg_.vocab_size)
        fail("token id {} at position {} is outside the vocabulary [0, {})", ids[t], t, cfg_.vocab_size);
  }

  // Everything a denoise step runs on the GPU, from the canvas ids in host_ids_ (pinned) to the row statistics in
  // host_stats_ (pinned): eagerly (the decoder layers then as their own graph, decoder_layers), or while the whole step
  // is being captured (launch_step_graph), when it must not synchronize or read host memory it does not own.
  // sc_ahead: a PreviousStep step's SC GEMM is already on the stream (launch_step_graph's head graph).
  void enqueue_denoise(const DenoiseRequest& req, int L, bool capturing, bool sc_ahead = false) {
    const int H = cfg_.hidden_size, V = cfg_.vocab_size;
    // Captured: the embedding reads the pinned ids where the host wrote them, and the statistics' merge kernel writes
    // them into mapped host memory: with memcpy nodes the graph's first kernel started ~80 us after its launch (H200
    // trace, session 12).
    const float sqrt_h = std::sqrt(float(H));
    // A PreviousStep step's SC GEMM (~0.5 ms) does not read the canvas embedding: the last norm of the SC prologue
    // embeds the canvas rows itself (embed_add_then_rms_norm), so nothing runs before that GEMM. Other steps embed
    // first.
    const bool embed_in_norm = req.self_condition == SelfCondition::PreviousStep;
    // The temperature into device memory on a branch of its own, long before the row statistics read it.
    const bool temperature_on_device = capturing && opt_.device_temperature;
    if (temperature_on_device) {
      CUDA_CHECK(cudaEventRecord(step_fork_, stream_));
      CUDA_CHECK(cudaStreamWaitEvent(side_, step_fork_));
      cuda::copy_words(mapped_temperature_, 1, s_.temperature, side_);
      CUDA_CHECK(cudaEventRecord(temperature_ready_, side_));
    }
    const int32_t* ids = capturing ? mapped_ids_ : upload_staged_ids(L);
    if (!embed_in_norm) embed_ids(ids, L);
    bool have_signal = true;
    switch (req.self_condition) {
      case SelfCondition::None: have_signal = false; break;
      case SelfCondition::CanvasEmbedding:
        CUDA_CHECK(cudaMemcpyAsync(s_.sig, s_.h, size_t(L) * H * 4, cudaMemcpyDeviceToDevice, stream_));
        break;
      case SelfCondition::PreviousStep:
        if (!sc_ahead) previous_step_sc(L);  // softmax(previous logits / previous T) @ E, exact or over the survivors
        break;
      case SelfCondition::External:  // never captured: the caller's pageable logits
        CUDA_CHECK(cudaMemcpyAsync(s_.logits, req.sc_logits.data(), req.sc_logits.size() * 4, cudaMemcpyHostToDevice,
                                   stream_));
        soft_embedding(L, 1.0f);
        break;
    }
    const float eps = cfg_.rms_norm_eps;
    if (have_signal) {
      // sig * sqrt(H) (times the fused probs' row factors), then the SC pre-norm, in one pass
      const bool row_scaled = req.self_condition == SelfCondition::PreviousStep && previous_probs_scaled();
      const float sig_scale = req.self_condition == SelfCondition::CanvasEmbedding ? 1.0f : sqrt_h;
      cuda::scaled_rms_norm_f32_to_bf16(s_.sig, L, H, row_scaled ? s_.probs_scale : nullptr, sig_scale,
                                        weights_->sc_pre_norm_, eps, s_.x, stream_);
      gated_mlp(s_.x, L, weights_->sc_gu_, weights_->sc_down_, cfg_.intermediate_size, s_.a);
      // h = no-scale norm(h + SC MLP), and the first layer's input norm of it in the same pass
      if (embed_in_norm)
        cuda::embed_add_then_rms_norm(ids, weights_->embed_, sqrt_h, s_.h, s_.a, L, H, nullptr, eps, stream_,
                                      layers_[0].input_norm, s_.x);
      else
        cuda::add_then_rms_norm(s_.h, s_.a, L, H, nullptr, eps, stream_, layers_[0].input_norm, s_.x);
    } else {
      cuda::rms_norm_f32_to_f32(s_.h, L, H, nullptr, eps, s_.h, stream_);
      cuda::rms_norm_f32_to_bf16(s_.h, L, H, layers_[0].input_norm, eps, s_.x, stream_);
    }
    mark(kStEmbedSc);
    if (trace_) {
      trace_->stages.clear(), trace_->router_logits.clear(), trace_->experts.clear();
      trace_stage(s_.h, L);
    }
    if (capturing) {
      for (int l = 0; l < cfg_.num_layers; ++l) layer(l, Pass::Decoder, L);
    } else {
      decoder_layers(L);
    }
    if (trace_) {  // the final norm in f32 (the lm_head reads its bf16 rounding, which the last combine wrote)
      cuda::rms_norm_f32_to_f32(s_.h, L, H, weights_->final_norm_, eps, s_.xr, stream_);
      trace_stage(s_.xr, L);
    }
    if (s_.logits16)
      gemm_->linear(s_.x, Dt::BF16, L, weights_->embed_, Dt::BF16, V, H, s_.logits16, Dt::BF16, stream_);
    else
      gemm_->linear(s_.x, Dt::BF16, L, weights_->embed_, Dt::BF16, V, H, s_.logits, Dt::F32, stream_);
    mark(kStLmHead);
    // The probs for a PreviousStep SC input of the next step come out of the same pass (softmax at this T). The
    // capped logits are written back only for their readers (the host's categorical sampler, the sparse SC's
    // survivors): a 268 MB write at the full shape, ~50 us.
    const bool capped_read = req.want_logits || opt_.sc_sparse;
    // Captured, the merge also writes the statistics into mapped host memory (a captured step never runs the sparse
    // SC, whose survivor pass below adds to them: whole_step_graph_applies).
    if (temperature_on_device) CUDA_CHECK(cudaStreamWaitEvent(stream_, temperature_ready_));
    cuda::softcap_row_stats(s_.logits, L, V, cfg_.final_logit_softcapping, req.temperature, s_.stats,
                            s_.row_stats_scratch, stream_, s_.probs, capped_read,
                            opt_.fused_sc_probs ? s_.probs_scale : nullptr, capturing ? mapped_stats_ : nullptr,
                            temperature_on_device ? s_.temperature : nullptr, s_.logits16);
    // Survivors of the next step's sparse SC, with the counts / dropped mass that decide whether it may use them.
    if (opt_.sc_sparse) cuda::sc_survivors(s_.logits, L, V, req.temperature, s_.stats, s_.sc, stream_);
    if (!capturing)
      CUDA_CHECK(cudaMemcpyAsync(host_stats_, s_.stats, size_t(L) * sizeof(cuda::DeviceRowStats),
                                 cudaMemcpyDeviceToHost, stream_));
    mark(kStRowStats);
  }

  // A captured whole denoise step (launch_step_graph) and what it was captured for.
  struct StepGraphKey {
    int rows = -1;
    int64_t kv_len = -1;
    float temperature = 0.0f;  // with CudaOptions::device_temperature: softcap_row_stats_variant
    bool timeline = false;     // cuda::experts_timeline_recording() at capture
    bool operator==(const StepGraphKey&) const = default;
  };
  struct StepGraph {
    cudaGraphExec_t exec = nullptr;
    StepGraphKey key;
    float temperature = 1.0f;  // the request's temperature at capture (prewarm_step_graphs captures with it again)
  };
  // CudaOptions::whole_step_graph: the steps whose launches depend only on (rows, kv length, temperature, SC mode)
  // and the device buffers: no trace or stage timing, no logits for the host, no sparse SC (its path is chosen per
  // step on the host), no caller-provided SC logits.
  bool whole_step_graph_applies(const DenoiseRequest& req) const {
    return opt_.whole_step_graph && opt_.cuda_graphs && !trace_ && !timing_ && !req.want_logits && !opt_.sc_sparse &&
           req.self_condition != SelfCondition::External;
  }
  // The whole denoise step (enqueue_denoise) as one CUDA graph: one launch a step instead of ~40 host launches around
  // the layers' graph (0.00-0.08 ms a 4K step on the H200, session 12; Nsight's graph-node tracing had made the host
  // look ~5x slower than it is). One executable graph per SC mode (their topologies differ: a canvas's first
  // step and its later ones would otherwise re-instantiate each other's), captured per (rows, kv length, temperature)
  // and patched in place as decoder_layers does.
  // head_ready: this step's SC GEMM is already on the stream (queued by the previous step: CudaOptions::sc_head_ahead).
  void launch_step_graph(const DenoiseRequest& req, int L, bool head_ready) {
    const size_t mode = size_t(req.self_condition);
    if (mode >= kSelfConditionModes) fail("denoise: unknown self-conditioning mode {}", int(mode));
    StepGraph& g = step_graphs_[2 * mode + (two_tiles_now_ ? 1 : 0)];
    // With the temperature on the device only its division variant shapes the graph (softcap_row_stats_variant).
    const float t_key = opt_.device_temperature
                            ? float(cuda::softcap_row_stats_variant(cfg_.final_logit_softcapping, req.temperature))
                            : req.temperature;
    const StepGraphKey key{L, kv_len_, t_key, cuda::experts_timeline_recording()};
    *host_temperature_ = req.temperature;  // the previous step's graph, its reader, is done (stage_ids)
    // CudaOptions::split_step_head: the SC GEMM as a graph of its own, launched first (its key: the rows; it reads
    // the previous step's probs and writes the SC signal, nothing else)
    const bool split = split_head(req);
    if (split && (!sc_head_.exec || sc_head_.key.rows != L)) {
      sc_head_.key = StepGraphKey{};
      capture_graph(sc_head_.exec, [&] { previous_step_sc(L); });
      sc_head_.key = StepGraphKey{L, -1, 0.0f};
    }
    if (!g.exec || !(key == g.key)) capture_step_graph(g, key, req, L);
    auto launch = [&](cudaGraphExec_t exec, std::vector<double>* us) {
      const auto t0 = std::chrono::steady_clock::now();
      CUDA_CHECK(cudaGraphLaunch(exec, stream_));
      if (us) us->push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    };
    CudaHostTimes* ht = opt_.host_times;
    if (split && !head_ready) launch(sc_head_.exec, ht ? &ht->head_launch_us : nullptr);
    launch(g.exec, ht ? &ht->graph_launch_us : nullptr);
    // CudaOptions::sc_head_ahead: the next step's SC GEMM behind this step (it reads only the probs this step writes),
    // once its graph exists for these rows (captured by a PreviousStep step: never in the middle of queued work). The
    // host then waits for step_done_ only (wait_for, from denoise and stage_ids).
    if (opt_.sc_head_ahead && opt_.split_step_head && req.more_steps && sc_head_.exec && sc_head_.key.rows == L) {
      CUDA_CHECK(cudaEventRecord(step_done_, stream_));
      launch(sc_head_.exec, ht ? &ht->head_launch_us : nullptr);
      sc_head_pending_ = true;
    }
  }
  // g := the whole step for req at L rows, under key (its SC GEMM a graph of its own where split_step_head applies)
  void capture_step_graph(StepGraph& g, const StepGraphKey& key, const DenoiseRequest& req, int L) {
    g.key = StepGraphKey{};  // stays invalid if the capture below throws
    capture_graph(g.exec, [&] { enqueue_denoise(req, L, /*capturing=*/true, /*sc_ahead=*/split_head(req)); });
    g.key = key;
    g.temperature = req.temperature;
  }
  bool split_head(const DenoiseRequest& req) const {
    return opt_.split_step_head && req.self_condition == SelfCondition::PreviousStep;
  }
  // Waits for the last denoise step's own work only (step_done_: not a queued SC head behind it), or for the stream.
  void wait_for(bool step_only) {
    if (step_only)
      CUDA_CHECK(cudaEventSynchronize(step_done_));
    else
      CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  void embed(std::span<const int32_t> ids) {
    stage_ids(ids);
    embed_ids(upload_staged_ids(int(ids.size())), int(ids.size()));
  }
  // ids into the pinned buffer, once the previous copy out of it has completed (the buffer is reused by the next
  // chunk or step; the sync also keeps the start mark of a timed step from landing behind queued work).
  // behind_head: a step's SC GEMM is queued (CudaOptions::sc_head_ahead) and this step uses it; the GEMM does not
  // read host_ids_, so only the step before it must be done (step_done_). Otherwise the whole stream: an abandoned
  // head is waited for, so that its graph may be re-captured.
  void stage_ids(std::span<const int32_t> ids, bool behind_head = false) {
    wait_for(/*step_only=*/behind_head);
    mark(-1);  // start of a timed denoise step (no-op otherwise)
    std::memcpy(host_ids_, ids.data(), ids.size() * 4);
  }
  // The n staged ids to the device (s_.ids, which it returns).
  const int32_t* upload_staged_ids(int n) {
    CUDA_CHECK(cudaMemcpyAsync(s_.ids, host_ids_, size_t(n) * 4, cudaMemcpyHostToDevice, stream_));
    return s_.ids;
  }
  // h = E[ids] * sqrt(H), ids in device-visible memory. HF multiplies by sqrt(H) in the weight dtype (53.0); the CPU
  // oracle uses f32 sqrt(H), and so do we.
  void embed_ids(const int32_t* ids, int n) {
    cuda::embed_scale(ids, n, weights_->embed_, cfg_.hidden_size, std::sqrt(float(cfg_.hidden_size)), s_.h, stream_);
  }

  // sig = softmax(logits / T) @ E (the sqrt(H) factor is applied by the caller)
  void soft_embedding(int L, float temperature) {
    cuda::softmax_rows_bf16(s_.logits, L, cfg_.vocab_size, temperature, s_.probs, stream_);
    probs_through_table(L);
  }
  // The SC signal of a PreviousStep step: the survivor gather when sparse SC is on and every row of the previous
  // step passed its bounds, else the exact GEMM through the whole table.
  void previous_step_sc(int L) {
    const bool sparse = opt_.sc_sparse && prev_sc_sparse_ok_;
    if (sparse)
      cuda::sc_gather_sum(s_.sc, L, cfg_.vocab_size, weights_->embed_, cfg_.hidden_size, s_.sig, stream_);
    else
      probs_through_table(L);
    if (opt_.sc_sparse && opt_.sc_stats) ++(sparse ? opt_.sc_stats->sparse_steps : opt_.sc_stats->dense_steps);
  }
  // Whether the previous step's SC signal (probs @ E) still needs its rows' factors: fused probs on the dense path
  // (the sparse gather uses normalized p).
  bool previous_probs_scaled() const { return opt_.fused_sc_probs && !(opt_.sc_sparse && prev_sc_sparse_ok_); }
  void probs_through_table(int L) {
    gemm_->through_table(s_.probs, Dt::BF16, L, weights_->embed_, Dt::BF16, cfg_.vocab_size, cfg_.hidden_size, s_.sig,
                         Dt::F32, stream_);
  }

  // y = down(gelu_tanh(gate x) * up x), gate and up stacked in one [2I, H] weight: on the main stream, or (_on) on
  // stream st with gemm g.
  void gated_mlp(const bf16* x, int T, const bf16* gu, const bf16* down, int I, bf16* y) {
    gated_mlp_on(*gemm_, stream_, x, T, gu, down, I, y);
  }
  void gated_mlp_on(cuda::Gemm& g, cudaStream_t st, const bf16* x, int T, const bf16* gu, const bf16* down, int I,
                    bf16* y) {
    gated_mlp_up_on(g, st, x, T, gu, I);
    gated_mlp_down_on(g, st, T, down, I, y);
  }
  // The halves of gated_mlp_on: act (s_.actd) = gelu(x gate^T) * (x up^T), then y = act down^T.
  void gated_mlp_up_on(cuda::Gemm& g, cudaStream_t st, const bf16* x, int T, const bf16* gu, int I) {
    g.linear(x, Dt::BF16, T, gu, Dt::BF16, 2 * I, cfg_.hidden_size, s_.gu, Dt::BF16, st);
    cuda::gelu_mul(s_.gu, T, I, s_.actd, st);
  }
  void gated_mlp_down_on(cuda::Gemm& g, cudaStream_t st, int T, const bf16* down, int I, bf16* y) {
    g.linear(s_.actd, Dt::BF16, T, down, Dt::BF16, cfg_.hidden_size, I, y, Dt::BF16, st);
  }

  // Full layers run their denoise attention on the GEMM path (CudaOptions::gemm_attention).
  bool uses_gemm_attention(const DevLayer& L) const {
    return gemm_attention_ && L.shape.kind != LayerKind::Sliding;
  }
  // Rows of a layer's K (and V) region: its cap, and for the GEMM attention the rows its key columns round up into
  // (zeroed at allocation: their P is 0, and 0 times a finite value is 0).
  size_t kv_rows(const DevLayer& L) const {
    return size_t(L.cap) + (uses_gemm_attention(L) ? size_t(cuda::kGemmAttentionKeyAlign) : 0);
  }
  // The GEMM attention's buffers for full layer L (its batch pointers depend only on these).
  cuda::GemmAttentionArgs gemm_attention_args(const DevLayer& L) const {
    cuda::GemmAttentionArgs g{};
    g.q = s_.q;
    g.nh = cfg_.num_heads, g.nkv = L.shape.n_kv_heads, g.D = L.shape.head_dim;
    g.k = L.kc, g.v = L.vc;
    g.S = s_.attn_S, g.P = s_.attn_P;
    g.head_rows = cfg_.canvas_length, g.ld = attn_ld_;
    g.out = s_.att;
    g.ptrs = L.attn_ptrs;
    return g;
  }

  void layer(int l, Pass pass, int T) {
    DevLayer& L = layers_[size_t(l)];
    const int H = cfg_.hidden_size, nh = cfg_.num_heads, nkv = L.shape.n_kv_heads, D = L.shape.head_dim;
    const int E = cfg_.num_experts, K = cfg_.top_k_experts;
    const float eps = cfg_.rms_norm_eps;
    const bool sliding = L.shape.kind == LayerKind::Sliding;

    // Layer l > 0 finds its input norm in x already: the previous layer's combine kernel wrote it; so does layer 0 of a
    // decoder pass (enqueue_denoise's SC prologue).
    if (l == 0 && pass == Pass::Encoder) cuda::rms_norm_f32_to_bf16(s_.h, T, H, L.input_norm, eps, s_.x, stream_);
    // CudaOptions::dense_tma (plan_dense_tma): qkv and o_proj as split-K partials, summed by their readers
    const bool dense = pass == Pass::Decoder && T <= cfg_.canvas_length;
    const int qkv_splits = dense ? L.qkv_splits : 0, o_splits = dense ? L.o_splits : 0;
    const int dcl = opt_.dense_tma_cluster;
    if (qkv_splits > 0)
      cuda::dense_tma_splitk(L.wqkv_map, cuda::dense_tma_token_map(s_.x, T, H, dcl), T, L.nqkv, H, qkv_splits, dcl,
                             s_.dense_part, stream_);
    else
      gemm_->linear(s_.x, Dt::BF16, T, L.wqkv, Dt::BF16, L.nqkv, H, s_.qkv, Dt::BF16, stream_);
    // A denoise pass of a full layer on the GEMM attention: the canvas keys / values go straight into the cache rows
    // after the cached ones (the positions they will have once committed; a commit rewrites them), so that all keys
    // are rows [0, kv_len + T) of one matrix.
    // (attn_ld_ is a multiple of the key alignment, so n_keys rounded up fits as well.)
    const int64_t n_keys = kv_len_ + T;
    const bool gemm_attn = pass == Pass::Decoder && L.attn_ptrs && n_keys <= attn_ld_;
    bf16* kn = gemm_attn ? L.kc + size_t(kv_len_) * nkv * D : s_.kn;
    bf16* vn = gemm_attn ? L.vc + size_t(kv_len_) * nkv * D : s_.vn;
    cuda::qkv_norm_rope(s_.qkv, T, nh, nkv, D, !L.shape.has_v_proj, L.q_norm, L.k_norm, L.inv_freq, kv_len_, eps,
                        s_.q, kn, vn, stream_, qkv_splits > 0 ? s_.dense_part : nullptr, qkv_splits);
    mark(kStAttnProj);
    if (gemm_attn) {
      cuda::gemm_attention(*gemm_, gemm_attention_args(L), T, int(n_keys), stream_, opt_.discard_attention_scores);
    } else {
      cuda::AttentionArgs a{};
      a.q = s_.q;
      a.T = T, a.nh = nh, a.nkv = nkv, a.D = D;
      a.k_cache = L.kc, a.v_cache = L.vc, a.cap = L.cap;
      a.first_pos = sliding ? std::max<int64_t>(0, kv_len_ - (cfg_.sliding_window - 1)) : 0;
      a.n_old = kv_len_ - a.first_pos;
      a.k_new = s_.kn, a.v_new = s_.vn, a.T_new = T;
      a.q_pos0 = kv_len_;
      a.causal = pass == Pass::Encoder;
      a.window = sliding ? cfg_.sliding_window : 0;
      a.out = s_.att;
      cuda::attention(a, stream_);
    }
    mark(kStAttention);
    if (pass == Pass::Encoder) cuda::kv_write(s_.kn, s_.vn, T, nkv * D, kv_len_, L.kc, L.vc, L.cap, stream_);
    if (o_splits > 0)
      cuda::dense_tma_splitk(L.wo_map, cuda::dense_tma_token_map(s_.att, T, nh * D, dcl), T, H, nh * D, o_splits, dcl,
                             s_.dense_part, stream_);
    else
      gemm_->linear(s_.att, Dt::BF16, T, L.wo, Dt::BF16, H, nh * D, s_.a, Dt::BF16, stream_);
    // h += rms(attention out; post_attn), then the FFN inputs x1, xe, xr from the new h: one kernel.
    cuda::add_rms_norm_pre_ffn(s_.h, s_.a, T, H, L.post_attn, L.pre_ff, L.pre_ff2, L.router_scale, eps, s_.x1, s_.xe,
                               s_.xr, stream_, o_splits > 0 ? s_.dense_part : nullptr, o_splits);
    mark(kStOProj);

    const int Ie = cfg_.moe_intermediate_size;
    // Canvas-sized passes (denoise, commit): experts padded to M rows as one strided-batched cuBLASLt GEMM each
    // (weights stream at ~4.1 instead of ~3.4 TB/s); the rare rows past M go through the grouped kernels.
    const bool padded_ok = opt_.padded_experts && T <= cfg_.canvas_length;
    const int M_tile = padded_ok ? cuda::moe_padded_rows_per_expert(T, K, E) : 0;
    // TMA gate_up (CudaOptions::tma_experts); its maps were built for the canvas's M (32). With
    // CudaOptions::tma_gather_rows it reads each expert's token rows from xe itself (slot_token), so no gather
    // kernel stands between the assignment and the experts; only the rare overflow rows are gathered, on the
    // overflow GEMMs' stream.
    const bool tma =
        padded_ok && use_tma_experts_ && M_tile == cuda::moe_padded_rows_per_expert(cfg_.canvas_length, K, E);
    // Packed expert weights (CudaOptions::pack_expert_gate_up / _down) are read by the TMA and the grouped kernels
    // only: a padded pass that cannot take the TMA path (cuBLASLt's GEMMs read the checkpoint layout) runs grouped.
    const bool padded = padded_ok && (tma || (!L.gu_packed && !L.dn_packed));
    const bool gathered = tma && opt_.tma_gather_rows;
    // CudaOptions::fused_router: the router GEMM and top-k in two launches, which also leave each expert's tokens as
    // a bit mask. With the gathered TMA gate_up, that kernel then reads its experts' tokens from the masks ("masked"),
    // and the assignment (for the combine, the overflow rows) runs beside it on the side stream instead of between the
    // router and the experts. The TMA down kernel then counts its experts' rows from the masks too.
    const bool fused_router = padded && opt_.fused_router && cuda::router_fused_supported(E, H, K);
    const bool masked = fused_router && gathered && T <= 1024;
    // The dense MLP (compute-bound) and the router + experts (latency- then bandwidth-bound) are independent until
    // the combine: the dense MLP runs on a side stream (fork/join events, captured into the graph as parallel
    // branches). Stage-timed, traced and GEMM-tuning passes keep one stream so their times stay attributable.
    const bool overlap = opt_.overlap_dense_mlp && !timing_ && !trace_ && !cuda::gemm_tuning();
    // The experts' output rows: bf16 on denoise passes (CudaOptions::bf16_expert_rows), else f32.
    const cuda::ExpertRows y = pass == Pass::Decoder && opt_.bf16_expert_rows
                                   ? cuda::ExpertRows(reinterpret_cast<bf16*>(s_.y))
                                   : cuda::ExpertRows(s_.y);
    const bool fused_experts = masked && opt_.fused_experts && opt_.dynamic_expert_tiles;
    // Padded rows an expert: with two token tiles an expert (CudaOptions::expert_two_token_tiles, or chosen for this
    // step: choose_token_tiles) the fused launch serves cuda::kFusedExpertRows, so only an expert's rows past 64 (not
    // 32) go through the overflow kernels.
    const bool two_token_tiles = fused_experts && two_tiles_now_;
    const int M = two_token_tiles ? cuda::kFusedExpertRows : M_tile;
    // Packed down weights leave the TMA kernel (or the fused launch) as down's only padded path.
    const bool down_tma = tma && !fused_experts && (opt_.tma_experts_down || L.dn_packed);
    const bool down_cublas = !down_tma && !fused_experts;
    const cuda::TmaExpertsPlan plan{
        .sms = overlap ? opt_.expert_sms : 0,
        .grid = opt_.tma_experts_grid,
        .stages = opt_.tma_experts_stages,
        .l2_prefetch_slices = opt_.tma_experts_l2_prefetch,
        .prewait_stages = opt_.tma_experts_prewait_stages,
        .tile_counters = opt_.dynamic_expert_tiles ? s_.expert_tile_counters : nullptr,
        .claim_ahead = opt_.tma_experts_claim_ahead,
        .first_tile_stride = opt_.tma_experts_first_stride,
        .gate_up_packed = L.gu_packed ? L.exp_gu : nullptr,
        .down_packed = L.dn_packed ? L.exp_down : nullptr,
        .two_token_tiles = two_token_tiles,
        .rows_evict_last = pass == Pass::Decoder ? opt_.expert_rows_l2 & 3 : 0};
    if (overlap) {
      // CudaOptions::dense_down_last: the dense MLP's down GEMM goes on the side stream after the assignment and the
      // overflow rows (below). Its blocks need more shared memory than the expert kernel leaves an SM, so it cannot
      // start before that kernel ends; queued first, it held those kernels back behind it as well.
      CUDA_CHECK(cudaEventRecord(fork_, stream_));
      CUDA_CHECK(cudaStreamWaitEvent(side_, fork_));
      gated_mlp_up_on(*gemm_side_, side_, s_.x1, T, L.dense_gu, cfg_.intermediate_size);
      if (!opt_.dense_down_last)
        gated_mlp_down_on(*gemm_side_, side_, T, L.dense_down, cfg_.intermediate_size, s_.m1);
    } else {
      gated_mlp(s_.x1, T, L.dense_gu, L.dense_down, cfg_.intermediate_size, s_.m1);
    }
    mark(kStDenseMlp);
    if (fused_router) {
      cuda::router_top_k(s_.xr, T, H, L.router_w, E, K, L.pes, s_.router_partial, s_.rl, s_.idx, s_.wk,
                         s_.expert_masks, stream_);
    } else {
      gemm_->linear(s_.xr, Dt::F32, T, L.router_w, Dt::F32, E, H, s_.rl, Dt::F32, stream_);
      cuda::route_top_k(s_.rl, T, E, K, L.pes, s_.idx, s_.wk, stream_);
    }
    mark(kStRouter);
    if (trace_) {  // debug path only: synchronizes
      std::vector<float> rl(size_t(T) * E);
      std::vector<int32_t> idx(size_t(T) * K);
      CUDA_CHECK(cudaMemcpyAsync(rl.data(), s_.rl, rl.size() * 4, cudaMemcpyDeviceToHost, stream_));
      CUDA_CHECK(cudaMemcpyAsync(idx.data(), s_.idx, idx.size() * 4, cudaMemcpyDeviceToHost, stream_));
      CUDA_CHECK(cudaStreamSynchronize(stream_));
      trace_->router_logits.push_back(std::move(rl));
      trace_->experts.push_back(std::move(idx));
    }
    if (padded) {
      auto assign = [&](cudaStream_t st) {
        // Beside the expert kernel (masked, side stream): a block that fits next to its blocks' registers.
        const int threads = masked && overlap && opt_.narrow_assignment ? 256 : 1024;
        cuda::moe_assign_padded(s_.idx, T, K, E, M, s_.offsets, s_.sorted_pos, s_.moe_meta, s_.slot_token, st,
                                threads, M_tile, mapped_heavy_ + l);
      };
      if (masked) {
        if (!overlap) assign(stream_);  // else on the side stream, below
      } else if (gathered) {
        assign(stream_);
      } else {
        cuda::moe_group_padded(s_.idx, T, K, E, s_.xe, H, M, s_.offsets, s_.sorted_pos, s_.xs, stream_, s_.moe_meta);
      }
      mark(kStGroup);
      // The overflow rows run on a small grid over the listed experts (moe_group_padded's meta). Their rows of xs,
      // act and y lie past the padded ones (the f32 gate/up below has a buffer of its own), so with the side stream
      // they run there, after the dense MLP, beside the padded GEMMs instead of between them.
      auto overflow_gate_up = [&](cudaStream_t st) {
        if (gathered) cuda::moe_gather(s_.sorted_pos, T, K, s_.xe, H, s_.xs, st, /*min_row=*/E * M);
        cuda::moe_gate_up(s_.xs, s_.offsets, E, T * K, L.exp_gu, H, Ie, s_.acte, st, s_.moe_meta, L.gu_packed);
      };
      auto overflow_down = [&](cudaStream_t st) {
        cuda::moe_down(s_.acte, s_.offsets, E, T * K, L.exp_down, H, Ie, y, st, s_.moe_meta, L.dn_packed);
      };
      if (overlap) {
        CUDA_CHECK(cudaEventRecord(grouped_, stream_));
        CUDA_CHECK(cudaStreamWaitEvent(side_, grouped_));
        if (masked) assign(side_);
        if (opt_.overflow_stream) {  // beside the dense down GEMM, not ahead of it (CudaOptions::overflow_stream)
          CUDA_CHECK(cudaEventRecord(assigned_, side_));
          CUDA_CHECK(cudaStreamWaitEvent(overflow_, assigned_));
          overflow_gate_up(overflow_);
          overflow_down(overflow_);
          CUDA_CHECK(cudaEventRecord(overflowed_, overflow_));
        } else {
          overflow_gate_up(side_);
          overflow_down(side_);
        }
      }
      // gate/up in f32 (in registers on the TMA path, else in gu32): one bf16 rounding, of the activation, as the
      // grouped kernels.
      // TMA path: both kernels are PDL-launched and stream weights before their griddepcontrol.wait. gate_up's
      // predecessor on stream_ is the router (masked), the gather or the assignment (the event record between them
      // only adds the side stream's edge); down's is gate_up (or the overflow gate_up without overlap), and its wait
      // is for that kernel's completion, which follows gate_up's. The overflow kernels touch only rows past E M,
      // which the maps do not cover.
      const int* valid_rows = s_.moe_meta + 1 + E;  // rows of each expert's padded block
      if (fused_experts) {
        cuda::moe_experts_fused_tma_masked(L.exp_gu_map, L.exp_down_map, s_.xe, s_.expert_masks, T, E, H, Ie,
                                           s_.acte, y, stream_, plan);
      } else if (masked) {
        cuda::moe_gate_up_padded_tma_masked(L.exp_gu_map, s_.xe, s_.expert_masks, T, E, H, Ie, s_.acte, stream_,
                                            plan);
      } else if (gathered) {
        cuda::moe_gate_up_padded_tma_gathered(L.exp_gu_map, s_.xe, s_.slot_token, valid_rows, E, H, Ie, s_.acte,
                                              stream_, plan);
      } else if (tma) {
        cuda::moe_gate_up_padded_tma(L.exp_gu_map, xs_map_, valid_rows, E, H, Ie, s_.acte, stream_, plan);
      } else {
        gemm_->linear_batched(s_.xs, Dt::BF16, M, L.exp_gu, Dt::BF16, 2 * Ie, H, s_.gu32, Dt::F32, E, stream_);
        cuda::moe_gelu_mul_padded(s_.gu32, E, M, Ie, s_.moe_meta, s_.acte, stream_);
      }
      if (!overlap) overflow_gate_up(stream_);
      mark(kStGateUp);
      if (down_tma && masked) {  // row counts from the masks: the assignment runs beside, on the side stream
        cuda::moe_down_padded_tma_masked(L.exp_down_map, acte_map_, s_.expert_masks, T, E, H, Ie, y, stream_, plan);
      } else if (down_tma) {
        cuda::moe_down_padded_tma(L.exp_down_map, acte_map_, valid_rows, E, H, Ie, y, stream_, plan);
      } else if (down_cublas) {
        gemm_->linear_batched(s_.acte, Dt::BF16, M, L.exp_down, Dt::BF16, H, Ie, y.p, y.is_bf16 ? Dt::BF16 : Dt::F32,
                              E, stream_);
      }  // else fused_experts: down ran in gate_up's launch
      if (!overlap) overflow_down(stream_);
      mark(kStDown);
    } else {
      cuda::moe_group(s_.idx, T, K, E, s_.xe, H, s_.offsets, s_.sorted_pos, s_.xs, stream_);
      mark(kStGroup);
      if (use_prefill_tma_) {  // CudaOptions::prefill_tma_experts
        unsigned* const items = opt_.prefill_item_counter ? s_.prefill_item_counters : nullptr;
        cuda::moe_gate_up_prefill_tma(L.exp_gu_map, L.gu_packed ? L.exp_gu : nullptr, s_.xs, s_.offsets, E, T * K, H,
                                      Ie, s_.acte, stream_, items);
        mark(kStGateUp);
        cuda::moe_down_prefill_tma(L.exp_down_map, L.dn_packed ? L.exp_down : nullptr, s_.acte, s_.offsets, E, T * K,
                                   H, Ie, y, stream_, items);
      } else {
        cuda::moe_gate_up(s_.xs, s_.offsets, E, T * K, L.exp_gu, H, Ie, s_.acte, stream_, nullptr, L.gu_packed);
        mark(kStGateUp);
        cuda::moe_down(s_.acte, s_.offsets, E, T * K, L.exp_down, H, Ie, y, stream_, nullptr, L.dn_packed);
      }
      mark(kStDown);
    }
    if (overlap) {
      if (opt_.dense_down_last)
        gated_mlp_down_on(gemm_tail_ ? *gemm_tail_ : *gemm_side_, side_, T, L.dense_down, cfg_.intermediate_size,
                          s_.m1);
      CUDA_CHECK(cudaEventRecord(join_, side_));
      CUDA_CHECK(cudaStreamWaitEvent(stream_, join_));
      if (padded && opt_.overflow_stream) CUDA_CHECK(cudaStreamWaitEvent(stream_, overflowed_));
    }
    // The combine also writes the next layer's input norm to x; after a decoder pass's last layer, the final norm
    // the lm_head reads (an encoder pass has no lm_head).
    const bool last = l + 1 == cfg_.num_layers;
    const float* next_norm = !last ? layers_[size_t(l) + 1].input_norm
                             : pass == Pass::Decoder ? weights_->final_norm_ : nullptr;
    cuda::moe_combine_ffn(y, s_.idx, s_.wk, s_.sorted_pos, T, K, s_.h, s_.m1, H, L.post_ff1, L.post_ff2,
                          L.post_ff, eps, pass == Pass::Encoder ? L.enc_scalar : L.dec_scalar, stream_, next_norm,
                          next_norm ? s_.x : nullptr, pass == Pass::Decoder && (opt_.expert_rows_l2 & 4) != 0);
    mark(kStCombine);
  }

  // CudaOptions::dense_tma: which denoise GEMMs run on dense_tma_splitk, with how many splits. A GEMM qualifies when
  // its grid (N / 128 weight tiles x splits) fills one wave with at least two splits; fewer blocks than SMs would
  // leave the tensor cores of the rest idle, and cuBLASLt is as fast there.
  void plan_dense_tma() {
    const int H = cfg_.hidden_size, T = cfg_.canvas_length, cl = opt_.dense_tma_cluster;
    for (DevLayer& L : layers_) {
      L.qkv_splits = L.o_splits = 0;
      if (!opt_.dense_tma) continue;
      const int nhD = cfg_.num_heads * L.shape.head_dim;
      auto splits = [&](int N, int K) {
        if (!cuda::dense_tma_supported(T, N, K)) return 0;
        const int s = cuda::dense_tma_splits(N, K, cl);
        return s >= 2 ? s : 0;
      };
      L.qkv_splits = splits(L.nqkv, H);
      L.o_splits = splits(H, nhD);
    }
  }

  // KV regions and scratch (the weights are CudaWeights').
  void layout(Arena& ar) {
    const size_t H = size_t(cfg_.hidden_size), V = size_t(cfg_.vocab_size), Id = size_t(cfg_.intermediate_size);
    const size_t Ie = size_t(cfg_.moe_intermediate_size), E = size_t(cfg_.num_experts), nh = size_t(cfg_.num_heads);
    const size_t K = size_t(cfg_.top_k_experts), Tm = size_t(tm_), Lc = size_t(cfg_.canvas_length);
    size_t max_qkv = 0, max_q = 0, max_kv = 0;
    for (DevLayer& L : layers_) {
      const size_t D = size_t(L.shape.head_dim), nkv = size_t(L.shape.n_kv_heads);
      max_qkv = std::max(max_qkv, size_t(L.nqkv));
      max_q = std::max(max_q, nh * D);
      max_kv = std::max(max_kv, nkv * D);
      L.cap = L.shape.kind == LayerKind::Sliding
                  ? std::min<int64_t>(opt_.max_context, cfg_.sliding_window - 1 + opt_.sliding_rewind)
                  : opt_.max_context;
      L.cap = std::max<int64_t>(L.cap, 1);
      L.kc = ar.take<bf16>(kv_rows(L) * nkv * D);
      L.vc = ar.take<bf16>(kv_rows(L) * nkv * D);
      L.attn_ptrs = uses_gemm_attention(L) ? ar.take<void*>(cuda::gemm_attention_pointer_count(int(nh))) : nullptr;
    }
    s_.attn_S = gemm_attention_ ? ar.take<float>(nh * Lc * size_t(attn_ld_)) : nullptr;
    s_.attn_P = gemm_attention_ ? ar.take<bf16>(nh * Lc * size_t(attn_ld_)) : nullptr;
    s_.ids = ar.take<int32_t>(Tm);
    s_.h = ar.take<float>(Tm * H);
    s_.xr = ar.take<float>(Tm * H);
    s_.rl = ar.take<float>(Tm * E);
    s_.router_partial = ar.take<float>(cuda::router_partial_floats(int(Lc), int(H)));
    size_t dense_part = 0;
    for (const DevLayer& L : layers_)
      dense_part = std::max({dense_part, size_t(L.qkv_splits) * size_t(L.nqkv), size_t(L.o_splits) * H});
    s_.dense_part = dense_part ? ar.take<float>(dense_part * Lc) : nullptr;
    s_.expert_masks = ar.take<unsigned>(cuda::expert_mask_words(int(Lc), int(E)));
    s_.expert_tile_counters = ar.take<unsigned>(2 + E);  // + the fused experts' per-expert counts
    s_.prefill_item_counters = ar.take<unsigned>(2);
    s_.wk = ar.take<float>(Tm * K);
    // expert rows: T k grouped, or E M padded + Lc k overflow for canvas-sized passes (moe_group_padded)
    const size_t pad_rows = E * size_t(padded_rows_capacity()) + Lc * K;
    const size_t exp_rows = std::max(Tm * K, pad_rows);
    s_.y = ar.take<float>(exp_rows * H);
    // Not in y's bytes: a bf16 y's overflow rows (past E M) would then overlap it when H < 4 Ie.
    s_.gu32 = ar.take<float>(pad_rows * 2 * Ie);
    s_.sig = ar.take<float>(Lc * H);
    s_.logits = ar.take<float>(Lc * V);
    s_.logits16 = opt_.bf16_logits ? ar.take<bf16>(Lc * V) : nullptr;
    for (bf16** p : {&s_.x, &s_.x1, &s_.xe, &s_.a, &s_.m1}) *p = ar.take<bf16>(Tm * H);
    s_.qkv = ar.take<bf16>(Tm * max_qkv);
    s_.q = ar.take<bf16>(Tm * max_q);
    s_.att = ar.take<bf16>(Tm * max_q);
    s_.kn = ar.take<bf16>(Tm * max_kv);
    s_.vn = ar.take<bf16>(Tm * max_kv);
    s_.gu = ar.take<bf16>(Tm * 2 * Id);
    s_.actd = ar.take<bf16>(Tm * Id);
    s_.xs = ar.take<bf16>(exp_rows * H);
    s_.acte = ar.take<bf16>(exp_rows * Ie);
    s_.probs = ar.take<bf16>(Lc * V);
    s_.idx = ar.take<int32_t>(Tm * K);
    s_.sorted_pos = ar.take<int32_t>(Tm * K);
    s_.offsets = ar.take<int32_t>(E + 1);
    s_.moe_meta = ar.take<int32_t>(2 * E + 1);
    s_.slot_token = ar.take<int32_t>(E * size_t(padded_rows_capacity()));
    s_.stats = ar.take<cuda::DeviceRowStats>(Lc);
    s_.row_stats_scratch = ar.take<char>(cuda::softcap_row_stats_scratch_bytes(int(Lc), int(V)));
    s_.probs_scale = ar.take<float>(Lc);
    s_.temperature = ar.take<float>(1);
    if (opt_.sc_sparse) {
      const size_t tiles = size_t(cuda::sc_tiles(int(V))), slots = Lc * tiles * cuda::kScTileSlots;
      s_.sc.ids = ar.take<int32_t>(slots);
      s_.sc.p = ar.take<float>(slots);
      s_.sc.counts = ar.take<int32_t>(Lc * tiles);
      s_.sc.tail = ar.take<double>(Lc * tiles);
    }
  }

  std::shared_ptr<const CudaWeights> weights_;
  ModelConfig cfg_;
  CudaOptions opt_;
  cudaStream_t stream_ = nullptr;
  cudaStream_t side_ = nullptr;  // the dense MLP's branch of a layer (layer())
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  cudaEvent_t grouped_ = nullptr;  // main -> side: the expert rows are grouped (the overflow kernels may start)
  cudaStream_t overflow_ = nullptr;  // the overflow rows' branch (CudaOptions::overflow_stream)
  cudaEvent_t assigned_ = nullptr, overflowed_ = nullptr;  // side -> overflow_, overflow_ -> main
  int tm_ = 0;
  Arena arena_;
  std::unique_ptr<cuda::Gemm> gemm_, gemm_side_, gemm_tail_;
  std::vector<DevLayer> layers_;  // CudaWeights' pointers + this backend's KV regions
  Scratch s_{};
  bool gemm_attention_ = false;  // CudaOptions::gemm_attention
  int attn_ld_ = 0;              // the GEMM attention's S / P row length: most keys it takes, rounded up
  // Padded rows an expert that the scratch holds room for: the canvas's (32) or, with two token tiles an expert, the
  // fused expert launch's (64).
  int padded_rows_capacity() const {
    const int canvas = cuda::moe_padded_rows_per_expert(int(cfg_.canvas_length), int(cfg_.top_k_experts),
                                                        int(cfg_.num_experts));
    return opt_.padded_experts && opt_.fused_experts &&
                   (opt_.expert_two_token_tiles || opt_.auto_two_token_tiles_heavy > 0)
               ? std::max(canvas, cuda::kFusedExpertRows)
               : canvas;
  }
  bool use_tma_experts_ = false;        // CudaOptions::tma_experts and experts_tma_supported at the canvas shape
  bool use_prefill_tma_ = false;        // CudaOptions::prefill_tma_experts and experts_prefill_supported
  cuda::TmaMap xs_map_{}, acte_map_{};  // over the padded rows of s_.xs / s_.acte (box M rows)
  int32_t* host_ids_ = nullptr;
  float* host_temperature_ = nullptr;  // mapped: the captured step's temperature (CudaOptions::device_temperature)
  float* mapped_temperature_ = nullptr;
  cudaEvent_t step_fork_ = nullptr, temperature_ready_ = nullptr;
  // CudaOptions::sc_head_ahead: recorded between a step's graph and the next step's SC GEMM queued behind it
  // (sc_head_pending_; sc_head_ is only re-captured once no head is pending, so its key gives the head's rows)
  cudaEvent_t step_done_ = nullptr;
  bool sc_head_pending_ = false;
  cuda::DeviceRowStats* host_stats_ = nullptr;
  int32_t* mapped_ids_ = nullptr;  // the device's addresses of the two pinned buffers above
  cuda::DeviceRowStats* mapped_stats_ = nullptr;
  int64_t kv_len_ = 0;
  int prev_rows_ = 0;
  bool prev_sc_sparse_ok_ = false;  // the previous step's survivors may serve this step's SC (sc_sparse)
  LayerTrace* trace_ = nullptr;
  bool timing_ = false;  // this denoise records CudaStageTimes marks
  std::vector<cudaEvent_t> events_;
  std::vector<int> mark_stage_;
  size_t n_marks_ = 0;
  cudaGraphExec_t graph_exec_ = nullptr;  // the decoder layers, see decoder_layers()
  static constexpr size_t kSelfConditionModes = 4;
  // a whole denoise step per (SelfCondition, token tiles of the fused expert launch), see launch_step_graph()
  std::array<StepGraph, 2 * kSelfConditionModes> step_graphs_;
  StepGraph sc_head_;  // CudaOptions::split_step_head: a PreviousStep step's SC GEMM (key: rows only)
  int graph_rows_ = -1;
  int64_t graph_kv_ = -1;
  bool graph_two_tiles_ = false;
  bool graph_timeline_ = false;  // captured with the expert tile timeline's kernels (cuda::experts_timeline_begin)
  // The fused expert launch's token tiles in the passes being enqueued (CudaOptions::expert_two_token_tiles, or per
  // step: choose_token_tiles), and what chooses them: each layer's count of experts past 32 rows (mapped).
  bool two_tiles_now_ = false;
  int prev_heavy_ = 0;
  int32_t* host_heavy_ = nullptr;
  int32_t* mapped_heavy_ = nullptr;
};

}  // namespace

std::shared_ptr<CudaWeights> upload_cuda_weights(const LoadedModel& model, const CudaOptions& options) {
  return std::make_shared<CudaWeights>(&model, model.config, 0, options);
}

std::shared_ptr<CudaWeights> synthetic_cuda_weights(const ModelConfig& config, uint64_t seed,
                                                    const CudaOptions& options) {
  return std::make_shared<CudaWeights>(nullptr, config, seed, options);
}

std::unique_ptr<Backend> make_cuda_backend(std::shared_ptr<const CudaWeights> weights, const CudaOptions& options) {
  if (!weights) fail("make_cuda_backend: no weights");
  return std::make_unique<CudaBackend>(std::move(weights), options);
}

std::unique_ptr<Backend> make_cuda_backend(const LoadedModel& model, const CudaOptions& options) {
  return make_cuda_backend(upload_cuda_weights(model, options), options);
}

std::unique_ptr<Backend> make_cuda_backend_synthetic(const ModelConfig& config, uint64_t seed,
                                                     const CudaOptions& options) {
  return make_cuda_backend(synthetic_cuda_weights(config, seed, options), options);
}

}  // namespace dg
