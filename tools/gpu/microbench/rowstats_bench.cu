// Microbench + checker for softcap_row_stats (src/backend/cuda/kernels_rows.cu) and the sparse-SC kernels
// (src/backend/cuda/kernels_sc.cu), one binary per GPU call:
//  - prev: the committed kernels before the reciprocal-division change (commit 16e1d7c: IEEE x / cap and c / T, expf
//    sums, one partial per tile after four barriers), copied below, vs new: the kernels in kernels_rows.cu, both the
//    shipped exp (kRsFastExp) and the other one ("new-alt"), through the same launcher logic;
//  - device checks of the arithmetic: div_rcp against the IEEE division for every float a with b = cap = 30 and
//    every |a| <= 1e4 with 67 values of T (no mismatch allowed for |a| >= 2^-102), softcap_rs (its ex2 / rcp form)
//    against cap * tanhf(x / cap) for all 2^32 bit patterns x (within 1e-6 cap for every finite x);
//  - per case (random rows at the denoise shape, the unit test's rows with ties, peaked rows, the scalar / tail
//    paths, a row of specials: +-inf, NaN, +-0, subnormals, 3e38; a cap < 1 that takes the IEEE fallback):
//    new vs prev capped logits within 1e-6 cap (prev: tanhf), argmax equal but between values prev had within
//    2e-6 cap, entropy / logsumexp / inv_sum relative to prev (limit 1e-5 for the shipped variant), each
//    implementation against the CPU oracle (a copy of dg::compute_row_stats, limit 1e-5 as
//    CudaKernels.SoftcapRowStats), bf16 probs vs prev (at most 1 bit, on
//    fewer than 10% of the tokens), and bitwise determinism of two runs;
//  - timings at 256 x 262144: medians of CUDA-event timings, the logits re-copied from a pristine buffer before every
//    rep (the in-place softcap must not see capped input);
//  - sparse SC: sc_survivors + sc_gather_sum on peaked rows (few / ~1-2k survivors per row), timed; the exact path
//    (probs @ E through cuBLASLt) is not linked here: 0.58 ms per step in docs/BENCHMARKS.md.
// Exit status 1 on any FAIL line. Build (no GPU needed): cmake --build build-gpu --target microbench_rowstats
// H200, 2026-11-30 (ms, medians): softcap_row_stats with probs 0.556 for the one-block-per-row kernel before prev,
// 0.339 for prev; stats only 0.402 -> 0.238 (a 268 MB D2D copy: 0.133, 4.03 TB/s); sc_survivors 0.27 ms on peaked
// rows, sc_gather_sum 0.033 / 0.365 / 0.553 ms at 32 / 1024 / 2048 survivors per row. The new kernels: see
// docs/BENCHMARKS.md.
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

namespace prev {
// kernels_rows.cu at commit 16e1d7c, verbatim but for the namespace (and `better`, copied from above the section).
__device__ __forceinline__ void better(float& bv, int& bi, float v, int i) {
  if (v > bv || (v == bv && i < bi)) bv = v, bi = i;
}

// ---- softcap + row statistics (+ SC probs) ----
// Three launches over [rows, V] (was one 1024-thread block per row with three passes over the row, exp in double:
// 0.556 ms at 256 x 262144 on the H200, now 0.339 with probs; tools/gpu/microbench/rowstats_bench.cu):
//  1. rowstats_tile_k: grid (tiles of kRsTile tokens, rows). Each block reads its tile once into registers (16-byte
//     loads when V % 4 == 0), softcaps it in place, takes the tile's max / argmax of z = c / T, then
//     s = sum exp(z - m_tile), w = sum exp(z - m_tile) (z - m_tile) (expf per token; each thread sums its 32
//     same-signed terms in f32, relative error <= 2e-6, then double across the block in a fixed tree)
//     -> one RowPartial per tile. This pass is bound by its arithmetic (tanhf, two IEEE divisions and an expf per
//     token) and barriers, not by its traffic: 0.238 ms stats-only at 256 x 262144 on the H200 where a copy moves
//     the same 537 MB in 0.133 (per-token double accumulation, the first version: 0.253).
//  2. rowstats_merge_k: one warp per row merges the row's tiles in a fixed order: M = max m, argmax = lowest index
//     among equal maxima, S = sum s_k e^(m_k - M), W = sum e^(m_k - M) (w_k + (m_k - M) s_k) in double
//     -> DeviceRowStats (H = log S - W / S, as compute_row_stats).
//  3. rowstats_probs_k (probs != nullptr): probs = bf16(expf(z - M) * inv_sum), tiles in reverse order so that the
//     first blocks read the capped logits that pass 1 wrote last (still in L2).
// No atomics, fixed reduction orders: bitwise deterministic.
constexpr int kRsThreads = 256, kRsVec = 8;               // float4 loads per thread
constexpr int kRsTile = kRsThreads * kRsVec * 4;          // 8192 tokens per block
struct RowPartial {
  double s, w;
  float m;
  int32_t idx;
};

__device__ __forceinline__ float softcap1(float x, float cap) { return cap * tanhf(x / cap); }

// Block-wide (max, lowest index) of (bv, bi); every thread gets the result.
__device__ __forceinline__ void block_argmax(float& bv, int& bi) {
  __shared__ float sv[32];
  __shared__ int si[32];
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    better(bv, bi, ov, oi);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) sv[warp] = bv, si[warp] = bi;
  __syncthreads();
  bv = lane < nw ? sv[lane] : -INFINITY;
  bi = lane < nw ? si[lane] : INT32_MAX;
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    better(bv, bi, ov, oi);
  }
}

