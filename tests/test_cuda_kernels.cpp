// Each CUDA kernel against its CPU oracle (backend/cpu/cpu_ops, dg::compute_row_stats) on random inputs of awkward
// sizes. Skips with the device-query reason when no GPU is usable.
#ifdef DIFFGEMMA_WITH_CUDA
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>

#include "backend/backend.h"
#include "backend/cpu/cpu_ops.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_device.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/expert_items.h"
#include "backend/cuda/expert_layout.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/pdl.h"
#include "util/dtype.h"

namespace dg::cuda {
namespace {

#define REQUIRE_GPU()                                                     \
  do {                                                                    \
    static const DeviceInfo info_ = query_device(0);                      \
    if (!info_.available) GTEST_SKIP() << "no GPU: " << info_.reason;     \
  } while (0)

template <class T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count) : n(count) {
    CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
    CUDA_CHECK(cudaMemset(p, 0xff, std::max<size_t>(n, 1) * sizeof(T)));  // poison: unwritten outputs show as NaN
  }
  ~Dev() { cudaFree(p); }
  void put(const std::vector<T>& v) { CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice)); }
  std::vector<T> get() const {
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<T> v(n);
    CUDA_CHECK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
};

std::mt19937 rng(1234);
std::vector<float> rnd(size_t n, float lo = -1, float hi = 1) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}
// Rounds to bf16 in place (so the oracle sees exactly the device's inputs) and returns the bf16 bits.
std::vector<bf16> to_bf16(std::vector<float>& v) {
  std::vector<bf16> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t h = f32_to_bf16(v[i]);
    v[i] = bf16_to_f32(h);
    std::memcpy(static_cast<void*>(&b[i]), &h, 2);
  }
  return b;
}
std::vector<float> from_bf16(const std::vector<bf16>& b) {
  std::vector<float> v(b.size());
  for (size_t i = 0; i < b.size(); ++i) {
    uint16_t h;
    std::memcpy(&h, &b[i], 2);
    v[i] = bf16_to_f32(h);
  }
  return v;
}
// max|got - want| / max|want|; NaN never passes.
double rel_err(const std::vector<float>& got, const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size());
  double md = 0, mr = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    md = std::max(md, double(std::fabs(got[i] - want[i])));
    mr = std::max(mr, double(std::fabs(want[i])));
  }
  return md / std::max(mr, 1e-30);
}

// A bf16 ExpertRows output against the f32 output of the same kernel and inputs: every written element its bf16
// rounding (to nearest even), every unwritten one (NaN poison in both buffers) left as the poison.
void expect_bf16_rounding(const std::vector<float>& f, const std::vector<bf16>& b, const std::string& what) {
  ASSERT_EQ(f.size(), b.size()) << what;
  size_t bad = 0, written = 0;
  for (size_t i = 0; i < f.size(); ++i) {
    uint16_t got;
    std::memcpy(&got, &b[i], 2);
    written += !std::isnan(f[i]);
    bad += got != (std::isnan(f[i]) ? uint16_t(0xFFFF) : f32_to_bf16(f[i]));
  }
  EXPECT_EQ(bad, 0u) << what;
  EXPECT_GT(written, 0u) << what;
}

// The vector path (H % 8 == 0) and the scalar one (H 70).
TEST(CudaKernels, EmbedScale) {
  REQUIRE_GPU();
  for (const int H : {72, 70, 2816}) {
    const int V = 37, T = 13;
    auto E = rnd(size_t(V) * H);
    Dev<bf16> dE(E.size());
    dE.put(to_bf16(E));
    std::vector<int32_t> ids(T);
    for (auto& i : ids) i = int32_t(rng() % V);
    Dev<int32_t> dids(T);
    dids.put(ids);
    Dev<float> out(size_t(T) * H);
    embed_scale(dids.p, T, dE.p, H, 3.5f, out.p, nullptr);
    std::vector<float> want(out.n);
    for (int t = 0; t < T; ++t)
      for (int i = 0; i < H; ++i) want[size_t(t) * H + i] = E[size_t(ids[t]) * H + i] * 3.5f;
    EXPECT_LE(rel_err(out.get(), want), 1e-7) << "H " << H;
  }
}

// copy_words into mapped pinned host memory (the whole-step graph's statistics) and device to device, at sizes that
// leave partial blocks and one that needs the grid-stride loop (more than 1024 blocks of 256 words).
TEST(CudaKernels, CopyWords) {
  REQUIRE_GPU();
  for (const size_t n : {size_t(1), size_t(7), size_t(2048) + 3, size_t(1024) * 256 * 2 + 77}) {
    std::vector<float> src = rnd(n);
    Dev<float> dsrc(n), ddst(n);
    dsrc.put(src);
    copy_words(dsrc.p, n, ddst.p, nullptr);
    EXPECT_EQ(0, std::memcmp(ddst.get().data(), src.data(), n * 4)) << n;
    float* host = nullptr;
    ASSERT_EQ(cudaSuccess, cudaHostAlloc(reinterpret_cast<void**>(&host), n * 4, cudaHostAllocMapped));
    std::fill(host, host + n, -1.0f);
    float* mapped = nullptr;
    ASSERT_EQ(cudaSuccess, cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped), host, 0));
    copy_words(dsrc.p, n, mapped, nullptr);
    ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
    EXPECT_EQ(0, std::memcmp(host, src.data(), n * 4)) << n;
    cudaFreeHost(host);
  }
}

// memset_nodes_as_kernels against the memset nodes it replaces: 1-, 2- and 4-byte elements, pitched rows and
// uneven widths, each followed by a copy that must see its stores (the edges moved with it); bytes between the rows
// keep their old value.
TEST(CudaKernels, MemsetNodesAsKernels) {
  REQUIRE_GPU();
  struct Case {
    unsigned elem, value;
    size_t width, height, pitch;
  };
  const Case cases[] = {{4, 0x0u, 1, 1, 4},          {4, 0xdeadbeefu, 37, 3, 200}, {2, 0xabcdu, 1001, 1, 2002},
                        {1, 0x5au, 4099, 2, 4200}, {4, 0x12345678u, 70000, 1, 280000}};
  for (const Case& c : cases) {
    const size_t bytes = (c.pitch * c.height + 3) / 4 * 4;  // whole words for the copy after it
    std::vector<unsigned char> init(bytes);
    for (size_t i = 0; i < bytes; ++i) init[i] = static_cast<unsigned char>(i * 131 + 7);
    std::vector<unsigned char> want = init;
    for (size_t r = 0; r < c.height; ++r)
      for (size_t x = 0; x < c.width; ++x)
        for (unsigned b = 0; b < c.elem; ++b) want[r * c.pitch + x * c.elem + b] = (c.value >> (8 * b)) & 0xff;
    Dev<unsigned char> buf(bytes), copy(bytes);
    for (const bool rewrite : {false, true}) {
      buf.put(init);
      cudaGraph_t g = nullptr;
      ASSERT_EQ(cudaSuccess, cudaGraphCreate(&g, 0));
      cudaMemsetParams mp{};
      mp.dst = buf.p, mp.pitch = c.pitch, mp.value = c.value, mp.elementSize = c.elem, mp.width = c.width;
      mp.height = c.height;
      cudaGraphNode_t ms = nullptr;
      ASSERT_EQ(cudaSuccess, cudaGraphAddMemsetNode(&ms, g, nullptr, 0, &mp));
      // A copy after it, as a captured kernel would be: a child graph of one copy_words launch.
      cudaStream_t st = nullptr;
      ASSERT_EQ(cudaSuccess, cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
      cudaGraph_t child = nullptr;
      ASSERT_EQ(cudaSuccess, cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed));
      copy_words(buf.p, bytes / 4, copy.p, st);
      ASSERT_EQ(cudaSuccess, cudaStreamEndCapture(st, &child));
      cudaGraphNode_t cn = nullptr;
      ASSERT_EQ(cudaSuccess, cudaGraphAddChildGraphNode(&cn, g, &ms, 1, child));
      if (rewrite) {
        EXPECT_EQ(1, memset_nodes_as_kernels(g));
        size_t n = 0;
        ASSERT_EQ(cudaSuccess, cudaGraphGetNodes(g, nullptr, &n));
        std::vector<cudaGraphNode_t> nodes(n);
        ASSERT_EQ(cudaSuccess, cudaGraphGetNodes(g, nodes.data(), &n));
        for (cudaGraphNode_t nd : nodes) {
          cudaGraphNodeType t{};
          ASSERT_EQ(cudaSuccess, cudaGraphNodeGetType(nd, &t));
          EXPECT_NE(cudaGraphNodeTypeMemset, t);
        }
        size_t deps = 0;
        ASSERT_EQ(cudaSuccess, cudaGraphNodeGetDependencies(cn, nullptr, nullptr, &deps));
        EXPECT_EQ(1u, deps);  // the copy still waits for the stores
      }
      cudaGraphExec_t ex = nullptr;
      ASSERT_EQ(cudaSuccess, cudaGraphInstantiate(&ex, g, 0));
      ASSERT_EQ(cudaSuccess, cudaGraphLaunch(ex, st));
      ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(st));
      EXPECT_EQ(want, buf.get()) << "elem " << c.elem << " width " << c.width << " rewrite " << rewrite;
      EXPECT_EQ(want, copy.get()) << "the copy after it, rewrite " << rewrite;
      cudaGraphExecDestroy(ex);
      cudaGraphDestroy(child);
      cudaGraphDestroy(g);
      cudaStreamDestroy(st);
    }
  }
}

// n = 203: the scalar kernels; 1000 and 2816 (the model's H): the 16-byte vector paths (NV 1 and 3).
TEST(CudaKernels, RmsNormVariants) {
  REQUIRE_GPU();
  for (const int n : {203, 1000, 2816}) {
    const int rows = 7;
    const float eps = 1e-6f;
    auto x = rnd(size_t(rows) * n, -3, 3), w = rnd(n, 0.5f, 1.5f);
    Dev<float> dx(x.size()), dw(n), y32(x.size());
    Dev<bf16> y16(x.size());
    dx.put(x);
    dw.put(w);
    std::vector<float> want(x.size()), want_ns(x.size());
    cpu::rms_norm(x.data(), rows, n, w.data(), eps, want.data());
    cpu::rms_norm(x.data(), rows, n, nullptr, eps, want_ns.data());
    rms_norm_f32_to_bf16(dx.p, rows, n, dw.p, eps, y16.p, nullptr);
    EXPECT_LE(rel_err(from_bf16(y16.get()), want), 8e-3);
    rms_norm_f32_to_f32(dx.p, rows, n, nullptr, eps, y32.p, nullptr);
    EXPECT_LE(rel_err(y32.get(), want_ns), 1e-5);

    // h += rms(a; w)
    auto a = rnd(x.size(), -2, 2);
    Dev<bf16> da(a.size());
    da.put(to_bf16(a));
    std::vector<float> an(a.size()), h = x;
    cpu::rms_norm(a.data(), rows, n, w.data(), eps, an.data());
    for (size_t i = 0; i < h.size(); ++i) h[i] += an[i];
    add_rms_norm(dx.p, da.p, rows, n, dw.p, eps, nullptr);
    EXPECT_LE(rel_err(dx.get(), h), 1e-5) << "n " << n;

    // the SC prologue's fused pairs, bitwise against the two launches they replace (and the first against the CPU)
    auto rs = rnd(rows, 0.01f, 5.0f);
    Dev<float> drs(rows), ds(x.size()), dh2(x.size());
    drs.put(rs);
    for (bool per_row : {true, false}) {
      const float scale = 53.0f;
      dx.put(x);
      scaled_rms_norm_f32_to_bf16(dx.p, rows, n, per_row ? drs.p : nullptr, scale, dw.p, eps, y16.p, nullptr);
      const auto fused = y16.get();
      ds.put(x);
      if (per_row)
        scale_rows_f32(ds.p, rows, n, drs.p, scale, ds.p, nullptr);
      else
        scale_f32(ds.p, x.size(), scale, ds.p, nullptr);
      rms_norm_f32_to_bf16(ds.p, rows, n, dw.p, eps, y16.p, nullptr);
      EXPECT_EQ(std::memcmp(fused.data(), y16.get().data(), fused.size() * 2), 0) << "n " << n << " per_row " << per_row;
      std::vector<float> xs = x, want_s(x.size());
      for (int r = 0; r < rows; ++r)
        for (int i = 0; i < n; ++i) xs[size_t(r) * n + i] *= (per_row ? rs[size_t(r)] : 1.0f) * scale;
      cpu::rms_norm(xs.data(), rows, n, w.data(), eps, want_s.data());
      EXPECT_LE(rel_err(from_bf16(fused), want_s), 8e-3);
    }
    for (const float* wn : {static_cast<const float*>(nullptr), static_cast<const float*>(dw.p)}) {
      dx.put(x), dh2.put(x);
      add_then_rms_norm(dx.p, da.p, rows, n, wn, eps, nullptr);
      add_bf16_to_f32(dh2.p, da.p, x.size(), nullptr);
      rms_norm_f32_to_f32(dh2.p, rows, n, wn, eps, dh2.p, nullptr);
      EXPECT_EQ(std::memcmp(dx.get().data(), dh2.get().data(), x.size() * 4), 0) << "n " << n;
      std::vector<float> hs(x.size()), want_h(x.size());
      const auto ab = from_bf16(to_bf16(a));
      for (size_t i = 0; i < hs.size(); ++i) hs[i] = x[i] + ab[i];
      cpu::rms_norm(hs.data(), rows, n, wn ? w.data() : nullptr, eps, want_h.data());
      EXPECT_LE(rel_err(dx.get(), want_h), 1e-5) << "n " << n;
      // with the next norm's output as well (the SC prologue into the first layer's input norm): the same bits as
      // rms_norm_f32_to_bf16 of the h just written
      auto w2 = rnd(n, 0.5f, 1.5f);
      Dev<float> dw2(n);
      Dev<bf16> y2(x.size());
      dw2.put(w2);
      dx.put(x);
      add_then_rms_norm(dx.p, da.p, rows, n, wn, eps, nullptr, dw2.p, y2.p);
      EXPECT_EQ(std::memcmp(dx.get().data(), dh2.get().data(), x.size() * 4), 0) << "n " << n;
      rms_norm_f32_to_bf16(dh2.p, rows, n, dw2.p, eps, y16.p, nullptr);
      EXPECT_EQ(std::memcmp(y2.get().data(), y16.get().data(), x.size() * 2), 0) << "n " << n;
      // with the rows embedded in the same pass (the PreviousStep SC prologue): the same bits as embed_scale first
      const int vocab = 11;
      auto table = rnd(size_t(vocab) * n, -1, 1);
      std::vector<int32_t> ids(rows);
      for (int r = 0; r < rows; ++r) ids[size_t(r)] = (r * 7 + 3) % vocab;
      Dev<bf16> dtable(table.size()), y2e(x.size());
      Dev<int32_t> dids(ids.size());
      dtable.put(to_bf16(table)), dids.put(ids);
      const float escale = std::sqrt(float(n));
      embed_scale(dids.p, rows, dtable.p, n, escale, dh2.p, nullptr);
      add_then_rms_norm(dh2.p, da.p, rows, n, wn, eps, nullptr, dw2.p, y2.p);
      dx.put(x);  // never read: the fused pass embeds the rows itself
      embed_add_then_rms_norm(dids.p, dtable.p, escale, dx.p, da.p, rows, n, wn, eps, nullptr, dw2.p, y2e.p);
      EXPECT_EQ(std::memcmp(dx.get().data(), dh2.get().data(), x.size() * 4), 0) << "embedded, n " << n;
      EXPECT_EQ(std::memcmp(y2e.get().data(), y2.get().data(), x.size() * 2), 0) << "embedded, n " << n;
    }
  }
}

TEST(CudaKernels, PreFfnAndCombine) {
  REQUIRE_GPU();
  for (const int n : {203, 168, 2816}) {
    const int rows = 5;
    const float eps = 1e-6f;
    auto h = rnd(size_t(rows) * n, -4, 4), w1 = rnd(n, 0.5f, 1.5f), w2 = rnd(n, 0.5f, 1.5f), rs = rnd(n, 0.5f, 1.5f);
    Dev<float> dh(h.size()), dw1(n), dw2(n), drs(n), xr(h.size());
    Dev<bf16> x1(h.size()), xe(h.size());
    dh.put(h), dw1.put(w1), dw2.put(w2), drs.put(rs);
    pre_ffn(dh.p, rows, n, dw1.p, dw2.p, drs.p, eps, x1.p, xe.p, xr.p, nullptr);
    std::vector<float> e1(h.size()), e2(h.size()), er(h.size());
    cpu::rms_norm(h.data(), rows, n, w1.data(), eps, e1.data());
    cpu::rms_norm(h.data(), rows, n, w2.data(), eps, e2.data());
    cpu::rms_norm(h.data(), rows, n, nullptr, eps, er.data());
    for (int r = 0; r < rows; ++r)
      for (int i = 0; i < n; ++i) er[size_t(r) * n + i] *= rs[size_t(i)] / std::sqrt(float(n));
    EXPECT_LE(rel_err(from_bf16(x1.get()), e1), 8e-3);
    EXPECT_LE(rel_err(from_bf16(xe.get()), e2), 8e-3);
    EXPECT_LE(rel_err(xr.get(), er), 1e-5);

    // h = (h + rms(rms(m1; w1) + rms(m2; w2); w)) * scalar
    auto m1 = rnd(h.size(), -2, 2), m2 = rnd(h.size(), -5, 5), w = rnd(n, 0.5f, 1.5f);
    Dev<bf16> dm1(m1.size());
    Dev<float> dm2(m2.size()), dw(n);
    dm1.put(to_bf16(m1)), dm2.put(m2), dw.put(w);
    std::vector<float> a(h.size()), b(h.size()), want = h;
    cpu::rms_norm(m1.data(), rows, n, w1.data(), eps, a.data());
    cpu::rms_norm(m2.data(), rows, n, w2.data(), eps, b.data());
    for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
    cpu::rms_norm(a.data(), rows, n, w.data(), eps, a.data());
    for (size_t i = 0; i < want.size(); ++i) want[i] = (want[i] + a[i]) * 0.75f;
    ffn_combine(dh.p, dm1.p, dm2.p, rows, n, dw1.p, dw2.p, dw.p, eps, 0.75f, nullptr);
    EXPECT_LE(rel_err(dh.get(), want), 1e-5) << "n " << n;
  }
}

TEST(CudaKernels, GeluMul) {
  REQUIRE_GPU();
  const int rows = 9, I = 77;
  auto gu = rnd(size_t(rows) * 2 * I, -4, 4);
  Dev<bf16> dgu(gu.size()), act(size_t(rows) * I);
  dgu.put(to_bf16(gu));
  gelu_mul(dgu.p, rows, I, act.p, nullptr);
  std::vector<float> want(act.n);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < I; ++i)
      want[size_t(r) * I + i] = cpu::gelu_tanh(gu[size_t(r) * 2 * I + i]) * gu[size_t(r) * 2 * I + I + i];
  EXPECT_LE(rel_err(from_bf16(act.get()), want), 8e-3);
}

void check_qkv(int T, int nh, int nkv, int D, bool v_from_k, RopeParams rp, int64_t pos0) {
  const float eps = 1e-6f;
  const int width = (nh + (v_from_k ? 1 : 2) * nkv) * D;
  // qkv as the in-order f32 sum of three split-K partials (dense_tma_splitk's output), rounded to bf16
  constexpr int kSplits = 3;
  auto part = rnd(size_t(kSplits) * T * width, -1, 1), qw = rnd(D, 0.5f, 1.5f), kw = rnd(D, 0.5f, 1.5f);
  std::vector<float> qkv(size_t(T) * width);
  for (size_t i = 0; i < qkv.size(); ++i) qkv[i] = part[i] + part[qkv.size() + i] + part[2 * qkv.size() + i];
  Dev<bf16> dqkv(qkv.size()), q(size_t(T) * nh * D), k(size_t(T) * nkv * D), v(size_t(T) * nkv * D);
  dqkv.put(to_bf16(qkv));
  std::vector<float> inv(size_t(D / 2), 0.0f);
  for (int i = 0; i < rp.rotated_pairs; ++i) inv[size_t(i)] = float(1.0 / std::pow(double(rp.theta), 2.0 * i / rp.exponent_dim));
  Dev<float> dqw(D), dkw(D), dinv(inv.size());
  dqw.put(qw), dkw.put(kw), dinv.put(inv);
  qkv_norm_rope(dqkv.p, T, nh, nkv, D, v_from_k, dqw.p, dkw.p, dinv.p, pos0, eps, q.p, k.p, v.p, nullptr);
  // The same from the partials: the same bits (D 256 / 512 read them in the kernel, other D sum them into qkv first).
  {
    Dev<float> dpart(part.size());
    Dev<bf16> qkv2(qkv.size()), q2(q.n), k2(k.n), v2(v.n);
    dpart.put(part);
    qkv_norm_rope(qkv2.p, T, nh, nkv, D, v_from_k, dqw.p, dkw.p, dinv.p, pos0, eps, q2.p, k2.p, v2.p, nullptr,
                  dpart.p, kSplits);
    for (auto [a, b] : {std::pair{&q, &q2}, std::pair{&k, &k2}, std::pair{&v, &v2}}) {
      const auto x = a->get(), y = b->get();
      EXPECT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * sizeof(bf16))) << "from split-K partials, D " << D;
    }
  }
  std::vector<float> eq(q.n), ek(k.n), ev(v.n);
  std::vector<int64_t> pos(static_cast<size_t>(T));
  std::iota(pos.begin(), pos.end(), pos0);
  for (int t = 0; t < T; ++t) {
    const float* row = qkv.data() + size_t(t) * width;
    std::copy_n(row, nh * D, eq.data() + size_t(t) * nh * D);
    std::copy_n(row + nh * D, nkv * D, ek.data() + size_t(t) * nkv * D);
    std::copy_n(row + (v_from_k ? nh : nh + nkv) * D, nkv * D, ev.data() + size_t(t) * nkv * D);
  }
  cpu::rms_norm(eq.data(), T * nh, D, qw.data(), eps, eq.data());
  cpu::rms_norm(ek.data(), T * nkv, D, kw.data(), eps, ek.data());
  cpu::rms_norm(ev.data(), T * nkv, D, nullptr, eps, ev.data());
  cpu::rope(eq.data(), T, nh, D, pos.data(), rp);
  cpu::rope(ek.data(), T, nkv, D, pos.data(), rp);
  EXPECT_LE(rel_err(from_bf16(q.get()), eq), 1e-2) << "D " << D;
  EXPECT_LE(rel_err(from_bf16(k.get()), ek), 1e-2) << "D " << D;
  EXPECT_LE(rel_err(from_bf16(v.get()), ev), 1e-2) << "D " << D;
}

