// Microbench + checker for the grouped expert GEMMs (src/backend/cuda/kernels_experts.cu), one binary per GPU call:
// checks every kernel variant against a CPU reference at small awkward sizes and against the old tiled kernel
// (element by element) at the real shapes, then times them at decode (P = 2048: 256 tokens top-8 of 128 experts)
// and prefill (P = 32768) shapes, rotating over several layers' weights (> 6 GB) so L2 does not flatter them.
// Build (no GPU needed):
//   cmake --build build --target microbench_experts   (or by hand: nvcc -std=c++20 -O3
//   -gencode arch=compute_90a,code=sm_90a -I src --expt-relaxed-constexpr -cudart static
//   tools/gpu/microbench/experts_bench.cu -o build-experts/experts_bench)
// The kernel file is included (not linked) so the bench can launch its internal variants directly.
// Variants: old-tiled = moe_tiled_k; public = moe_gate_up / moe_down (dispatch); s<GNI,SK,S[,R][,NP]> =
// moe_stream_k with GNI weight rows x SK k per stage, S stages, R = rotated k start, NP = one block per item
// (otherwise persistent). H200, 2026-11-30 (ms per layer, gate_up / down; plain read ceiling 4.49 TB/s):
//   decode  P=2048 : old 0.301 / 0.168 (3.37 / 3.02 TB/s); best stream s<128,64,4,NP> 0.350 / 0.177;
//                    persistent s<64,64,11,R> 0.861 / 0.447; s<128,64,4,R> 0.384 / 0.180
//   prefill P=32768: old 2.090 / 1.140; s<128,64,4,NP> 1.925 / 0.973 (bit-identical outputs) -> used for prefill
#include "backend/cuda/kernels_experts.cu"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace dg::cuda {
void throw_cuda_error(const char* expr, const char* msg, int code, const char* file, int line) {
  std::fprintf(stderr, "CUDA error %s: %s (%d) at %s:%d\n", expr, msg, code, file, line);
  std::exit(2);
}
void check_cublas(int, const char*, const char*, int) {}
}  // namespace dg::cuda

using namespace dg::cuda;

namespace eb {

int g_fail = 0;

__global__ void fill_k(bf16* p, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed ^ uint32_t(i >> 32) * 40503u;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
    p[i] = __float2bfloat16((float(h) * (1.0f / 4294967296.0f) * 2.0f - 1.0f) * scale);
  }
}
void fill(bf16* p, size_t n, uint32_t seed, float scale) {
  fill_k<<<4096, 256>>>(p, n, seed, scale);
  CUDA_CHECK_LAUNCH();
}
__global__ void read_k(const uint4* p, size_t n, unsigned* sink) {
  unsigned s = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint4 v = __ldcs(p + i);
    s ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (s == 0x12345678u) *sink = s;
}

template <class T>
T* dalloc(size_t n) {
  T* p = nullptr;
  CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
  return p;
}
template <class T>
std::vector<T> get(const T* p, size_t n) {
  std::vector<T> v(n);
  CUDA_CHECK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}
float f(bf16 x) { return __bfloat162float(x); }
float gelu(float x) { return 0.5f * x * (1.0f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x))); }