// Block-wide sums of a and b in double (fixed tree); every thread gets the results.
__device__ __forceinline__ void block_sum2(double& a, double& b) {
  __shared__ double pa[32], pb[32];
  for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o), b += __shfl_xor_sync(0xffffffffu, b, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) pa[warp] = a, pb[warp] = b;
  __syncthreads();
  a = lane < nw ? pa[lane] : 0.0;
  b = lane < nw ? pb[lane] : 0.0;
  for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o), b += __shfl_xor_sync(0xffffffffu, b, o);
}

// kVec: V % 4 == 0 (16-byte aligned rows). Token j of thread t in the tile: float4 chunk t + k * kRsThreads.
template <bool kVec>
__global__ void __launch_bounds__(kRsThreads) rowstats_tile_k(float* logits, int V, int tiles, float cap,
                                                              float temperature, RowPartial* part) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  const int tile = blockIdx.x, r = blockIdx.y;
  float* row = logits + size_t(r) * V;
  const int base = tile * kRsTile;
  float z[kRsVec * 4];
  float bv = -INFINITY;
  int bi = INT32_MAX;
#pragma unroll
  for (int k = 0; k < kRsVec; ++k) {
    const int i0 = base + 4 * (threadIdx.x + k * kRsThreads);
    float c[4];
    if (kVec) {
      if (i0 < V) {
        float4 x = reinterpret_cast<const float4*>(row)[i0 / 4];
        x.x = softcap1(x.x, cap), x.y = softcap1(x.y, cap), x.z = softcap1(x.z, cap), x.w = softcap1(x.w, cap);
        reinterpret_cast<float4*>(row)[i0 / 4] = x;
        c[0] = x.x, c[1] = x.y, c[2] = x.z, c[3] = x.w;
      }
    } else {
#pragma unroll
      for (int q = 0; q < 4; ++q)
        if (i0 + q < V) {
          c[q] = softcap1(row[i0 + q], cap);
          row[i0 + q] = c[q];
        }
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const bool valid = i0 + q < V;
      z[4 * k + q] = valid ? c[q] / temperature : -INFINITY;  // division, as compute_row_stats
      // a thread's tokens come in ascending index: strict > keeps the lowest index of equal maxima
      if (valid && z[4 * k + q] > bv) bv = z[4 * k + q], bi = i0 + q;
    }
  }
  block_argmax(bv, bi);
  float sf = 0, wf = 0;
  if (bv > -INFINITY) {
#pragma unroll
    for (int j = 0; j < kRsVec * 4; ++j)
      if (z[j] > -INFINITY) {
        const float d = z[j] - bv;  // the f32 difference, as compute_row_stats
        const float e = expf(d);
        sf += e;
        wf = fmaf(e, d, wf);
      }
  }
  double s = sf, w = wf;
  block_sum2(s, w);
  if (threadIdx.x == 0) part[size_t(r) * tiles + tile] = RowPartial{s, w, bv, bi};
}

// One warp per row; stats[r] from the row's tile partials in a fixed order.
__global__ void rowstats_merge_k(const RowPartial* part, int rows, int tiles, DeviceRowStats* stats) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (r >= rows) return;
  const RowPartial* p = part + size_t(r) * tiles;
  float bv = -INFINITY;
  int bi = INT32_MAX;
  for (int t = lane; t < tiles; t += 32) better(bv, bi, p[t].m, p[t].idx);
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    better(bv, bi, ov, oi);
  }
  double S = 0, W = 0;
  for (int t = lane; t < tiles; t += 32) {
    if (!(p[t].m > -INFINITY)) continue;  // a tile without a finite value contributes nothing
    const double dm = double(p[t].m) - double(bv), f = exp(dm);
    S += p[t].s * f;
    W += f * (p[t].w + dm * p[t].s);
  }
  S = warp_sum_d(S);
  W = warp_sum_d(W);
  if (lane == 0) {
    DeviceRowStats o;
    o.argmax = bi == INT32_MAX ? 0 : bi;
    o.max_z = bv;
    o.logsumexp = float(double(bv) + log(S));
    o.entropy = float(fmax(0.0, log(S) - W / S));
    o.inv_sum = float(1.0 / S);
    o.survivors = -1, o.tail_mass = 0.0f, o.tile_overflow = 0;
    stats[r] = o;
  }
}

template <bool kVec>
__global__ void __launch_bounds__(kRsThreads) rowstats_probs_k(const float* logits, int rows, int V, int tiles,
                                                               float temperature, const DeviceRowStats* stats,
                                                               bf16* probs) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  const int tile = tiles - 1 - int(blockIdx.x), r = rows - 1 - int(blockIdx.y);  // reverse: L2-resident tiles first
  const float* row = logits + size_t(r) * V;
  bf16* out = probs + size_t(r) * V;
  const float M = stats[r].max_z, inv = stats[r].inv_sum;
  const int base = tile * kRsTile;