TEST(CudaKernels, QkvNormRope) {
  REQUIRE_GPU();
  check_qkv(5, 4, 2, 32, false, {10000.0f, 16, 32.0f}, 3);          // sliding: full rotary
  check_qkv(7, 4, 1, 64, true, {1e6f, 8, 64.0f}, 1000);              // full: proportional partial rotary, V = raw k
  check_qkv(3, 16, 2, 512, true, {1e6f, 64, 512.0f}, 33000);         // full-size full layer at a large position
  check_qkv(3, 16, 8, 256, false, {10000.0f, 128, 256.0f}, 4097);   // full-size sliding layer
}

// Attention against cpu::attention on [ring window ; new] keys.
void check_attention(int T, int nh, int nkv, int D, int64_t cap, int64_t first_pos, int64_t n_old, bool causal,
                     int64_t window) {
  auto q = rnd(size_t(T) * nh * D), kc = rnd(size_t(cap) * nkv * D), vc = rnd(kc.size()),
       kn = rnd(size_t(T) * nkv * D), vn = rnd(kn.size());
  Dev<bf16> dq(q.size()), dkc(kc.size()), dvc(vc.size()), dkn(kn.size()), dvn(vn.size()), out(q.size());
  dq.put(to_bf16(q)), dkc.put(to_bf16(kc)), dvc.put(to_bf16(vc)), dkn.put(to_bf16(kn)), dvn.put(to_bf16(vn));
  AttentionArgs a{dq.p, T, nh, nkv, D, dkc.p, dvc.p, cap, first_pos, n_old, dkn.p, dvn.p, T, first_pos + n_old,
                  causal, window, out.p};
  // Denoise launches also with the keys tiled by index (set_attention_key_runs(false)): both tilings against the
  // oracle; and with Q loaded by the consumers' cp.async instead of TMA: the same bits.
  Dev<bf16> out_index(q.size()), out_q_async(q.size());
  if (!causal) {
    set_attention_key_runs(false);
    a.out = out_index.p;
    attention(a, nullptr);
    set_attention_key_runs(true);
    set_attention_q_tma(false);
    a.out = out_q_async.p;
    attention(a, nullptr);
    set_attention_q_tma(true);
    a.out = out.p;
  }
  // D = 512 also on attention_wgx_k (the cluster-pair attention_ws_k is the default where there is an sm_90a image),
  // and the default launch twice: the two blocks of a pair add the partial S in either order, so repeat runs and the
  // pair must agree bitwise.
  Dev<bf16> out_wgx(D == 512 ? q.size() : 1), out_again(q.size()), out_cp_async(q.size());
  // Every K / V (and Q) tile by cp.async (set_attention_tma(false), which also tiles the keys by index): the same
  // bits as the launch that tiles them the same way with TMA where a tile is contiguous.
  set_attention_tma(false);
  a.out = out_cp_async.p;
  attention(a, nullptr);
  set_attention_tma(true);
  if (D == 512) {
    set_attention_ws512(false);
    a.out = out_wgx.p;
    attention(a, nullptr);
    set_attention_ws512(true);
  }
  a.out = out_again.p;
  attention(a, nullptr);
  // D = 256 with the split combine leaving its partial rows in L2 (set_attention_discard_partials(false)): the same
  // bits as the default, which drops them once read (the default launch below finds its workspace after discards).
  Dev<bf16> out_discard(D == 256 ? q.size() : 1);
  if (D == 256) {
    set_attention_discard_partials(false);
    a.out = out_discard.p;
    attention(a, nullptr);
    set_attention_discard_partials(true);
  }
  a.out = out.p;
  attention(a, nullptr);
  {
    const std::vector<bf16> x = out.get(), y = out_again.get();
    EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * sizeof(bf16)), 0)
        << "repeat launch: T " << T << " D " << D << " n_old " << n_old;
    if (D == 256) {
      const std::vector<bf16> z = out_discard.get();
      EXPECT_EQ(std::memcmp(x.data(), z.data(), x.size() * sizeof(bf16)), 0)
          << "partials kept vs discarded: T " << T << " n_old " << n_old;
    }
    const std::vector<bf16> tma = causal ? x : out_index.get(), cp = out_cp_async.get();
    EXPECT_EQ(std::memcmp(tma.data(), cp.data(), cp.size() * sizeof(bf16)), 0)
        << "all by cp.async vs TMA: T " << T << " D " << D << " n_old " << n_old;
  }
  const size_t row = size_t(nkv) * D;
  const int64_t nk = n_old + T;
  std::vector<float> K(size_t(nk) * row), Vv(K.size());
  for (int64_t j = 0; j < n_old; ++j) {
    const size_t slot = size_t((first_pos + j) % cap);
    std::copy_n(kc.data() + slot * row, row, K.data() + size_t(j) * row);
    std::copy_n(vc.data() + slot * row, row, Vv.data() + size_t(j) * row);
  }
  std::copy(kn.begin(), kn.end(), K.begin() + ptrdiff_t(size_t(n_old) * row));
  std::copy(vn.begin(), vn.end(), Vv.begin() + ptrdiff_t(size_t(n_old) * row));
  std::vector<int64_t> qpos(static_cast<size_t>(T));
  std::iota(qpos.begin(), qpos.end(), first_pos + n_old);
  cpu::AttentionMask m;
  m.kind = causal ? cpu::AttentionMask::Causal : cpu::AttentionMask::Bidirectional;
  m.window = window;
  m.q_pos = qpos.data();
  m.k_pos0 = first_pos;
  std::vector<float> want(q.size());
  ThreadPool pool(2);
  cpu::attention(pool, q.data(), T, nh, K.data(), Vv.data(), nk, nkv, D, m, want.data());
  EXPECT_LE(rel_err(from_bf16(out.get()), want), 2e-2) << "T " << T << " D " << D << " n_old " << n_old;
  if (D == 512) {
    EXPECT_LE(rel_err(from_bf16(out_wgx.get()), want), 2e-2) << "attention_wgx_k: T " << T << " n_old " << n_old;
  }
  if (!causal) {
    EXPECT_LE(rel_err(from_bf16(out_index.get()), want), 2e-2)
        << "keys tiled by index: T " << T << " D " << D << " n_old " << n_old;
    const std::vector<bf16> q_tma = out.get(), q_async = out_q_async.get();
    EXPECT_EQ(std::memcmp(q_tma.data(), q_async.data(), q_tma.size() * sizeof(bf16)), 0)
        << "Q by TMA vs cp.async: T " << T << " D " << D << " n_old " << n_old;
  }
}

TEST(CudaKernels, Attention) {
  REQUIRE_GPU();
  check_attention(37, 4, 2, 16, 11, 20, 7, true, 8);       // tiny sliding prefill over a wrapped ring
  check_attention(19, 4, 1, 32, 50, 0, 45, true, 0);       // full layer prefill after a cache
  check_attention(33, 4, 2, 64, 23, 100, 23, false, 0);    // bidirectional denoise over a full ring
  check_attention(70, 16, 8, 256, 1535, 3000, 1023, false, 0);  // full-size sliding denoise
  check_attention(45, 16, 2, 512, 300, 0, 211, true, 0);   // full-size full layer, causal
  check_attention(130, 16, 8, 256, 1535, 0, 5, true, 64);  // window inside the new chunk
  // full-size full layer, bidirectional denoise over many cp.async K/V tiles (n_old not a multiple of the tile)
  check_attention(40, 16, 2, 512, 800, 0, 651, false, 0);
  // Awkward sizes: one query; a grid big enough to run unsplit (causal, window reaching into the wrapped ring);
  // split-KV over a wrapped ring with a ragged last row tile; head dims 48 / 80 / 128 with groups 3 and 8.
  check_attention(1, 16, 8, 256, 1535, 500, 1023, false, 0);
  check_attention(600, 16, 8, 256, 2048, 100, 900, true, 1024);
  check_attention(300, 16, 2, 512, 1000, 7, 333, true, 0);
  check_attention(257, 16, 2, 512, 400, 350, 300, false, 0);
  check_attention(256, 16, 2, 512, 1024, 0, 1000, false, 0);  // a full layer's denoise shape (fewer cached keys)
  // D = 512 with a group of 3 (Q by the consumers' cp.async: 64 is no multiple of 3), denoise and causal
  check_attention(37, 6, 2, 512, 100, 0, 90, false, 0);
  check_attention(33, 6, 2, 512, 64, 0, 50, true, 0);
  check_attention(100, 6, 2, 48, 70, 3, 61, false, 0);
  check_attention(77, 8, 1, 128, 130, 0, 129, true, 16);
  check_attention(50, 4, 4, 80, 64, 10, 60, false, 0);
  // Sliding denoise key runs: a first run shorter than a tile (45 rows before the wrap); a ring not yet full (one run
  // whose last tile reaches past the window into other rows of the ring); a ring of exactly the window.
  check_attention(256, 16, 8, 256, 1535, 1490, 1023, false, 0);
  check_attention(200, 16, 8, 256, 1100, 0, 300, false, 0);
  check_attention(256, 16, 8, 256, 1023, 4000, 1023, false, 0);
}

// softmax_rows_to_bf16 against a double softmax: every dispatch branch (row in registers with 64 / 128 / 256 threads,
// the long two-pass kernel), rows in groups at a stride (the rows between stay untouched), n not a multiple of 4,
// the columns [n, n_cols) written as exact zeros, bitwise repeatable.
TEST(CudaKernels, SoftmaxRowsToBf16) {
  REQUIRE_GPU();
  for (auto [rows, groups, group_rows, n, n_cols] :
       {std::tuple{5, 3, 7, 37, 40}, std::tuple{3, 2, 3, 1, 64}, std::tuple{9, 2, 11, 1500, 1536},
        std::tuple{4, 3, 4, 4352, 4352}, std::tuple{2, 2, 5, 9001, 9088}, std::tuple{3, 1, 3, 20001, 20032}}) {
    const int ld = (n_cols + 7) / 8 * 8 + 8;
    const size_t total = size_t(groups) * group_rows * ld;
    auto S = rnd(total, -30, 30);
    Dev<float> dS(total);
    Dev<bf16> dP(total);
    dS.put(S);
    softmax_rows_to_bf16(dS.p, ld, rows, groups, group_rows, n, n_cols, dP.p, nullptr);
    const auto P = from_bf16(dP.get());
    for (int g = 0; g < groups; ++g)
      for (int r = 0; r < group_rows; ++r) {
        const size_t off = (size_t(g) * group_rows + r) * ld;
        if (r >= rows) {  // not a row of this call: still the poison
          EXPECT_TRUE(std::isnan(P[off])) << "row " << r << " of group " << g << " was written";
          continue;
        }
        double mx = -INFINITY, sum = 0;
        for (int c = 0; c < n; ++c) mx = std::max(mx, double(S[off + c]));
        for (int c = 0; c < n; ++c) sum += std::exp(double(S[off + c]) - mx);
        double worst = 0, psum = 0;
        for (int c = 0; c < n; ++c) {
          const double want = std::exp(double(S[off + c]) - mx) / sum;
          worst = std::max(worst, std::fabs(P[off + c] - want) / std::max(want, 1e-30));
          psum += P[off + c];
        }
        EXPECT_LE(worst, 1.0 / 256) << "n " << n << " row " << r << " group " << g;  // bf16 rounding (+ f32 exp)
        EXPECT_NEAR(psum, 1.0, 1e-2) << "n " << n;
        for (int c = n; c < n_cols; ++c) EXPECT_EQ(P[off + c], 0.0f) << "n " << n << " column " << c;
      }
    Dev<bf16> dP2(total), dP3(total);
    softmax_rows_to_bf16(dS.p, ld, rows, groups, group_rows, n, n_cols, dP2.p, nullptr);
    auto a = dP.get(), b = dP2.get();
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(bf16)), 0) << "n " << n << ": not repeatable";
    set_softmax_rows_reverse(false);  // the groups in order: the same bits
    softmax_rows_to_bf16(dS.p, ld, rows, groups, group_rows, n, n_cols, dP3.p, nullptr);
    set_softmax_rows_reverse(true);
    auto c = dP3.get();
    EXPECT_EQ(std::memcmp(a.data(), c.data(), a.size() * sizeof(bf16)), 0) << "n " << n << ": group order changed it";
  }
  EXPECT_THROW(softmax_rows_to_bf16(nullptr, 16, 1, 1, 1, 5, 6, nullptr, nullptr), std::exception);  // n_cols % 4
}

// softmax_rows_to_bf16 with discard_scores (each score line dropped from L2 once read): P the same bits as without, on
// every dispatch branch, with rows 128-byte aligned (ld % 32 == 0) so that the discard path runs. S is uploaded again
// before each launch: its contents are undefined after a discarding one.
TEST(CudaKernels, SoftmaxRowsDiscardScores) {
  REQUIRE_GPU();
  for (auto [rows, groups, group_rows, n, n_cols] :
       {std::tuple{3, 2, 5, 37, 64}, std::tuple{9, 2, 11, 1500, 1536}, std::tuple{4, 3, 4, 4300, 4352},
        std::tuple{2, 2, 3, 9001, 9088}, std::tuple{1, 2, 2, 20001, 20032}}) {
    const int ld = n_cols + 32;
    const size_t total = size_t(groups) * group_rows * ld;
    const auto S = rnd(total, -30, 30);
    Dev<float> dS(total);
    Dev<bf16> dP(total), dPd(total);
    dS.put(S);
    softmax_rows_to_bf16(dS.p, ld, rows, groups, group_rows, n, n_cols, dP.p, nullptr);
    dS.put(S);
    softmax_rows_to_bf16(dS.p, ld, rows, groups, group_rows, n, n_cols, dPd.p, nullptr, /*discard_scores=*/true);
    auto a = dP.get(), b = dPd.get();
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(bf16)), 0) << "n " << n << ": the discard changed P";
  }
}

// gemm_attention (cuBLASLt S = Q K^T, softmax, O = P V) against cpu::attention over keys [0, n) with every key
// visible: GQA groups 1 / 3 / 8, head dims 32 / 48 / 256 / 512, one query, n not a multiple of the 64-key columns
// (the rows past n are finite garbage: their P must be 0), the model's full layer at kv 4096; repeatable bitwise.
void check_gemm_attention(int T, int nh, int nkv, int D, int n) {
  const int n_cols = gemm_attention_key_columns(n), head_rows = T + 3, ld = n_cols + 64;
  const size_t row = size_t(nkv) * D;
  auto q = rnd(size_t(T) * nh * D), k = rnd(size_t(n_cols) * row), v = rnd(k.size());
  Dev<bf16> dq(q.size()), dk(k.size()), dv(v.size()), out(q.size()), out2(q.size());
  dq.put(to_bf16(q)), dk.put(to_bf16(k)), dv.put(to_bf16(v));
  Dev<float> S(size_t(nh) * head_rows * ld);
  Dev<bf16> P(S.n);
  Dev<void*> ptrs(gemm_attention_pointer_count(nh));
  Gemm gemm;
  GemmAttentionArgs a{dq.p, nh, nkv, D, dk.p, dv.p, S.p, P.p, head_rows, ld, out.p, ptrs.p};
  set_gemm_attention_pointers(a, nullptr);
  gemm_attention(gemm, a, T, n, nullptr);
  const auto got = from_bf16(out.get());
  std::vector<float> want(q.size());
  std::vector<int64_t> qpos(static_cast<size_t>(T), 0);
  cpu::AttentionMask m;
  m.kind = cpu::AttentionMask::Bidirectional;
  m.q_pos = qpos.data();
  ThreadPool pool(2);
  cpu::attention(pool, q.data(), T, nh, k.data(), v.data(), n, nkv, D, m, want.data());
  EXPECT_LE(rel_err(got, want), 2e-2) << "T " << T << " nh " << nh << " nkv " << nkv << " D " << D << " n " << n;
  a.out = out2.p;
  set_gemm_attention_pointers(a, nullptr);
  gemm_attention(gemm, a, T, n, nullptr);
  auto x = out.get(), y = out2.get();
  EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * sizeof(bf16)), 0) << "not repeatable, D " << D;
}

TEST(CudaKernels, GemmAttention) {
  REQUIRE_GPU();
  check_gemm_attention(19, 4, 4, 32, 50);
  check_gemm_attention(33, 6, 2, 48, 97);
  check_gemm_attention(1, 16, 8, 256, 1279);
  check_gemm_attention(70, 16, 2, 512, 651);
  check_gemm_attention(256, 16, 2, 512, 4352);
  Gemm gemm;
  GemmAttentionArgs a{};
  a.nh = 4, a.nkv = 2, a.D = 32, a.head_rows = 8, a.ld = 64;
  EXPECT_THROW(gemm_attention(gemm, a, 9, 10, nullptr), std::exception);   // T > head_rows
  EXPECT_THROW(gemm_attention(gemm, a, 4, 65, nullptr), std::exception);   // 128 key columns > ld
}

TEST(CudaKernels, RouteTopK) {
  REQUIRE_GPU();
  // warp-per-token kernel (E <= 256): awkward sizes, the model's 128/8, a full 256; block kernel above 256 experts
  for (auto [T, E, k] : {std::tuple{9, 37, 5}, std::tuple{300, 128, 8}, std::tuple{17, 256, 32}, std::tuple{5, 300, 9}}) {
    auto logits = rnd(size_t(T) * E, -3, 3), pes = rnd(size_t(E), 0.5f, 1.5f);
    for (int e = 0; e < E; ++e) logits[size_t(e)] = float(e % 3);  // row 0: many exact ties
    Dev<float> dl(logits.size()), dp(static_cast<size_t>(E)), w(size_t(T) * k);
    Dev<int32_t> idx(size_t(T) * k);
    dl.put(logits), dp.put(pes);
    route_top_k(dl.p, T, E, k, dp.p, idx.p, w.p, nullptr);
    auto gi = idx.get();
    auto gw = w.get();
    for (int t = 0; t < T; ++t) {
      std::vector<int32_t> ei(static_cast<size_t>(k));
      std::vector<float> ew(static_cast<size_t>(k));
      cpu::route_top_k(logits.data() + size_t(t) * E, E, k, pes.data(), ei.data(), ew.data());
      for (int j = 0; j < k; ++j) {
        EXPECT_EQ(gi[size_t(t) * k + j], ei[size_t(j)]) << "E " << E << " token " << t << " slot " << j;
        EXPECT_NEAR(gw[size_t(t) * k + j], ew[size_t(j)], 1e-5f) << "E " << E;
      }
    }
  }
}

