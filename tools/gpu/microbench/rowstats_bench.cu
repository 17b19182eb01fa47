// Microbench + checker for softcap_row_stats (src/backend/cuda/kernels_rows.cu) and the sparse-SC kernels
// (src/backend/cuda/kernels_sc.cu), one binary per GPU call, at the denoise shape 256 x 262144:
//  - old: the previous kernel (one 1024-thread block per row, three passes over the row, exp in double), copied
//    below, vs new: the tiled fused pass + fixed-order merge + probs pass; medians of CUDA-event timings, the
//    logits re-copied from a pristine buffer before every rep (the in-place softcap must not see capped input);
//  - checks: the new stats vs a CPU oracle (a copy of dg::compute_row_stats) on a few rows, new vs old (capped
//    logits bitwise, argmax, entropy), bitwise determinism of two runs (capped logits, stats, probs);
//  - sparse SC: sc_survivors + sc_gather_sum on peaked rows (few / ~1-2k survivors per row), timed; the exact path
//    (probs @ E through cuBLASLt) is not linked here: 0.58 ms per step in docs/BENCHMARKS.md.
// Build (no GPU needed): cmake --build build --target microbench_rowstats
// H200, 2026-11-30 (ms, medians): softcap_row_stats with probs old 0.556 -> new 0.339 (1.64x), stats only 0.402 ->
// 0.238 (a 268 MB D2D copy: 0.133, 4.03 TB/s); new vs old entropy / logsumexp identical in f32, 29 of 67M bf16
// probs one bit apart; sc_survivors 0.27 ms on peaked rows (a coalesced variant, since reverted: 0.31-0.33, 0.37
// on flat rows), sc_gather_sum 0.033 / 0.365 / 0.553 ms at 32 / 1024 / 2048 survivors per row.
#include "backend/cuda/kernels_rows.cu"
#include "backend/cuda/kernels_sc.cu"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace dg::cuda {
void throw_cuda_error(const char* expr, const char* msg, int code, const char* file, int line) {
  std::fprintf(stderr, "CUDA error %s: %s (%d) at %s:%d\n", expr, msg, code, file, line);
  std::exit(2);
}
void check_cublas(int, const char*, const char*, int) {}
}  // namespace dg::cuda

using namespace dg::cuda;

namespace old {
// The kernel before this change (commit c31e6d3), verbatim but for the names.
__device__ __forceinline__ void better(float& bv, int& bi, float v, int i) {
  if (v > bv || (v == bv && i < bi)) bv = v, bi = i;
}
struct OldStats {
  int32_t argmax;
  float max_z, logsumexp, entropy;
};
__global__ void softcap_row_stats_k(float* logits, int V, float cap, float temperature, OldStats* stats,
                                    bf16* probs) {
  __shared__ float sv[32];
  __shared__ int si[32];
  __shared__ float best_s;
  __shared__ int best_i;
  float* row = logits + size_t(blockIdx.x) * V;
  float bv = -INFINITY;
  int bi = INT32_MAX;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    const float c = cap * tanhf(row[i] / cap);
    row[i] = c;
    better(bv, bi, c / temperature, i);
  }
  for (int o = 16; o > 0; o >>= 1) {
    float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    better(bv, bi, ov, oi);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sv[warp] = bv, si[warp] = bi;
  __syncthreads();
  if (warp == 0) {
    bv = lane < int(blockDim.x >> 5) ? sv[lane] : -INFINITY;
    bi = lane < int(blockDim.x >> 5) ? si[lane] : INT32_MAX;
    for (int o = 16; o > 0; o >>= 1) {
      float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      better(bv, bi, ov, oi);
    }
    if (lane == 0) best_s = bv, best_i = bi;
  }
  __syncthreads();
  const float best = best_s;
  // Double accumulation as in compute_row_stats: the accept rule compares entropies against a threshold.
  double sum = 0, weighted = 0;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    const double d = double(row[i] / temperature) - best;
    const double e = exp(d);
    sum += e;
    weighted += e * d;
  }
  sum = block_sum(sum);
  weighted = block_sum(weighted);
  if (threadIdx.x == 0) {
    OldStats r;
    r.argmax = best_i;
    r.max_z = best;
    r.logsumexp = float(best + log(sum));
    r.entropy = float(fmax(0.0, log(sum) - weighted / sum));
    stats[blockIdx.x] = r;
  }
  // The next step's SC soft-embedding input, softmax(z) as bf16: written here from the row's own max and sum saves
  // softmax_rows_bf16's three passes over the 1 MB row.
  if (probs) {
    const float inv = float(1.0 / sum);
    bf16* out = probs + size_t(blockIdx.x) * V;
    for (int i = threadIdx.x; i < V; i += blockDim.x) out[i] = __float2bfloat16(expf(row[i] / temperature - best) * inv);
  }
}
}  // namespace old

