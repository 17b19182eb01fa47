// Sparse self-conditioning: survivor compaction and the gather-sum over the tied embedding table
// (declarations and semantics in cuda_kernels.h). Fixed-order reductions, no atomics: bitwise deterministic.
#include <cmath>
#include <cstdint>
#include <cstdio>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/cuda_util.cuh"

namespace dg::cuda {
namespace {

constexpr int kScThreads = 256;
constexpr int kScPer = kScTile / kScThreads;  // 32 consecutive tokens per thread
static_assert(kScPer % 4 == 0, "tokens per thread must be whole float4s");

// Exclusive prefix over the block of v (blockDim.x == kScThreads); *total gets the block sum.
__device__ __forceinline__ int block_exclusive_scan(int v, int* total) {
  __shared__ int warp_tot[kScThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int incl = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += u;
  }
  if (lane == 31) warp_tot[warp] = incl;
  __syncthreads();
  int before = 0, all = 0;
  for (int w = 0; w < kScThreads / 32; ++w) {
    if (w < warp) before += warp_tot[w];
    all += warp_tot[w];
  }
  *total = all;
  return before + incl - v;
}

// Grid (tiles, rows); thread t owns tokens [tile * kScTile + t * kScPer, + kScPer), so one block-wide scan of the
// per-thread counts orders the survivors by token id. (A coalesced variant, thread t on float4 t + k * 256 with a
// scan per round, measured 0.31-0.37 ms against this one's 0.27 at 256 x 262144 on the H200: the pass is bound by
// its arithmetic and barriers, not by the load pattern.)
template <bool kVec>
__global__ void __launch_bounds__(kScThreads) sc_compact_k(const float* logits, int V, int tiles, float temperature,
                                                           const DeviceRowStats* stats, ScSurvivorBuffers b) {
  const int tile = blockIdx.x, r = blockIdx.y;
  const float* row = logits + size_t(r) * V;
  const float M = stats[r].max_z, inv = stats[r].inv_sum, thr = M - kScWindow;
  const int i0 = tile * kScTile + threadIdx.x * kScPer;
  float z[kScPer];
#pragma unroll
  for (int k = 0; k < kScPer / 4; ++k) {
    const int i = i0 + 4 * k;
    if (kVec && i < V) {
      const float4 x = reinterpret_cast<const float4*>(row)[i / 4];
      z[4 * k] = x.x / temperature, z[4 * k + 1] = x.y / temperature;
      z[4 * k + 2] = x.z / temperature, z[4 * k + 3] = x.w / temperature;
    } else {
#pragma unroll
      for (int q = 0; q < 4; ++q) z[4 * k + q] = i + q < V ? row[i + q] / temperature : -INFINITY;
    }
  }
  int n = 0;
  double tail = 0;
#pragma unroll
  for (int j = 0; j < kScPer; ++j) {
    if (i0 + j >= V) continue;
    if (z[j] >= thr)
      ++n;
    else
      tail += double(expf(z[j] - M) * inv);  // the f32 prob before its bf16 rounding
  }
  int total = 0;
  int pos = block_exclusive_scan(n, &total);
  const size_t slot0 = (size_t(r) * tiles + tile) * kScTileSlots;
  if (n) {
#pragma unroll
    for (int j = 0; j < kScPer; ++j) {
      if (i0 + j < V && z[j] >= thr) {
        if (pos < kScTileSlots) {
          b.ids[slot0 + pos] = i0 + j;
          // the same expression as rowstats_probs_k: bitwise the exact path's bf16 prob
          b.p[slot0 + pos] = __bfloat162float(__float2bfloat16(expf(z[j] - M) * inv));
        }
        ++pos;
      }
    }
  }
  tail = block_sum(tail);
  if (threadIdx.x == 0) {
    b.counts[size_t(r) * tiles + tile] = total;
    b.tail[size_t(r) * tiles + tile] = tail;
  }
}

// One warp per row: the tiles' counts and tail sums in a fixed order -> stats.
__global__ void sc_finish_k(int rows, int tiles, ScSurvivorBuffers b, DeviceRowStats* stats) {
  const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (r >= rows) return;
  int n = 0, ovf = 0;
  double tail = 0;
  for (int t = lane; t < tiles; t += 32) {
    const int c = b.counts[size_t(r) * tiles + t];
    n += c;
    ovf |= c > kScTileSlots;
    tail += b.tail[size_t(r) * tiles + t];
  }
  for (int o = 16; o > 0; o >>= 1) {
    n += __shfl_xor_sync(0xffffffffu, n, o);
    ovf |= __shfl_xor_sync(0xffffffffu, ovf, o);
  }
  tail = warp_sum_d(tail);
  if (lane == 0) {
    stats[r].survivors = n;
    stats[r].tail_mass = float(tail);
    stats[r].tile_overflow = ovf;
  }
}

constexpr int kGatherThreads = 128;

__device__ __forceinline__ void fma8(float* acc, float p, uint4 u) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(h[j]);
    acc[2 * j] = fmaf(p, f.x, acc[2 * j]);
    acc[2 * j + 1] = fmaf(p, f.y, acc[2 * j + 1]);
  }
}