// router_top_k (two launches: f32 GEMM partials split over H, then top-k and the expert masks) against the CPU:
// logits vs a double GEMM, the selection and weights vs cpu::route_top_k on the kernel's own logits (so near-ties
// cannot flip), every mask bit vs the selection (the masks start poisoned: the router must rewrite them all). Then
// moe_assign_padded on its idx: every row once, each expert's rows in token order (the order gate_up reads from the
// masks), slot_token naming the token of every padded row. One workspace serves every size in turn, and each call is
// repeated for bitwise determinism, rows included.
TEST(CudaKernels, RouterTopKMasksAndAssignment) {
  REQUIRE_GPU();
  const size_t max_t = 300, max_h = 2816;
  Dev<float> partial(router_partial_floats(int(max_t), int(max_h)) + 1024 * 128);
  for (bool tensor_cores : {true, false})
  for (auto [T, E, k, H] : {std::tuple{256, 128, 8, 2816}, std::tuple{37, 6, 2, 40}, std::tuple{300, 128, 8, 2816},
                            std::tuple{1, 128, 8, 2816}, std::tuple{65, 100, 7, 1004}, std::tuple{256, 128, 8, 2816}}) {
    set_router_tensor_cores(tensor_cores);
    ASSERT_TRUE(router_fused_supported(E, H, k));
    ASSERT_LE(router_partial_floats(T, H), partial.n);
    const int M = moe_padded_rows_per_expert(T, k, E), P = T * k, words = (T + 31) / 32;
    auto x = rnd(size_t(T) * H, -2, 2), W = rnd(size_t(E) * H, -0.05f, 0.05f), pes = rnd(size_t(E), 0.5f, 1.5f);
    const size_t pairs = static_cast<size_t>(P);
    Dev<float> dx(x.size()), dW(W.size()), dp(static_cast<size_t>(E)), logits(size_t(T) * E), w(pairs);
    Dev<int32_t> idx(pairs), ovf(size_t(E) + 1), spos(pairs), meta(2 * size_t(E) + 1), slot(size_t(E) * M);
    Dev<unsigned> masks(expert_mask_words(T, E));  // poisoned: all bits set
    ASSERT_EQ(masks.n, size_t(E) * size_t(words));
    dx.put(x), dW.put(W), dp.put(pes);
    auto run = [&] {
      router_top_k(dx.p, T, H, dW.p, E, k, dp.p, partial.p, logits.p, idx.p, w.p, masks.p, nullptr);
      moe_assign_padded(idx.p, T, k, E, M, ovf.p, spos.p, meta.p, slot.p, nullptr);
    };
    run();
    const std::string what = "T " + std::to_string(T) + " E " + std::to_string(E) + " H " + std::to_string(H) +
                             (tensor_cores ? " (3xTF32)" : " (f32 FMA)");
    auto gl = logits.get();
    auto gi = idx.get();
    auto gw = w.get();
    auto go = ovf.get();
    auto gs = spos.get();
    auto gm = meta.get();
    auto gk = masks.get();
    double md = 0, mr = 0;
    for (int t = 0; t < T; ++t)
      for (int e = 0; e < E; ++e) {
        double ref = 0;
        for (int i = 0; i < H; ++i) ref += double(x[size_t(t) * H + i]) * W[size_t(e) * H + i];
        md = std::max(md, std::fabs(double(gl[size_t(t) * E + e]) - ref)), mr = std::max(mr, std::fabs(ref));
      }
    EXPECT_LE(md / mr, 1e-5) << what;
    std::vector<unsigned> want_masks(masks.n, 0u);
    for (int t = 0; t < T; ++t) {
      std::vector<int32_t> ei(static_cast<size_t>(k));
      std::vector<float> ew(static_cast<size_t>(k));
      cpu::route_top_k(gl.data() + size_t(t) * E, E, k, pes.data(), ei.data(), ew.data());
      for (int j = 0; j < k; ++j) {
        ASSERT_EQ(gi[size_t(t) * k + j], ei[size_t(j)]) << what << " token " << t << " slot " << j;
        EXPECT_NEAR(gw[size_t(t) * k + j], ew[size_t(j)], 1e-5f) << what;
        want_masks[size_t(ei[size_t(j)]) * words + t / 32] |= 1u << (t % 32);
      }
    }
    EXPECT_EQ(gk, want_masks) << what << ": expert masks";
    // assignment: expert e's first min(count, M) pairs in rows e M .., the rest in its overflow range, every row once
    std::vector<int> cnt(static_cast<size_t>(E), 0);
    for (int i = 0; i < P; ++i) ++cnt[size_t(gi[size_t(i)])];
    int run_ovf = E * M, n_ovf = 0;
    for (int e = 0; e < E; ++e) {
      EXPECT_EQ(go[size_t(e)], run_ovf) << what << " expert " << e;
      EXPECT_EQ(gm[size_t(1 + E + e)], std::min(cnt[size_t(e)], M)) << what;
      if (cnt[size_t(e)] > M) {
        EXPECT_EQ(gm[size_t(1 + n_ovf++)], e) << what;
      }
      run_ovf += std::max(0, cnt[size_t(e)] - M);
    }
    EXPECT_EQ(go[size_t(E)], run_ovf) << what;
    EXPECT_EQ(gm[0], n_ovf) << what;
    std::vector<int> seen(size_t(run_ovf), 0), next_slot(size_t(E), 0);
    auto gt = slot.get();
    for (int i = 0; i < P; ++i) {  // pairs in token order: each expert's slots count up from 0
      const int e = gi[size_t(i)], r = gs[size_t(i)], s = next_slot[size_t(e)]++;
      ASSERT_TRUE(r >= 0 && r < run_ovf) << what;
      EXPECT_EQ(r, s < M ? e * M + s : go[size_t(e)] + s - M) << what << " pair " << i;
      EXPECT_EQ(++seen[size_t(r)], 1) << what << ": row " << r << " assigned twice";
      if (s < M) {
        EXPECT_EQ(gt[size_t(e) * M + s], i / k) << what << " slot_token of row " << r;
      }
    }
    // the assignment on 256 and 32 threads (CudaOptions::narrow_assignment): the same rows, meta and slots; and the
    // count of experts past heavy_rows pairs (thresholds around the mean, so that some are and some are not)
    for (int threads : {256, 32}) {
      Dev<int32_t> ovf_n(size_t(E) + 1), spos_n(pairs), meta_n(2 * size_t(E) + 1), slot_n(size_t(E) * M), heavy(1);
      CUDA_CHECK(cudaMemcpy(slot_n.p, slot.p, slot.n * sizeof(int32_t), cudaMemcpyDeviceToDevice));
      const int heavy_rows = threads == 32 ? M / 2 : M / 2 - 1;
      moe_assign_padded(idx.p, T, k, E, M, ovf_n.p, spos_n.p, meta_n.p, slot_n.p, nullptr, threads, heavy_rows,
                        heavy.p);
      const int want_heavy = int(std::count_if(cnt.begin(), cnt.end(), [&](int c) { return c > heavy_rows; }));
      EXPECT_EQ(heavy.get()[0], want_heavy) << what << ", experts past " << heavy_rows << " rows";
      EXPECT_EQ(ovf_n.get(), go) << what << ", " << threads << " threads";
      EXPECT_EQ(spos_n.get(), gs) << what << ", " << threads << " threads";
      EXPECT_EQ(meta_n.get(), gm) << what << ", " << threads << " threads";
      EXPECT_EQ(slot_n.get(), gt) << what << ", " << threads << " threads";
    }
    // Bitwise repeatable, the rows too, with the route kernel's other block shape (8 tokens a block, not 2).
    set_route_tokens_per_block(8);
    run();
    set_route_tokens_per_block(2);
    auto gl2 = logits.get();
    auto gw2 = w.get();
    EXPECT_EQ(0, std::memcmp(gl.data(), gl2.data(), gl.size() * sizeof(float))) << what;
    EXPECT_EQ(0, std::memcmp(gw.data(), gw2.data(), gw.size() * sizeof(float))) << what;
    EXPECT_EQ(idx.get(), gi) << what;
    EXPECT_EQ(spos.get(), gs) << what;
    EXPECT_EQ(masks.get(), gk) << what;
  }
  set_router_tensor_cores(false);
}

// moe_combine_ffn = the expert combine (ascending expert id) followed by the FFN output norms and residual.
TEST(CudaKernels, MoeCombineFfn) {
  REQUIRE_GPU();
  for (auto [T, k, H, P] : {std::tuple{7, 3, 203, 40}, std::tuple{9, 5, 1000, 50}, std::tuple{33, 8, 2816, 300},
                               std::tuple{5, 8, 4000, 60}}) {
    const float eps = 1e-6f, scalar = 0.6f;
    auto y = rnd(size_t(P) * H, -3, 3), wts = rnd(size_t(T) * k, 0.1f, 1.0f), h = rnd(size_t(T) * H, -4, 4);
    auto m1 = rnd(size_t(T) * H, -2, 2), w1 = rnd(size_t(H), 0.5f, 1.5f), w2 = rnd(size_t(H), 0.5f, 1.5f);
    auto wn = rnd(size_t(H), 0.5f, 1.5f);
    std::vector<int32_t> idx(size_t(T) * k), spos(size_t(T) * k);
    for (auto& e : idx) e = int32_t(rng() % 64);
    for (auto& r : spos) r = int32_t(rng() % uint32_t(P));
    Dev<float> dy(y.size()), dw(wts.size()), dh(h.size()), dw1(static_cast<size_t>(H)), dw2(static_cast<size_t>(H)), dwn(static_cast<size_t>(H));
    Dev<bf16> dm1(m1.size());
    Dev<int32_t> didx(idx.size()), dspos(spos.size());
    dy.put(y), dw.put(wts), dh.put(h), dw1.put(w1), dw2.put(w2), dwn.put(wn), dm1.put(to_bf16(m1)), didx.put(idx);
    dspos.put(spos);
    moe_combine_ffn(dy.p, didx.p, dw.p, dspos.p, T, k, dh.p, dm1.p, H, dw1.p, dw2.p, dwn.p, eps, scalar, nullptr);
    std::vector<float> m2(size_t(T) * H, 0.0f), a(m1.size()), b(m2.size()), want = h;
    for (int t = 0; t < T; ++t) {
      std::vector<int> order(static_cast<size_t>(k));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int p, int q) { return idx[size_t(t) * k + p] < idx[size_t(t) * k + q]; });
      for (int j : order)
        for (int i = 0; i < H; ++i)
          m2[size_t(t) * H + i] += wts[size_t(t) * k + j] * y[size_t(spos[size_t(t) * k + j]) * H + i];
    }
    cpu::rms_norm(m1.data(), T, H, w1.data(), eps, a.data());
    cpu::rms_norm(m2.data(), T, H, w2.data(), eps, b.data());
    for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
    cpu::rms_norm(a.data(), T, H, wn.data(), eps, a.data());
    for (size_t i = 0; i < want.size(); ++i) want[i] = (want[i] + a[i]) * scalar;
    EXPECT_LE(rel_err(dh.get(), want), 1e-5) << "T " << T << " H " << H;
    // With x_next: the same h, plus the next layer's input norm of it (as rms_norm_f32_to_bf16 computes it)
    auto w_next = rnd(size_t(H), 0.5f, 1.5f);
    Dev<float> dh2(h.size()), dwx(static_cast<size_t>(H));
    Dev<bf16> x_next(h.size()), x_sep(h.size());
    dh2.put(h), dwx.put(w_next);
    moe_combine_ffn(dy.p, didx.p, dw.p, dspos.p, T, k, dh2.p, dm1.p, H, dw1.p, dw2.p, dwn.p, eps, scalar, nullptr,
                    dwx.p, x_next.p);
    const auto h2 = dh2.get();
    EXPECT_EQ(0, std::memcmp(h2.data(), dh.get().data(), h2.size() * sizeof(float))) << "h changed with x_next";
    rms_norm_f32_to_bf16(dh2.p, T, H, dwx.p, eps, x_sep.p, nullptr);
    EXPECT_LE(rel_err(from_bf16(x_next.get()), from_bf16(x_sep.get())), 4e-3) << "T " << T << " H " << H;
    std::vector<float> want_x(h2.size());
    cpu::rms_norm(h2.data(), T, H, w_next.data(), eps, want_x.data());
    EXPECT_LE(rel_err(from_bf16(x_next.get()), want_x), 8e-3) << "T " << T << " H " << H;
    // bf16 expert rows (ExpertRows, the denoise passes' y): the same h and x_next bits as f32 rows holding the same
    // (bf16-exact) values, since the combine widens each one exactly before the same arithmetic.
    auto y_r = y;
    const auto y16 = to_bf16(y_r);  // y_r rounded in place
    Dev<float> dy_r(y_r.size()), dh_f(h.size()), dh_b(h.size());
    Dev<bf16> dy16(y16.size()), xn_f(h.size()), xn_b(h.size());
    dy_r.put(y_r), dy16.put(y16), dh_f.put(h), dh_b.put(h);
    moe_combine_ffn(dy_r.p, didx.p, dw.p, dspos.p, T, k, dh_f.p, dm1.p, H, dw1.p, dw2.p, dwn.p, eps, scalar, nullptr,
                    dwx.p, xn_f.p);
    moe_combine_ffn(dy16.p, didx.p, dw.p, dspos.p, T, k, dh_b.p, dm1.p, H, dw1.p, dw2.p, dwn.p, eps, scalar, nullptr,
                    dwx.p, xn_b.p);
    const auto hf = dh_f.get(), hb = dh_b.get();
    EXPECT_EQ(0, std::memcmp(hf.data(), hb.data(), hf.size() * sizeof(float))) << "bf16 rows, T " << T << " H " << H;
    const auto xf = xn_f.get(), xb = xn_b.get();
    EXPECT_EQ(0, std::memcmp(xf.data(), xb.data(), xf.size() * sizeof(bf16))) << "bf16 rows, T " << T << " H " << H;
    Dev<float> out_f(h.size()), out_b(h.size());
    moe_combine(dy_r.p, didx.p, dw.p, dspos.p, T, k, H, out_f.p, nullptr);
    moe_combine(dy16.p, didx.p, dw.p, dspos.p, T, k, H, out_b.p, nullptr);
    const auto of = out_f.get(), ob = out_b.get();
    EXPECT_EQ(0, std::memcmp(of.data(), ob.data(), of.size() * sizeof(float))) << "moe_combine, bf16 rows";
    {  // the combine dropping each bf16 y line after reading it (discard_y; H % 64 == 0 only): the same bits. Last:
       // dy16 is undefined afterwards
      Dev<float> dh_d(h.size());
      Dev<bf16> xn_d(h.size());
      dh_d.put(h);
      moe_combine_ffn(dy16.p, didx.p, dw.p, dspos.p, T, k, dh_d.p, dm1.p, H, dw1.p, dw2.p, dwn.p, eps, scalar, nullptr,
                      dwx.p, xn_d.p, /*discard_y=*/true);
      const auto hd = dh_d.get();
      const auto xd = xn_d.get();
      EXPECT_EQ(0, std::memcmp(hb.data(), hd.data(), hb.size() * sizeof(float))) << "discard, T " << T << " H " << H;
      EXPECT_EQ(0, std::memcmp(xb.data(), xd.data(), xb.size() * sizeof(bf16))) << "discard, T " << T << " H " << H;
    }
  }
}

// dense_tma_splitk (kernels_dense_tma.cu) against a double-precision CPU product on awkward T (a partial token box,
// a cluster's second half entirely past T), K not a multiple of the ring, every split count up to one k slice a
// split, clusters of 1 and 2: the partial sums added in order within f32 round-off of the product; every
// launch bitwise the same as the first of its split count (clusters change no sum); dense_splits_to_bf16 bitwise
// bf16(the in-order sum).
TEST(CudaKernels, DenseTmaSplitK) {
  REQUIRE_GPU();
  if (!dense_tma_supported(256, 256, 64)) GTEST_SKIP() << "dense_tma_splitk needs an sm_90 GPU (sm_90a image)";
  struct Shape {
    int T, N, K;
  };
  for (const Shape sh : {Shape{1, 256, 64}, Shape{37, 512, 320}, Shape{129, 256, 1472}, Shape{256, 768, 2816}}) {
    const auto [T, N, K] = sh;
    auto x = rnd(size_t(T) * K), w = rnd(size_t(N) * K);
    const auto xb = to_bf16(x), wb = to_bf16(w);
    std::vector<float> want(size_t(T) * N);
    for (int t = 0; t < T; ++t)
      for (int n = 0; n < N; ++n) {
        double acc = 0;
        for (int k = 0; k < K; ++k) acc += double(x[size_t(t) * K + k]) * w[size_t(n) * K + k];
        want[size_t(t) * N + n] = float(acc);
      }
    Dev<bf16> dx(xb.size()), dw(wb.size()), out(size_t(T) * N);
    dx.put(xb), dw.put(wb);
    const TmaMap mw = dense_tma_weight_map(dw.p, N, K);
    for (const int splits : {1, 2, 3, 6, K / 64}) {
      if (splits > K / 64) continue;
      std::vector<float> first;
      for (const int cluster : {1, 2, 1}) {
        const std::string what = "T " + std::to_string(T) + " N " + std::to_string(N) + " K " + std::to_string(K) +
                                 " splits " + std::to_string(splits) + " cluster " + std::to_string(cluster);
        Dev<float> part(size_t(splits) * T * N);
        dense_tma_splitk(mw, dense_tma_token_map(dx.p, T, K, cluster), T, N, K, splits, cluster, part.p, nullptr);
        const auto p = part.get();
        if (first.empty()) {
          first = p;
        } else {
          EXPECT_EQ(0, std::memcmp(first.data(), p.data(), p.size() * sizeof(float))) << what;
        }
        std::vector<float> sum(size_t(T) * N);
        for (size_t i = 0; i < sum.size(); ++i) {
          float v = p[i];
          for (int s = 1; s < splits; ++s) v += p[size_t(s) * sum.size() + i];
          sum[i] = v;
        }
        EXPECT_LE(rel_err(sum, want), 1e-5) << what;  // f32 accumulation on the tensor cores
        dense_splits_to_bf16(part.p, splits, T, N, out.p, nullptr);
        const auto ob = out.get();
        size_t bad = 0;
        for (size_t i = 0; i < sum.size(); ++i) {
          uint16_t got;
          std::memcpy(&got, &ob[i], 2);
          bad += got != f32_to_bf16(sum[i]);
        }
        EXPECT_EQ(bad, 0u) << what << ": dense_splits_to_bf16";
      }
    }
  }
  EXPECT_THROW(dense_tma_splitk(TmaMap{}, TmaMap{}, 257, 256, 64, 1, 1, nullptr, nullptr), std::exception);
  EXPECT_THROW(dense_tma_splitk(TmaMap{}, TmaMap{}, 16, 384, 64, 1, 1, nullptr, nullptr), std::exception);
  EXPECT_THROW(dense_tma_splitk(TmaMap{}, TmaMap{}, 16, 256, 128, 3, 1, nullptr, nullptr), std::exception);
}

// add_rms_norm_pre_ffn = add_rms_norm then pre_ffn (vector rows fused, others the two launches): compared with the
// two launches and with the CPU oracle.
TEST(CudaKernels, AddRmsNormPreFfn) {
  REQUIRE_GPU();
  for (const int n : {40, 203, 1024, 2816, 4100}) {
    for (const int rows : {1, 7, 256}) {
      const float eps = 1e-6f;
      auto h = rnd(size_t(rows) * n, -4, 4), a = rnd(size_t(rows) * n, -2, 2);
      auto wp = rnd(n, 0.5f, 1.5f), w1 = rnd(n, 0.5f, 1.5f), w2 = rnd(n, 0.5f, 1.5f), rs = rnd(n, 0.5f, 1.5f);
      Dev<float> dh(h.size()), dh2(h.size()), dwp(n), dw1(n), dw2(n), drs(n), xr(h.size()), xr2(h.size());
      Dev<bf16> da(a.size()), x1(h.size()), xe(h.size()), x1b(h.size()), xeb(h.size());
      dh.put(h), dh2.put(h), da.put(to_bf16(a)), dwp.put(wp), dw1.put(w1), dw2.put(w2), drs.put(rs);
      add_rms_norm_pre_ffn(dh.p, da.p, rows, n, dwp.p, dw1.p, dw2.p, drs.p, eps, x1.p, xe.p, xr.p, nullptr);
      {  // a given as two split-K partials whose in-order f32 sum rounds to a's bf16 values: the same bits
        std::vector<float> ab = a;
        to_bf16(ab);
        std::vector<float> part(2 * ab.size());
        for (size_t i = 0; i < ab.size(); ++i) part[i] = ab[i] * 0.75f, part[ab.size() + i] = ab[i] - part[i];
        for (size_t i = 0; i < ab.size(); ++i) ASSERT_EQ(part[i] + part[ab.size() + i], ab[i]);
        Dev<float> dh3(h.size()), xr3(h.size()), dpart(part.size());
        Dev<bf16> a3(a.size()), x13(h.size()), xe3(h.size());
        dh3.put(h), dpart.put(part);
        add_rms_norm_pre_ffn(dh3.p, a3.p, rows, n, dwp.p, dw1.p, dw2.p, drs.p, eps, x13.p, xe3.p, xr3.p, nullptr,
                             dpart.p, 2);
        const std::string w3 = "from split-K partials, rows " + std::to_string(rows) + " n " + std::to_string(n);
        const auto h1 = dh.get(), h3 = dh3.get(), r1 = xr.get(), r3 = xr3.get();
        EXPECT_EQ(0, std::memcmp(h1.data(), h3.data(), h1.size() * sizeof(float))) << w3;
        EXPECT_EQ(0, std::memcmp(r1.data(), r3.data(), r1.size() * sizeof(float))) << w3;
        const auto e1 = xe.get(), e3 = xe3.get();
        EXPECT_EQ(0, std::memcmp(e1.data(), e3.data(), e1.size() * sizeof(bf16))) << w3;
      }
      add_rms_norm(dh2.p, da.p, rows, n, dwp.p, eps, nullptr);
      pre_ffn(dh2.p, rows, n, dw1.p, dw2.p, drs.p, eps, x1b.p, xeb.p, xr2.p, nullptr);
      const std::string what = "rows " + std::to_string(rows) + " n " + std::to_string(n);
      EXPECT_LE(rel_err(dh.get(), dh2.get()), 1e-6) << what;
      EXPECT_LE(rel_err(xr.get(), xr2.get()), 1e-6) << what;
      EXPECT_LE(rel_err(from_bf16(x1.get()), from_bf16(x1b.get())), 4e-3) << what;
      EXPECT_LE(rel_err(from_bf16(xe.get()), from_bf16(xeb.get())), 4e-3) << what;
      // CPU oracle: h + rms(bf16(a); wp), then the three FFN inputs
      auto ab = from_bf16(to_bf16(a));
      std::vector<float> d(h.size()), want_h = h, e1(h.size()), er(h.size());
      cpu::rms_norm(ab.data(), rows, n, wp.data(), eps, d.data());
      for (size_t i = 0; i < h.size(); ++i) want_h[i] += d[i];
      EXPECT_LE(rel_err(dh.get(), want_h), 1e-5) << what;
      cpu::rms_norm(want_h.data(), rows, n, w1.data(), eps, e1.data());
      EXPECT_LE(rel_err(from_bf16(x1.get()), e1), 8e-3) << what;
      cpu::rms_norm(want_h.data(), rows, n, nullptr, eps, er.data());
      for (int r = 0; r < rows; ++r)
        for (int i = 0; i < n; ++i) er[size_t(r) * n + i] *= rs[size_t(i)] / std::sqrt(float(n));
      EXPECT_LE(rel_err(xr.get(), er), 1e-5) << what;
    }
  }
}

