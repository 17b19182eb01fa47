// CPU backend: one layer body shared by the encoder (prefill/commit) and decoder (denoise) passes.
#include "backend/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/cpu_ops.h"
#include "util/error.h"

namespace dg {
namespace {

using cpu::WeightMatrix;

// Small per-layer vectors (norm weights, scalars) converted to f32 once at load.
struct LayerVectors {
  std::vector<float> q_norm, k_norm, input_norm, post_attn_norm, pre_ff_norm, post_ff_norm_1, pre_ff_norm_2,
      post_ff_norm_2, post_ff_norm, router_scale, per_expert_scale;
  float encoder_scalar = 1, decoder_scalar = 1;
};

struct LayerCache {
  std::vector<float> k, v;  // [n, nkv, D], every position from 0 (the CPU keeps it all; masks apply the window)
};

enum class Pass { Encoder, Decoder };

class CpuBackend final : public Backend {
 public:
  CpuBackend(const LoadedModel& model, int threads)
      : model_(model), cfg_(model.config), w_(model.weights), pool_(threads) {
    for (auto& lw : w_.layers) {
      LayerVectors v;
      v.q_norm = lw.q_norm->to_f32();
      v.k_norm = lw.k_norm->to_f32();
      v.input_norm = lw.input_norm->to_f32();
      v.post_attn_norm = lw.post_attn_norm->to_f32();
      v.pre_ff_norm = lw.pre_ff_norm->to_f32();
      v.post_ff_norm_1 = lw.post_ff_norm_1->to_f32();
      v.pre_ff_norm_2 = lw.pre_ff_norm_2->to_f32();
      v.post_ff_norm_2 = lw.post_ff_norm_2->to_f32();
      v.post_ff_norm = lw.post_ff_norm->to_f32();
      v.router_scale = lw.router_scale->to_f32();
      v.per_expert_scale = lw.per_expert_scale->to_f32();
      v.encoder_scalar = lw.encoder_layer_scalar->to_f32()[0];
      v.decoder_scalar = lw.decoder_layer_scalar->to_f32()[0];
      vectors_.push_back(std::move(v));
    }
    final_norm_ = w_.final_norm->to_f32();
    sc_pre_norm_ = w_.sc_pre_norm->to_f32();
    cache_.resize(size_t(cfg_.num_layers));
  }

  std::string name() const override { return "cpu"; }
  const ModelConfig& config() const override { return cfg_; }
  int64_t kv_len() const override { return kv_len_; }
  bool can_truncate(int64_t n) const override { return n >= 0 && n <= kv_len_; }

  void truncate(int64_t n) override {
    if (!can_truncate(n)) fail("cannot truncate the KV cache to {} tokens: it holds {}", n, kv_len_);
    for (int l = 0; l < cfg_.num_layers; ++l) {
      size_t row = size_t(cfg_.layers[size_t(l)].n_kv_heads * cfg_.layers[size_t(l)].head_dim);
      cache_[size_t(l)].k.resize(size_t(n) * row);
      cache_[size_t(l)].v.resize(size_t(n) * row);
    }
    kv_len_ = n;
  }

  KvSnapshot kv_snapshot(int layer) const override {
    if (layer < 0 || layer >= cfg_.num_layers) fail("kv_snapshot: layer {} out of range [0, {})", layer, cfg_.num_layers);
    const LayerShape& ls = cfg_.layers[size_t(layer)];
    KvSnapshot s;
    s.n_kv_heads = ls.n_kv_heads;
    s.head_dim = ls.head_dim;
    s.first_pos = ls.kind == LayerKind::Sliding ? std::max<int64_t>(0, kv_len_ - (cfg_.sliding_window - 1)) : 0;
    s.n = kv_len_ - s.first_pos;
    size_t row = size_t(ls.n_kv_heads * ls.head_dim);
    auto& c = cache_[size_t(layer)];
    s.k.assign(c.k.begin() + ptrdiff_t(size_t(s.first_pos) * row), c.k.end());
    s.v.assign(c.v.begin() + ptrdiff_t(size_t(s.first_pos) * row), c.v.end());
    return s;
  }