// Gate-up / down launchers under test: old tiled kernel, stream variants, and the public entry points.
using GU = std::function<void(const bf16*, const int32_t*, int, int, const bf16*, int, int, bf16*)>;
using DN = std::function<void(const bf16*, const int32_t*, int, int, const bf16*, int, int, float*)>;
struct Variant {
  std::string name;
  GU gu;
  DN dn;
};
void old_gu(const bf16* xs, const int32_t* off, int E, int, const bf16* W, int H, int I, bf16* act) {
  dim3 grid((I + GN / 2 - 1) / (GN / 2), E);
  raise_smem_limit<true>();
  moe_tiled_k<true><<<grid, kGemmThreads, kMoeSmem>>>(xs, off, W, I, H, act, nullptr, false, nullptr, false);
  CUDA_CHECK_LAUNCH();
}
void old_dn(const bf16* a, const int32_t* off, int E, int, const bf16* W, int H, int I, float* y) {
  dim3 grid((H + GN - 1) / GN, E);
  raise_smem_limit<false>();
  moe_tiled_k<false><<<grid, kGemmThreads, kMoeSmem>>>(a, off, W, H, I, nullptr, y, false, nullptr, false);
  CUDA_CHECK_LAUNCH();
}
template <int GNI, int SK, int S, bool ROT, bool PERSIST = true>
Variant stream_variant() {
  return {"s<" + std::to_string(GNI) + "," + std::to_string(SK) + "," + std::to_string(S) + (ROT ? ",R" : "") +
              (PERSIST ? "" : ",NP") + ">",
          [](const bf16* xs, const int32_t* off, int E, int, const bf16* W, int H, int I, bf16* act) {
            launch_stream<true, GNI, SK, S, ROT, PERSIST>(xs, off, E, W, I, H, act, nullptr, nullptr);
          },
          [](const bf16* a, const int32_t* off, int E, int, const bf16* W, int H, int I, float* y) {
            launch_stream<false, GNI, SK, S, ROT, PERSIST>(a, off, E, W, H, I, nullptr, y, nullptr);
          }};
}
std::vector<Variant> variants() {
  return {{"old-tiled", old_gu, old_dn},
          {"public",
           [](const bf16* xs, const int32_t* off, int E, int P, const bf16* W, int H, int I, bf16* act) {
             moe_gate_up(xs, off, E, P, W, H, I, act, nullptr);
           },
           [](const bf16* a, const int32_t* off, int E, int P, const bf16* W, int H, int I, float* y) {
             moe_down(a, off, E, P, W, H, I, y, nullptr);
           }},
          stream_variant<64, 64, 5, false>(),
          stream_variant<64, 64, 5, true>(),
          stream_variant<64, 64, 4, true>(),
          stream_variant<64, 128, 3, true>(),
          stream_variant<128, 64, 4, true>(),
          stream_variant<64, 64, 11, true>(),
          stream_variant<128, 64, 8, true>(),
          stream_variant<128, 64, 4, true, false>(),
          stream_variant<128, 64, 4, false, false>()};
}

// Top-k routing of T tokens over E experts (k distinct each; expert 1 unused when E > k + 1): offsets [E+1].
std::vector<int32_t> route(int T, int E, int k, std::mt19937& rng, bool skip1) {
  std::vector<int32_t> cnt(size_t(E), 0);
  std::vector<int> pool;
  for (int e = 0; e < E; ++e)
    if (!skip1 || e != 1 || E <= k + 1) pool.push_back(e);
  for (int t = 0; t < T; ++t) {
    for (int j = 0; j < k; ++j) {  // partial Fisher-Yates
      std::uniform_int_distribution<int> d(j, int(pool.size()) - 1);
      std::swap(pool[size_t(j)], pool[size_t(d(rng))]);
      ++cnt[size_t(pool[size_t(j)])];
    }
  }
  std::vector<int32_t> off(size_t(E) + 1, 0);
  for (int e = 0; e < E; ++e) off[size_t(e) + 1] = off[size_t(e)] + cnt[size_t(e)];
  return off;
}

double rel(const std::vector<double>& got, const std::vector<double>& want) {
  double n = 0, d = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    n += (got[i] - want[i]) * (got[i] - want[i]), d += want[i] * want[i];
  }
  return std::sqrt(n / std::max(d, 1e-300));
}

}  // namespace eb
using namespace eb;

struct Case {
  int T, E, k, H, I;
  bool skip1;
};