// CPU reference of the routed experts + combine: per token, its k experts in ascending id order, gate/up in double,
// the activation rounded to bf16 as the kernels store it.
std::vector<float> moe_reference(const std::vector<float>& x, const std::vector<float>& gu, const std::vector<float>& dn,
                                 const std::vector<float>& wts, const std::vector<int32_t>& idx, int T, int E, int k,
                                 int H, int I) {
  (void)E;
  std::vector<float> want(size_t(T) * H, 0.0f), g(size_t(2) * I), a(static_cast<size_t>(I));
  for (int t = 0; t < T; ++t) {
    std::vector<int> order(static_cast<size_t>(k));
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int p, int q) { return idx[size_t(t) * k + p] < idx[size_t(t) * k + q]; });
    for (int j : order) {
      const int e = idx[size_t(t) * k + j];
      for (int o = 0; o < 2 * I; ++o) {
        double s = 0;
        for (int i = 0; i < H; ++i) s += double(x[size_t(t) * H + i]) * gu[(size_t(e) * 2 * I + o) * H + i];
        g[size_t(o)] = float(s);
      }
      for (int i = 0; i < I; ++i) a[size_t(i)] = round_to_bf16(cpu::gelu_tanh(g[size_t(i)]) * g[size_t(I + i)]);
      for (int o = 0; o < H; ++o) {
        double s = 0;
        for (int i = 0; i < I; ++i) s += double(a[size_t(i)]) * dn[(size_t(e) * H + o) * I + i];
        want[size_t(t) * H + o] += wts[size_t(t) * k + j] * float(s);
      }
    }
  }
  return want;
}
// k distinct random experts per token; expert 1 unused when E > k + 1 (an empty group)
std::vector<int32_t> random_routing(int T, int E, int k) {
  std::vector<int32_t> idx(size_t(T) * k);
  for (int t = 0; t < T; ++t) {
    std::vector<int32_t> pool;
    for (int e = 0; e < E; ++e)
      if (e != 1 || E <= k + 1) pool.push_back(e);
    std::shuffle(pool.begin(), pool.end(), rng);
    for (int j = 0; j < k; ++j) idx[size_t(t) * k + j] = pool[size_t(j)];
  }
  return idx;
}

// A routing concentrated as a canvas of `distinct` repeated tokens routes: token t takes the k experts of base token
// t % distinct (k distinct random ones, never expert 1 when E > k + 1). Expert 0 is among the first four base
// tokens' experts and expert 2 among the first five (E > k + 2), so that at T = 16 distinct expert 0 gets exactly
// 64 rows and expert 2 80 (past 64: overflow rows).
std::vector<int32_t> concentrated_routing(int T, int E, int k, int distinct) {
  std::vector<int32_t> base(size_t(distinct) * k);
  for (int b = 0; b < distinct; ++b) {
    std::vector<int32_t> pool;
    for (int e = 0; e < E; ++e)
      if ((e != 1 || E <= k + 1) && !(E > k + 2 && ((e == 0 && b < 4) || (e == 2 && b < 5)))) pool.push_back(e);
    std::shuffle(pool.begin(), pool.end(), rng);
    int j = 0;
    if (E > k + 2 && b < 4) base[size_t(b) * k + j++] = 0;
    if (E > k + 2 && b < 5) base[size_t(b) * k + j++] = 2;
    for (size_t i = 0; j < k; ++i) base[size_t(b) * k + j++] = pool[i];
  }
  std::vector<int32_t> idx(size_t(T) * k);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) idx[size_t(t) * k + j] = base[size_t(t % distinct) * k + j];
  return idx;
}

// The TMA expert kernels' maps: gate_up weights, padded token rows xs, down weights, padded activations act.
struct TmaExpertMaps {
  TmaMap wgu, xm, wdn, am;
};
TmaExpertMaps tma_expert_maps(const bf16* gu, const bf16* xs, const bf16* dn, const bf16* act, int E, int H, int I,
                              int M) {
  return {tma_map_bf16_rows(gu, int64_t(E) * 2 * I, H, 64), tma_map_bf16_rows(xs, int64_t(E) * M, H, M),
          tma_map_bf16_rows(dn, int64_t(E) * H, I, 64), tma_map_bf16_rows(act, int64_t(E) * M, I, M)};
}

// router_top_k's expert masks for a routing: bit t % 32 of word e ceil(T / 32) + t / 32 iff token t chose e.
std::vector<unsigned> expert_masks_of(const std::vector<int32_t>& idx, int T, int E, int k) {
  const int words = (T + 31) / 32;
  std::vector<unsigned> m(size_t(E) * size_t(words), 0u);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) m[size_t(idx[size_t(t) * k + j]) * words + t / 32] |= 1u << (t % 32);
  return m;
}

// Words of padded row `row` of act (bf16, I wide) and y (f32, H wide) that are no longer the 0xFF poison the test
// filled them with: a kernel wrote a row it should have left alone.
int64_t unpoisoned_words(const std::vector<bf16>& act, const std::vector<float>& y, size_t row, int I, int H) {
  int64_t n = 0;
  for (int i = 0; i < I; ++i) {
    uint16_t b;
    std::memcpy(&b, &act[row * I + i], 2);
    n += b != 0xFFFF;
  }
  for (int h = 0; h < H; ++h) {
    uint32_t b;
    std::memcpy(&b, &y[row * H + h], 4);
    n += b != 0xFFFFFFFFu;
  }
  return n;
}

// The prefill expert kernels' item numbering (expert_items.h, CPU only): every (expert, weight tile, token row) is
// covered by exactly one item, each item's rows lie inside its expert's, and items of one weight tile are adjacent.
TEST(ExpertItems, PrefillItemsCoverEveryRowOnce) {
  constexpr int kTokItem = 256;
  std::mt19937 gen(7);
  for (int trial = 0; trial < 40; ++trial) {
    const int E = 1 + int(gen() % 200), tiles_n = 1 + int(gen() % 12);
    std::vector<int> offs(size_t(E) + 1, 0), item_start(size_t(E) + 1, 0);
    for (int e = 0; e < E; ++e) {
      const int kind = int(gen() % 4);  // empty, short, around a tile, several tiles
      const int rows = kind == 0 ? 0 : kind == 1 ? int(gen() % 40) : kind == 2 ? 240 + int(gen() % 40) : int(gen() % 1100);
      offs[size_t(e) + 1] = offs[size_t(e)] + rows;
      item_start[size_t(e) + 1] = item_start[size_t(e)] + expert_prefill_items(rows, tiles_n, kTokItem);
    }
    const int P = offs[size_t(E)], n_items = item_start[size_t(E)];
    std::vector<int> seen(size_t(P) * size_t(tiles_n), 0);
    int prev_e = -1, prev_nt = -1, prev_end = 0;
    for (int item = 0; item < n_items; ++item) {
      const ExpertPrefillItem m = expert_prefill_item_at(item, item_start.data(), offs.data(), E, kTokItem);
      ASSERT_TRUE(m.e >= 0 && m.e < E && m.nt >= 0 && m.nt < tiles_n) << "item " << item << " trial " << trial;
      ASSERT_TRUE(m.rows >= 1 && m.rows <= kTokItem) << "item " << item << " trial " << trial;
      ASSERT_GE(m.row0, offs[size_t(m.e)]);
      ASSERT_LE(m.row0 + m.rows, offs[size_t(m.e) + 1]);
      // a weight tile's token tiles follow each other, in row order
      const int expected_row0 = m.e == prev_e && m.nt == prev_nt ? prev_end : offs[size_t(m.e)];
      EXPECT_EQ(m.row0, expected_row0) << "item " << item;
      prev_e = m.e, prev_nt = m.nt, prev_end = m.row0 + m.rows;
      for (int r = m.row0; r < m.row0 + m.rows; ++r) ++seen[size_t(r) * size_t(tiles_n) + size_t(m.nt)];
    }
    EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), ptrdiff_t(seen.size())) << "trial " << trial;
  }
}