#pragma unroll
  for (int k = 0; k < kRsVec; ++k) {
    const int i0 = base + 4 * (threadIdx.x + k * kRsThreads);
    if (kVec) {
      if (i0 < V) {
        const float4 x = reinterpret_cast<const float4*>(row)[i0 / 4];
        const float4 pv = make_float4(expf(x.x / temperature - M) * inv, expf(x.y / temperature - M) * inv,
                                      expf(x.z / temperature - M) * inv, expf(x.w / temperature - M) * inv);
        st4(out, i0 / 4, pv);
      }
    } else {
#pragma unroll
      for (int q = 0; q < 4; ++q)
        if (i0 + q < V) out[i0 + q] = __float2bfloat16(expf(row[i0 + q] / temperature - M) * inv);
    }
  }
}

size_t softcap_row_stats_scratch_bytes(int rows, int V) {
  return size_t(rows < 0 ? 0 : rows) * size_t((V + kRsTile - 1) / kRsTile) * sizeof(RowPartial);
}
void softcap_row_stats(float* logits, int rows, int V, float softcap, float temperature, DeviceRowStats* stats,
                       void* scratch, cudaStream_t s, bf16* probs) {
  char msg[160];
  if (rows < 0 || rows > 65535 || V < 1) {
    std::snprintf(msg, sizeof msg, "rows %d must be in [0, 65535] and V %d >= 1", rows, V);
    throw_cuda_error("softcap_row_stats", msg, 0, __FILE__, __LINE__);
  }
  if (!(temperature > 0) || !(softcap > 0)) {
    std::snprintf(msg, sizeof msg, "temperature %g and softcap %g must be > 0", double(temperature), double(softcap));
    throw_cuda_error("softcap_row_stats", msg, 0, __FILE__, __LINE__);
  }
  if (rows == 0) return;
  if (!scratch) throw_cuda_error("softcap_row_stats", "no scratch (softcap_row_stats_scratch_bytes)", 0, __FILE__, __LINE__);
  const int tiles = (V + kRsTile - 1) / kRsTile;
  auto* part = static_cast<RowPartial*>(scratch);
  const dim3 grid{unsigned(tiles), unsigned(rows)};
  const bool vec = V % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0 &&
                   (!probs || reinterpret_cast<uintptr_t>(probs) % 8 == 0);
  if (vec)
    launch_pdl(rowstats_tile_k<true>, dim3(grid), dim3(kRsThreads), 0, s, logits, V, tiles, softcap, temperature, part);
  else
    launch_pdl(rowstats_tile_k<false>, dim3(grid), dim3(kRsThreads), 0, s, logits, V, tiles, softcap, temperature, part);
  CUDA_CHECK_LAUNCH();
  launch_pdl(rowstats_merge_k, dim3((rows + 7) / 8), dim3(256), 0, s, part, rows, tiles, stats);
  CUDA_CHECK_LAUNCH();
  if (probs) {
    if (vec)
      launch_pdl(rowstats_probs_k<true>, dim3(grid), dim3(kRsThreads), 0, s, logits, rows, V, tiles, temperature, stats, probs);
    else
      launch_pdl(rowstats_probs_k<false>, dim3(grid), dim3(kRsThreads), 0, s, logits, rows, V, tiles, temperature, stats, probs);
    CUDA_CHECK_LAUNCH();
  }
}
}  // namespace prev

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

// ---- the arithmetic, on the device ----
// cnt[0]: a / b and div_rcp differ with |a| >= 2^-102, cnt[1]: differ below, cnt[2]: pairs checked. a: both signs
// of every bit pattern in [0, hi].
__global__ void div_check_k(float b, float r, uint32_t hi, unsigned long long* cnt) {
  unsigned long long big = 0, small = 0, n = 0;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i <= hi; i += uint64_t(gridDim.x) * blockDim.x)
    for (uint32_t sign : {0u, 0x80000000u}) {
      const float a = __uint_as_float(uint32_t(i) | sign);
      const bool differ = __float_as_uint(__fdiv_rn(a, b)) != __float_as_uint(div_rcp(a, b, r));
      ++n;
      if (differ) (fabsf(a) >= 0x1p-102f ? big : small) += 1;
    }
  for (int o = 16; o > 0; o >>= 1) {
    big += __shfl_xor_sync(0xffffffffu, big, o);
    small += __shfl_xor_sync(0xffffffffu, small, o);
    n += __shfl_xor_sync(0xffffffffu, n, o);
  }
  if ((threadIdx.x & 31) == 0) atomicAdd(cnt, big), atomicAdd(cnt + 1, small), atomicAdd(cnt + 2, n);
}
// softcap_rs (ex2 / rcp form) vs cap * tanhf(x / cap) over all 2^32 x: cnt[0] how many finite x are more than
// tol apart, cnt[1] the largest |difference| (as float bits: non-negative floats order as integers), cnt[2] x checked.
__global__ void softcap_check_k(float cap, float ck, float tol, unsigned long long* cnt) {
  unsigned long long over = 0, n = 0;
  float worst = 0;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i <= 0xffffffffull;
       i += uint64_t(gridDim.x) * blockDim.x) {
    const float x = __uint_as_float(uint32_t(i));
    if (!isfinite(x)) continue;
    const float d = fabsf(softcap_rs(x, cap, ck) - cap * tanhf(x / cap));
    ++n;
    over += d > tol;
    worst = fmaxf(worst, d);
  }
  for (int o = 16; o > 0; o >>= 1) {
    over += __shfl_xor_sync(0xffffffffu, over, o);
    n += __shfl_xor_sync(0xffffffffu, n, o);
    worst = fmaxf(worst, __shfl_xor_sync(0xffffffffu, worst, o));
  }
  if ((threadIdx.x & 31) == 0)
    atomicAdd(cnt, over), atomicMax(cnt + 1, (unsigned long long)__float_as_uint(worst)), atomicAdd(cnt + 2, n);
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
uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
uint16_t bits(bf16 x) {
  uint16_t u;
  std::memcpy(&u, &x, 2);
  return u;
}
bool same(float a, float b) { return bits(a) == bits(b) || (std::isnan(a) && std::isnan(b)); }