// Grid (column groups, rows); each thread owns 8 columns and walks the row's survivors in ascending id.
__global__ void __launch_bounds__(kGatherThreads) sc_gather_k(ScSurvivorBuffers b, int tiles, const uint4* E, int H8,
                                                              float* out) {
  const int r = blockIdx.y, c = blockIdx.x * kGatherThreads + threadIdx.x;
  if (c >= H8) return;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int t = 0; t < tiles; ++t) {
    const size_t ti = size_t(r) * tiles + t;
    const int cnt = b.counts[ti], n = cnt < kScTileSlots ? cnt : kScTileSlots;
    const int32_t* ids = b.ids + ti * kScTileSlots;
    const float* p = b.p + ti * kScTileSlots;
    int k = 0;
    for (; k + 4 <= n; k += 4) {  // four table rows in flight, summed in order
      const uint4 e0 = E[size_t(ids[k]) * H8 + c], e1 = E[size_t(ids[k + 1]) * H8 + c];
      const uint4 e2 = E[size_t(ids[k + 2]) * H8 + c], e3 = E[size_t(ids[k + 3]) * H8 + c];
      fma8(acc, p[k], e0), fma8(acc, p[k + 1], e1), fma8(acc, p[k + 2], e2), fma8(acc, p[k + 3], e3);
    }
    for (; k < n; ++k) fma8(acc, p[k], E[size_t(ids[k]) * H8 + c]);
  }
  float4* o = reinterpret_cast<float4*>(out + size_t(r) * H8 * 8) + 2 * c;
  o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
  o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
}

void check_args(const char* what, int rows, int V, float temperature) {
  char msg[160];
  if (rows < 0 || rows > 65535 || V < 1) {
    std::snprintf(msg, sizeof msg, "rows %d must be in [0, 65535] and V %d >= 1", rows, V);
    throw_cuda_error(what, msg, 0, __FILE__, __LINE__);
  }
  if (!(temperature > 0)) {
    std::snprintf(msg, sizeof msg, "temperature %g must be > 0", double(temperature));
    throw_cuda_error(what, msg, 0, __FILE__, __LINE__);
  }
}

}  // namespace

void sc_survivors(const float* logits, int rows, int V, float temperature, DeviceRowStats* stats,
                  const ScSurvivorBuffers& b, cudaStream_t s) {
  check_args("sc_survivors", rows, V, temperature);
  if (rows == 0) return;
  const int tiles = sc_tiles(V);
  const dim3 grid{unsigned(tiles), unsigned(rows)};
  if (V % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0)
    sc_compact_k<true><<<grid, kScThreads, 0, s>>>(logits, V, tiles, temperature, stats, b);
  else
    sc_compact_k<false><<<grid, kScThreads, 0, s>>>(logits, V, tiles, temperature, stats, b);
  CUDA_CHECK_LAUNCH();
  sc_finish_k<<<(rows + 7) / 8, 256, 0, s>>>(rows, tiles, b, stats);
  CUDA_CHECK_LAUNCH();
}

void sc_gather_sum(const ScSurvivorBuffers& b, int rows, int V, const bf16* E, int H, float* out, cudaStream_t s) {
  check_args("sc_gather_sum", rows, V, 1.0f);
  if (H < 8 || H % 8 != 0) {
    char msg[96];
    std::snprintf(msg, sizeof msg, "hidden size %d must be a positive multiple of 8", H);
    throw_cuda_error("sc_gather_sum", msg, 0, __FILE__, __LINE__);
  }
  if (rows == 0) return;
  const int H8 = H / 8;
  const dim3 grid{unsigned((H8 + kGatherThreads - 1) / kGatherThreads), unsigned(rows)};
  sc_gather_k<<<grid, kGatherThreads, 0, s>>>(b, sc_tiles(V), reinterpret_cast<const uint4*>(E), H8, out);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dg::cuda
