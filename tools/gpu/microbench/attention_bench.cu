// Standalone check + timing of dg::cuda::attention (src/backend/cuda/kernels_attention.cu) against an older kernel
// ("old": attention_old.cuh, the file before attention_k) and a CPU reference (double, unrounded P, as the
// engine's cpu::attention oracle). Optionally (-DWITH_V3 / -DWITH_V4, see build_attention_bench.sh) a third and a
// fourth build of the file with one change each, as "var" and "var2", to try variants in the same GPU call; e.g.
// VARIANT_SED='s/^constexpr bool kWgmma = true; /constexpr bool kWgmma = false;/' times the mma.sync kernel
// (attention_k) beside the wgmma ones. A variant that faults takes the whole process down: build risky ones as
// separate binaries (ATTN_SRC=copy.cu ... build_attention_bench.sh other-dir). ATTN_CASE=substring runs only the
// matching cases (for ncu).
// Correctness: every row on small awkward shapes, sampled rows on the real ones; determinism: two runs and a
// CUDA-graph replay of the call compared bitwise. Timing: cudaEvents at the model's shapes, plus per-step
// estimates (25 sliding + 5 full layers).
// Build: tools/gpu/microbench/build_attention_bench.sh (-> build-attn/attention_bench; no engine sources needed).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_kernels.h"
#include "attention_old.cuh"

namespace dg::cuda {
[[noreturn]] void throw_cuda_error(const char* expr, const char* msg, int code, const char* file, int line) {
  std::fprintf(stderr, "CUDA error %s: %s (%d) at %s:%d\n", expr, msg, code, file, line);
  std::exit(1);
}
void check_cublas(int, const char*, const char*, int) {}
#ifdef WITH_V3
void attention_v3(const AttentionArgs& a, cudaStream_t s);  // the variant
void set_attention_tma_v3(bool on);
#endif
#ifdef WITH_V4
void attention_v4(const AttentionArgs& a, cudaStream_t s);  // the second variant (VARIANT_SED2)
void set_attention_tma_v4(bool on);
#endif
#ifdef DG_ATTN_TIMELINE
int attention_timeline_slots();
void attention_timeline(long long* host, int blocks);
void clear_attention_timeline();
#endif
}  // namespace dg::cuda