  void prefill(std::span<const int32_t> ids) override {
    if (ids.empty()) return;
    const int64_t T = int64_t(ids.size());
    std::vector<int64_t> pos(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) pos[size_t(t)] = kv_len_ + t;
    std::vector<float> h = embed(ids);
    if (trace_) trace_->stages.clear(), trace_->router_logits.clear(), trace_->experts.clear();
    trace_stage(h);
    for (int l = 0; l < cfg_.num_layers; ++l) {
      layer(l, Pass::Encoder, h.data(), T, pos.data());
      trace_stage(h);
    }
    kv_len_ += T;  // the encoder's final norm output is unused for generation
  }

  void denoise(const DenoiseRequest& req, DenoiseResult& out) override {
    const int64_t L = int64_t(req.canvas.size()), H = cfg_.hidden_size, V = cfg_.vocab_size;
    if (L == 0) fail("denoise: empty canvas");
    if (L > cfg_.canvas_length) fail("denoise: canvas of {} tokens exceeds canvas_length {}", L, cfg_.canvas_length);
    if (!(req.temperature > 0)) fail("denoise: temperature must be > 0, got {}", req.temperature);
    std::vector<int64_t> pos(static_cast<size_t>(L));
    for (int64_t t = 0; t < L; ++t) pos[size_t(t)] = kv_len_ + t;
    std::vector<float> e = embed(req.canvas);

    // Self-conditioning before layer 0: x = RMSNorm_noscale(e + SC_MLP(RMSNorm_w(signal))).
    std::vector<float> signal;
    switch (req.self_condition) {
      case SelfCondition::None: break;
      case SelfCondition::CanvasEmbedding: signal = e; break;
      case SelfCondition::PreviousStep:
        if (prev_tempered_rows_ != L)
          fail("denoise: SelfCondition::PreviousStep needs a previous denoise of the same canvas length ({} vs {})",
               prev_tempered_rows_, L);
        signal = soft_embedding(prev_tempered_.data(), L);
        break;
      case SelfCondition::External:
        if (int64_t(req.sc_logits.size()) != L * V)
          fail("denoise: sc_logits has {} values, expected {} x {}", req.sc_logits.size(), L, V);
        signal = soft_embedding(req.sc_logits.data(), L);
        break;
    }
    if (!signal.empty()) {
      std::vector<float> s(size_t(L * H)), sc(size_t(L * H));
      cpu::rms_norm(signal.data(), L, H, sc_pre_norm_.data(), cfg_.rms_norm_eps, s.data());
      gated_mlp(s.data(), L, *w_.sc_gate, *w_.sc_up, *w_.sc_down, sc.data());
      for (size_t i = 0; i < e.size(); ++i) e[i] += sc[i];
    }
    cpu::rms_norm(e.data(), L, H, nullptr, cfg_.rms_norm_eps, e.data());
    if (trace_) trace_->stages.clear(), trace_->router_logits.clear(), trace_->experts.clear();
    trace_stage(e);

    for (int l = 0; l < cfg_.num_layers; ++l) {
      layer(l, Pass::Decoder, e.data(), L, pos.data());
      trace_stage(e);
    }

    cpu::rms_norm(e.data(), L, H, final_norm_.data(), cfg_.rms_norm_eps, e.data());
    trace_stage(e);
    std::vector<float> logits(size_t(L * V));
    cpu::matmul_wt(pool_, e.data(), L, WeightMatrix::of(*w_.embed), logits.data());
    out.rows.resize(size_t(L));
    prev_tempered_.resize(logits.size());
    pool_.parallel_for(size_t(L), [&](size_t r0, size_t r1) {
      for (size_t r = r0; r < r1; ++r) {
        float* row = logits.data() + r * size_t(V);
        cpu::softcap(row, V, cfg_.final_logit_softcapping);
        out.rows[r] = compute_row_stats(row, int(V), req.temperature);
        float* tempered = prev_tempered_.data() + r * size_t(V);
        for (int64_t i = 0; i < V; ++i) tempered[i] = row[i] / req.temperature;
      }
    });
    prev_tempered_rows_ = L;
    if (req.want_logits)
      out.logits = std::move(logits);
    else
      out.logits.clear();
  }

  void set_layer_trace(LayerTrace* trace) override { trace_ = trace; }

 private:
  // Records the residual as the next stage and, when replaying, continues from the other backend's value instead.
  void trace_stage(std::vector<float>& h) {
    if (!trace_) return;
    const size_t s = trace_->stages.size();
    trace_->stages.push_back(h);
    if (trace_->replay && s < trace_->replay->size() && (*trace_->replay)[s].size() == h.size())
      h = (*trace_->replay)[s];
  }