// The prefill wgmma expert kernels on grouped rows whose counts cross every tile edge (a warpgroup's 32 / 64 / 128
// token columns, an item's 256, empty experts), against a double CPU reference: act from the bf16 token rows, y from
// the kernel's own act (so each GEMM is checked alone). Packed weights must give the same bits, and no row past P may
// be written.
TEST(CudaKernels, MoePrefillExpertsWgmma) {
  REQUIRE_GPU();
  if (!experts_prefill_supported(8, 256, 192)) GTEST_SKIP() << "the prefill wgmma expert kernels need an sm_90a device";
  for (const auto& [H, I, counts] :
       {std::tuple{256, 192, std::vector<int>{0, 1, 33, 128, 129, 256, 300, 65}},
        std::tuple{384, 128, std::vector<int>{257, 64, 0, 511, 31, 2, 0, 97}},
        std::tuple{128, 64, std::vector<int>{0, 0, 600}},
        // more experts than a warp's lanes (the item prefix over several chunks), zeros among them
        std::tuple{128, 64, [] {
                     std::vector<int> c(70);
                     for (size_t e = 0; e < c.size(); ++e) c[e] = int((e * 37) % 11 == 3 ? 0 : (e * 53) % 41);
                     return c;
                   }()}}) {
    const int E = int(counts.size());
    std::vector<int32_t> offs(size_t(E) + 1, 0);
    for (int e = 0; e < E; ++e) offs[size_t(e) + 1] = offs[size_t(e)] + counts[size_t(e)];
    const int P = offs[size_t(E)], pad = 40;  // rows past P: poison that must survive
    auto x = rnd(size_t(P) * H), gu = rnd(size_t(E) * 2 * I * H, -0.1f, 0.1f), dn = rnd(size_t(E) * H * I, -0.1f, 0.1f);
    Dev<bf16> dx(x.size()), dgu(gu.size()), ddn(dn.size()), act(size_t(P + pad) * I);
    Dev<int32_t> doff(offs.size());
    Dev<float> y(size_t(P + pad) * H);
    dx.put(to_bf16(x)), dgu.put(to_bf16(gu)), ddn.put(to_bf16(dn)), doff.put(offs);
    CUDA_CHECK(cudaMemset(act.p, 0xFF, size_t(P + pad) * I * sizeof(bf16)));
    CUDA_CHECK(cudaMemset(y.p, 0xFF, size_t(P + pad) * H * sizeof(float)));
    const TmaMap gu_map = tma_map_bf16_rows(dgu.p, int64_t(E) * 2 * I, H, 64);
    const TmaMap dn_map = tma_map_bf16_rows(ddn.p, int64_t(E) * H, I, 64);
    moe_gate_up_prefill_tma(gu_map, nullptr, dx.p, doff.p, E, P, H, I, act.p, nullptr);
    moe_down_prefill_tma(dn_map, nullptr, act.p, doff.p, E, P, H, I, y.p, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    const auto a16 = act.get();
    const auto a = from_bf16(a16);
    const auto yy = y.get();
    const std::string what = "H " + std::to_string(H) + " I " + std::to_string(I) + " E " + std::to_string(E);
    std::vector<float> act_ref(size_t(P) * I), y_ref(size_t(P) * H);
    for (int e = 0; e < E; ++e)
      for (int r = offs[size_t(e)]; r < offs[size_t(e) + 1]; ++r) {
        for (int i = 0; i < I; ++i) {
          double g = 0, u = 0;
          for (int k = 0; k < H; ++k) {
            g += double(x[size_t(r) * H + k]) * gu[(size_t(e) * 2 * I + i) * H + k];
            u += double(x[size_t(r) * H + k]) * gu[(size_t(e) * 2 * I + I + i) * H + k];
          }
          act_ref[size_t(r) * I + i] = cpu::gelu_tanh(float(g)) * float(u);
        }
        for (int h = 0; h < H; ++h) {
          double v = 0;
          for (int i = 0; i < I; ++i) v += double(a[size_t(r) * I + i]) * dn[(size_t(e) * H + h) * I + i];
          y_ref[size_t(r) * H + h] = float(v);
        }
      }
    EXPECT_LE(rel_err(std::vector<float>(a.begin(), a.begin() + ptrdiff_t(act_ref.size())), act_ref), 8e-3) << what;
    EXPECT_LE(rel_err(std::vector<float>(yy.begin(), yy.begin() + ptrdiff_t(y_ref.size())), y_ref), 2e-4) << what;
    int64_t touched = 0;
    for (size_t r = size_t(P); r < size_t(P + pad); ++r) touched += unpoisoned_words(a16, yy, r, I, H);
    EXPECT_EQ(touched, 0) << "rows past P written, " << what;
    // Packed weights: the same shared-memory stages, so the same bits; these runs also claim their items from
    // counters (CudaOptions::prefill_item_counter), which must not change a bit and must be left zeroed.
    Dev<unsigned> items(2);
    CUDA_CHECK(cudaMemset(items.p, 0, 2 * sizeof(unsigned)));
    Dev<bf16> gu_pk(gu.size()), dn_pk(dn.size()), act_pk(size_t(P + pad) * I);
    Dev<float> y_pk(size_t(P + pad) * H);
    Dev<bf16> y16(size_t(P + pad) * H);
    pack_expert_gate_up(dgu.p, gu_pk.p, E, H, I, nullptr);
    pack_expert_down(ddn.p, dn_pk.p, E, H, I, nullptr);
    CUDA_CHECK(cudaMemset(y_pk.p, 0xFF, size_t(P + pad) * H * sizeof(float)));
    CUDA_CHECK(cudaMemset(y16.p, 0xFF, size_t(P + pad) * H * sizeof(bf16)));
    moe_gate_up_prefill_tma(gu_map, gu_pk.p, dx.p, doff.p, E, P, H, I, act_pk.p, nullptr, items.p);
    moe_down_prefill_tma(dn_map, dn_pk.p, act.p, doff.p, E, P, H, I, y_pk.p, nullptr, items.p);
    moe_down_prefill_tma(dn_map, nullptr, act.p, doff.p, E, P, H, I, y16.p, nullptr, items.p);
    const auto ap = act_pk.get();
    const auto yp = y_pk.get();
    EXPECT_EQ(items.get(), (std::vector<unsigned>{0u, 0u})) << "item counters left zeroed, " << what;
    EXPECT_EQ(std::memcmp(ap.data(), a16.data(), size_t(P) * I * sizeof(bf16)), 0) << "packed gate_up, " << what;
    EXPECT_EQ(std::memcmp(yp.data(), yy.data(), size_t(P + pad) * H * sizeof(float)), 0) << "packed down, " << what;
    expect_bf16_rounding(yy, y16.get(), "prefill down, bf16 y, " + what);
    // Deterministic: a second run gives the same bits.
    moe_gate_up_prefill_tma(gu_map, nullptr, dx.p, doff.p, E, P, H, I, act_pk.p, nullptr);
    const auto a2 = act_pk.get();
    EXPECT_EQ(std::memcmp(a2.data(), a16.data(), size_t(P) * I * sizeof(bf16)), 0) << "rerun, " << what;
  }
}

TEST(CudaKernels, MoeGroupedExperts) {
  REQUIRE_GPU();
  for (auto [T, E, k, H, I] : {std::tuple{37, 6, 2, 40, 24}, std::tuple{300, 16, 4, 136, 72},
                               std::tuple{40, 16, 8, 2816, 704},
                               // > 64 rows per expert (several m-tiles) with a deep k pipeline and a ragged K tail
                               std::tuple{200, 8, 4, 1000, 200},
                               // ~300 rows per expert (prefill kernel: several m-tiles in one ring), one unused expert
                               std::tuple{600, 4, 2, 264, 88},
                               // the same kernel on shapes with a packed gate_up layout (checked below)
                               std::tuple{600, 4, 2, 256, 128}}) {
    auto x = rnd(size_t(T) * H), gu = rnd(size_t(E) * 2 * I * H, -0.1f, 0.1f), dn = rnd(size_t(E) * H * I, -0.1f, 0.1f);
    auto wts = rnd(size_t(T) * k, 0.1f, 1.0f);
    auto idx = random_routing(T, E, k);
    Dev<bf16> dx(x.size()), dgu(gu.size()), ddn(dn.size()), xs(idx.size() * H), act(idx.size() * I);
    Dev<int32_t> didx(idx.size()), off(size_t(E) + 1), spos(idx.size());
    Dev<float> y(idx.size() * H), dw(wts.size()), out(size_t(T) * H);
    dx.put(to_bf16(x)), dgu.put(to_bf16(gu)), ddn.put(to_bf16(dn)), didx.put(idx), dw.put(wts);
    moe_group(didx.p, T, k, E, dx.p, H, off.p, spos.p, xs.p, nullptr);
    moe_gate_up(xs.p, off.p, E, T * k, dgu.p, H, I, act.p, nullptr);
    moe_down(act.p, off.p, E, T * k, ddn.p, H, I, y.p, nullptr);
    moe_combine(y.p, didx.p, dw.p, spos.p, T, k, H, out.p, nullptr);
    if (expert_gate_up_packable(H, I)) {  // packed weights: the same smem tiles, so bitwise the same act
      Dev<bf16> dgu_pk(gu.size()), act_pk(idx.size() * I);
      pack_expert_gate_up(dgu.p, dgu_pk.p, E, H, I, nullptr);
      moe_gate_up(xs.p, off.p, E, T * k, dgu_pk.p, H, I, act_pk.p, nullptr, nullptr, true);
      const auto a = act.get(), ap = act_pk.get();
      EXPECT_EQ(std::memcmp(a.data(), ap.data(), a.size() * sizeof(bf16)), 0)
          << "grouped gate_up on packed weights, T " << T << " E " << E << " H " << H;
    }
    if (expert_down_packable(H, I)) {  // and y
      Dev<bf16> ddn_pk(dn.size());
      Dev<float> y_pk(idx.size() * H);
      pack_expert_down(ddn.p, ddn_pk.p, E, H, I, nullptr);
      moe_down(act.p, off.p, E, T * k, ddn_pk.p, H, I, y_pk.p, nullptr, nullptr, true);
      const auto yy = y.get(), yp = y_pk.get();
      EXPECT_EQ(std::memcmp(yy.data(), yp.data(), yy.size() * sizeof(float)), 0)
          << "grouped down on packed weights, T " << T << " E " << E << " H " << H;
    }
    {  // bf16 output rows (ExpertRows)
      Dev<bf16> y16(idx.size() * H);
      moe_down(act.p, off.p, E, T * k, ddn.p, H, I, y16.p, nullptr);
      expect_bf16_rounding(y.get(), y16.get(), "grouped down, bf16 y, T " + std::to_string(T) + " H " + std::to_string(H));
    }
    auto offs = off.get();
    EXPECT_EQ(offs[size_t(E)], T * k);
    EXPECT_LE(rel_err(out.get(), moe_reference(x, gu, dn, wts, idx, T, E, k, H, I)), 1e-2)
        << "T " << T << " E " << E << " H " << H;
  }
}

// The padded path of canvas-sized passes: moe_group_padded, strided-batched cuBLASLt GEMMs over E x M rows,
// gelu_mul, and the grouped kernels for the overflow rows (M forced below the busiest experts' counts).
TEST(CudaKernels, MoePaddedExperts) {
  REQUIRE_GPU();
  Gemm gemm;
  for (auto [T, E, k, H, I, M] : {std::tuple{40, 16, 8, 96, 64, 16}, std::tuple{37, 6, 2, 40, 24, 16},
                                  std::tuple{64, 128, 8, 2816, 704, moe_padded_rows_per_expert(256, 8, 128)}}) {
    auto x = rnd(size_t(T) * H), gu = rnd(size_t(E) * 2 * I * H, -0.1f, 0.1f), dn = rnd(size_t(E) * H * I, -0.1f, 0.1f);
    auto wts = rnd(size_t(T) * k, 0.1f, 1.0f);
    auto idx = random_routing(T, E, k);
    const size_t rows = size_t(E) * M + idx.size();
    Dev<bf16> dx(x.size()), dgu(gu.size()), ddn(dn.size()), xs(rows * H), act(rows * I);
    Dev<int32_t> didx(idx.size()), ovf(size_t(E) + 1), spos(idx.size()), meta(2 * size_t(E) + 1);
    Dev<float> y(rows * H), g(rows * 2 * I), dw(wts.size()), out(size_t(T) * H);
    dx.put(to_bf16(x)), dgu.put(to_bf16(gu)), ddn.put(to_bf16(dn)), didx.put(idx), dw.put(wts);
    moe_group_padded(didx.p, T, k, E, dx.p, H, M, ovf.p, spos.p, xs.p, nullptr, meta.p);
    gemm.linear_batched(xs.p, Dt::BF16, M, dgu.p, Dt::BF16, 2 * I, H, g.p, Dt::F32, E, nullptr);
    moe_gelu_mul_padded(g.p, E, M, I, meta.p, act.p, nullptr);
    moe_gate_up(xs.p, ovf.p, E, T * k, dgu.p, H, I, act.p, nullptr, meta.p);  // overflow rows: listed experts
    gemm.linear_batched(act.p, Dt::BF16, M, ddn.p, Dt::BF16, H, I, y.p, Dt::F32, E, nullptr);
    moe_down(act.p, ovf.p, E, T * k, ddn.p, H, I, y.p, nullptr, meta.p);
    moe_combine(y.p, didx.p, dw.p, spos.p, T, k, H, out.p, nullptr);
    {  // the overflow rows alone into fresh buffers, f32 and bf16 (ExpertRows)
      Dev<float> y_o(rows * H);
      Dev<bf16> y_o16(rows * H);
      moe_down(act.p, ovf.p, E, T * k, ddn.p, H, I, y_o.p, nullptr, meta.p);
      moe_down(act.p, ovf.p, E, T * k, ddn.p, H, I, y_o16.p, nullptr, meta.p);
      if (M == 16 && E == 16) expect_bf16_rounding(y_o.get(), y_o16.get(), "overflow down, bf16 y");
    }
    // the overflow rows are exactly the pairs past M of each expert; meta lists those experts and the padded rows
    std::vector<int> cnt(static_cast<size_t>(E), 0);
    for (int e : idx) ++cnt[size_t(e)];
    int overflow = 0;
    std::vector<int32_t> want_list;
    for (int e = 0; e < E; ++e) {
      overflow += std::max(0, cnt[size_t(e)] - M);
      if (cnt[size_t(e)] > M) want_list.push_back(e);
    }
    auto o = ovf.get();
    auto mt = meta.get();
    EXPECT_EQ(o[size_t(E)] - o[0], overflow) << "E " << E << " M " << M;
    ASSERT_EQ(mt[0], int32_t(want_list.size())) << "E " << E << " M " << M;
    for (size_t j = 0; j < want_list.size(); ++j) EXPECT_EQ(mt[1 + j], want_list[j]);
    for (int e = 0; e < E; ++e) EXPECT_EQ(mt[size_t(1 + E + e)], std::min(cnt[size_t(e)], M)) << "expert " << e;
    if (M == 16 && E == 16) {
      EXPECT_GT(overflow, 0) << "the case meant to overflow does not";
    }
    EXPECT_LE(rel_err(out.get(), moe_reference(x, gu, dn, wts, idx, T, E, k, H, I)), 1e-2)
        << "T " << T << " E " << E << " H " << H << " M " << M;
  }
}

// The Hopper TMA expert kernels of the padded path (gate_up + GELU, then down; kernels_experts_tma.cu) against a
// CPU double reference and against the cuBLASLt path (linear_batched f32 + moe_gelu_mul_padded, linear_batched) on
// moe_group_padded's rows: every valid row checked; padding rows (poisoned NaN in xs and act) must neither leak into
// valid outputs nor be written; overflow rows (past 32) are not their job. random_routing leaves expert 1 empty
// (E > k + 1), which is also some block's FIRST tile (run regardless: its weights are requested before the PDL
// wait). Bitwise equal across: a repeat run, a launch on 5 SMs (the 8-stage ring), PDL off, an L2 prefetch, and a
// grid of 7 blocks with 5-stage rings, three 3-stage blocks per SM; and gate_up reading the token rows straight from x
// (moe_gate_up_padded_tma_gathered) bitwise equal to gate_up on the gathered copy, with its tiles by the fixed stride
// or from the atomic counter (TmaExpertsPlan::tile_counters, left zeroed) on three grids, and with each expert's
// tokens from router_top_k-style masks (moe_gate_up_padded_tma_masked; the case with E = 3 overflows 32 rows); and the
// fused gate_up + down launch (moe_experts_fused_tma_masked) bitwise equal to both, on three plans.
// Awkward sizes: nk = K / 64 below the ring depth (down with I = 64: one k slice), one tile per expert, persistent
// blocks over many tiles (the real shape). Skips where the kernels do not run (not an sm_90 GPU with the sm_90a image).
TEST(CudaKernels, MoeExpertsPaddedTma) {
  REQUIRE_GPU();
  constexpr int M = 32;
  Gemm gemm;
  for (auto [T, E, k, H, I, distinct] :
       {std::tuple{256, 128, 8, 2816, 704, 0}, std::tuple{20, 5, 2, 256, 64, 0}, std::tuple{100, 3, 1, 384, 128, 0},
        std::tuple{50, 7, 3, 128, 192, 0},
        // a concentrated routing: experts of 16 to 80 rows (the fused launch's second token tile, its overflow)
        std::tuple{256, 128, 8, 2816, 704, 16}}) {
    if (!experts_tma_supported(M, H, I)) GTEST_SKIP() << "the TMA expert kernels need an sm_90 GPU (sm_90a image)";
    auto x = rnd(size_t(T) * H), gu = rnd(size_t(E) * 2 * I * H, -0.1f, 0.1f), dn = rnd(size_t(E) * H * I, -0.1f, 0.1f);
    auto idx = distinct > 0 ? concentrated_routing(T, E, k, distinct) : random_routing(T, E, k);
    const size_t rows = size_t(E) * M + idx.size();
    Dev<bf16> dx(x.size()), dgu(gu.size()), ddn(dn.size()), xs(rows * H), act(rows * I), act2(rows * I);
    Dev<bf16> act3(rows * I), act4(rows * I), act5(rows * I), act6(rows * I), act7(rows * I), act8(rows * I);
    Dev<bf16> act_lt(rows * I), act9(rows * I), act10(rows * I), act11(rows * I), act12(rows * I), act13(rows * I);
    const auto host_masks = expert_masks_of(idx, T, E, k);
    Dev<unsigned> dmasks(host_masks.size());
    dmasks.put(host_masks);
    Dev<unsigned> tile_ctr(2);
    CUDA_CHECK(cudaMemset(tile_ctr.p, 0, 2 * sizeof(unsigned)));
    Dev<int32_t> didx(idx.size()), ovf(size_t(E) + 1), spos(idx.size()), meta(2 * size_t(E) + 1);
    Dev<int32_t> slot(size_t(E) * M);
    Dev<float> y(rows * H), y2(rows * H), y3(rows * H), y4(rows * H), y5(rows * H), y6(rows * H), y7(rows * H);
    Dev<float> y_lt(rows * H);
    Dev<float> g(rows * 2 * I);
    // the fused gate_up + down launch, three plans: its act and y, and its counters (2 + E)
    Dev<bf16> act_f1(rows * I), act_f2(rows * I), act_f3(rows * I);
    Dev<float> y_f1(rows * H), y_f2(rows * H), y_f3(rows * H);
    Dev<unsigned> fused_ctr(2 + size_t(E));
    CUDA_CHECK(cudaMemset(fused_ctr.p, 0, fused_ctr.n * sizeof(unsigned)));
    dx.put(to_bf16(x)), dgu.put(to_bf16(gu)), ddn.put(to_bf16(dn)), didx.put(idx);
    // moe_group_padded in its two halves, so that the gathered gate_up below sees the same slots as xs
    moe_assign_padded(didx.p, T, k, E, M, ovf.p, spos.p, meta.p, slot.p, nullptr);
    moe_gather(spos.p, T, k, dx.p, H, xs.p, nullptr);
    const auto [wgu, xm, wdn, am] = tma_expert_maps(dgu.p, xs.p, ddn.p, act.p, E, H, I, M);
    const int32_t* valid = meta.p + 1 + E;
    ASSERT_TRUE(pdl_enabled());
    moe_gate_up_padded_tma(wgu, xm, valid, E, H, I, act2.p, nullptr, {.sms = 5});
    moe_gate_up_padded_tma(wgu, xm, valid, E, H, I, act.p, nullptr);
    // repeat, the first round's tiles permuted (the fixed stride after it)
    moe_gate_up_padded_tma(wgu, xm, valid, E, H, I, act3.p, nullptr, {.first_tile_stride = 5});
    moe_gate_up_padded_tma(wgu, xm, valid, E, H, I, act5.p, nullptr, {.l2_prefetch_slices = 6});
    moe_gate_up_padded_tma(wgu, xm, valid, E, H, I, act6.p, nullptr, {.grid = 7, .stages = 5});
    moe_down_padded_tma(wdn, am, valid, E, H, I, y2.p, nullptr, {.sms = 5});
    moe_down_padded_tma(wdn, am, valid, E, H, I, y.p, nullptr);
    moe_down_padded_tma(wdn, am, valid, E, H, I, y3.p, nullptr);
    moe_down_padded_tma(wdn, am, valid, E, H, I, y5.p, nullptr, {.l2_prefetch_slices = 6});
    moe_down_padded_tma(wdn, am, valid, E, H, I, y6.p, nullptr, {.grid = 7, .stages = 5});
    moe_gate_up_padded_tma(wgu, xm, valid, E, H, I, act7.p, nullptr, {.grid = 1000, .stages = 3});
    moe_gate_up_padded_tma_gathered(wgu, dx.p, slot.p, valid, E, H, I, act8.p, nullptr);
    // tiles from the counter: the default grid, 7 blocks (many tiles each), and a grid past the tile count (blocks
    // without a first tile of their own); the counter must come back zeroed after each
    moe_gate_up_padded_tma_gathered(wgu, dx.p, slot.p, valid, E, H, I, act9.p, nullptr, {.tile_counters = tile_ctr.p});
    const auto ctr_after_default = tile_ctr.get();
    moe_gate_up_padded_tma_gathered(wgu, dx.p, slot.p, valid, E, H, I, act10.p, nullptr,
                                    {.grid = 7, .stages = 5, .tile_counters = tile_ctr.p});
    moe_gate_up_padded_tma_gathered(wgu, dx.p, slot.p, valid, E, H, I, act11.p, nullptr,
                                    {.grid = 1000, .stages = 3, .tile_counters = tile_ctr.p});
    // each expert's tokens from the router's masks instead of the assignment (slot_token, row counts)
    moe_gate_up_padded_tma_masked(wgu, dx.p, dmasks.p, T, E, H, I, act12.p, nullptr, {.tile_counters = tile_ctr.p});
    moe_gate_up_padded_tma_masked(wgu, dx.p, dmasks.p, T, E, H, I, act13.p, nullptr, {.grid = 7, .stages = 5});
    moe_down_padded_tma(wdn, am, valid, E, H, I, y7.p, nullptr, {.grid = 1000, .stages = 3});
    moe_experts_fused_tma_masked(wgu, wdn, dx.p, dmasks.p, T, E, H, I, act_f1.p, y_f1.p, nullptr,
                                 {.tile_counters = fused_ctr.p});
    moe_experts_fused_tma_masked(wgu, wdn, dx.p, dmasks.p, T, E, H, I, act_f2.p, y_f2.p, nullptr,
                                 {.grid = 7, .stages = 5, .tile_counters = fused_ctr.p});
    moe_experts_fused_tma_masked(wgu, wdn, dx.p, dmasks.p, T, E, H, I, act_f3.p, y_f3.p, nullptr,
                                 {.grid = 1000, .stages = 3, .tile_counters = fused_ctr.p});
    // The same launch with the tile timeline on (its own kernel instantiation): the same outputs bit for bit, one
    // entry record per block and one record per tile, every tile of an expert with rows among them exactly once.
    Dev<bf16> act_ftl(rows * I);
    Dev<float> y_ftl(rows * H);
    experts_timeline_begin(size_t(1) << 16);
    moe_experts_fused_tma_masked(wgu, wdn, dx.p, dmasks.p, T, E, H, I, act_ftl.p, y_ftl.p, nullptr,
                                 {.stages = 3, .tile_counters = fused_ctr.p});  // the instantiation the engine runs
    const auto timeline = experts_timeline_end();
    {
      const int n_gate = E * (I / 64), n_tiles = n_gate + E * (H / 128);
      std::vector<int> seen(size_t(n_tiles), 0);
      int entries = 0;
      for (const auto& r : timeline) {
        if (r.tile == -1) {
          ++entries;
          EXPECT_LE(r.t0, r.t1);
          continue;
        }
        ASSERT_TRUE(r.tile >= 0 && r.tile < n_tiles) << r.tile;
        ++seen[size_t(r.tile)];
        EXPECT_TRUE(r.t_req <= r.t0 && r.t0 <= r.t1) << "tile " << r.tile;
      }
      int sms = 0;
      CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
      EXPECT_EQ(entries, std::min(n_gate, 3 * sms)) << "one entry record per block (the default grid)";
      for (int e = 0; e < E; ++e) {
        int cnt = 0;
        for (int w = 0; w < (T + 31) / 32; ++w) cnt += __builtin_popcount(host_masks[size_t(e) * ((T + 31) / 32) + w]);
        if (cnt == 0) continue;  // its tiles are skipped (but for a block's first tile)
        for (int nt = 0; nt < I / 64; ++nt) EXPECT_EQ(1, seen[size_t(e * (I / 64) + nt)]) << e << " " << nt;
        for (int nt = 0; nt < H / 128; ++nt)
          EXPECT_EQ(1, seen[size_t(n_gate + e * (H / 128) + nt)]) << "down tile of expert " << e;
      }
      const auto af1_bits = act_f1.get(), atl_bits = act_ftl.get();  // bitwise: the unwritten padding holds NaNs
      EXPECT_EQ(0, std::memcmp(af1_bits.data(), atl_bits.data(), af1_bits.size() * sizeof(bf16)));
      const auto yf1_bits = y_f1.get(), ytl_bits = y_ftl.get();
      EXPECT_EQ(0, std::memcmp(yf1_bits.data(), ytl_bits.data(), yf1_bits.size() * 4));
      // The same outputs with next tiles claimed at a tile's last stage, at its first (claim_ahead past every tile's
      // length) and 2 before on 7 blocks, each with the first round's tiles permuted (first_tile_stride: 97 and 5 are
      // coprime to the default grids; 7 on 7 blocks falls back to tile b).
      for (const auto& [ahead, grid, stride] : {std::tuple{1, 0, 97}, std::tuple{64, 0, 5}, std::tuple{2, 7, 7}}) {
        Dev<bf16> act_c(rows * I);
        Dev<float> y_c(rows * H);
        moe_experts_fused_tma_masked(wgu, wdn, dx.p, dmasks.p, T, E, H, I, act_c.p, y_c.p, nullptr,
                                     {.grid = grid, .stages = grid ? 5 : 4, .tile_counters = fused_ctr.p,
                                      .claim_ahead = ahead, .first_tile_stride = stride});
        const auto ac = act_c.get();
        const auto yc_bits = y_c.get();
        EXPECT_EQ(0, std::memcmp(af1_bits.data(), ac.data(), ac.size() * sizeof(bf16))) << "claim_ahead " << ahead;
        EXPECT_EQ(0, std::memcmp(yf1_bits.data(), yc_bits.data(), yc_bits.size() * 4)) << "claim_ahead " << ahead;
      }
    }
    // The packed gate_up layout (1D bulk copies of pre-swizzled stages) through every producer path: token rows from
    // the xs map, from x by slot_token, from the masks, the fused launch (with an L2 prefetch); 5 SMs (8-stage ring),
    // an L2 prefetch.
    ASSERT_TRUE(expert_gate_up_packable(H, I));
    Dev<bf16> dgu_pk(gu.size());
    pack_expert_gate_up(dgu.p, dgu_pk.p, E, H, I, nullptr);
    Dev<bf16> act_pk(6 * rows * I);  // six outputs side by side
    auto pk = [&](int i) { return act_pk.p + size_t(i) * rows * I; };
    Dev<float> y_fpk(rows * H);
    moe_gate_up_padded_tma(wgu, xm, valid, E, H, I, pk(0), nullptr, {.gate_up_packed = dgu_pk.p});
    moe_gate_up_padded_tma(wgu, xm, valid, E, H, I, pk(1), nullptr,
                           {.sms = 5, .l2_prefetch_slices = 6, .gate_up_packed = dgu_pk.p});
    moe_gate_up_padded_tma_gathered(wgu, dx.p, slot.p, valid, E, H, I, pk(2), nullptr,
                                    {.tile_counters = tile_ctr.p, .gate_up_packed = dgu_pk.p});
    moe_gate_up_padded_tma_masked(wgu, dx.p, dmasks.p, T, E, H, I, pk(3), nullptr,
                                  {.tile_counters = tile_ctr.p, .gate_up_packed = dgu_pk.p});
    moe_gate_up_padded_tma_masked(wgu, dx.p, dmasks.p, T, E, H, I, pk(4), nullptr,
                                  {.grid = 7, .stages = 5, .gate_up_packed = dgu_pk.p});
    // The fused launch with the producer's L2 prefetch of 3 more stages of its first tile, and only one ring stage
    // requested before the PDL wait: the results must not move.
    moe_experts_fused_tma_masked(wgu, wdn, dx.p, dmasks.p, T, E, H, I, pk(5), y_fpk.p, nullptr,
                                 {.l2_prefetch_slices = 3, .prewait_stages = 1, .tile_counters = fused_ctr.p,
                                  .gate_up_packed = dgu_pk.p});
    // Packed down weights, and down's row counts from the masks: the plain kernel (all SMs; 5 SMs with an L2
    // prefetch), the masked one with and without packing, and the fused launch with both packed (7 blocks).
    ASSERT_TRUE(expert_down_packable(H, I));
    Dev<bf16> ddn_pk(dn.size());
    pack_expert_down(ddn.p, ddn_pk.p, E, H, I, nullptr);
    Dev<float> y_pk(5 * rows * H);  // five outputs side by side
    auto ypk = [&](int i) { return y_pk.p + size_t(i) * rows * H; };
    Dev<bf16> act_fpk2(rows * I);
    moe_down_padded_tma(wdn, am, valid, E, H, I, ypk(0), nullptr, {.down_packed = ddn_pk.p});
    moe_down_padded_tma(wdn, am, valid, E, H, I, ypk(1), nullptr,
                        {.sms = 5, .l2_prefetch_slices = 6, .down_packed = ddn_pk.p});
    moe_down_padded_tma_masked(wdn, am, dmasks.p, T, E, H, I, ypk(2), nullptr);
    moe_down_padded_tma_masked(wdn, am, dmasks.p, T, E, H, I, ypk(3), nullptr,
                               {.grid = 7, .stages = 5, .down_packed = ddn_pk.p});
    moe_experts_fused_tma_masked(wgu, wdn, dx.p, dmasks.p, T, E, H, I, act_fpk2.p, ypk(4), nullptr,
                                 {.grid = 7, .stages = 5, .prewait_stages = 0, .tile_counters = fused_ctr.p,
                                  .gate_up_packed = dgu_pk.p, .down_packed = ddn_pk.p});
    set_pdl(false);
    moe_gate_up_padded_tma(wgu, xm, valid, E, H, I, act4.p, nullptr);
    moe_down_padded_tma(wdn, am, valid, E, H, I, y4.p, nullptr);
    set_pdl(true);
    // cuBLASLt: f32 gate/up + the GELU pass; down from the TMA kernel's own act (so each kernel is checked alone)
    gemm.linear_batched(xs.p, Dt::BF16, M, dgu.p, Dt::BF16, 2 * I, H, g.p, Dt::F32, E, nullptr);
    moe_gelu_mul_padded(g.p, E, M, I, meta.p, act_lt.p, nullptr);
    gemm.linear_batched(act.p, Dt::BF16, M, ddn.p, Dt::BF16, H, I, y_lt.p, Dt::F32, E, nullptr);
    const auto a1 = act.get(), a2 = act2.get(), a3 = act3.get(), a4 = act4.get(), a5 = act5.get();
    const auto a6 = act6.get(), a7 = act7.get(), a8 = act8.get(), a9 = act9.get(), a10 = act10.get();
    const auto a11 = act11.get(), a12 = act12.get(), a13 = act13.get();
    const auto ctr_after = tile_ctr.get();
    const auto fused_ctr_after = fused_ctr.get();
    const auto af1 = act_f1.get(), af2 = act_f2.get(), af3 = act_f3.get();
    const auto yf1 = y_f1.get(), yf2 = y_f2.get(), yf3 = y_f3.get();
    const auto y1 = y.get(), yb = y2.get(), yc = y3.get(), yd = y4.get(), ye = y5.get();
    const auto yf = y6.get(), yg = y7.get();
    const auto mt = meta.get();
    const auto hx = from_bf16(xs.get()), ha = from_bf16(a1), hlt = from_bf16(act_lt.get());
    const auto ylt = y_lt.get();
    std::vector<float> got_a, want_a, got_y, want_y, got_a_all, lt_a_all, got_y_all, lt_y_all;
    int64_t padding_written = 0;
    int empty_experts = 0;
    // The CPU double reference on every 8th expert at the real shape (all of them would take minutes); cuBLASLt on all.
    const int cpu_stride = E >= 64 ? 8 : 1;
    for (int e = 0; e < E; ++e) {
      const int n = mt[size_t(1 + E + e)];
      empty_experts += n == 0;
      for (int t = 0; t < M; ++t) {
        const size_t row = size_t(e) * M + t;
        if (t >= n) {
          padding_written += unpoisoned_words(a1, y1, row, I, H);
          continue;
        }
        for (int i = 0; i < I; ++i) got_a_all.push_back(ha[row * I + i]), lt_a_all.push_back(hlt[row * I + i]);
        for (int h = 0; h < H; ++h) got_y_all.push_back(y1[row * H + h]), lt_y_all.push_back(ylt[row * H + h]);
        if (e % cpu_stride != 0) continue;
        for (int i = 0; i < I; ++i) {
          double gg = 0, u = 0;
          for (int h = 0; h < H; ++h) {
            const double xv = hx[row * H + h];
            gg += xv * gu[(size_t(e) * 2 * I + i) * H + h];
            u += xv * gu[(size_t(e) * 2 * I + I + i) * H + h];
          }
          want_a.push_back(float(double(cpu::gelu_tanh(float(gg))) * u));
          got_a.push_back(ha[row * I + i]);
        }
        for (int h = 0; h < H; ++h) {
          double acc = 0;
          for (int i = 0; i < I; ++i) acc += double(ha[row * I + i]) * dn[(size_t(e) * H + h) * I + i];
          want_y.push_back(float(acc));
          got_y.push_back(y1[row * H + h]);
        }
      }
    }
    int overflow = 0;
    {
      std::vector<int> cnt(size_t(E), 0);
      for (int e : idx) ++cnt[size_t(e)];
      for (int c : cnt) overflow += std::max(0, c - M);
    }
    const std::string what = "T " + std::to_string(T) + " E " + std::to_string(E) + " H " + std::to_string(H) +
                             " I " + std::to_string(I);
    ASSERT_FALSE(want_a.empty());
    EXPECT_GT(empty_experts, 0) << "routing meant to leave an expert empty does not, " << what;
    EXPECT_LE(rel_err(got_a, want_a), 1e-2) << "gate_up vs CPU, " << what;
    EXPECT_LE(rel_err(got_y, want_y), 1e-3) << "down vs CPU, " << what;
    EXPECT_LE(rel_err(got_a_all, lt_a_all), 1e-2) << "gate_up vs cuBLASLt + GELU pass, " << what;
    EXPECT_LE(rel_err(got_y_all, lt_y_all), 1e-4) << "down vs cuBLASLt, " << what;
    EXPECT_EQ(padding_written, 0) << "padding rows of act / y written, " << what;
    auto same = [](const auto& u, const auto& v) {
      return u.size() == v.size() && std::memcmp(u.data(), v.data(), u.size() * sizeof(u[0])) == 0;
    };
    EXPECT_TRUE(same(a1, a2)) << "gate_up: 5 SMs vs all, " << what;
    EXPECT_TRUE(same(a1, a3)) << "gate_up: repeat, " << what;
    EXPECT_TRUE(same(a1, a4)) << "gate_up: PDL off, " << what;
    EXPECT_TRUE(same(a1, a5)) << "gate_up: L2 prefetch, " << what;
    EXPECT_TRUE(same(a1, a6)) << "gate_up: 7 blocks of 5 stages, " << what;
    EXPECT_TRUE(same(a1, a7)) << "gate_up: three 3-stage blocks per SM, " << what;
    EXPECT_TRUE(same(a1, a8)) << "gate_up: token rows read from x (slot_token) instead of the gathered xs, " << what;
    EXPECT_TRUE(same(a1, a9)) << "gate_up from x, tiles from the counter, " << what;
    EXPECT_TRUE(same(a1, a10)) << "gate_up from x, tiles from the counter, 7 blocks, " << what;
    EXPECT_TRUE(same(a1, a11)) << "gate_up from x, tiles from the counter, grid past the tiles, " << what;
    EXPECT_TRUE(same(a1, a12)) << "gate_up from x, tokens from the expert masks, tiles from the counter, " << what;
    EXPECT_TRUE(same(a1, a13)) << "gate_up from x, tokens from the expert masks, 7 blocks, " << what;
    EXPECT_EQ(ctr_after_default, (std::vector<unsigned>{0u, 0u})) << "tile counters not left zeroed, " << what;
    EXPECT_EQ(ctr_after, (std::vector<unsigned>{0u, 0u})) << "tile counters not left zeroed, " << what;
    EXPECT_TRUE(same(y1, yb)) << "down: 5 SMs vs all, " << what;
    EXPECT_TRUE(same(y1, yc)) << "down: repeat, " << what;
    EXPECT_TRUE(same(y1, yd)) << "down: PDL off, " << what;
    EXPECT_TRUE(same(y1, ye)) << "down: L2 prefetch, " << what;
    EXPECT_TRUE(same(y1, yf)) << "down: 7 blocks of 5 stages, " << what;
    EXPECT_TRUE(same(y1, yg)) << "down: three 3-stage blocks per SM, " << what;
    // The fused launch: act as the masked gate_up (padding rows untouched, as a1's), y as down on that act.
    EXPECT_TRUE(same(a1, af1)) << "fused gate_up + down: act, " << what;
    EXPECT_TRUE(same(y1, yf1)) << "fused gate_up + down: y, " << what;
    EXPECT_TRUE(same(a1, af2)) << "fused, 7 blocks of 5 stages: act, " << what;
    EXPECT_TRUE(same(y1, yf2)) << "fused, 7 blocks of 5 stages: y, " << what;
    EXPECT_TRUE(same(a1, af3)) << "fused, three 3-stage blocks per SM: act, " << what;
    EXPECT_TRUE(same(y1, yf3)) << "fused, three 3-stage blocks per SM: y, " << what;
    EXPECT_EQ(fused_ctr_after, std::vector<unsigned>(2 + size_t(E), 0u)) << "fused counters not left zeroed, " << what;
    const char* packed_case[6] = {"xs map", "xs map, 5 SMs, L2 prefetch", "x by slot_token, tile counter",
                                  "masks, tile counter", "masks, 7 blocks of 5 stages", "fused launch"};
    const auto apk = act_pk.get();
    for (int i = 0; i < 6; ++i)
      EXPECT_TRUE(same(a1, std::vector<bf16>(apk.begin() + i * rows * I, apk.begin() + (i + 1) * rows * I)))
          << "gate_up on packed weights, " << packed_case[i] << ", " << what;
    EXPECT_TRUE(same(y1, y_fpk.get())) << "fused gate_up (packed) + down: y, " << what;
    const char* down_case[5] = {"packed", "packed, 5 SMs, L2 prefetch", "rows from the masks",
                                "rows from the masks, packed, 7 blocks of 5 stages", "fused launch, both packed"};
    const auto ypk_all = y_pk.get();
    for (int i = 0; i < 5; ++i)
      EXPECT_TRUE(same(y1, std::vector<float>(ypk_all.begin() + i * rows * H, ypk_all.begin() + (i + 1) * rows * H)))
          << "down, " << down_case[i] << ", " << what;
    EXPECT_TRUE(same(a1, act_fpk2.get())) << "fused launch, both packed: act, " << what;
    EXPECT_EQ(tile_ctr.get(), (std::vector<unsigned>{0u, 0u})) << "tile counters not left zeroed (packed), " << what;
    {  // bf16 y (ExpertRows): the fused launch and the down kernel, bitwise the bf16 rounding of their f32 y
      Dev<bf16> act_b(rows * I), y_b(rows * H), y_db(rows * H);
      moe_experts_fused_tma_masked(wgu, wdn, dx.p, dmasks.p, T, E, H, I, act_b.p, y_b.p, nullptr,
                                   {.tile_counters = fused_ctr.p});
      moe_down_padded_tma(wdn, am, valid, E, H, I, y_db.p, nullptr);
      EXPECT_TRUE(same(a1, act_b.get())) << "fused, bf16 y: act, " << what;
      expect_bf16_rounding(yf1, y_b.get(), "fused, bf16 y, " + what);
      expect_bf16_rounding(y1, y_db.get(), "down, bf16 y, " + what);
      // y and act stored with an evict_last policy (rows_evict_last 1 | 2): the same bits, the same rows written
      Dev<bf16> act_l(rows * I), y_l(rows * H);  // poisoned as y_b was
      moe_experts_fused_tma_masked(wgu, wdn, dx.p, dmasks.p, T, E, H, I, act_l.p, y_l.p, nullptr,
                                   {.tile_counters = fused_ctr.p, .rows_evict_last = 3});
      EXPECT_TRUE(same(a1, act_l.get())) << "fused, act evict_last: act, " << what;
      EXPECT_TRUE(same(y_b.get(), y_l.get())) << "fused, y evict_last: y, " << what;
    }
    {  // Two token tiles an expert (TmaExpertsPlan::two_token_tiles): the layout of kFusedExpertRows rows an expert
      constexpr int MF = kFusedExpertRows;
      const size_t rows_f = size_t(E) * MF + idx.size();
      const TmaExpertsPlan two{.tile_counters = fused_ctr.p, .two_token_tiles = true};
      Dev<bf16> act_t1(rows_f * I), act_t2(rows_f * I), act_t3(rows_f * I), act_ttl(rows_f * I);
      Dev<float> y_t1(rows_f * H), y_t2(rows_f * H), y_t3(rows_f * H), y_ttl(rows_f * H);
      Dev<bf16> y_t16(rows_f * H);
      auto with = [&](TmaExpertsPlan p) {
        p.tile_counters = fused_ctr.p, p.two_token_tiles = true;
        return p;
      };
      // The default grid (blocks' first tiles of experts past 32 rows run once per token tile), 7 blocks of 5 stages
      // (tiles mostly claimed: two-tile instances), both weight sets packed with the first tiles permuted.
      moe_experts_fused_tma_masked(wgu, wdn, dx.p, dmasks.p, T, E, H, I, act_t1.p, y_t1.p, nullptr, two);
      moe_experts_fused_tma_masked(wgu, wdn, dx.p, dmasks.p, T, E, H, I, act_t2.p, y_t2.p, nullptr,
                                   with({.grid = 7, .stages = 5}));
      moe_experts_fused_tma_masked(wgu, wdn, dx.p, dmasks.p, T, E, H, I, act_t3.p, y_t3.p, nullptr,
                                   with({.stages = 4, .first_tile_stride = 5, .gate_up_packed = dgu_pk.p,
                                         .down_packed = ddn_pk.p}));
      moe_experts_fused_tma_masked(wgu, wdn, dx.p, dmasks.p, T, E, H, I, act_ttl.p, y_t16.p, nullptr, two);
      experts_timeline_begin(size_t(1) << 16);
      moe_experts_fused_tma_masked(wgu, wdn, dx.p, dmasks.p, T, E, H, I, act_ttl.p, y_ttl.p, nullptr,
                                   with({.stages = 3}));
      const auto timeline = experts_timeline_end();
      const auto at1 = act_t1.get(), at2 = act_t2.get(), at3 = act_t3.get(), attl = act_ttl.get();
      const auto yt1 = y_t1.get(), yt2 = y_t2.get(), yt3 = y_t3.get(), yttl = y_ttl.get();
      // In the 32-row layout: row e 32 + t (t < 32) from row e MF + t, every other row the poison of an unwritten
      // buffer; so slots below 32 must be the one-tile launch's bit for bit.
      auto as_m32 = [&](const auto& f, int width) {
        using V = std::decay_t<decltype(f[0])>;
        std::vector<V> v(rows * size_t(width));
        std::memset(static_cast<void*>(v.data()), 0xff, v.size() * sizeof(V));
        for (int e = 0; e < E; ++e)
          std::memcpy(static_cast<void*>(&v[size_t(e) * M * width]), &f[size_t(e) * MF * width],
                      size_t(M) * width * sizeof(V));
        return v;
      };
      EXPECT_TRUE(same(af1, as_m32(at1, I))) << "two token tiles: act slots < 32, " << what;
      EXPECT_TRUE(same(yf1, as_m32(yt1, H))) << "two token tiles: y slots < 32, " << what;
      EXPECT_TRUE(same(at1, at2) && same(yt1, yt2)) << "two token tiles, 7 blocks of 5 stages, " << what;
      EXPECT_TRUE(same(at1, at3) && same(yt1, yt3)) << "two token tiles, packed, first tiles permuted, " << what;
      EXPECT_TRUE(same(at1, attl) && same(yt1, yttl)) << "two token tiles, tile timeline on, " << what;
      expect_bf16_rounding(yt1, y_t16.get(), "two token tiles, bf16 y, " + what);
      EXPECT_EQ(fused_ctr.get(), std::vector<unsigned>(2 + size_t(E), 0u)) << "fused counters not left zeroed, " << what;
      // Slots 32 .. min(rows, MF) - 1 against the CPU double reference; slots past an expert's rows never written;
      // the timeline: a block's first tile of an expert past 32 rows twice, every other tile with rows once.
      const auto hxb = from_bf16(to_bf16(x));  // the bf16 token rows the kernels read
      const auto hat = from_bf16(at1);
      std::vector<float> got_a2, want_a2, got_y2, want_y2;
      int64_t unwritten_bad = 0;
      int second_tile_experts = 0;
      const int words = (T + 31) / 32, n_gate = E * (I / 64), n_tiles = n_gate + E * (H / 128);
      // The launch's grid, from its blocks' records: the timeline instantiation's occupancy decides it (not always
      // three blocks an SM), and the first round's tiles are the grid's first ones.
      int sms = 0, grid = 0;
      CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
      for (const auto& r : timeline) grid = std::max(grid, r.block + 1);
      EXPECT_TRUE(grid % sms == 0 || grid == n_gate) << "grid " << grid << " of " << sms << " SMs, " << what;
      EXPECT_LE(grid, std::min(n_gate, 3 * sms)) << what;
      std::vector<int> seen(size_t(n_tiles), 0);
      for (const auto& r : timeline)
        if (r.tile >= 0 && r.tile < n_tiles) ++seen[size_t(r.tile)];
      for (int e = 0; e < E; ++e) {
        std::vector<int> toks;  // the expert's tokens in ascending order: its slots
        for (int t = 0; t < T; ++t)
          if (host_masks[size_t(e) * words + t / 32] >> (t % 32) & 1u) toks.push_back(t);
        const int n = std::min(int(toks.size()), MF);
        second_tile_experts += n > M;
        if (n > 0) {
          for (int nt = 0; nt < I / 64; ++nt) {
            const int tile = e * (I / 64) + nt;
            EXPECT_EQ(tile < grid && n > M ? 2 : 1, seen[size_t(tile)]) << "gate_up tile " << e << " " << nt;
          }
          for (int nt = 0; nt < H / 128; ++nt) EXPECT_EQ(1, seen[size_t(n_gate + e * (H / 128) + nt)]) << e;
        }
        for (int t = 0; t < MF; ++t) {
          const size_t row = size_t(e) * MF + t;
          if (t >= n) {
            unwritten_bad += unpoisoned_words(at1, yt1, row, I, H);
            continue;
          }
          if (t < M || (E >= 64 && e % 4 != 0 && e > 2)) continue;  // (at the real shape: every 4th expert, 0, 2)
          const float* xr = &hxb[size_t(toks[size_t(t)]) * H];
          for (int i = 0; i < I; ++i) {
            double gg = 0, u = 0;
            for (int h = 0; h < H; ++h) {
              gg += double(xr[h]) * gu[(size_t(e) * 2 * I + i) * H + h];
              u += double(xr[h]) * gu[(size_t(e) * 2 * I + I + i) * H + h];
            }
            want_a2.push_back(float(double(cpu::gelu_tanh(float(gg))) * u));
            got_a2.push_back(hat[row * I + i]);
          }
          for (int h = 0; h < H; ++h) {
            double acc = 0;
            for (int i = 0; i < I; ++i) acc += double(hat[row * I + i]) * dn[(size_t(e) * H + h) * I + i];
            want_y2.push_back(float(acc));
            got_y2.push_back(yt1[row * H + h]);
          }
        }
      }
      EXPECT_EQ(unwritten_bad, 0) << "two token tiles: slots past an expert's rows written, " << what;
      if (distinct > 0 || E == 3) {
        EXPECT_GT(second_tile_experts, 0) << "no expert past 32 rows, " << what;
        ASSERT_FALSE(want_a2.empty()) << what;
      }
      if (!want_a2.empty()) {
        EXPECT_LE(rel_err(got_a2, want_a2), 1e-2) << "two token tiles: gate_up, slots 32-63, vs CPU, " << what;
        EXPECT_LE(rel_err(got_y2, want_y2), 1e-3) << "two token tiles: down, slots 32-63, vs CPU, " << what;
      }
    }
    if (E == 3) {
      EXPECT_GT(overflow, 0) << "the case meant to overflow does not";
    }
  }
}

// Packs a layer of E experts x `rows` rows x `cols` columns (distinct-enough values) with `pack` and checks that every
// weight lands where `offset(e, r, k)` says and that the offsets are a permutation (nothing overwritten, nothing left
// out).
template <class Pack, class Offset>
void check_packed_layout(int E, int rows, int cols, Pack pack, Offset offset, const std::string& what) {
  const size_t n = size_t(E) * rows * cols;
  std::vector<uint16_t> src(n);
  for (size_t i = 0; i < n; ++i) src[i] = uint16_t(i * 2654435761u >> 7);
  Dev<bf16> dsrc(n), ddst(n);
  CUDA_CHECK(cudaMemcpy(dsrc.p, src.data(), n * 2, cudaMemcpyHostToDevice));
  pack(dsrc.p, ddst.p);
  std::vector<uint16_t> dst(n);
  CUDA_CHECK(cudaMemcpy(dst.data(), ddst.p, n * 2, cudaMemcpyDeviceToHost));
  std::vector<uint8_t> hit(n, 0);
  int64_t misplaced = 0, collisions = 0;
  for (int e = 0; e < E; ++e)
    for (int r = 0; r < rows; ++r)
      for (int k = 0; k < cols; ++k) {
        const size_t o = offset(e, r, k);
        ASSERT_LT(o, n) << what;
        collisions += hit[o]++ != 0;
        misplaced += dst[o] != src[(size_t(e) * rows + r) * cols + k];
      }
  EXPECT_EQ(collisions, 0) << what;
  EXPECT_EQ(misplaced, 0) << what;
}

// pack_expert_gate_up / pack_expert_down against expert_*_packed_offset (check_packed_layout), and the layout's
// landmarks: within a stage the tile's first 64 rows (gate rows; down rows nt 128 ..) then its second 64 (the matching
// up rows; down rows nt 128 + 64 ..), 128 B a row, chunk c of row r at c ^ (r % 8); the next k slice is the next
// stage; the next tile follows all k slices of this one. Shapes: one tile and slice, several experts with several
// tiles and slices, and two experts at the real H / I.
TEST(CudaKernels, PackExpertWeights) {
  REQUIRE_GPU();
  EXPECT_FALSE(expert_gate_up_packable(2816, 88));
  EXPECT_FALSE(expert_gate_up_packable(96, 64));
  EXPECT_FALSE(expert_down_packable(192, 64));
  for (auto [E, H, I] : {std::tuple{1, 128, 64}, std::tuple{3, 384, 192}, std::tuple{2, 2816, 704}}) {
    ASSERT_TRUE(expert_gate_up_packable(H, I) && expert_down_packable(H, I));
    const std::string what = "E " + std::to_string(E) + " H " + std::to_string(H) + " I " + std::to_string(I);
    check_packed_layout(
        E, 2 * I, H, [&](const bf16* s, bf16* d) { pack_expert_gate_up(s, d, E, H, I, nullptr); },
        [&](int e, int r, int k) { return expert_gate_up_packed_offset(e, r, k, H, I); }, "gate_up, " + what);
    check_packed_layout(
        E, H, I, [&](const bf16* s, bf16* d) { pack_expert_down(s, d, E, H, I, nullptr); },
        [&](int e, int r, int k) { return expert_down_packed_offset(e, r, k, H, I); }, "down, " + what);
    EXPECT_EQ(expert_gate_up_packed_offset(0, 0, 0, H, I), 0u);
    EXPECT_EQ(expert_gate_up_packed_offset(0, I, 0, H, I), 4096u);
    EXPECT_EQ(expert_gate_up_packed_offset(0, 1, 0, H, I), 64u + 8u);
    EXPECT_EQ(expert_gate_up_packed_offset(0, 0, 64, H, I), 8192u);
    EXPECT_EQ(expert_down_packed_offset(0, 64, 0, H, I), 4096u);
    EXPECT_EQ(expert_down_packed_offset(0, 9, 8, H, I), 9u * 64 + 0u);  // chunk 1 of row 9 at chunk 1 ^ 1 = 0
    if (I > 64) {
      EXPECT_EQ(expert_gate_up_packed_offset(0, 64, 0, H, I), 8192u * size_t(H / 64));
      EXPECT_EQ(expert_down_packed_offset(0, 0, 64, H, I), 8192u);
    }
    if (H > 128) {
      EXPECT_EQ(expert_down_packed_offset(0, 128, 0, H, I), 8192u * size_t(I / 64));
    }
  }
}

// The PDL contract of the TMA expert kernels: they may start while their predecessor still runs and stream their
// weights then, but must read nothing the predecessor writes (token rows, row counts) and write nothing before
// griddepcontrol.wait. The predecessor here (delayed_copy_for_test) triggers its dependents at once, sleeps, and only
// then writes xs and meta into buffers poisoned with 0xFF (NaN token rows; -1 row counts, which would make the
// kernels skip every tile): gate_up then down, back to back on one stream, must match bitwise a run on the same
// inputs written long before. A kernel that read xs / meta early, or a down that read act before gate_up finished,
// leaves NaN or unwritten rows. Several delays (the second kernel can also start during the first's sleep) and the
// 5-SM launch (8-stage ring). Skips where the kernels do not run.
TEST(CudaKernels, MoeExpertsPaddedTmaLatePredecessor) {
  REQUIRE_GPU();
  constexpr int M = 32;
  for (auto [T, E, k, H, I] : {std::tuple{20, 5, 2, 256, 64}, std::tuple{256, 128, 8, 2816, 704}}) {
    if (!experts_tma_supported(M, H, I)) GTEST_SKIP() << "the TMA expert kernels need an sm_90 GPU (sm_90a image)";
    ASSERT_TRUE(pdl_enabled());
    auto x = rnd(size_t(T) * H), gu = rnd(size_t(E) * 2 * I * H, -0.1f, 0.1f), dn = rnd(size_t(E) * H * I, -0.1f, 0.1f);
    auto idx = random_routing(T, E, k);
    const size_t rows = size_t(E) * M + idx.size(), n_meta = 2 * size_t(E) + 1;
    Dev<bf16> dx(x.size()), dgu(gu.size()), ddn(dn.size()), xs_src(rows * H), xs(rows * H), act(rows * I);
    // meta and slot_token in one buffer, so that the late predecessor writes both (delayed_copy_for_test copies two)
    const size_t n_slot = size_t(E) * M;
    Dev<int32_t> didx(idx.size()), ovf(size_t(E) + 1), spos(idx.size()), meta_src(n_meta + n_slot);
    Dev<int32_t> meta(n_meta + n_slot);
    Dev<bf16> xg(x.size());
    Dev<float> y(rows * H);
    dx.put(to_bf16(x)), dgu.put(to_bf16(gu)), ddn.put(to_bf16(dn)), didx.put(idx);
    moe_assign_padded(didx.p, T, k, E, M, ovf.p, spos.p, meta_src.p, meta_src.p + n_meta, nullptr);
    moe_gather(spos.p, T, k, dx.p, H, xs_src.p, nullptr);
    const auto [wgu, xm, wdn, am] = tma_expert_maps(dgu.p, xs.p, ddn.p, act.p, E, H, I, M);
    const int32_t* valid = meta.p + 1 + E;
    // reference: inputs in place long before, one kernel at a time
    CUDA_CHECK(cudaMemcpy(xs.p, xs_src.p, rows * H * sizeof(bf16), cudaMemcpyDeviceToDevice));
    CUDA_CHECK(cudaMemcpy(meta.p, meta_src.p, (n_meta + n_slot) * sizeof(int32_t), cudaMemcpyDeviceToDevice));
    moe_gate_up_padded_tma(wgu, xm, valid, E, H, I, act.p, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    moe_down_padded_tma(wdn, am, valid, E, H, I, y.p, nullptr);
    const auto act_ref = act.get();
    const auto y_ref = y.get();
    cudaStream_t st;
    CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    int run = 0;
    for (int sms : {0, 5}) {
      for (int delay_us : {3000, 300, 30, 0}) {
        CUDA_CHECK(cudaMemsetAsync(xs.p, 0xff, rows * H * sizeof(bf16), st));
        CUDA_CHECK(cudaMemsetAsync(meta.p, 0xff, n_meta * sizeof(int32_t), st));
        CUDA_CHECK(cudaMemsetAsync(act.p, 0xff, rows * I * sizeof(bf16), st));
        CUDA_CHECK(cudaMemsetAsync(y.p, 0xff, rows * H * sizeof(float), st));
        delayed_copy_for_test(xs_src.p, xs.p, rows * H * sizeof(bf16), meta_src.p, meta.p, n_meta * sizeof(int32_t),
                              delay_us, st);
        moe_gate_up_padded_tma(wgu, xm, valid, E, H, I, act.p, st,
                               {.sms = sms, .l2_prefetch_slices = run % 2 == 0 ? 0 : 4});
        moe_down_padded_tma(wdn, am, valid, E, H, I, y.p, st, {.sms = sms, .l2_prefetch_slices = run % 2 == 0 ? 0 : 4});
        CUDA_CHECK(cudaStreamSynchronize(st));
        const auto a = act.get();
        const auto yy = y.get();
        EXPECT_EQ(std::memcmp(a.data(), act_ref.data(), a.size() * sizeof(bf16)), 0)
            << "gate_up after a late predecessor: delay " << delay_us << " us, sms " << sms << ", E " << E;
        EXPECT_EQ(std::memcmp(yy.data(), y_ref.data(), yy.size() * sizeof(float)), 0)
            << "down after gate_up after a late predecessor: delay " << delay_us << " us, sms " << sms << ", E " << E;
        ++run;
      }
    }
    // gate_up reading the token rows from x: the late predecessor writes x and the row counts + slot_token
    for (int delay_us : {3000, 30, 0}) {
      CUDA_CHECK(cudaMemsetAsync(xg.p, 0xff, x.size() * sizeof(bf16), st));
      CUDA_CHECK(cudaMemsetAsync(meta.p, 0xff, (n_meta + n_slot) * sizeof(int32_t), st));
      CUDA_CHECK(cudaMemsetAsync(act.p, 0xff, rows * I * sizeof(bf16), st));
      delayed_copy_for_test(dx.p, xg.p, x.size() * sizeof(bf16), meta_src.p, meta.p,
                            (n_meta + n_slot) * sizeof(int32_t), delay_us, st);
      moe_gate_up_padded_tma_gathered(wgu, xg.p, meta.p + n_meta, valid, E, H, I, act.p, st);
      CUDA_CHECK(cudaStreamSynchronize(st));
      const auto a = act.get();
      EXPECT_EQ(std::memcmp(a.data(), act_ref.data(), a.size() * sizeof(bf16)), 0)
          << "gathered gate_up after a late predecessor: delay " << delay_us << " us, E " << E;
    }
    // gate_up reading each expert's tokens from the masks: the late predecessor writes x and the masks
    const auto host_masks = expert_masks_of(idx, T, E, k);
    Dev<unsigned> masks_src(host_masks.size()), masks(host_masks.size());
    masks_src.put(host_masks);
    for (int delay_us : {3000, 30, 0}) {
      CUDA_CHECK(cudaMemsetAsync(xg.p, 0xff, x.size() * sizeof(bf16), st));
      CUDA_CHECK(cudaMemsetAsync(masks.p, 0xff, masks.n * sizeof(unsigned), st));
      CUDA_CHECK(cudaMemsetAsync(act.p, 0xff, rows * I * sizeof(bf16), st));
      delayed_copy_for_test(dx.p, xg.p, x.size() * sizeof(bf16), masks_src.p, masks.p, masks.n * sizeof(unsigned),
                            delay_us, st);
      moe_gate_up_padded_tma_masked(wgu, xg.p, masks.p, T, E, H, I, act.p, st);
      CUDA_CHECK(cudaStreamSynchronize(st));
      const auto a = act.get();
      EXPECT_EQ(std::memcmp(a.data(), act_ref.data(), a.size() * sizeof(bf16)), 0)
          << "gate_up from the masks after a late predecessor: delay " << delay_us << " us, E " << E;
    }
    // the same with packed weights (their first stages requested by 1D bulk copies before the wait), then down with
    // packed weights and its row counts from the same masks
    Dev<bf16> dgu_pk(gu.size()), ddn_pk(dn.size());
    pack_expert_gate_up(dgu.p, dgu_pk.p, E, H, I, nullptr);
    pack_expert_down(ddn.p, ddn_pk.p, E, H, I, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    for (int delay_us : {3000, 30, 0}) {
      CUDA_CHECK(cudaMemsetAsync(xg.p, 0xff, x.size() * sizeof(bf16), st));
      CUDA_CHECK(cudaMemsetAsync(masks.p, 0xff, masks.n * sizeof(unsigned), st));
      CUDA_CHECK(cudaMemsetAsync(act.p, 0xff, rows * I * sizeof(bf16), st));
      delayed_copy_for_test(dx.p, xg.p, x.size() * sizeof(bf16), masks_src.p, masks.p, masks.n * sizeof(unsigned),
                            delay_us, st);
      moe_gate_up_padded_tma_masked(wgu, xg.p, masks.p, T, E, H, I, act.p, st, {.gate_up_packed = dgu_pk.p});
      CUDA_CHECK(cudaMemsetAsync(y.p, 0xff, rows * H * sizeof(float), st));
      moe_down_padded_tma_masked(wdn, am, masks.p, T, E, H, I, y.p, st, {.down_packed = ddn_pk.p});
      CUDA_CHECK(cudaStreamSynchronize(st));
      const auto a = act.get();
      const auto yy = y.get();
      EXPECT_EQ(std::memcmp(a.data(), act_ref.data(), a.size() * sizeof(bf16)), 0)
          << "gate_up from the masks on packed weights after a late predecessor: delay " << delay_us << " us, E "
          << E;
      EXPECT_EQ(std::memcmp(yy.data(), y_ref.data(), yy.size() * sizeof(float)), 0)
          << "down (rows from the masks, packed) after that gate_up: delay " << delay_us << " us, E " << E;
    }
    CUDA_CHECK(cudaStreamDestroy(st));
  }
}

// Runs softcap_row_stats on a copy of `logits`; returns the capped logits, the stats and the probs.
struct RowStatsRun {
  std::vector<float> capped;
  std::vector<DeviceRowStats> stats;
  std::vector<bf16> probs;
};
RowStatsRun run_row_stats(const std::vector<float>& logits, int rows, int V, float cap, float T,
                          bool write_capped = true) {
  Dev<float> dl(logits.size());
  Dev<DeviceRowStats> st{size_t(rows)};
  Dev<bf16> probs(logits.size());
  Dev<char> scratch(softcap_row_stats_scratch_bytes(rows, V));
  dl.put(logits);
  softcap_row_stats(dl.p, rows, V, cap, T, st.p, scratch.p, nullptr, probs.p, write_capped);
  return {dl.get(), st.get(), probs.get()};
}

TEST(CudaKernels, SoftcapRowStats) {
  REQUIRE_GPU();
  // V: not a multiple of 4 (scalar path), a multiple of 4 but not of the 8192-token tile, one tile plus one, the
  // vocabulary; rows 1, 3, 4 and the canvas of 256.
  struct Case {
    int rows, V;
  };
  for (Case c : {Case{4, 5003}, Case{1, 8193}, Case{3, 20004}, Case{256, 262144}}) {
    const int rows = c.rows, V = c.V;
    auto logits = rnd(size_t(rows) * V, -60, 60);
    if (rows >= 3) {
      for (int i = 0; i < V; ++i) logits[size_t(V) + size_t(i)] = float(i % 7);  // row 1: ties of the max across tiles
      logits[size_t(2) * V + size_t(V - 1)] = 500.0f;                            // row 2: near one-hot, last token
    }
    if (rows >= 4) {  // row 3: the same maximum in a later tile and an earlier one: the lower index wins
      logits[size_t(3) * V + size_t(V - 2)] = 400.0f;
      logits[size_t(3) * V + 3] = 400.0f;
    }
    const float T = 0.61f;
    auto run = run_row_stats(logits, rows, V, 30.0f, T);
    auto want_capped = logits;
    cpu::softcap(want_capped.data(), int64_t(want_capped.size()), 30.0f);
    EXPECT_LE(rel_err(run.capped, want_capped), 1e-6) << "V " << V;
    double worst = 0;  // softcap_rs's ex2 / rcp form: within 1e-6 cap of cap * tanh(x / cap) everywhere
    for (size_t i = 0; i < logits.size(); ++i)
      worst = std::max(worst, std::fabs(double(run.capped[i]) - double(want_capped[i])));
    EXPECT_LE(worst, 1e-6 * 30.0) << "V " << V;
    for (int r = 0; r < rows; ++r) {
      // Stats from the device's own softcapped row, so only the reduction is under test here.
      RowStats w = compute_row_stats(run.capped.data() + size_t(r) * V, V, T);
      const DeviceRowStats& g = run.stats[size_t(r)];
      EXPECT_EQ(g.argmax, w.argmax) << "row " << r << " V " << V;
      EXPECT_FLOAT_EQ(g.max_z, w.max_z);
      EXPECT_NEAR(g.logsumexp, w.logsumexp, 1e-5 * std::max(1.0f, std::fabs(w.logsumexp)));
      EXPECT_NEAR(g.entropy, w.entropy, 1e-5 * std::max(1.0f, w.entropy)) << "row " << r << " V " << V;
      EXPECT_EQ(g.survivors, -1);
      EXPECT_NEAR(g.inv_sum, float(std::exp(double(w.max_z) - double(w.logsumexp))), 1e-5 * g.inv_sum);
    }
    if (rows >= 4) {
      EXPECT_EQ(run.stats[1].argmax, 6);
      EXPECT_EQ(run.stats[2].argmax, V - 1);
      EXPECT_EQ(run.stats[3].argmax, 3);
    }
    // the SC probs written by the same pass: softmax(capped / T), per row, to bf16 rounding
    auto gp = from_bf16(run.probs);
    for (int r = 0; r < rows; ++r) {
      std::vector<float> want(static_cast<size_t>(V)),
          got_row(gp.begin() + ptrdiff_t(r) * V, gp.begin() + ptrdiff_t(r + 1) * V);
      const float* cr = run.capped.data() + size_t(r) * V;
      double mx = -INFINITY, sum = 0;
      for (int i = 0; i < V; ++i) mx = std::max(mx, double(cr[i] / T));
      for (int i = 0; i < V; ++i) sum += std::exp(double(cr[i] / T) - mx);
      for (int i = 0; i < V; ++i) want[size_t(i)] = float(std::exp(double(cr[i] / T) - mx) / sum);
      EXPECT_LE(rel_err(got_row, want), 8e-3) << "probs row " << r << " V " << V;
    }
    // bitwise deterministic: a second run on the same input
    auto again = run_row_stats(logits, rows, V, 30.0f, T);
    EXPECT_EQ(std::memcmp(again.capped.data(), run.capped.data(), run.capped.size() * 4), 0);
    EXPECT_EQ(std::memcmp(again.stats.data(), run.stats.data(), run.stats.size() * sizeof(DeviceRowStats)), 0);
    EXPECT_EQ(std::memcmp(again.probs.data(), run.probs.data(), run.probs.size() * 2), 0) << "V " << V;
    // write_capped false: the logits left as they were, the stats and probs the same bits
    auto raw = run_row_stats(logits, rows, V, 30.0f, T, false);
    EXPECT_EQ(std::memcmp(raw.capped.data(), logits.data(), logits.size() * 4), 0) << "V " << V;
    EXPECT_EQ(std::memcmp(raw.stats.data(), run.stats.data(), run.stats.size() * sizeof(DeviceRowStats)), 0);
    EXPECT_EQ(std::memcmp(raw.probs.data(), run.probs.data(), run.probs.size() * 2), 0) << "V " << V;
  }
  // bad input is refused by value
  Dev<float> dl(8);
  Dev<DeviceRowStats> st(1);
  Dev<char> scratch(softcap_row_stats_scratch_bytes(1, 8));
  EXPECT_ANY_THROW(softcap_row_stats(dl.p, 1, 0, 30.0f, 1.0f, st.p, scratch.p, nullptr));
  EXPECT_ANY_THROW(softcap_row_stats(dl.p, 1, 8, 30.0f, 0.0f, st.p, scratch.p, nullptr));
  EXPECT_ANY_THROW(softcap_row_stats(dl.p, 1, 8, 30.0f, 1.0f, st.p, nullptr, nullptr));
}

// The fused-probs cases: V off the tile size, and T where row 1 takes the merge's exact fallback.
struct FusedProbsCase {
  int rows, V;
  float T;
};
constexpr FusedProbsCase kFusedProbsCases[] = {{4, 5003, 0.61f}, {3, 20004, 0.4f}, {2, 262144, 0.8f}, {5, 8193, 0.4f}};
std::vector<float> fused_probs_logits(int rows, int V) {
  auto logits = rnd(size_t(rows) * V, -60, 60);
  // row 1: every capped logit <= ~3, so at T 0.4 (cap / T = 75) its max is > 60 below: the exact fallback
  for (int i = 0; i < V; ++i) logits[size_t(V) + size_t(i)] = -40.0f + 43.0f * float(i % 97) / 96.0f;
  if (rows >= 3) logits[size_t(2) * V + size_t(V - 1)] = 500.0f;  // row 2: near one-hot, last token
  if (rows >= 5)  // row 4: flat at the softcap floor (max -30 / T)
    for (int i = 0; i < V; ++i) logits[size_t(4) * V + size_t(i)] = -1000.0f;
  return logits;
}

// The fused SC probs (probs_row_scale): the same stats bits as the unfused pass, probs[r, :] * scale[r] equal to the
// unfused normalized probs to bf16 rounding, and rows whose max lies too far below cap / T rewritten with exactly the
// unfused probs (scale 1).
TEST(CudaKernels, SoftcapRowStatsFusedProbs) {
  REQUIRE_GPU();
  for (const FusedProbsCase& c : kFusedProbsCases) {
    const int rows = c.rows, V = c.V;
    const float T = c.T, cap = 30.0f;
    const auto logits = fused_probs_logits(rows, V);
    for (bool write_capped : {true, false}) {
      auto plain = run_row_stats(logits, rows, V, cap, T, write_capped);
      Dev<float> dl{logits.size()}, scale{size_t(rows)};
      Dev<DeviceRowStats> st{size_t(rows)};
      Dev<bf16> probs(logits.size());
      Dev<char> scratch(softcap_row_stats_scratch_bytes(rows, V));
      auto fused_run = [&] {
        dl.put(logits);
        softcap_row_stats(dl.p, rows, V, cap, T, st.p, scratch.p, nullptr, probs.p, write_capped, scale.p);
        CUDA_CHECK(cudaDeviceSynchronize());
        return std::make_tuple(dl.get(), st.get(), probs.get(), scale.get());
      };
      auto [capped, stats, u, sc] = fused_run();
      EXPECT_EQ(std::memcmp(capped.data(), plain.capped.data(), capped.size() * 4), 0) << "V " << V;
      EXPECT_EQ(std::memcmp(stats.data(), plain.stats.data(), stats.size() * sizeof(DeviceRowStats)), 0) << "V " << V;
      const auto uf = from_bf16(u), pf = from_bf16(plain.probs);
      for (int r = 0; r < rows; ++r) {
        const double gap = double(cap / T) - double(stats[size_t(r)].max_z);
        const bool exact = gap > 60.0;
        if (T == 0.4f && r == 1) {
          EXPECT_TRUE(exact) << "row 1 should take the fallback, gap " << gap;
        }
        if (r == 0) {
          EXPECT_FALSE(exact) << "row 0 should be fused, gap " << gap;
        }
        if (exact) {
          EXPECT_EQ(sc[size_t(r)], 1.0f) << "row " << r << " V " << V;
          EXPECT_EQ(std::memcmp(u.data() + size_t(r) * V, plain.probs.data() + size_t(r) * V, size_t(V) * 2), 0)
              << "fallback row " << r << " V " << V;
          continue;
        }
        EXPECT_NEAR(double(sc[size_t(r)]), std::exp(gap) * double(stats[size_t(r)].inv_sum),
                    1e-5 * double(sc[size_t(r)]))
            << "row " << r;
        // each token within two bf16 ulps of the unfused value (both are roundings of the same softmax), apart from
        // the tokens so far below the max that they weigh nothing
        int bad = 0;
        double mass_u = 0, mass_p = 0;
        for (int i = 0; i < V; ++i) {
          const double a = double(uf[size_t(r) * V + i]) * sc[size_t(r)];
          const double b = pf[size_t(r) * V + i];
          mass_u += a, mass_p += b;
          if (b > 1e-12 && std::fabs(a - b) > b * (2.0 / 256)) ++bad;
        }
        EXPECT_EQ(bad, 0) << "row " << r << " V " << V << " T " << T;
        EXPECT_NEAR(mass_u, mass_p, 1e-3 * mass_p) << "row " << r;
      }
      // bitwise deterministic
      auto [capped2, stats2, u2, sc2] = fused_run();
      EXPECT_EQ(std::memcmp(u2.data(), u.data(), u.size() * 2), 0) << "V " << V;
      EXPECT_EQ(std::memcmp(sc2.data(), sc.data(), sc.size() * 4), 0) << "V " << V;
      {  // the temperature from device memory (a captured step's): the same bits, whatever the launch argument says
        Dev<float> t_dev{1};
        t_dev.put(std::vector<float>{T});
        dl.put(logits);
        const float other = T == 0.4f ? 0.9f : 0.4f;  // the same division variant, a different value
        ASSERT_EQ(softcap_row_stats_variant(cap, other), softcap_row_stats_variant(cap, T));
        softcap_row_stats(dl.p, rows, V, cap, other, st.p, scratch.p, nullptr, probs.p, write_capped, scale.p,
                          nullptr, t_dev.p);
        CUDA_CHECK(cudaDeviceSynchronize());
        EXPECT_EQ(std::memcmp(dl.get().data(), capped.data(), capped.size() * 4), 0) << "V " << V;
        EXPECT_EQ(std::memcmp(st.get().data(), stats.data(), stats.size() * sizeof(DeviceRowStats)), 0) << "V " << V;
        EXPECT_EQ(std::memcmp(probs.get().data(), u.data(), u.size() * 2), 0) << "V " << V;
        EXPECT_EQ(std::memcmp(scale.get().data(), sc.data(), sc.size() * 4), 0) << "V " << V;
        // the unfused probs pass reads it too
        dl.put(logits);
        softcap_row_stats(dl.p, rows, V, cap, other, st.p, scratch.p, nullptr, probs.p, write_capped, nullptr,
                          nullptr, t_dev.p);
        CUDA_CHECK(cudaDeviceSynchronize());
        EXPECT_EQ(std::memcmp(st.get().data(), plain.stats.data(), stats.size() * sizeof(DeviceRowStats)), 0)
            << "V " << V;
        EXPECT_EQ(std::memcmp(probs.get().data(), plain.probs.data(), plain.probs.size() * 2), 0) << "V " << V;
      }
      // the stats mirrored into mapped host memory (as the captured step writes them) are the same bits
      DeviceRowStats* host = nullptr;
      CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host), size_t(rows) * sizeof(DeviceRowStats),
                               cudaHostAllocMapped));
      std::memset(static_cast<void*>(host), 0xff, size_t(rows) * sizeof(DeviceRowStats));
      DeviceRowStats* mapped = nullptr;
      CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped), host, 0));
      dl.put(logits);
      softcap_row_stats(dl.p, rows, V, cap, T, st.p, scratch.p, nullptr, probs.p, write_capped, scale.p, mapped);
      CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_EQ(std::memcmp(host, stats.data(), stats.size() * sizeof(DeviceRowStats)), 0) << "V " << V;
      CUDA_CHECK(cudaFreeHost(host));
    }
  }
}