static void run_check(const std::vector<Variant>& vs, const Case& c, std::mt19937& rng, const std::vector<int>* only) {
  const int E = c.E, H = c.H, I = c.I;
  auto off = route(c.T, E, c.k, rng, c.skip1);
  const int P = off[size_t(E)];
  int32_t* doff = dalloc<int32_t>(size_t(E) + 1);
  CUDA_CHECK(cudaMemcpy(doff, off.data(), (size_t(E) + 1) * 4, cudaMemcpyHostToDevice));
  bf16 *dxs = dalloc<bf16>(size_t(P) * H), *dgu = dalloc<bf16>(size_t(E) * 2 * I * H),
       *ddn = dalloc<bf16>(size_t(E) * H * I), *dact = dalloc<bf16>(size_t(P) * I), *dact0 = dalloc<bf16>(size_t(P) * I);
  float* dy = dalloc<float>(size_t(P) * H);
  const uint32_t seed = uint32_t(rng());
  fill(dxs, size_t(P) * H, seed, 1.0f), fill(dgu, size_t(E) * 2 * I * H, seed + 1, 0.1f),
      fill(ddn, size_t(E) * H * I, seed + 2, 0.1f);
  old_gu(dxs, doff, E, P, dgu, H, I, dact0);  // down input for every variant (isolates the down check)
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<int> ex;
  if (only)
    ex = *only;
  else
    for (int e = 0; e < E; ++e) ex.push_back(e);
  auto xs = get(dxs, size_t(P) * H);
  auto a0 = get(dact0, size_t(P) * I);
  // reference for the chosen experts' rows
  std::vector<double> ref_act, ref_y;
  std::vector<std::pair<int, int>> rows;  // (row, expert)
  for (int e : ex)
    for (int r = off[size_t(e)]; r < off[size_t(e) + 1]; ++r) rows.push_back({r, e});
  {
    std::vector<bf16> wg(size_t(2) * I * H), wd(size_t(H) * I);
    int cur = -1;
    for (auto [r, e] : rows) {
      if (e != cur) {
        CUDA_CHECK(cudaMemcpy(wg.data(), dgu + size_t(e) * 2 * I * H, wg.size() * 2, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(wd.data(), ddn + size_t(e) * H * I, wd.size() * 2, cudaMemcpyDeviceToHost));
        cur = e;
      }
      for (int o = 0; o < I; ++o) {
        double g = 0, u = 0;
        for (int i = 0; i < H; ++i) {
          const double x = f(xs[size_t(r) * H + i]);
          g += x * f(wg[size_t(o) * H + i]), u += x * f(wg[(size_t(I) + o) * H + i]);
        }
        ref_act.push_back(double(gelu(float(g))) * u);
      }
      for (int o = 0; o < H; ++o) {
        double s = 0;
        for (int i = 0; i < I; ++i) s += double(f(a0[size_t(r) * I + i])) * f(wd[size_t(o) * I + i]);
        ref_y.push_back(s);
      }
    }
  }
  for (const auto& v : vs) {
    CUDA_CHECK(cudaMemset(dact, 0xFF, size_t(P) * I * 2));
    CUDA_CHECK(cudaMemset(dy, 0xFF, size_t(P) * H * 4));
    v.gu(dxs, doff, E, P, dgu, H, I, dact);
    v.dn(dact0, doff, E, P, ddn, H, I, dy);
    CUDA_CHECK(cudaDeviceSynchronize());
    auto a = get(dact, size_t(P) * I);
    auto y = get(dy, size_t(P) * H);
    std::vector<double> ga, gy;
    for (auto [r, e] : rows) {
      for (int o = 0; o < I; ++o) ga.push_back(f(a[size_t(r) * I + o]));
      for (int o = 0; o < H; ++o) gy.push_back(y[size_t(r) * H + o]);
    }
    const double ea = rel(ga, ref_act), ey = rel(gy, ref_y);
    // every element written (poisoned with NaN before the run) and equal-ish to the old kernel over ALL rows
    size_t nan = 0;
    double dmax_a = 0, mx_a = 0, mx_y = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      if (!std::isfinite(f(a[i]))) ++nan;
      dmax_a = std::max(dmax_a, double(std::fabs(f(a[i]) - f(a0[i])))), mx_a = std::max(mx_a, double(std::fabs(f(a0[i]))));
    }
    for (size_t i = 0; i < y.size(); ++i) {
      if (!std::isfinite(y[i])) ++nan;
      mx_y = std::max(mx_y, double(std::fabs(y[i])));
    }
    const bool ok = ea <= 1e-2 && ey <= 1e-4 && nan == 0 && dmax_a <= 0.02 * mx_a;
    if (!ok) ++g_fail;
    std::printf("  %-18s T=%-5d E=%-3d k=%d H=%-5d I=%-4d P=%-6d rows_checked=%-6zu gate_up rel %.2e  down rel %.2e  "
                "nan %zu  |act-old|max/max %.1e  %s\n",
                v.name.c_str(), c.T, E, c.k, H, I, P, rows.size(), ea, ey, nan, dmax_a / std::max(mx_a, 1e-30),
                ok ? "OK" : "FAIL");
  }
  CUDA_CHECK(cudaFree(doff));
  for (bf16* p : {dxs, dgu, ddn, dact, dact0}) CUDA_CHECK(cudaFree(p));
  CUDA_CHECK(cudaFree(dy));
}