namespace rb {

int g_fail = 0;
#define CHECK_TRUE(cond, ...)                  \
  do {                                         \
    if (!(cond)) {                             \
      std::printf("FAIL: " __VA_ARGS__);       \
      std::printf("\n");                       \
      ++g_fail;                                \
    }                                          \
  } while (0)

__global__ void fill_k(float* p, size_t n, uint32_t seed, float lo, float hi) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed ^ uint32_t(i >> 32) * 40503u;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
    p[i] = lo + (hi - lo) * (float(h) * (1.0f / 4294967296.0f));
  }
}
__global__ void fill_bf16_k(bf16* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2246822519u ^ seed;
    h ^= h >> 15, h *= 2654435761u, h ^= h >> 13;
    p[i] = __float2bfloat16(float(h) * (1.0f / 4294967296.0f) * 0.1f - 0.05f);
  }
}
// Peaked rows: every `stride`-th token of a row gets a logit in [hi - 2, hi], the rest [lo, lo + 10].
__global__ void peak_k(float* p, int rows, int V, int stride, float lo, float hi) {
  const size_t n = size_t(rows) * V;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const int t = int(i % V), r = int(i / V);
    uint32_t h = uint32_t(i) * 2654435761u ^ 0x9e37u;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    const float u = float(h) * (1.0f / 4294967296.0f);
    p[i] = (t + 7 * r) % stride == 0 ? hi - 2.0f * u : lo + 10.0f * u;
  }
}

struct Timer {
  cudaEvent_t a, b;
  Timer() { cudaEventCreate(&a), cudaEventCreate(&b); }
  template <class F>
  float ms(F&& f) {
    cudaEventRecord(a);
    f();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    return t;
  }
};
float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// dg::compute_row_stats (src/backend/row_stats.cpp)
void oracle(const float* logits, int vocab, float temperature, int& arg, float& max_z, float& lse, float& ent) {
  float best = -INFINITY;
  arg = 0;
  for (int i = 0; i < vocab; ++i) {
    float z = logits[i] / temperature;
    if (z > best) best = z, arg = i;
  }
  double sum = 0, weighted = 0;
  for (int i = 0; i < vocab; ++i) {
    float d = logits[i] / temperature - best;
    double e = std::exp(d);
    sum += e;
    weighted += e * d;
  }
  max_z = best;
  lse = float(best + std::log(sum));
  ent = float(std::max(0.0, std::log(sum) - weighted / sum));
}