// bf16 logits (logits_bf16, the lm_head's bf16 output): the same bits as f32 logits holding the same values, stats,
// probs (fused and not, the fused rows' exact fallback included) and capped logits; the f32 buffer only receives the
// capped values (untouched, or absent, when they are not written).
TEST(CudaKernels, SoftcapRowStatsBf16Logits) {
  REQUIRE_GPU();
  for (const FusedProbsCase& c : kFusedProbsCases) {
    const int rows = c.rows, V = c.V;
    const float T = c.T, cap = 30.0f;
    const size_t n = size_t(rows) * V;
    auto logits = fused_probs_logits(rows, V);
    const std::vector<bf16> bits = to_bf16(logits);  // logits now hold the bf16 values
    Dev<bf16> db(n);
    db.put(bits);
    for (bool write_capped : {true, false})
      for (bool fused : {false, true}) {
        Dev<float> dl{n}, dc{n}, scale{size_t(rows)}, scale16{size_t(rows)};
        Dev<DeviceRowStats> st{size_t(rows)}, st16{size_t(rows)};
        Dev<bf16> probs{n}, probs16{n};
        Dev<char> scratch(softcap_row_stats_scratch_bytes(rows, V));
        dl.put(logits);
        softcap_row_stats(dl.p, rows, V, cap, T, st.p, scratch.p, nullptr, probs.p, write_capped,
                          fused ? scale.p : nullptr);
        const auto capped = dl.get();
        softcap_row_stats(dc.p, rows, V, cap, T, st16.p, scratch.p, nullptr, probs16.p, write_capped,
                          fused ? scale16.p : nullptr, nullptr, nullptr, db.p);
        const std::string what = "V " + std::to_string(V) + (write_capped ? " capped" : " raw") +
                                 (fused ? " fused" : " unfused");
        EXPECT_EQ(std::memcmp(st16.get().data(), st.get().data(), size_t(rows) * sizeof(DeviceRowStats)), 0) << what;
        EXPECT_EQ(std::memcmp(probs16.get().data(), probs.get().data(), n * 2), 0) << what;
        if (fused) {
          EXPECT_EQ(std::memcmp(scale16.get().data(), scale.get().data(), size_t(rows) * 4), 0) << what;
        }
        const auto out = dc.get();
        if (write_capped) {
          EXPECT_EQ(std::memcmp(out.data(), capped.data(), n * 4), 0) << what;
        } else {
          const size_t written = size_t(std::count_if(out.begin(), out.end(), [](float x) {
            uint32_t u;
            std::memcpy(&u, &x, 4);
            return u != 0xffffffffu;  // Dev's poison
          }));
          EXPECT_EQ(written, 0u) << what << ": the f32 buffer was written";
          // no f32 buffer at all
          softcap_row_stats(nullptr, rows, V, cap, T, st16.p, scratch.p, nullptr, probs16.p, false,
                            fused ? scale16.p : nullptr, nullptr, nullptr, db.p);
          EXPECT_EQ(std::memcmp(st16.get().data(), st.get().data(), size_t(rows) * sizeof(DeviceRowStats)), 0) << what;
          EXPECT_EQ(std::memcmp(probs16.get().data(), probs.get().data(), n * 2), 0) << what;
        }
      }
  }
  Dev<DeviceRowStats> st(1);
  Dev<char> scratch(softcap_row_stats_scratch_bytes(1, 8));
  Dev<bf16> db(8);
  // capped logits asked for without a buffer to hold them
  EXPECT_ANY_THROW(softcap_row_stats(nullptr, 1, 8, 30.0f, 1.0f, st.p, scratch.p, nullptr, nullptr, true, nullptr,
                                     nullptr, nullptr, db.p));
}