#ifdef DG_ATTN_TIMELINE
// One launch of `run` with the kernels' per-block timestamps on (kernels_attention.cu, TlSlot), summarized: medians
// over blocks of each phase, the blocks' start skew and the kernel's span. Phases are clock64 deltas of one thread,
// converted with the clock rate the same blocks show against %globaltimer.
template <class Run>
static void print_timeline(const char* name, Run run) {
  enum { EntryNs, EndNs, Entry, Setup, Q, FirstK, FirstTile, LoopEnd, LastPv, Stored, ProducerDone, Tiles, Laps };
  const int slots = dg::cuda::attention_timeline_slots(), cap = 4096;
  dg::cuda::clear_attention_timeline();
  run();
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<long long> tl(size_t(cap) * slots);
  dg::cuda::attention_timeline(tl.data(), cap);
  std::vector<const long long*> b;
  for (int i = 0; i < cap; ++i)
    if (tl[size_t(i) * slots + EntryNs] != 0 && tl[size_t(i) * slots + EndNs] != 0) b.push_back(&tl[size_t(i) * slots]);
  if (b.empty()) {
    std::printf("timeline %s: no instrumented blocks\n", name);
    return;
  }
  long long t0 = b[0][EntryNs], t1 = b[0][EndNs], e_last = b[0][EntryNs], end_first = b[0][EndNs];
  std::vector<double> ghz;
  for (auto* r : b) {
    t0 = std::min(t0, r[EntryNs]), t1 = std::max(t1, r[EndNs]);
    e_last = std::max(e_last, r[EntryNs]), end_first = std::min(end_first, r[EndNs]);
    if (r[EndNs] > r[EntryNs]) ghz.push_back(double(r[Stored] - r[Entry]) / double(r[EndNs] - r[EntryNs]));
  }
  std::sort(ghz.begin(), ghz.end());
  const double rate = ghz.empty() ? 1.98 : ghz[ghz.size() / 2];  // cycles per ns
  auto med = [&](auto f) {
    std::vector<double> v;
    for (auto* r : b) v.push_back(f(r));
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  auto us = [&](int from, int to) { return med([&](const long long* r) { return double(r[to] - r[from]) / rate / 1e3; }); };
  const double tiles = med([&](const long long* r) { return double(r[Tiles]); });
  std::printf("timeline %s: %zu blocks, %.0f key tiles each, clock %.2f GHz; kernel span %.1f us, entries spread %.1f "
              "us, ends spread %.1f us; per block (medians, us): block %.1f = setup %.2f + Q %.2f + first K %.2f + "
              "first tile %.2f + %.0f more tiles %.2f (%.2f each) + last P.V %.2f + stores %.2f; producer done at "
              "%.2f\n",
              name, b.size(), tiles, rate, (t1 - t0) / 1e3, (e_last - t0) / 1e3, (t1 - end_first) / 1e3,
              med([&](const long long* r) { return double(r[EndNs] - r[EntryNs]) / 1e3; }), us(Entry, Setup),
              b[0][Q] ? us(Setup, Q) : 0.0, us(b[0][Q] ? Q : Setup, FirstK), us(FirstK, FirstTile), tiles - 1,
              us(FirstTile, LoopEnd), tiles > 1 ? us(FirstTile, LoopEnd) / (tiles - 1) : 0.0, us(LoopEnd, LastPv),
              us(LastPv, Stored), b[0][ProducerDone] ? us(Entry, ProducerDone) : 0.0);
  // ATTN_TL_BLOCKS=1: every block's span (us, in launch order: x fastest, then kv head, then split) and its loop's
  // time from the first tile's end to the loop's end, to see which blocks the launch waits for.
  if (const char* e = std::getenv("ATTN_TL_BLOCKS"); e && *e == '1') {
    std::printf("  blocks (index: span / later tiles, us):");
    for (size_t i = 0; i < b.size(); ++i)
      std::printf("%s%zu: %.1f / %.1f", i % 8 ? "  " : "\n   ", i, (b[i][EndNs] - b[i][EntryNs]) / 1e3,
                  double(b[i][LoopEnd] - b[i][FirstTile]) / rate / 1e3);
    std::printf("\n");
  }
  if (b[0][Laps] == 0 && b[0][Laps + 1] == 0) return;  // attention_ws_k only
  const char* lap[] = {"wait K", "ping-pong", "issue S", "wait V", "issue P.V", "wait S", "softmax", "wait P.V",
                       "rescale + pack"};
  std::printf("  loop of one consumer thread, per tile (median block, us):");
  for (int k = 0; k < 9; ++k)
    std::printf(" %s %.2f%s", lap[k], med([&](const long long* r) { return double(r[Laps + k]) / rate / 1e3 / r[Tiles]; }),
                k < 8 ? "," : "\n");
}
#endif

using dg::cuda::AttentionArgs;
using bf16 = __nv_bfloat16;

static uint16_t f2b(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
static float b2f(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Buf {
  std::vector<uint16_t> h;
  bf16* d = nullptr;
  explicit Buf(size_t n, uint64_t seed) : h(n) {
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (auto& v : h) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      v = f2b(float((x >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f);
    }
    cudaMalloc(&d, n * 2);
    cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice);
  }
  ~Buf() { cudaFree(d); }
  float at(size_t i) const { return b2f(h[i]); }
};

struct Case {
  const char* name;
  int T, nh, nkv, D;
  int64_t cap, first_pos, n_old;
  bool causal;
  int64_t window;
  int samples;  // 0: check every row
  int iters;    // 0: no timing
};

struct Result {
  double t_old = 0, t_new = 0, t_v3 = 0, t_v4 = 0;
};

static Result run_case(const Case& c, bool& all_ok) {
  // ATTN_CASE=substring runs only the cases whose name holds it (for a profiler).
  if (const char* only = std::getenv("ATTN_CASE"); only && !std::strstr(c.name, only)) return Result{};
  const size_t qn = size_t(c.T) * c.nh * c.D, cn = size_t(c.cap) * c.nkv * c.D, nn = size_t(c.T) * c.nkv * c.D;
  Buf q(qn, 1), kc(cn, 2), vc(cn, 3), kn(nn, 4), vn(nn, 5);
  bf16 *o_new, *o_new2, *o_old, *o_v3, *o_v4;
  cudaMalloc(&o_new, qn * 2), cudaMalloc(&o_new2, qn * 2), cudaMalloc(&o_old, qn * 2), cudaMalloc(&o_v3, qn * 2);
  cudaMalloc(&o_v4, qn * 2);
  cudaMemset(o_v4, 0xff, qn * 2);
  cudaMemset(o_new, 0xff, qn * 2), cudaMemset(o_new2, 0x7f, qn * 2), cudaMemset(o_old, 0xff, qn * 2);
  cudaMemset(o_v3, 0xff, qn * 2);
  AttentionArgs a{q.d,    c.T,   c.nh,      c.nkv, c.D,      kc.d,  vc.d, c.cap, c.first_pos, c.n_old,
                  kn.d,   vn.d,  c.T,       c.first_pos + c.n_old, c.causal, c.window, o_new};
  dg::cuda::attention(a, nullptr);
  a.out = o_new2;
  dg::cuda::attention(a, nullptr);
  a.out = o_old;
  dg::cuda::attention_old(a, nullptr);
#ifdef WITH_V3
  a.out = o_v3;
  dg::cuda::attention_v3(a, nullptr);
#endif
#ifdef WITH_V4
  a.out = o_v4;
  dg::cuda::attention_v4(a, nullptr);
#endif
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> hn(qn), hn2(qn), ho(qn), h3(qn), h4(qn);
  cudaMemcpy(h4.data(), o_v4, qn * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(h3.data(), o_v3, qn * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(hn.data(), o_new, qn * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(hn2.data(), o_new2, qn * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(ho.data(), o_old, qn * 2, cudaMemcpyDeviceToHost);
  bool det = std::memcmp(hn.data(), hn2.data(), qn * 2) == 0;
  {  // the engine captures attention into CUDA graphs: a captured launch must give the same bits
    cudaStream_t st;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    a.out = o_new2;
    CUDA_CHECK(cudaMemset(o_new2, 0x7f, qn * 2));
    CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    dg::cuda::attention(a, st);
    CUDA_CHECK(cudaStreamEndCapture(st, &graph));
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_CHECK(cudaGraphLaunch(exec, st));
    CUDA_CHECK(cudaStreamSynchronize(st));
    CUDA_CHECK(cudaMemcpy(hn2.data(), o_new2, qn * 2, cudaMemcpyDeviceToHost));
    det = det && std::memcmp(hn.data(), hn2.data(), qn * 2) == 0;
    cudaGraphExecDestroy(exec), cudaGraphDestroy(graph), cudaStreamDestroy(st);
  }
  const bool v3_same = std::memcmp(hn.data(), h3.data(), qn * 2) == 0;  // bitwise equal to the file's kernel

  // Rows to check: (t, h) pairs.
  std::vector<std::pair<int, int>> rows;
  if (c.samples == 0) {
    for (int t = 0; t < c.T; ++t)
      for (int h = 0; h < c.nh; ++h) rows.push_back({t, h});
  } else {
    for (int i = 0; i < c.samples; ++i) {
      const int t = i == 0 ? 0 : i == 1 ? c.T - 1 : int((int64_t(i) * 2654435761ll) % c.T);
      rows.push_back({t, (i * 7) % c.nh});
    }
  }
  const int g = c.nh / c.nkv;
  const int64_t nk = c.n_old + c.T;
  std::vector<double> md_new(rows.size()), md_old(rows.size()), md_v3(rows.size()), md_v4(rows.size()),
      mr(rows.size());
  auto work = [&](size_t i0, size_t i1) {
    std::vector<double> sc(size_t(nk) + 1), acc(size_t(c.D));
    for (size_t ri = i0; ri < i1; ++ri) {
      const int t = rows[ri].first, h = rows[ri].second, kvh = h / g;
      const int64_t qp = c.first_pos + c.n_old + t;
      auto key = [&](const Buf& cache, const Buf& fresh, int64_t j, int d) {
        if (j < c.n_old) return cache.at((size_t((c.first_pos + j) % c.cap) * c.nkv + kvh) * c.D + d);
        return fresh.at((size_t(j - c.n_old) * c.nkv + kvh) * c.D + d);
      };
      double mx = -INFINITY;
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t kp = c.first_pos + j;
        bool vis = true;
        if (c.causal) vis = kp <= qp && (c.window == 0 || qp - kp < c.window);
        double s = -INFINITY;
        if (vis) {
          s = 0;
          for (int d = 0; d < c.D; ++d) s += double(q.at((size_t(t) * c.nh + h) * c.D + d)) * key(kc, kn, j, d);
        }
        sc[size_t(j)] = s;
        mx = std::max(mx, s);
      }
      double sum = 0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = 0; j < nk; ++j) {
        if (sc[size_t(j)] == -INFINITY) continue;
        const double p = std::exp(sc[size_t(j)] - mx);
        sum += p;
        for (int d = 0; d < c.D; ++d) acc[size_t(d)] += p * key(vc, vn, j, d);
      }
      double dn = 0, dol = 0, d3 = 0, d4 = 0, r = 0;
      for (int d = 0; d < c.D; ++d) {
        const double want = acc[size_t(d)] / sum;
        const size_t idx = (size_t(t) * c.nh + h) * c.D + d;
        const double gn = b2f(hn[idx]), go = b2f(ho[idx]);
        dn = std::isfinite(gn) ? std::max(dn, std::fabs(gn - want)) : INFINITY;
        dol = std::isfinite(go) ? std::max(dol, std::fabs(go - want)) : INFINITY;
        const double g3 = b2f(h3[idx]);
        d3 = std::isfinite(g3) ? std::max(d3, std::fabs(g3 - want)) : INFINITY;
        const double g4 = b2f(h4[idx]);
        d4 = std::isfinite(g4) ? std::max(d4, std::fabs(g4 - want)) : INFINITY;
        r = std::max(r, std::fabs(want));
      }
      md_new[ri] = dn, md_old[ri] = dol, md_v3[ri] = d3, md_v4[ri] = d4, mr[ri] = r;
    }
  };
  const size_t nth = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> th;
  for (size_t k = 0; k < nth; ++k)
    th.emplace_back(work, rows.size() * k / nth, rows.size() * (k + 1) / nth);
  for (auto& x : th) x.join();
  double dn = 0, dol = 0, d3 = 0, d4 = 0, r = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    dn = std::max(dn, md_new[i]), dol = std::max(dol, md_old[i]);
    d3 = std::max(d3, md_v3[i]), d4 = std::max(d4, md_v4[i]), r = std::max(r, mr[i]);
  }
  const double en = dn / r, eo = dol / r, e3 = d3 / r, e4 = d4 / r;
  const bool v4_same = std::memcmp(hn.data(), h4.data(), qn * 2) == 0;
  const bool ok = en <= 2e-2 && det && std::isfinite(en);
  all_ok = all_ok && ok;

  Result res;
  if (c.iters > 0) {
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    void (*fns[4])(const AttentionArgs&, cudaStream_t) = {dg::cuda::attention_old, dg::cuda::attention, nullptr,
                                                          nullptr};
#ifdef WITH_V3
    fns[2] = dg::cuda::attention_v3;
#endif
#ifdef WITH_V4
    fns[3] = dg::cuda::attention_v4;
#endif
    double* dst[4] = {&res.t_old, &res.t_new, &res.t_v3, &res.t_v4};
    bf16* outs[4] = {o_old, o_new, o_v3, o_v4};
    for (int pass = 0; pass < 4; ++pass) {
      if (!fns[pass]) continue;
      a.out = outs[pass];
      for (int i = 0; i < 3; ++i) fns[pass](a, nullptr);
      cudaEventRecord(e0);
      for (int i = 0; i < c.iters; ++i) fns[pass](a, nullptr);
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      *dst[pass] = ms / c.iters;
    }
    CUDA_CHECK(cudaGetLastError());
    cudaEventDestroy(e0), cudaEventDestroy(e1);
#ifdef DG_ATTN_TIMELINE
    a.out = o_new;
    print_timeline(c.name, [&] { dg::cuda::attention(a, nullptr); });
#endif
  }
  std::printf("%-34s rows %6zu  rel_err new %.2e old %.2e", c.name, rows.size(), en, eo);
#ifdef WITH_V3
  std::printf(" var %.2e%s", e3, v3_same ? "(=new)" : "");
#endif
#ifdef WITH_V4
  std::printf(" var2 %.2e%s", e4, v4_same ? "(=new)" : "");
#endif
  std::printf("  det %s  %s", det ? "yes" : "NO", ok ? "OK  " : "FAIL");
  if (c.iters > 0) std::printf("  old %7.4f  new %7.4f ms  x%.2f", res.t_old, res.t_new, res.t_old / res.t_new);
#ifdef WITH_V3
  if (c.iters > 0) std::printf("  var %7.4f ms", res.t_v3);
#endif
#ifdef WITH_V4
  if (c.iters > 0) std::printf("  var2 %7.4f ms", res.t_v4);
#endif
  std::printf("\n");
  std::fflush(stdout);
  cudaFree(o_new), cudaFree(o_new2), cudaFree(o_old), cudaFree(o_v3), cudaFree(o_v4);
  return res;
}

int main() {
  bool ok = true;
  // ATTN_SPLITS=n: the split-KV count of every launch (dg::cuda::set_attention_splits; 0 or unset: the launcher's pick)
  if (const char* e = std::getenv("ATTN_SPLITS")) dg::cuda::set_attention_splits(std::atoi(e));
  // ATTN_TMA=0: every build's launches load by cp.async only (dg::cuda::set_attention_tma(false))
  if (const char* e = std::getenv("ATTN_TMA"); e && *e == '0') {
    dg::cuda::set_attention_tma(false);
#ifdef WITH_V3
    dg::cuda::set_attention_tma_v3(false);
#endif
#ifdef WITH_V4
    dg::cuda::set_attention_tma_v4(false);
#endif
  }
  // Awkward shapes, every row checked.
  const Case small[] = {
      {"tiny sliding prefill wrapped", 37, 4, 2, 16, 11, 20, 7, true, 8, 0, 0},
      {"full prefill after cache D32", 19, 4, 1, 32, 50, 0, 45, true, 0, 0, 0},
      {"bidir full ring D64", 33, 4, 2, 64, 23, 100, 23, false, 0, 0, 0},
      {"sliding denoise T70", 70, 16, 8, 256, 1535, 3000, 1023, false, 0, 0, 0},
      {"full causal D512 T45", 45, 16, 2, 512, 300, 0, 211, true, 0, 0, 0},
      {"window inside chunk T130", 130, 16, 8, 256, 1535, 0, 5, true, 64, 0, 0},
      {"full bidir D512 n_old 651", 40, 16, 2, 512, 800, 0, 651, false, 0, 0, 0},
      {"T1 sliding denoise", 1, 16, 8, 256, 1535, 500, 1023, false, 0, 0, 0},
      {"sliding causal T600 unsplit", 600, 16, 8, 256, 2048, 100, 900, true, 1024, 0, 0},
      {"full causal T300 unsplit", 300, 16, 2, 512, 1000, 7, 333, true, 0, 0, 0},
      {"full bidir T257 wrapped", 257, 16, 2, 512, 5000, 4000, 4095, false, 0, 48, 0},
      {"D48 g3", 100, 6, 2, 48, 70, 3, 61, false, 0, 0, 0},
      {"D128 g8 causal window 16", 77, 8, 1, 128, 130, 0, 129, true, 16, 0, 0},
      {"D80 bidir", 50, 4, 4, 80, 64, 10, 60, false, 0, 0, 0},
      {"D112 causal", 90, 4, 2, 112, 64, 3, 40, true, 0, 0, 0},
  };
  for (const auto& c : small) run_case(c, ok);
  // The model's shapes: sampled rows, timed.
  const Case S{"denoise sliding T256 n_old 1023", 256, 16, 8, 256, 1535, 3000, 1023, false, 0, 64, 50};
  const Case F512{"denoise full T256 kv 512", 256, 16, 2, 512, 768, 0, 512, false, 0, 64, 50};
  const Case F4K{"denoise full T256 kv 4096", 256, 16, 2, 512, 4352, 0, 4096, false, 0, 64, 30};
  const Case F32K{"denoise full T256 kv 32768", 256, 16, 2, 512, 33024, 0, 32768, false, 0, 32, 10};
  const Case PS{"prefill sliding T4096 causal w1024", 4096, 16, 8, 256, 4096, 0, 0, true, 1024, 64, 10};
  const Case PF{"prefill full T4096 causal", 4096, 16, 2, 512, 4096, 0, 0, true, 0, 64, 10};
  const Result rs = run_case(S, ok), r512 = run_case(F512, ok), r4k = run_case(F4K, ok), r32k = run_case(F32K, ok);
  const Result rps = run_case(PS, ok), rpf = run_case(PF, ok);
  auto step = [&](const Result& f, double Result::*m) { return 25 * (rs.*m) + 5 * (f.*m); };
  std::printf("\nper denoise step (25 sliding + 5 full), old / new (/ var / var2) ms:\n");
  for (auto [name, r] : {std::pair{"  kv   512", &r512}, std::pair{"  kv  4096", &r4k}, std::pair{"  kv 32768", &r32k}})
    std::printf("%s: %7.3f  %7.3f  %7.3f  %7.3f\n", name, step(*r, &Result::t_old), step(*r, &Result::t_new),
                step(*r, &Result::t_v3), step(*r, &Result::t_v4));
  std::printf("prefill 4096-token chunk attention (25 + 5 layers): %7.3f  %7.3f  %7.3f  %7.3f\n",
              25 * rps.t_old + 5 * rpf.t_old, 25 * rps.t_new + 5 * rpf.t_new, 25 * rps.t_v3 + 5 * rpf.t_v3,
              25 * rps.t_v4 + 5 * rpf.t_v4);
  std::printf("%s\n", ok ? "ALL OK" : "SOME CHECKS FAILED");
  return ok ? 0 : 1;
}