// softcap_row_stats with the exp the library does not ship (kernels_rows.cu's launcher otherwise).
template <bool kFastExp>
void new_variant(float* logits, int rows, int V, float cap, float T, DeviceRowStats* stats, void* scratch,
                 bf16* probs) {
  const int tiles = (V + kRsTile - 1) / kRsTile;
  auto* part = static_cast<RowPartial*>(scratch);
  const dim3 grid{unsigned(tiles), unsigned(rows)};
  const bool vec = V % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0 &&
                   (!probs || reinterpret_cast<uintptr_t>(probs) % 8 == 0);
  const bool rcp = rs_rcp_ok(cap, T);
  const float ck = softcap_k(cap), rT = 1.0f / T;
  auto* tile_k = vec ? (rcp ? rowstats_tile_k<true, true, kFastExp, float> : rowstats_tile_k<true, false, kFastExp, float>)
                     : (rcp ? rowstats_tile_k<false, true, kFastExp, float> : rowstats_tile_k<false, false, kFastExp, float>);
  launch_pdl(tile_k, dim3(grid), dim3(kRsThreads), 0, nullptr, static_cast<const float*>(logits), logits, V, cap, ck,
             T, rT, part, true,
             static_cast<bf16*>(nullptr), 0.0f, static_cast<const float*>(nullptr));
  launch_pdl(rowstats_merge_k, dim3(rows), dim3(kRsThreads), 0, nullptr, part, tiles * kRsWarps, stats, FusedProbs{},
             static_cast<DeviceRowStats*>(nullptr));
  if (probs) {
    auto* probs_k = vec ? (rcp ? rowstats_probs_k<true, true, float> : rowstats_probs_k<true, false, float>)
                        : (rcp ? rowstats_probs_k<false, true, float> : rowstats_probs_k<false, false, float>);
    launch_pdl(probs_k, dim3(grid), dim3(kRsThreads), 0, nullptr, static_cast<const float*>(logits), rows, V, tiles,
               T, rT, stats, probs, false, cap, ck, static_cast<const float*>(nullptr));
  }
  CUDA_CHECK(cudaGetLastError());
}

enum Impl { kPrev, kNew, kNewAlt, kNewNoWrite };  // kNewNoWrite: new with write_capped false (timed only)
const char* impl_name[] = {"prev", "new", "new-alt", "new-nowrite"};

// Device buffers for up to n = rows * V tokens; src holds the pristine logits.
struct Bufs {
  size_t n = 0;
  float *src = nullptr, *work = nullptr;
  bf16* probs = nullptr;
  DeviceRowStats* st = nullptr;
  void* scratch = nullptr;
  Bufs(int R, int V) : n(size_t(R) * V) {
    CUDA_CHECK(cudaMalloc(&src, n * 4));
    CUDA_CHECK(cudaMalloc(&work, n * 4));
    CUDA_CHECK(cudaMalloc(&probs, n * 2));
    CUDA_CHECK(cudaMalloc(&st, size_t(R) * sizeof(DeviceRowStats)));
    CUDA_CHECK(cudaMalloc(&scratch, std::max(softcap_row_stats_scratch_bytes(R, V),
                                             prev::softcap_row_stats_scratch_bytes(R, V))));
  }
  ~Bufs() {
    cudaFree(src), cudaFree(work), cudaFree(probs), cudaFree(st), cudaFree(scratch);
  }
  void reset() const { CUDA_CHECK(cudaMemcpy(work, src, n * 4, cudaMemcpyDeviceToDevice)); }
  void run(Impl im, int R, int V, float cap, float T, bool with_probs) const {
    bf16* p = with_probs ? probs : nullptr;
    if (im == kPrev) prev::softcap_row_stats(work, R, V, cap, T, st, scratch, nullptr, p);
    if (im == kNew) softcap_row_stats(work, R, V, cap, T, st, scratch, nullptr, p);
    if (im == kNewAlt) new_variant<!kRsFastExp>(work, R, V, cap, T, st, scratch, p);
    if (im == kNewNoWrite) softcap_row_stats(work, R, V, cap, T, st, scratch, nullptr, p, false);
  }
};
struct Out {
  std::vector<float> capped;
  std::vector<DeviceRowStats> st;
  std::vector<bf16> probs;
};
Out run_once(const Bufs& b, Impl im, int R, int V, float cap, float T) {
  b.reset();
  b.run(im, R, V, cap, T, true);
  CUDA_CHECK(cudaDeviceSynchronize());
  return Out{get(b.work, b.n), get(b.st, size_t(R)), get(b.probs, b.n)};
}
double rel(double a, double b) { return std::fabs(a - b) / std::max(1.0, std::fabs(b)); }