  std::vector<float> embed(std::span<const int32_t> ids) const {
    const int64_t H = cfg_.hidden_size;
    // HF multiplies by sqrt(H) cast to the weight dtype of the running model; the CPU engine computes in f32.
    const float scale = std::sqrt(float(H));
    WeightMatrix E = WeightMatrix::of(*w_.embed);
    std::vector<float> h(ids.size() * size_t(H));
    for (size_t t = 0; t < ids.size(); ++t) {
      if (ids[t] < 0 || ids[t] >= cfg_.vocab_size)
        fail("token id {} at position {} is outside the vocabulary [0, {})", ids[t], t, cfg_.vocab_size);
      E.row_to_f32(ids[t], h.data() + t * size_t(H));
      for (int64_t i = 0; i < H; ++i) h[t * size_t(H) + size_t(i)] *= scale;
    }
    return h;
  }

  // softmax(tempered logits) @ E * sqrt(H): the SC signal.
  std::vector<float> soft_embedding(const float* tempered, int64_t L) {
    const int64_t V = cfg_.vocab_size, H = cfg_.hidden_size;
    std::vector<float> probs(size_t(L * V));
    pool_.parallel_for(size_t(L), [&](size_t r0, size_t r1) {
      for (size_t r = r0; r < r1; ++r) {
        const float* z = tempered + r * size_t(V);
        float* p = probs.data() + r * size_t(V);
        float mx = *std::max_element(z, z + V);
        double sum = 0;
        for (int64_t i = 0; i < V; ++i) sum += p[i] = std::exp(z[i] - mx);
        float inv = float(1.0 / sum);
        for (int64_t i = 0; i < V; ++i) p[i] *= inv;
      }
    });
    std::vector<float> sig(size_t(L * H));
    cpu::matmul_w(pool_, probs.data(), L, WeightMatrix::of(*w_.embed), sig.data());
    const float scale = std::sqrt(float(H));
    for (auto& x : sig) x *= scale;
    return sig;
  }

  // down(gelu_tanh(gate x) * up x)
  void gated_mlp_mats(const float* x, int64_t T, const WeightMatrix& gate, const WeightMatrix& up,
                      const WeightMatrix& down, float* y) {
    const int64_t I = gate.rows;
    std::vector<float> g(size_t(T * I)), u(size_t(T * I));
    cpu::matmul_wt(pool_, x, T, gate, g.data());
    cpu::matmul_wt(pool_, x, T, up, u.data());
    for (size_t i = 0; i < g.size(); ++i) g[i] = cpu::gelu_tanh(g[i]) * u[i];
    cpu::matmul_wt(pool_, g.data(), T, down, y);
  }
  void gated_mlp(const float* x, int64_t T, const TensorView& gate, const TensorView& up, const TensorView& down,
                 float* y) {
    gated_mlp_mats(x, T, WeightMatrix::of(gate), WeightMatrix::of(up), WeightMatrix::of(down), y);
  }