// Element-by-element comparison of every variant with the old kernel over all outputs, then timing.
static void run_bench(const std::vector<Variant>& vs, int T, int E, int k, int H, int I, int NL, int launches,
                      int reps, std::mt19937& rng, const char* label) {
  auto off = route(T, E, k, rng, false);
  const int P = off[size_t(E)];
  int mn = 1 << 30, mx = 0;
  for (int e = 0; e < E; ++e) mn = std::min(mn, off[size_t(e) + 1] - off[size_t(e)]), mx = std::max(mx, off[size_t(e) + 1] - off[size_t(e)]);
  std::printf("\n== %s: T=%d E=%d k=%d H=%d I=%d P=%d rows/expert %d..%d, %d layers of weights rotated\n", label, T,
              E, k, H, I, P, mn, mx, NL);
  int32_t* doff = dalloc<int32_t>(size_t(E) + 1);
  CUDA_CHECK(cudaMemcpy(doff, off.data(), (size_t(E) + 1) * 4, cudaMemcpyHostToDevice));
  const size_t gu_sz = size_t(E) * 2 * I * H, dn_sz = size_t(E) * H * I;
  bf16 *dxs = dalloc<bf16>(size_t(P) * H), *dgu = dalloc<bf16>(gu_sz * NL), *ddn = dalloc<bf16>(dn_sz * NL),
       *dact = dalloc<bf16>(size_t(P) * I), *dact0 = dalloc<bf16>(size_t(P) * I);
  float *dy = dalloc<float>(size_t(P) * H), *dy0 = dalloc<float>(size_t(P) * H);
  fill(dxs, size_t(P) * H, 11, 1.0f), fill(dgu, gu_sz * NL, 12, 0.05f), fill(ddn, dn_sz * NL, 13, 0.05f);
  old_gu(dxs, doff, E, P, dgu, H, I, dact0);
  old_dn(dact0, doff, E, P, ddn, H, I, dy0);
  CUDA_CHECK(cudaDeviceSynchronize());
  auto a0 = get(dact0, size_t(P) * I);
  auto y0 = get(dy0, size_t(P) * H);
  // read-bandwidth ceiling: one pass over all gate_up weights
  {
    unsigned* sink = dalloc<unsigned>(1);
    cudaEvent_t b, e;
    CUDA_CHECK(cudaEventCreate(&b));
    CUDA_CHECK(cudaEventCreate(&e));
    read_k<<<132 * 8, 512>>>(reinterpret_cast<const uint4*>(dgu), gu_sz * NL * 2 / 16, sink);
    CUDA_CHECK(cudaEventRecord(b));
    for (int r = 0; r < 3; ++r) read_k<<<132 * 8, 512>>>(reinterpret_cast<const uint4*>(dgu), gu_sz * NL * 2 / 16, sink);
    CUDA_CHECK(cudaEventRecord(e));
    CUDA_CHECK(cudaEventSynchronize(e));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, b, e));
    std::printf("  plain read of %.2f GB: %.3f ms -> %.2f TB/s (ceiling)\n", gu_sz * NL * 2 / 1e9, ms / 3,
                gu_sz * NL * 2 / (ms / 3 * 1e-3) / 1e12);
    CUDA_CHECK(cudaFree(sink));
  }
  std::printf("  %-18s %10s %10s %9s | %10s %10s %9s | %s\n", "variant", "gu ms/lay", "gu ms/30", "gu TB/s",
              "dn ms/lay", "dn ms/30", "dn TB/s", "check vs old (all elements)");
  for (const auto& v : vs) {
    CUDA_CHECK(cudaMemset(dact, 0xFF, size_t(P) * I * 2));
    CUDA_CHECK(cudaMemset(dy, 0xFF, size_t(P) * H * 4));
    v.gu(dxs, doff, E, P, dgu, H, I, dact);
    v.dn(dact0, doff, E, P, ddn, H, I, dy);
    CUDA_CHECK(cudaDeviceSynchronize());
    auto a = get(dact, size_t(P) * I);
    auto y = get(dy, size_t(P) * H);
    double da = 0, ma = 0, dyn = 0, yn = 0;
    size_t bad = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      if (!std::isfinite(f(a[i]))) ++bad;
      da = std::max(da, double(std::fabs(f(a[i]) - f(a0[i])))), ma = std::max(ma, double(std::fabs(f(a0[i]))));
    }
    for (size_t i = 0; i < y.size(); ++i) {
      if (!std::isfinite(y[i])) ++bad;
      dyn += double(y[i] - y0[i]) * (y[i] - y0[i]), yn += double(y0[i]) * y0[i];
    }
    const double ry = std::sqrt(dyn / std::max(yn, 1e-300)), ra = da / std::max(ma, 1e-30);
    const bool ok = bad == 0 && ra <= 0.02 && ry <= 1e-4;
    if (!ok) ++g_fail;
    auto time = [&](bool gated) {
      std::vector<float> t;
      cudaEvent_t b, e;
      CUDA_CHECK(cudaEventCreate(&b));
    CUDA_CHECK(cudaEventCreate(&e));
      for (int r = -1; r < reps; ++r) {
        CUDA_CHECK(cudaEventRecord(b));
        for (int l = 0; l < launches; ++l) {
          if (gated)
            v.gu(dxs, doff, E, P, dgu + gu_sz * (l % NL), H, I, dact);
          else
            v.dn(dact0, doff, E, P, ddn + dn_sz * (l % NL), H, I, dy);
        }
        CUDA_CHECK(cudaEventRecord(e));
        CUDA_CHECK(cudaEventSynchronize(e));
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, b, e));
        if (r >= 0) t.push_back(ms / launches);
      }
      std::sort(t.begin(), t.end());
      return t[t.size() / 2];
    };
    const float tg = time(true), td = time(false);
    std::printf("  %-18s %10.4f %10.3f %9.2f | %10.4f %10.3f %9.2f | act max|d|/max %.1e, y rel %.1e, nan %zu %s\n",
                v.name.c_str(), tg, tg * 30, gu_sz * 2 / (tg * 1e-3) / 1e12, td, td * 30,
                dn_sz * 2 / (td * 1e-3) / 1e12, ra, ry, bad, ok ? "OK" : "FAIL");
  }
  CUDA_CHECK(cudaFree(doff));
  for (bf16* p : {dxs, dgu, ddn, dact, dact0}) CUDA_CHECK(cudaFree(p));
  CUDA_CHECK(cudaFree(dy));
  CUDA_CHECK(cudaFree(dy0));
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const bool quick = mode == "--quick", small = mode == "--small";  // --small: small CPU checks only (sanitizer)
  auto vs = variants();
  std::mt19937 rng(1234);
  std::printf("== CPU-reference checks (all rows unless noted; gate_up rel <= 1e-2, down rel <= 1e-4)\n");
  for (Case c : {Case{37, 6, 2, 40, 24, true}, Case{300, 16, 4, 136, 72, true}, Case{40, 16, 8, 2816, 704, true},
                 Case{200, 8, 4, 1000, 200, true}, Case{600, 4, 2, 264, 88, false}, Case{5, 20, 3, 24, 8, true},
                 Case{3000, 8, 2, 72, 40, false}})
    run_check(vs, c, rng, nullptr);
  if (small) {
    std::printf("\n%s (%d failures)\n", g_fail ? "SOME CHECKS FAILED" : "ALL CHECKS PASSED", g_fail);
    return g_fail ? 1 : 0;
  }
  {
    std::vector<int> ex = {0, 5, 77};
    run_check(vs, Case{256, 128, 8, 2816, 704, false}, rng, &ex);  // full size, 3 experts' rows against the CPU
  }
  run_bench(vs, 256, 128, 8, 2816, 704, 4, 30, quick ? 2 : 5, rng, "decode (one 30-layer step = 30 launches)");
  run_bench(vs, 4096, 128, 8, 2816, 704, 2, 6, quick ? 1 : 3, rng, "prefill 4K");
  std::printf("\n%s (%d failures)\n", g_fail ? "SOME CHECKS FAILED" : "ALL CHECKS PASSED", g_fail);
  return g_fail ? 1 : 0;
}