// Runs prev, new and new-alt on b.src (R x V) and checks them; oracle_rows: how many rows go to the CPU (the first
// four, the unit test's special rows, then spread over the rest).
void check_case(const char* name, const Bufs& b, int R, int V, float cap, float T, int oracle_rows) {
  std::printf("\n== %s: %d x %d, cap %g, T %g (%s division)\n", name, R, V, double(cap), double(T),
              rs_rcp_ok(cap, T) ? "div_rcp" : "IEEE fallback");
  const auto input = get(b.src, b.n);
  Out o[3];
  for (int im = 0; im < 3; ++im) o[im] = run_once(b, Impl(im), R, V, cap, T);
  // capped logits: within softcap_rs's 1e-6 cap of prev's tanhf (non-finite inputs: the same bits)
  for (int im : {kNew, kNewAlt}) {
    size_t over = 0;
    double worst = 0;
    for (size_t i = 0; i < b.n; ++i) {
      if (!std::isfinite(input[i])) {
        over += !same(o[im].capped[i], o[kPrev].capped[i]);
        continue;
      }
      const double d = std::fabs(double(o[im].capped[i]) - o[kPrev].capped[i]);
      worst = std::max(worst, d), over += d > 1e-6 * cap;
    }
    std::printf("  %-7s capped logits vs prev: largest |difference| %.3g, %zu of %zu over 1e-6 cap\n",
                impl_name[im], worst, over, b.n);
    CHECK_TRUE(over == 0, "%s: %s capped logits more than 1e-6 cap from prev's", name, impl_name[im]);
  }
  // stats vs prev
  for (int im : {kNew, kNewAlt}) {
    int arg_diff = 0;
    double de = 0, dl = 0, di = 0;
    for (int r = 0; r < R; ++r) {
      const auto &g = o[im].st[size_t(r)], &w = o[kPrev].st[size_t(r)];
      // the argmax may move only between tokens whose capped values prev had within 2e-6 cap
      if (g.argmax != w.argmax) {
        const float* pc = o[kPrev].capped.data() + size_t(r) * V;
        arg_diff += !(std::fabs(double(pc[g.argmax]) - pc[w.argmax]) <= 2e-6 * cap);
      }
      arg_diff += !(std::fabs(double(g.max_z) - w.max_z) <= 1e-6 * cap / T) && !same(g.max_z, w.max_z);
      if (std::isfinite(w.entropy) && std::isfinite(w.logsumexp)) {
        de = std::max(de, rel(g.entropy, w.entropy)), dl = std::max(dl, rel(g.logsumexp, w.logsumexp));
        di = std::max(di, std::fabs(double(g.inv_sum) - w.inv_sum) / std::max(1e-30, double(w.inv_sum)));
      } else {
        arg_diff += !(same(g.entropy, w.entropy) && same(g.logsumexp, w.logsumexp));  // NaN rows: NaN alike
      }
    }
    const bool ok = de <= 1e-5 && dl <= 1e-5;
    std::printf("  %-7s stats vs prev: argmax/max_z (or non-finite stats) differ in %d rows; max |d|/max(1,|prev|): "
                "entropy %.3g, logsumexp %.3g (limit 1e-5: %s); inv_sum max rel %.3g\n",
                impl_name[im], arg_diff, de, dl, ok ? "ok" : (im == kNew ? "FAIL" : "over"), di);
    CHECK_TRUE(arg_diff == 0, "%s: %s argmax / max_z differ from prev's in %d rows", name, impl_name[im], arg_diff);
    if (im == kNew) CHECK_TRUE(ok, "%s: new entropy / logsumexp more than 1e-5 from prev's", name);
  }
  // each against the CPU oracle on its own capped rows
  for (int im = 0; im < 3; ++im) {
    double de = 0, dl = 0;
    int bad_arg = 0, checked = 0;
    for (int k = 0; k < oracle_rows; ++k) {
      const int r = oracle_rows >= R || k < 4 ? k : 4 + int(int64_t(k - 4) * (R - 5) / std::max(1, oracle_rows - 5));
      if (r >= R) break;
      const float* row = o[im].capped.data() + size_t(r) * V;
      if (!std::all_of(row, row + V, [](float x) { return std::isfinite(x); })) continue;  // the oracle sums NaN
      int arg;
      float mz, lse, ent;
      oracle(row, V, T, arg, mz, lse, ent);
      const auto& g = o[im].st[size_t(r)];
      ++checked;
      bad_arg += g.argmax != arg || g.max_z != mz;
      de = std::max(de, rel(g.entropy, ent)), dl = std::max(dl, rel(g.logsumexp, lse));
    }
    std::printf("  %-7s vs CPU oracle (%d rows): argmax/max_z differ in %d; max |d|/max(1,|cpu|) entropy %.3g, "
                "logsumexp %.3g (limit 1e-5)\n", impl_name[im], checked, bad_arg, de, dl);
    CHECK_TRUE(bad_arg == 0 && de <= 1e-5 && dl <= 1e-5, "%s: %s vs CPU oracle", name, impl_name[im]);
  }
  // probs vs prev: bf16 bits
  for (int im : {kNew, kNewAlt}) {
    size_t diff = 0;
    int max_bits = 0;
    for (size_t i = 0; i < b.n; ++i) {
      const int d = std::abs(int(bits(o[im].probs[i])) - int(bits(o[kPrev].probs[i])));
      diff += d != 0, max_bits = std::max(max_bits, d);
    }
    std::printf("  %-7s bf16 probs vs prev: %zu of %zu differ, by at most %d in the last bit\n", impl_name[im], diff,
                b.n, max_bits);
    // the softcap's ~1e-6 cap moves z by ~1e-5: a token's bf16 rounding flips by one bit now and then
    CHECK_TRUE(max_bits <= 1 && double(diff) <= 0.1 * double(b.n), "%s: %s probs vs prev", name, impl_name[im]);
  }
  // determinism of the shipped one
  const Out again = run_once(b, kNew, R, V, cap, T);
  const bool rep = std::memcmp(again.capped.data(), o[kNew].capped.data(), b.n * 4) == 0 &&
                   std::memcmp(again.st.data(), o[kNew].st.data(), size_t(R) * sizeof(DeviceRowStats)) == 0 &&
                   std::memcmp(again.probs.data(), o[kNew].probs.data(), b.n * 2) == 0;
  std::printf("  new twice: %s\n", rep ? "bitwise the same" : "DIFFERENT");
  CHECK_TRUE(rep, "%s: new not bitwise repeatable", name);
  // write_capped false (the engine's denoise step when nothing reads the capped logits): the logits untouched, the
  // stats and probs the same bits as new's
  b.reset();
  b.run(kNewNoWrite, R, V, cap, T, true);
  CUDA_CHECK(cudaDeviceSynchronize());
  const Out nw{get(b.work, b.n), get(b.st, size_t(R)), get(b.probs, b.n)};
  const bool untouched = std::memcmp(nw.capped.data(), input.data(), b.n * 4) == 0;
  const bool same_out = std::memcmp(nw.st.data(), o[kNew].st.data(), size_t(R) * sizeof(DeviceRowStats)) == 0 &&
                        std::memcmp(nw.probs.data(), o[kNew].probs.data(), b.n * 2) == 0;
  std::printf("  new-nowrite: logits %s, stats and probs %s\n", untouched ? "untouched" : "WRITTEN",
              same_out ? "bitwise new's" : "DIFFERENT from new's");
  CHECK_TRUE(untouched && same_out, "%s: write_capped false", name);
}