// Host oracle of sc_survivors for one row of capped logits with the given max_z / inv_sum.
struct ScRowOracle {
  std::vector<std::vector<int32_t>> kept;  // per tile, ascending, at most kScTileSlots
  std::vector<int32_t> counts;
  int survivors = 0;
  double tail = 0;
  bool overflow = false;
};
ScRowOracle sc_oracle(const float* capped, int V, float T, float M, float inv) {
  ScRowOracle o;
  const int tiles = sc_tiles(V);
  o.kept.resize(size_t(tiles));
  o.counts.assign(size_t(tiles), 0);
  for (int i = 0; i < V; ++i) {
    const float z = capped[i] / T;
    const size_t t = size_t(i / kScTile);
    if (z >= M - kScWindow) {
      ++o.survivors, ++o.counts[t];
      if (o.kept[t].size() < size_t(kScTileSlots)) o.kept[t].push_back(i);
    } else {
      o.tail += double(std::exp(z - M) * inv);
    }
  }
  for (int c : o.counts) o.overflow = o.overflow || c > kScTileSlots;
  return o;
}

struct DevSc {
  Dev<int32_t> ids, counts;
  Dev<float> p;
  Dev<double> tail;
  DevSc(int rows, int V)
      : ids(size_t(rows) * sc_tiles(V) * kScTileSlots), counts(size_t(rows) * sc_tiles(V)),
        p(size_t(rows) * sc_tiles(V) * kScTileSlots), tail(size_t(rows) * sc_tiles(V)) {}
  ScSurvivorBuffers buf() const { return {ids.p, p.p, counts.p, tail.p}; }
};