  void attention_block(int l, Pass pass, const float* x, int64_t T, const int64_t* pos, float* out) {
    const LayerShape& ls = cfg_.layers[size_t(l)];
    const LayerWeights& lw = w_.layers[size_t(l)];
    const LayerVectors& lv = vectors_[size_t(l)];
    const int nh = cfg_.num_heads, nkv = ls.n_kv_heads, D = ls.head_dim;
    const float eps = cfg_.rms_norm_eps;
    std::vector<float> q(size_t(T * nh * D)), k(size_t(T * nkv * D)), v(size_t(T * nkv * D));
    cpu::matmul_wt(pool_, x, T, WeightMatrix::of(*lw.q_proj), q.data());
    cpu::matmul_wt(pool_, x, T, WeightMatrix::of(*lw.k_proj), k.data());
    if (lw.v_proj)
      cpu::matmul_wt(pool_, x, T, WeightMatrix::of(*lw.v_proj), v.data());
    else
      v = k;  // full layers: V is the raw k_proj output (before k_norm and RoPE)
    cpu::rms_norm(q.data(), T * nh, D, lv.q_norm.data(), eps, q.data());
    cpu::rms_norm(k.data(), T * nkv, D, lv.k_norm.data(), eps, k.data());
    cpu::rms_norm(v.data(), T * nkv, D, nullptr, eps, v.data());
    cpu::rope(q.data(), T, nh, D, pos, ls.rope);
    cpu::rope(k.data(), T, nkv, D, pos, ls.rope);

    LayerCache& c = cache_[size_t(l)];
    const size_t row = size_t(nkv * D);
    const int64_t n_cached = kv_len_;
    std::vector<float> attn(size_t(T * nh * D));
    cpu::AttentionMask mask;
    if (pass == Pass::Encoder) {
      c.k.insert(c.k.end(), k.begin(), k.end());
      c.v.insert(c.v.end(), v.begin(), v.end());
      int64_t first = 0;
      mask.kind = cpu::AttentionMask::Causal;
      if (ls.kind == LayerKind::Sliding) {
        mask.window = cfg_.sliding_window;
        first = std::max<int64_t>(0, pos[0] - (cfg_.sliding_window - 1));
      }
      mask.q_pos = pos;
      mask.k_pos0 = first;
      cpu::attention(pool_, q.data(), T, nh, c.k.data() + size_t(first) * row, c.v.data() + size_t(first) * row,
                     n_cached + T - first, nkv, D, mask, attn.data());
    } else {
      int64_t first = ls.kind == LayerKind::Sliding ? std::max<int64_t>(0, n_cached - (cfg_.sliding_window - 1)) : 0;
      int64_t nk = n_cached - first + T;
      std::vector<float> K(size_t(nk) * row), Vv(size_t(nk) * row);
      std::copy(c.k.begin() + ptrdiff_t(size_t(first) * row), c.k.end(), K.begin());
      std::copy(c.v.begin() + ptrdiff_t(size_t(first) * row), c.v.end(), Vv.begin());
      std::copy(k.begin(), k.end(), K.begin() + ptrdiff_t(size_t(n_cached - first) * row));
      std::copy(v.begin(), v.end(), Vv.begin() + ptrdiff_t(size_t(n_cached - first) * row));
      mask.kind = cpu::AttentionMask::Bidirectional;
      cpu::attention(pool_, q.data(), T, nh, K.data(), Vv.data(), nk, nkv, D, mask, attn.data());
    }
    cpu::matmul_wt(pool_, attn.data(), T, WeightMatrix::of(*lw.o_proj), out);
  }

  void moe_block(int l, const float* h, int64_t T, float* out) {
    const LayerWeights& lw = w_.layers[size_t(l)];
    const LayerVectors& lv = vectors_[size_t(l)];
    const int64_t H = cfg_.hidden_size;
    const int E = cfg_.num_experts, K = cfg_.top_k_experts;
    const float eps = cfg_.rms_norm_eps;
    // The router reads the un-normed residual: RMSNorm_noscale(h) * router.scale * H^-0.5.
    std::vector<float> xr(size_t(T * H)), rl(size_t(T * E));
    cpu::rms_norm(h, T, H, nullptr, eps, xr.data());
    const float inv_sqrt_h = 1.0f / std::sqrt(float(H));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < H; ++i) xr[size_t(t * H + i)] = xr[size_t(t * H + i)] * lv.router_scale[size_t(i)] * inv_sqrt_h;
    cpu::matmul_wt(pool_, xr.data(), T, WeightMatrix::of(*lw.router_proj), rl.data());
    std::vector<int32_t> idx(size_t(T * K));
    std::vector<float> wt(size_t(T * K));
    for (int64_t t = 0; t < T; ++t)
      cpu::route_top_k(rl.data() + t * E, E, K, lv.per_expert_scale.data(), idx.data() + t * K, wt.data() + t * K);
    if (trace_) {
      trace_->router_logits.push_back(rl);
      trace_->experts.push_back(idx);
    }