void upload(const Bufs& b, const std::vector<float>& h) {
  CUDA_CHECK(cudaMemcpy(b.src, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
}
std::vector<float> rnd(size_t n, float lo, float hi, uint64_t seed) {
  std::vector<float> v(n);
  uint64_t s = seed;
  for (auto& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = lo + (hi - lo) * float(double(s >> 40) / double(1ull << 24));
  }
  return v;
}
// The unit test's rows: 1 ties of the max across tiles, 2 near one-hot at the last token, 3 the same maximum twice.
void test_rows(std::vector<float>& l, int rows, int V) {
  if (rows >= 3) {
    for (int i = 0; i < V; ++i) l[size_t(V) + size_t(i)] = float(i % 7);
    l[size_t(2) * V + size_t(V - 1)] = 500.0f;
  }
  if (rows >= 4) l[size_t(3) * V + size_t(V - 2)] = 400.0f, l[size_t(3) * V + 3] = 400.0f;
}

int main() {
  // ---- the arithmetic ----
  unsigned long long* cnt;
  CUDA_CHECK(cudaMalloc(&cnt, 3 * sizeof(unsigned long long)));
  auto counts = [&](auto&& launch) {
    CUDA_CHECK(cudaMemset(cnt, 0, 3 * sizeof(unsigned long long)));
    launch();
    CUDA_CHECK(cudaDeviceSynchronize());
    return get(cnt, 3);
  };
  {
    const float cap = 30.0f;
    auto c = counts([&] { div_check_k<<<132 * 16, 256>>>(cap, 1.0f / cap, 0x7f7fffffu, cnt); });
    std::printf("div_rcp vs IEEE a / b on the device, b = cap = 30, every finite a: %llu pairs, %llu apart with "
                "|a| >= 2^-102, %llu below\n", c[2], c[0], c[1]);
    CHECK_TRUE(c[0] == 0, "div_rcp differs from a / 30 above 2^-102");
    std::vector<float> Ts;
    for (int i = 0; i < 64; ++i) Ts.push_back(0.3f + 0.7f * float(i) / 63.0f);
    for (float t : {0.61f, 0.8f, 5.96e-8f}) Ts.push_back(t);
    unsigned long long big = 0, small = 0, n = 0;
    for (float t : Ts) {
      c = counts([&] { div_check_k<<<132 * 16, 256>>>(t, 1.0f / t, 0x461c4000u /* 1e4 */, cnt); });
      big += c[0], small += c[1], n += c[2];
      if (c[0]) std::printf("  T %.9g: %llu apart above 2^-102\n", double(t), c[0]);
    }
    std::printf("div_rcp vs IEEE a / T, %zu T in [0.3, 1] (+ 0.61, 0.8, 5.96e-8), every |a| <= 1e4: %llu pairs, %llu "
                "apart with |a| >= 2^-102, %llu below\n", Ts.size(), n, big, small);
    CHECK_TRUE(big == 0, "div_rcp differs from a / T above 2^-102");
    const float tol = 1e-6f * cap;
    c = counts([&] { softcap_check_k<<<132 * 16, 256>>>(cap, softcap_k(cap), tol, cnt); });
    float worst;
    const uint32_t wb = uint32_t(c[1]);
    std::memcpy(&worst, &wb, 4);
    std::printf("softcap_rs vs 30 tanhf(x / 30), all %llu finite x: largest |difference| %.3g, %llu more than %.3g\n",
                c[2], double(worst), c[0], double(tol));
    CHECK_TRUE(c[0] == 0, "softcap_rs more than 1e-6 cap from cap * tanhf(x / cap)");
  }

  // ---- the cases ----
  {
    const int R = 4, V = 5003;  // scalar path
    Bufs b(R, V);
    auto l = rnd(size_t(R) * V, -60, 60, 1);
    test_rows(l, R, V);
    upload(b, l);
    check_case("unit-test rows, V % 4 != 0", b, R, V, 30.0f, 0.61f, R);
  }
  for (int V : {8193, 20004}) {  // one tile plus one; V % 4 == 0 with a partial last tile
    const int R = 3;
    Bufs b(R, V);
    auto l = rnd(size_t(R) * V, -60, 60, 2);
    test_rows(l, R, V);
    upload(b, l);
    check_case(V == 8193 ? "unit-test rows, one tile + 1" : "unit-test rows, partial last tile", b, R, V, 30.0f,
               0.61f, R);
  }
  {
    const int R = 4, V = 20004;
    Bufs b(R, V);
    auto l = rnd(size_t(R) * V, -60, 60, 3);
    const float sp[] = {INFINITY, -INFINITY, NAN, 0.0f, -0.0f, 1e-40f, -1.4e-45f, 1e-35f, -1e-33f, 3e38f, -3e38f,
                        1e4f, -1e4f, 2.3e-38f};
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < int(sizeof sp / sizeof sp[0]); ++k)
        if (!(r == 0 && std::isnan(sp[k])) && !(r == 2 && std::isinf(sp[k])))  // row 0: no NaN, row 2: no inf
          l[size_t(r) * V + size_t(97 * k + 13 * r)] = sp[k];
    // row 3: every other token tiny (div_rcp's one-ulp range; not the row's max, which would then differ too)
    for (int i = 1; i < V; i += 2) l[size_t(3) * V + size_t(i)] = i % 10 == 1 ? -0.0f : 1e-39f * float(i % 10);
    upload(b, l);
    check_case("specials (+-inf, NaN, +-0, subnormals, 3e38)", b, R, V, 30.0f, 0.8f, R);
  }
  {
    const int R = 2, V = 3 * 8192 + 4;
    Bufs b(R, V);
    upload(b, rnd(size_t(R) * V, -60, 60, 4));
    check_case("cap < 1: the IEEE fallback", b, R, V, 0.5f, 0.8f, R);
  }

  const int R = 256, V = 262144, H = 2816, reps = 20;
  const float cap = 30.0f, T = 0.8f;
  const size_t n = size_t(R) * V;
  Bufs b(R, V);
  {
    auto l = rnd(n, -60, 60, 5);
    test_rows(l, R, V);
    upload(b, l);
    check_case("unit-test rows at the denoise shape", b, R, V, cap, 0.61f, 8);
  }
  peak_k<<<4096, 256>>>(b.src, R, V, 256, -30.0f, 28.0f);
  check_case("peaked rows (one in 256 tokens 30 above the rest)", b, R, V, cap, T, 8);
  fill_k<<<4096, 256>>>(b.src, n, 12345u, -40.0f, 40.0f);
  check_case("random rows in [-40, 40] (the timed input)", b, R, V, cap, T, 8);

  // ---- timings ----
  Timer tm;
  auto timed = [&](Impl im, bool with_probs) {
    std::vector<float> t;
    for (int i = 0; i < reps + 2; ++i) {
      b.reset();
      const float ms = tm.ms([&] { b.run(im, R, V, cap, T, with_probs); });
      if (i >= 2) t.push_back(ms);
    }
    return median(t);
  };
  float tp[4], ts[4];
  for (int im = 0; im < 4; ++im) tp[im] = timed(Impl(im), true), ts[im] = timed(Impl(im), false);
  std::vector<float> tc;
  for (int i = 0; i < 5; ++i) tc.push_back(tm.ms([&] { b.reset(); }));
  const float t_copy = median(tc);
  std::printf("\nsoftcap_row_stats 256 x 262144, cap 30, T 0.8 (ms, median of %d):\n", reps);
  std::printf("  %-28s %10s %10s %10s %12s\n", "", "prev", "new", "new-alt", "new-nowrite");
  std::printf("  %-28s %10.4f %10.4f %10.4f %12.4f   (new: %.2fx prev)\n", "stats + probs (denoise)", tp[0], tp[1],
              tp[2], tp[3], tp[0] / tp[1]);
  std::printf("  %-28s %10.4f %10.4f %10.4f %12.4f   (new: %.2fx prev)\n", "stats only", ts[0], ts[1], ts[2], ts[3],
              ts[0] / ts[1]);
  std::printf("  new = kRsFastExp %s (%s exp in the sums), new-alt = the other\n", kRsFastExp ? "true" : "false",
              kRsFastExp ? "ex2.approx" : "expf");
  std::printf("  a 268 MB D2D copy %.4f ms (%.2f TB/s); new with probs moves 939 MB: %.2f TB/s\n", t_copy,
              2.0 * n * 4 / (t_copy * 1e-3) / 1e12, (3.0 * n * 4 + n * 2) / (tp[1] * 1e-3) / 1e12);

  // ---- sparse SC on peaked rows ----
  bf16* E;
  float* sig;
  CUDA_CHECK(cudaMalloc(&E, size_t(V) * H * 2));
  CUDA_CHECK(cudaMalloc(&sig, size_t(R) * H * 4));
  fill_bf16_k<<<4096, 256>>>(E, size_t(V) * H, 777u);
  const int tiles = sc_tiles(V);
  ScSurvivorBuffers sb{};
  CUDA_CHECK(cudaMalloc(&sb.ids, size_t(R) * tiles * kScTileSlots * 4));
  CUDA_CHECK(cudaMalloc(&sb.p, size_t(R) * tiles * kScTileSlots * 4));
  CUDA_CHECK(cudaMalloc(&sb.counts, size_t(R) * tiles * 4));
  CUDA_CHECK(cudaMalloc(&sb.tail, size_t(R) * tiles * 8));
  {  // near-flat random rows, every tile overflows (the step would fall back to the exact path)
    b.reset();
    b.run(kNew, R, V, cap, T, true);
    std::vector<float> ts2;
    for (int i = 0; i < 5; ++i) ts2.push_back(tm.ms([&] { sc_survivors(b.work, R, V, T, b.st, sb, nullptr); }));
    const auto s = get(b.st, size_t(R));
    int mn = V, ovf = 0;
    for (auto& x : s) mn = std::min(mn, x.survivors), ovf += x.tile_overflow;
    std::printf("\nsparse SC, random rows in [-40, 40]: min survivors/row %d, rows with a tile overflow %d; "
                "sc_survivors %.4f ms (median of 5)\n", mn, ovf, median(ts2));
  }
  for (int stride : {8192, 256, 128}) {
    peak_k<<<4096, 256>>>(b.src, R, V, stride, -30.0f, 28.0f);
    b.reset();
    b.run(kNew, R, V, cap, T, true);
    std::vector<float> ts2;
    for (int i = 0; i < 5; ++i) ts2.push_back(tm.ms([&] { sc_survivors(b.work, R, V, T, b.st, sb, nullptr); }));
    const float t_surv = median(ts2);
    std::vector<float> tg;
    for (int i = 0; i < 7; ++i) tg.push_back(tm.ms([&] { sc_gather_sum(sb, R, V, E, H, sig, nullptr); }));
    const auto s = get(b.st, size_t(R));
    int mx = 0, ovf = 0;
    double tail = 0;
    for (auto& x : s) mx = std::max(mx, x.survivors), ovf += x.tile_overflow, tail = std::max(tail, double(x.tail_mass));
    // CPU check of one row's sum
    const auto sg = get(sig, size_t(R) * H);
    const auto counts_h = get(sb.counts, size_t(R) * tiles);
    const auto ids = get(sb.ids, size_t(R) * tiles * kScTileSlots);
    const auto pp = get(sb.p, size_t(R) * tiles * kScTileSlots);
    const int r = 5;
    std::vector<bf16> Eh(static_cast<size_t>(H));
    double maxd = 0, maxv = 0;
    std::vector<float> want(static_cast<size_t>(H), 0.0f);
    for (int t = 0; t < tiles; ++t)
      for (int k = 0; k < std::min(counts_h[size_t(r) * tiles + t], kScTileSlots); ++k) {
        const size_t si = (size_t(r) * tiles + t) * kScTileSlots + k;
        CUDA_CHECK(cudaMemcpy(Eh.data(), E + size_t(ids[si]) * H, H * 2, cudaMemcpyDeviceToHost));
        for (int h = 0; h < H; ++h) want[size_t(h)] = std::fma(pp[si], __bfloat162float(Eh[size_t(h)]), want[size_t(h)]);
      }
    for (int h = 0; h < H; ++h)
      maxd = std::max(maxd, double(std::fabs(sg[size_t(r) * H + h] - want[size_t(h)]))),
      maxv = std::max(maxv, double(std::fabs(want[size_t(h)])));
    CHECK_TRUE(maxd <= 1e-6 * std::max(maxv, 1e-30), "stride %d: gather row %d vs cpu %.3g", stride, r, maxd);
    sc_gather_sum(sb, R, V, E, H, sig + 0, nullptr);
    CHECK_TRUE(get(sig, size_t(R) * H) == sg, "gather not bitwise repeatable");
    std::printf("sparse SC, peaks every %5d tokens: max survivors/row %5d, tile overflows %d, max dropped mass %.3g; "
                "sc_survivors %.4f ms (median of 5), sc_gather_sum %.4f ms (median of 7); gather vs cpu row %d max|d| %.3g\n",
                stride, mx, ovf, tail, t_surv, median(tg), r, maxd);
  }
  std::printf(g_fail ? "\nrowstats_bench: %d FAILED checks\n" : "\nrowstats_bench: all checks passed\n", g_fail);
  return g_fail ? 1 : 0;
}

}  // namespace rb

int main() { return rb::main(); }