TEST(CudaKernels, ScSparseSurvivors) {
  REQUIRE_GPU();
  // Pipeline of the backend: softcap_row_stats (probs) -> sc_survivors -> sc_gather_sum, V not a multiple of 4 and
  // spanning 3 tiles, H = 24.
  const int rows = 4, V = 20005, H = 24;
  const float T = 0.7f;
  auto logits = rnd(size_t(rows) * V, -60, 60);  // row 0: wide random (thousands of survivors, tiles overflow)
  for (int i = 0; i < V; ++i) logits[size_t(V) + i] = 0.3f * float(i % 5);  // row 1: flat, every token survives
  for (int i = 0; i < V; ++i) logits[size_t(2) * V + i] = -40.0f + 5.0f * float(i % 3);  // row 2: peaked
  logits[size_t(2) * V + 17] = 60.0f, logits[size_t(2) * V + 9001] = 59.0f, logits[size_t(2) * V + V - 1] = 58.5f;
  for (int i = 0; i < V; ++i)  // row 3: 600 survivors, < kScTileSlots per tile, but over a cap of 512
    logits[size_t(3) * V + i] = i % 33 == 0 ? 30.0f + 0.001f * float(i % 7) : -60.0f;
  auto E = rnd(size_t(V) * H);
  Dev<bf16> dE(E.size());
  dE.put(to_bf16(E));
  Dev<float> dl(logits.size()), out(size_t(rows) * H), out2(size_t(rows) * H);
  Dev<DeviceRowStats> st(rows);
  Dev<bf16> probs(logits.size());
  Dev<char> scratch(softcap_row_stats_scratch_bytes(rows, V));
  dl.put(logits);
  softcap_row_stats(dl.p, rows, V, 30.0f, T, st.p, scratch.p, nullptr, probs.p);
  DevSc sc(rows, V);
  sc_survivors(dl.p, rows, V, T, st.p, sc.buf(), nullptr);
  sc_gather_sum(sc.buf(), rows, V, dE.p, H, out.p, nullptr);
  const auto capped = dl.get();
  const auto stats = st.get();
  const auto dense = from_bf16(probs.get());
  const auto ids = sc.ids.get(), counts = sc.counts.get();
  const auto p = sc.p.get();
  const auto got = out.get();
  const int tiles = sc_tiles(V);
  for (int r = 0; r < rows; ++r) {
    const DeviceRowStats& d = stats[size_t(r)];
    const auto o = sc_oracle(capped.data() + size_t(r) * V, V, T, d.max_z, d.inv_sum);
    EXPECT_EQ(d.survivors, o.survivors) << "row " << r;
    EXPECT_EQ(d.tile_overflow, int(o.overflow)) << "row " << r;
    EXPECT_NEAR(d.tail_mass, o.tail, 1e-5 * std::max(1e-3, o.tail) + 1e-9) << "row " << r;
    std::vector<float> want(static_cast<size_t>(H), 0.0f);
    for (int t = 0; t < tiles; ++t) {
      const size_t ti = size_t(r) * tiles + t;
      EXPECT_EQ(counts[ti], o.counts[size_t(t)]) << "row " << r << " tile " << t;
      for (size_t k = 0; k < o.kept[size_t(t)].size(); ++k) {
        const int32_t id = ids[ti * kScTileSlots + k];
        ASSERT_EQ(id, o.kept[size_t(t)][k]) << "row " << r << " tile " << t << " slot " << k;
        const float pk = p[ti * kScTileSlots + k];
        // bitwise the bf16 prob of the exact path
        EXPECT_EQ(pk, dense[size_t(r) * V + size_t(id)]) << "row " << r << " id " << id;
        for (int h = 0; h < H; ++h) want[size_t(h)] = std::fma(pk, E[size_t(id) * H + h], want[size_t(h)]);
      }
    }
    std::vector<float> got_row(got.begin() + ptrdiff_t(r) * H, got.begin() + ptrdiff_t(r + 1) * H);
    EXPECT_LE(rel_err(got_row, want), 1e-6) << "row " << r;
    if (r == 2) {  // peaked: the survivor sum is the exact soft embedding up to the dropped tail
      EXPECT_TRUE(sc_sparse_row_ok(d, 2048, 1e-3)) << d.survivors << " " << d.tail_mass;
      std::vector<float> exact(static_cast<size_t>(H), 0.0f);
      for (int i = 0; i < V; ++i)
        for (int h = 0; h < H; ++h) exact[size_t(h)] += dense[size_t(r) * V + i] * E[size_t(i) * H + h];
      for (int h = 0; h < H; ++h) EXPECT_NEAR(got_row[size_t(h)], exact[size_t(h)], d.tail_mass + 1e-5);
    }
  }
  EXPECT_GT(stats[0].survivors, 1);
  EXPECT_EQ(stats[1].survivors, V);  // the flat row: every token, tiles overflow -> the exact path
  EXPECT_EQ(stats[1].tile_overflow, 1);
  EXPECT_FALSE(sc_sparse_row_ok(stats[1], 2048, 1e-3));
  EXPECT_EQ(stats[2].survivors, 3);
  EXPECT_EQ(stats[3].survivors, (V + 32) / 33);
  EXPECT_EQ(stats[3].tile_overflow, 0);
  EXPECT_FALSE(sc_sparse_row_ok(stats[3], 512, 1e-3));  // over the survivor cap
  EXPECT_TRUE(sc_sparse_row_ok(stats[3], 2048, 1e-3));
  // determinism: the same survivors and sums again
  sc_survivors(dl.p, rows, V, T, st.p, sc.buf(), nullptr);
  sc_gather_sum(sc.buf(), rows, V, dE.p, H, out2.p, nullptr);
  const auto got2 = out2.get();
  EXPECT_EQ(std::memcmp(got2.data(), got.data(), got.size() * 4), 0);
  const auto stats2 = st.get();
  EXPECT_EQ(std::memcmp(stats2.data(), stats.data(), stats.size() * sizeof(DeviceRowStats)), 0);

  // Ties at the threshold (host-made stats, integer logits at T = 1: z == max_z - 10 exactly survives), rows = 1.
  {
    const int V1 = 1001;
    std::vector<float> z(static_cast<size_t>(V1));
    for (int i = 0; i < V1; ++i) z[size_t(i)] = float(int(i * 7 % 23) - 17);  // in [-17, 5]
    double s = 0;
    for (float x : z) s += std::exp(double(x) - 5.0);
    DeviceRowStats d{};
    d.max_z = 5.0f, d.inv_sum = float(1.0 / s);
    Dev<float> dz(z.size());
    Dev<DeviceRowStats> st1(1);
    dz.put(z), st1.put({d});
    DevSc sc1(1, V1);
    sc_survivors(dz.p, 1, V1, 1.0f, st1.p, sc1.buf(), nullptr);
    const auto o = sc_oracle(z.data(), V1, 1.0f, 5.0f, d.inv_sum);
    int at_threshold = 0;
    for (float x : z) at_threshold += x == -5.0f;
    ASSERT_GT(at_threshold, 0);
    const auto g = st1.get()[0];
    EXPECT_EQ(g.survivors, o.survivors);
    const auto gi = sc1.ids.get();
    const auto gp = sc1.p.get();
    ASSERT_EQ(size_t(std::min(o.survivors, kScTileSlots)), o.kept[0].size());
    for (size_t k = 0; k < o.kept[0].size(); ++k) {
      EXPECT_EQ(gi[k], o.kept[0][k]);
      const float want = bf16_to_f32(f32_to_bf16(std::exp(z[size_t(gi[k])] - 5.0f) * d.inv_sum));
      EXPECT_NEAR(gp[k], want, std::ldexp(want, -8));  // host and device expf may differ by an ulp
    }
  }
  EXPECT_ANY_THROW(sc_gather_sum(sc.buf(), rows, V, dE.p, 12, out.p, nullptr));  // H not a multiple of 8
  EXPECT_ANY_THROW(sc_survivors(dl.p, rows, V, 0.0f, st.p, sc.buf(), nullptr));
}

TEST(CudaKernels, SoftEmbeddingAndGemm) {
  REQUIRE_GPU();
  const int L = 5, V = 777, H = 40;
  auto z = rnd(size_t(L) * V, -8, 8), E = rnd(size_t(V) * H);
  Dev<float> dz(z.size()), sig(size_t(L) * H);
  Dev<bf16> dE(E.size()), probs(z.size());
  dz.put(z), dE.put(to_bf16(E));
  softmax_rows_bf16(dz.p, L, V, 0.7f, probs.p, nullptr);
  Gemm gemm;
  gemm.through_table(probs.p, Dt::BF16, L, dE.p, Dt::BF16, V, H, sig.p, Dt::F32, nullptr);
  std::vector<float> p(z.size()), want(sig.n);
  for (int r = 0; r < L; ++r) {
    float mx = -INFINITY;
    for (int i = 0; i < V; ++i) mx = std::max(mx, z[size_t(r) * V + i] / 0.7f);
    double s = 0;
    for (int i = 0; i < V; ++i) s += std::exp(double(z[size_t(r) * V + i] / 0.7f) - mx);
    for (int i = 0; i < V; ++i) p[size_t(r) * V + i] = float(std::exp(double(z[size_t(r) * V + i] / 0.7f) - mx) / s);
  }
  EXPECT_LE(rel_err(from_bf16(probs.get()), p), 8e-3);
  ThreadPool pool(2);
  cpu::WeightMatrix wm{DType::F32, reinterpret_cast<const uint8_t*>(E.data()), V, H};
  cpu::matmul_w(pool, p.data(), L, wm, want.data());
  EXPECT_LE(rel_err(sig.get(), want), 1e-2);

  // linear: bf16 and f32 operands
  const int T = 13, out = 70, in = 48;
  auto x = rnd(size_t(T) * in), W = rnd(size_t(out) * in);
  Dev<float> x32(x.size()), W32(W.size()), y32(size_t(T) * out);
  Dev<bf16> x16(x.size()), W16(W.size()), y16(size_t(T) * out);
  x16.put(to_bf16(x)), W16.put(to_bf16(W)), x32.put(x), W32.put(W);
  std::vector<float> wy(y32.n);
  cpu::WeightMatrix wW{DType::F32, reinterpret_cast<const uint8_t*>(W.data()), out, in};
  cpu::matmul_wt(pool, x.data(), T, wW, wy.data());
  gemm.linear(x16.p, Dt::BF16, T, W16.p, Dt::BF16, out, in, y16.p, Dt::BF16, nullptr);
  gemm.linear(x32.p, Dt::F32, T, W32.p, Dt::F32, out, in, y32.p, Dt::F32, nullptr);
  EXPECT_LE(rel_err(from_bf16(y16.get()), wy), 8e-3);
  EXPECT_LE(rel_err(y32.get(), wy), 1e-5);
}

TEST(CudaKernels, KvWriteRing) {
  REQUIRE_GPU();
  const int T = 7, row = 24;
  const int64_t cap = 5, pos0 = 9;
  auto k = rnd(size_t(T) * row), v = rnd(k.size());
  Dev<bf16> dk(k.size()), dv(v.size()), kc(size_t(cap) * row), vc(size_t(cap) * row);
  dk.put(to_bf16(k)), dv.put(to_bf16(v));
  kv_write(dk.p, dv.p, T, row, pos0, kc.p, vc.p, cap, nullptr);
  auto gk = from_bf16(kc.get()), gv = from_bf16(vc.get());
  for (int t = T - int(cap); t < T; ++t) {  // the last cap rows survive, at slot pos % cap
    const size_t slot = size_t((pos0 + t) % cap);
    for (int i = 0; i < row; ++i) {
      EXPECT_EQ(gk[slot * row + i], k[size_t(t) * row + i]);
      EXPECT_EQ(gv[slot * row + i], v[size_t(t) * row + i]);
    }
  }
}

}  // namespace
}  // namespace dg::cuda
#endif  // DIFFGEMMA_WITH_CUDA