    std::vector<float> xe(size_t(T * H));
    cpu::rms_norm(h, T, H, lv.pre_ff_norm_2.data(), eps, xe.data());
    // Group tokens by expert; expert outputs land in slot (t, j) and are summed per token in ascending expert id
    // order afterwards (HF's index_add_ order), independent of how the work was split.
    std::vector<float> slots(size_t(T * K * H));
    std::vector<std::vector<int64_t>> members(static_cast<size_t>(E));  // entries t*K + j
    for (int64_t t = 0; t < T; ++t)
      for (int j = 0; j < K; ++j) members[size_t(idx[size_t(t * K + j)])].push_back(t * K + j);
    std::vector<float> xin, y;
    for (int e = 0; e < E; ++e) {
      auto& m = members[size_t(e)];
      if (m.empty()) continue;
      const int64_t n = int64_t(m.size());
      xin.resize(size_t(n * H));
      y.resize(size_t(n * H));
      for (int64_t r = 0; r < n; ++r) std::copy_n(xe.data() + (m[size_t(r)] / K) * H, H, xin.data() + r * H);
      WeightMatrix gu = WeightMatrix::expert(*lw.experts_gate_up, e), dn = WeightMatrix::expert(*lw.experts_down, e);
      const int64_t I = cfg_.moe_intermediate_size;
      std::vector<float> g(size_t(n * 2 * I)), act(size_t(n * I));
      cpu::matmul_wt(pool_, xin.data(), n, gu, g.data());
      for (int64_t r = 0; r < n; ++r)
        for (int64_t i = 0; i < I; ++i)
          act[size_t(r * I + i)] = cpu::gelu_tanh(g[size_t(r * 2 * I + i)]) * g[size_t(r * 2 * I + I + i)];
      cpu::matmul_wt(pool_, act.data(), n, dn, y.data());
      for (int64_t r = 0; r < n; ++r) std::copy_n(y.data() + r * H, H, slots.data() + m[size_t(r)] * H);
    }
    std::fill(out, out + T * H, 0.0f);
    std::vector<int> order(static_cast<size_t>(K));
    for (int64_t t = 0; t < T; ++t) {
      for (int j = 0; j < K; ++j) order[size_t(j)] = j;
      std::sort(order.begin(), order.end(),
                [&](int a, int b) { return idx[size_t(t * K + a)] < idx[size_t(t * K + b)]; });
      for (int j : order) {
        const float w = wt[size_t(t * K + j)];
        const float* s = slots.data() + (t * K + j) * H;
        for (int64_t i = 0; i < H; ++i) out[t * H + i] += w * s[i];
      }
    }
  }

  // The layer body shared by both passes (model-reference §3.2).
  void layer(int l, Pass pass, float* h, int64_t T, const int64_t* pos) {
    const LayerWeights& lw = w_.layers[size_t(l)];
    const LayerVectors& lv = vectors_[size_t(l)];
    const int64_t H = cfg_.hidden_size, N = T * H;
    const float eps = cfg_.rms_norm_eps;
    std::vector<float> x(static_cast<size_t>(N)), a(static_cast<size_t>(N));
    cpu::rms_norm(h, T, H, lv.input_norm.data(), eps, x.data());
    attention_block(l, pass, x.data(), T, pos, a.data());
    cpu::rms_norm(a.data(), T, H, lv.post_attn_norm.data(), eps, a.data());
    for (int64_t i = 0; i < N; ++i) h[i] += a[size_t(i)];

    std::vector<float> m1(static_cast<size_t>(N)), m2(static_cast<size_t>(N));
    cpu::rms_norm(h, T, H, lv.pre_ff_norm.data(), eps, x.data());
    gated_mlp(x.data(), T, *lw.mlp_gate, *lw.mlp_up, *lw.mlp_down, m1.data());
    cpu::rms_norm(m1.data(), T, H, lv.post_ff_norm_1.data(), eps, m1.data());
    moe_block(l, h, T, m2.data());
    cpu::rms_norm(m2.data(), T, H, lv.post_ff_norm_2.data(), eps, m2.data());
    for (int64_t i = 0; i < N; ++i) m1[size_t(i)] += m2[size_t(i)];
    cpu::rms_norm(m1.data(), T, H, lv.post_ff_norm.data(), eps, m1.data());
    const float scalar = pass == Pass::Encoder ? lv.encoder_scalar : lv.decoder_scalar;
    for (int64_t i = 0; i < N; ++i) h[i] = (h[i] + m1[size_t(i)]) * scalar;  // scales the whole residual stream
  }

  const LoadedModel& model_;
  const ModelConfig& cfg_;
  const ModelWeights& w_;
  ThreadPool pool_;
  std::vector<LayerVectors> vectors_;
  std::vector<float> final_norm_, sc_pre_norm_;
  std::vector<LayerCache> cache_;
  int64_t kv_len_ = 0;
  std::vector<float> prev_tempered_;
  int64_t prev_tempered_rows_ = 0;
  LayerTrace* trace_ = nullptr;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const LoadedModel& model, int threads) {
  return std::make_unique<CpuBackend>(model, threads);
}

}  // namespace dg