template <class T>
std::vector<T> get(const T* d, size_t n) {
  std::vector<T> v(n);
  CUDA_CHECK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

int main() {
  const int R = 256, V = 262144, H = 2816, reps = 20;
  const float cap = 30.0f, T = 0.8f;
  const size_t n = size_t(R) * V;
  float *src, *work;
  bf16 *probs, *probs_old;
  DeviceRowStats* st;
  old::OldStats* st_old;
  CUDA_CHECK(cudaMalloc(&src, n * 4));
  CUDA_CHECK(cudaMalloc(&work, n * 4));
  CUDA_CHECK(cudaMalloc(&probs, n * 2));
  CUDA_CHECK(cudaMalloc(&probs_old, n * 2));
  CUDA_CHECK(cudaMalloc(&st, R * sizeof(DeviceRowStats)));
  CUDA_CHECK(cudaMalloc(&st_old, R * sizeof(old::OldStats)));
  void* scratch;
  CUDA_CHECK(cudaMalloc(&scratch, softcap_row_stats_scratch_bytes(R, V)));
  fill_k<<<4096, 256>>>(src, n, 12345u, -40.0f, 40.0f);
  CUDA_CHECK(cudaDeviceSynchronize());
  Timer tm;
  auto reset = [&] { CUDA_CHECK(cudaMemcpy(work, src, n * 4, cudaMemcpyDeviceToDevice)); };
  auto run_old = [&](bool with_probs) {
    old::softcap_row_stats_k<<<R, 1024>>>(work, V, cap, T, st_old, with_probs ? probs_old : nullptr);
  };
  auto run_new = [&](bool with_probs) {
    softcap_row_stats(work, R, V, cap, T, st, scratch, nullptr, with_probs ? probs : nullptr);
  };
  // correctness first: old and new from the same input
  reset();
  run_old(true);
  CUDA_CHECK(cudaDeviceSynchronize());
  const auto cap_old = get(work, n);
  const auto so = get(st_old, R);
  const auto po = get(probs_old, n);
  reset();
  run_new(true);
  CUDA_CHECK(cudaDeviceSynchronize());
  const auto cap_new = get(work, n);
  const auto sn = get(st, R);
  const auto pn = get(probs, n);
  CHECK_TRUE(std::memcmp(cap_old.data(), cap_new.data(), n * 4) == 0, "capped logits differ from the old kernel's");
  double max_dent = 0, max_dlse = 0;
  for (int r = 0; r < R; ++r) {
    CHECK_TRUE(sn[r].argmax == so[r].argmax && sn[r].max_z == so[r].max_z, "row %d argmax/max vs old", r);
    max_dent = std::max(max_dent, double(std::fabs(sn[r].entropy - so[r].entropy)));
    max_dlse = std::max(max_dlse, double(std::fabs(sn[r].logsumexp - so[r].logsumexp)));
  }
  size_t pdiff = 0;
  for (size_t i = 0; i < n; ++i) {
    uint16_t a, b;
    std::memcpy(&a, &po[i], 2), std::memcpy(&b, &pn[i], 2);
    pdiff += a != b;
  }
  std::printf("new vs old: max |d entropy| %.3g, max |d logsumexp| %.3g, probs differing in the bf16 bits %zu of %zu\n",
              max_dent, max_dlse, pdiff, n);
  CHECK_TRUE(max_dent <= 1e-5 * 13, "entropy vs old");
  for (int r : {0, 1, 127, 255}) {
    int arg;
    float mz, lse, ent;
    oracle(cap_new.data() + size_t(r) * V, V, T, arg, mz, lse, ent);
    const auto& g = sn[size_t(r)];
    std::printf("row %3d: argmax %6d/%6d max_z %.6f/%.6f lse %.6f/%.6f entropy %.7f/%.7f (device/cpu)\n", r, g.argmax,
                arg, g.max_z, mz, g.logsumexp, lse, g.entropy, ent);
    CHECK_TRUE(g.argmax == arg && g.max_z == mz, "row %d argmax vs cpu", r);
    CHECK_TRUE(std::fabs(g.entropy - ent) <= 1e-5f * std::max(1.0f, ent), "row %d entropy vs cpu", r);
    CHECK_TRUE(std::fabs(g.logsumexp - lse) <= 1e-5f * std::max(1.0f, std::fabs(lse)), "row %d lse vs cpu", r);
  }
  // determinism
  reset();
  run_new(true);
  CUDA_CHECK(cudaDeviceSynchronize());
  CHECK_TRUE(get(work, n) == cap_new, "capped logits not bitwise repeatable");
  const auto sn2 = get(st, R);
  CHECK_TRUE(std::memcmp(sn2.data(), sn.data(), R * sizeof(DeviceRowStats)) == 0, "stats not bitwise repeatable");
  const auto pn2 = get(probs, n);
  CHECK_TRUE(std::memcmp(pn2.data(), pn.data(), n * 2) == 0, "probs not bitwise repeatable");

  // timings
  auto timed = [&](auto&& f) {
    std::vector<float> t;
    for (int i = 0; i < reps + 2; ++i) {
      reset();
      const float ms = tm.ms(f);
      if (i >= 2) t.push_back(ms);
    }
    return median(t);
  };
  const float t_old = timed([&] { run_old(true); }), t_new = timed([&] { run_new(true); });
  const float t_old_np = timed([&] { run_old(false); }), t_new_np = timed([&] { run_new(false); });
  const float t_copy = tm.ms([&] { reset(); });
  std::printf("softcap_row_stats 256 x 262144 (ms, median of %d): with probs old %.4f new %.4f (%.2fx); "
              "stats only old %.4f new %.4f; a 268 MB D2D copy %.4f (%.2f TB/s)\n",
              reps, t_old, t_new, t_old / t_new, t_old_np, t_new_np, t_copy, 2.0 * n * 4 / (t_copy * 1e-3) / 1e12);
  std::printf("new with probs: %.2f TB/s of its 939 MB (read + write logits, read logits, write probs)\n",
              (3.0 * n * 4 + n * 2) / (t_new * 1e-3) / 1e12);

  // sparse SC on peaked rows
  bf16* E;
  float* sig;
  CUDA_CHECK(cudaMalloc(&E, size_t(V) * H * 2));
  CUDA_CHECK(cudaMalloc(&sig, size_t(R) * H * 4));
  fill_bf16_k<<<4096, 256>>>(E, size_t(V) * H, 777u);
  const int tiles = sc_tiles(V);
  ScSurvivorBuffers b{};
  CUDA_CHECK(cudaMalloc(&b.ids, size_t(R) * tiles * kScTileSlots * 4));
  CUDA_CHECK(cudaMalloc(&b.p, size_t(R) * tiles * kScTileSlots * 4));
  CUDA_CHECK(cudaMalloc(&b.counts, size_t(R) * tiles * 4));
  CUDA_CHECK(cudaMalloc(&b.tail, size_t(R) * tiles * 8));
  {  // the bench's case: near-flat random rows, every tile overflows (the step would fall back to the exact path)
    reset();
    run_new(true);
    std::vector<float> ts;
    for (int i = 0; i < 5; ++i) ts.push_back(tm.ms([&] { sc_survivors(work, R, V, T, st, b, nullptr); }));
    const auto s = get(st, R);
    int mn = V, ovf = 0;
    for (auto& x : s) mn = std::min(mn, x.survivors), ovf += x.tile_overflow;
    std::printf("sparse SC, random rows in [-40, 40]: min survivors/row %d, rows with a tile overflow %d; "
                "sc_survivors %.4f ms (median of 5)\n", mn, ovf, median(ts));
  }
  for (int stride : {8192, 256, 128}) {
    peak_k<<<4096, 256>>>(src, R, V, stride, -30.0f, 28.0f);
    reset();
    run_new(true);
    std::vector<float> ts;
    for (int i = 0; i < 5; ++i) ts.push_back(tm.ms([&] { sc_survivors(work, R, V, T, st, b, nullptr); }));
    const float t_surv = median(ts);
    std::vector<float> tg;
    for (int i = 0; i < 7; ++i) tg.push_back(tm.ms([&] { sc_gather_sum(b, R, V, E, H, sig, nullptr); }));
    const auto s = get(st, R);
    int mx = 0, ovf = 0;
    double tail = 0;
    for (auto& x : s) mx = std::max(mx, x.survivors), ovf += x.tile_overflow, tail = std::max(tail, double(x.tail_mass));
    // CPU check of one row's sum
    const auto sg = get(sig, size_t(R) * H);
    const auto counts = get(b.counts, size_t(R) * tiles);
    const auto ids = get(b.ids, size_t(R) * tiles * kScTileSlots);
    const auto pp = get(b.p, size_t(R) * tiles * kScTileSlots);
    const int r = 5;
    std::vector<bf16> Eh(static_cast<size_t>(H));
    double maxd = 0, maxv = 0;
    std::vector<float> want(static_cast<size_t>(H), 0.0f);
    for (int t = 0; t < tiles; ++t)
      for (int k = 0; k < std::min(counts[size_t(r) * tiles + t], kScTileSlots); ++k) {
        const size_t si = (size_t(r) * tiles + t) * kScTileSlots + k;
        CUDA_CHECK(cudaMemcpy(Eh.data(), E + size_t(ids[si]) * H, H * 2, cudaMemcpyDeviceToHost));
        for (int h = 0; h < H; ++h) want[size_t(h)] = std::fma(pp[si], __bfloat162float(Eh[size_t(h)]), want[size_t(h)]);
      }
    for (int h = 0; h < H; ++h)
      maxd = std::max(maxd, double(std::fabs(sg[size_t(r) * H + h] - want[size_t(h)]))),
      maxv = std::max(maxv, double(std::fabs(want[size_t(h)])));
    CHECK_TRUE(maxd <= 1e-6 * std::max(maxv, 1e-30), "stride %d: gather row %d vs cpu %.3g", stride, r, maxd);
    sc_gather_sum(b, R, V, E, H, sig + 0, nullptr);
    CHECK_TRUE(get(sig, size_t(R) * H) == sg, "gather not bitwise repeatable");
    std::printf("sparse SC, peaks every %5d tokens: max survivors/row %5d, tile overflows %d, max dropped mass %.3g; "
                "sc_survivors %.4f ms (median of 5), sc_gather_sum %.4f ms (median of 7); gather vs cpu row %d max|d| %.3g\n",
                stride, mx, ovf, tail, t_surv, median(tg), r, maxd);
  }
  std::printf(g_fail ? "rowstats_bench: %d FAILED checks\n" : "rowstats_bench: all checks passed\n", g_fail);
  return g_fail ? 1 : 0;
}

}  // namespace rb

int main() { return rb::main(); }
