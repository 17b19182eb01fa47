// MoE around the expert GEMMs (kernels_experts.cu): router top-k, token->expert grouping, and the weighted combine
// in ascending expert id order.
#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/cuda_util.cuh"

namespace dg::cuda {
namespace {

constexpr int kMaxTopK = 32;

// One block per token; mirrors cpu::route_top_k (float exp, double sum, p = float(e / sum)).
__global__ void route_top_k_k(const float* logits, int E, int k, const float* pes, int32_t* idx, float* w) {
  extern __shared__ float p[];
  __shared__ float sel_v[kMaxTopK];
  __shared__ int sel_i[kMaxTopK];
  __shared__ float red_v[32];
  __shared__ int red_i[32];
  const float* l = logits + size_t(blockIdx.x) * E;
  float mx = -INFINITY;
  for (int e = threadIdx.x; e < E; e += blockDim.x) mx = fmaxf(mx, l[e]);
  mx = warp_max(mx);
  if ((threadIdx.x & 31) == 0) red_v[threadIdx.x >> 5] = mx;
  __syncthreads();
  mx = -INFINITY;
  for (int i = 0; i < int(blockDim.x >> 5); ++i) mx = fmaxf(mx, red_v[i]);
  double sum = 0;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    p[e] = expf(l[e] - mx);
    sum += p[e];
  }
  sum = block_sum(sum);
  for (int e = threadIdx.x; e < E; e += blockDim.x) p[e] = float(double(p[e]) / sum);
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int j = 0; j < k; ++j) {
    float bv = -1.0f;
    int bi = INT32_MAX;
    for (int e = threadIdx.x; e < E; e += blockDim.x)
      if (p[e] > bv || (p[e] == bv && e < bi)) bv = p[e], bi = e;
    for (int o = 16; o > 0; o >>= 1) {
      float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
    }
    if (lane == 0) red_v[warp] = bv, red_i[warp] = bi;
    __syncthreads();
    if (threadIdx.x == 0) {
      bv = red_v[0], bi = red_i[0];
      for (int i = 1; i < int(blockDim.x >> 5); ++i)
        if (red_v[i] > bv || (red_v[i] == bv && red_i[i] < bi)) bv = red_v[i], bi = red_i[i];
      sel_v[j] = bv, sel_i[j] = bi;
      p[bi] = -2.0f;  // taken
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    float total = 0;
    for (int j = 0; j < k; ++j) total += sel_v[j];
    for (int j = 0; j < k; ++j) {
      idx[size_t(blockIdx.x) * k + j] = sel_i[j];
      w[size_t(blockIdx.x) * k + j] = sel_v[j] / total * pes[sel_i[j]];
    }
  }
}

// Router logits on CUDA cores in true f32. A block computes a 32-token x 32-expert tile over one of kRouterSplits
// contiguous k chunks (blockIdx.z); its 4 warp pairs each take a quarter of that chunk, every lane a 4 x 4 register
// tile fed by 16-byte loads (x and W rows stay in L2: 2.9 + 1.4 MB a layer), and the pairs' sums are added in pair
// order through shared memory. 512 blocks at the model's 256 x 128 x 2816 (cuBLASLt's f32 GEMM: 17 us, one layer;
// a first version with 4 splits and no explicit prefetch took ~35 us: one L2 round trip per k step, 8 warps / SM).
// Every logit is a fixed-order sum (k ascending within a quarter, quarters, then splits): deterministic.
constexpr int kRtTile = 32, kRtPairs = 4;
__global__ void __launch_bounds__(256) router_partial_k(const float* __restrict__ x, int T, int H,
                                                        const float* __restrict__ W, int E, float* __restrict__ part) {
  __shared__ float red[kRtPairs][kRtTile][kRtTile + 1];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, pair = warp >> 1;
  const int q = (warp & 1) * 32 + lane, tg = q >> 3, eg = q & 7;
  const int t0 = blockIdx.x * kRtTile + tg * 4, e0 = blockIdx.y * kRtTile + eg * 4;
  const int chunk = (H + kRouterSplits * kRtPairs * 4 - 1) / (kRouterSplits * kRtPairs * 4) * 4;
  const int kb = min(H, (int(blockIdx.z) * kRtPairs + pair) * chunk), ke = min(H, kb + chunk);
  const float4* xr[4];
  const float4* wr[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // rows past T / E read a valid row; their sums are never stored
    xr[i] = reinterpret_cast<const float4*>(x + size_t(min(t0 + i, T - 1)) * H);
    wr[i] = reinterpret_cast<const float4*>(W + size_t(min(e0 + i, E - 1)) * H);
  }
  float acc[4][4] = {};
  auto fma16 = [&](const float4 (&xv)[4], const float4 (&wv)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        acc[i][j] = fmaf(xv[i].x, wv[j].x, acc[i][j]);
        acc[i][j] = fmaf(xv[i].y, wv[j].y, acc[i][j]);
        acc[i][j] = fmaf(xv[i].z, wv[j].z, acc[i][j]);
        acc[i][j] = fmaf(xv[i].w, wv[j].w, acc[i][j]);
      }
  };
  // Two register stages: the loads of step k4 + 1 are in flight while step k4 is multiplied.
  float4 xa[4], wa[4], xb[4], wb[4];
  const int k4e = ke / 4;
  int k4 = kb / 4;
  if (k4 < k4e)
#pragma unroll
    for (int i = 0; i < 4; ++i) xa[i] = __ldg(xr[i] + k4), wa[i] = __ldg(wr[i] + k4);
  for (; k4 < k4e; k4 += 2) {
    const bool second = k4 + 1 < k4e;
    if (second)
#pragma unroll
      for (int i = 0; i < 4; ++i) xb[i] = __ldg(xr[i] + k4 + 1), wb[i] = __ldg(wr[i] + k4 + 1);
    fma16(xa, wa);
    if (k4 + 2 < k4e)
#pragma unroll
      for (int i = 0; i < 4; ++i) xa[i] = __ldg(xr[i] + k4 + 2), wa[i] = __ldg(wr[i] + k4 + 2);
    if (second) fma16(xb, wb);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) red[pair][tg * 4 + i][eg * 4 + j] = acc[i][j];
  __syncthreads();
  for (int o = threadIdx.x; o < kRtTile * kRtTile; o += blockDim.x) {
    const int r = o / kRtTile, c = o % kRtTile, t = blockIdx.x * kRtTile + r, e = blockIdx.y * kRtTile + c;
    if (t >= T || e >= E) continue;
    float v = red[0][r][c];
#pragma unroll
    for (int pr = 1; pr < kRtPairs; ++pr) v += red[pr][r][c];
    part[(size_t(blockIdx.z) * T + t) * E + e] = v;
  }
}

// Sums nsplit slabs of [T, E] logits in slab order (f32), optionally storing the sum.
__device__ __forceinline__ float slab_sum(const float* l, size_t stride, int nsplit, size_t at) {
  float v = l[at];
  for (int s = 1; s < nsplit; ++s) v += l[at + size_t(s) * stride];
  return v;
}

__global__ void sum_slabs_k(const float* part, int nsplit, size_t n, float* out) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = slab_sum(part, n, nsplit, i);
}

// One warp per token, the token's expert probabilities in registers (kPerLane per lane, E <= 32 * kPerLane): no
// shared memory and no block barriers, where route_top_k_k spends two barriers per selected expert. Same rules:
// float exp, double sum, p = float(e / sum), ties to the lower index. The logits are the sum of nsplit slabs
// (router_partial_k), also stored to logits_out when given.
constexpr int kPerLane = 8;
__global__ void route_top_k_warp_k(const float* logits, int nsplit, int T, int E, int k, const float* pes,
                                   int32_t* idx, float* w, float* logits_out) {
  const int lane = threadIdx.x & 31, t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (t >= T) return;
  float p[kPerLane];
  float mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    p[j] = e < E ? slab_sum(logits, size_t(T) * E, nsplit, size_t(t) * E + e) : -INFINITY;
    if (logits_out && e < E) logits_out[size_t(t) * E + e] = p[j];
    mx = fmaxf(mx, p[j]);
  }
  mx = warp_max(mx);
  double sum = 0;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    p[j] = lane + 32 * j < E ? expf(p[j] - mx) : 0.0f;
    sum += p[j];
  }
  sum = warp_sum_d(sum);
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) p[j] = lane + 32 * j < E ? float(double(p[j]) / sum) : -1.0f;
  float total = 0, my_v = 0;
  int my_i = 0;
  for (int s = 0; s < k; ++s) {
    float bv = -2.0f;
    int bi = INT32_MAX;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      if (p[j] > bv) bv = p[j], bi = lane + 32 * j;  // ascending index within a lane: first wins ties
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
    }
    total += bv;
    if (lane == s) my_v = bv, my_i = bi;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      if (lane + 32 * j == bi) p[j] = -2.0f;  // taken
  }
  if (lane < k) {
    idx[size_t(t) * k + lane] = my_i;
    w[size_t(t) * k + lane] = my_v / total * pes[my_i];
  }
}

// Single block: counts, exclusive scan and row assignment. Expert e's first M pairs go to rows e M .. e M + M - 1,
// the rest ("overflow") to rows from ovf[e] = E M + (overflow of the experts before e); ovf[E] = end of the overflow
// rows. M = 0 is the plain grouping: ovf is then the exclusive prefix of the counts (moe_group's offsets).
__global__ void moe_assign_k(const int32_t* idx, int P, int E, int M, int32_t* ovf, int32_t* sorted_pos) {
  extern __shared__ int cnt[];  // [E] counts, then cursors
  for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < P; i += blockDim.x) atomicAdd(&cnt[idx[i]], 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int run = E * M;
    for (int e = 0; e < E; ++e) {
      ovf[e] = run;
      run += max(0, cnt[e] - M);
      cnt[e] = 0;
    }
    ovf[E] = run;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < P; i += blockDim.x) {
    const int e = idx[i], slot = atomicAdd(&cnt[e], 1);
    sorted_pos[i] = slot < M ? e * M + slot : ovf[e] + slot - M;
  }
}

__global__ void moe_gather_k(const int32_t* sorted_pos, int k, const uint4* x, int hvec, uint4* xs) {
  const int pair = blockIdx.x, t = pair / k;
  const size_t dst = size_t(sorted_pos[pair]) * hvec;
  for (int i = threadIdx.x; i < hvec; i += blockDim.x) xs[dst + i] = x[size_t(t) * hvec + i];
}

__global__ void moe_combine_k(const float* y, const int32_t* idx, const float* w, const int32_t* sorted_pos, int k,
                              int H, float* out) {
  const int t = blockIdx.x;
  int order[kMaxTopK];
  for (int j = 0; j < k; ++j) order[j] = j;
  for (int j = 1; j < k; ++j)  // insertion sort by expert id: HF's index_add_ order
    for (int i = j; i > 0 && idx[t * k + order[i]] < idx[t * k + order[i - 1]]; --i) {
      int tmp = order[i];
      order[i] = order[i - 1];
      order[i - 1] = tmp;
    }
  for (int h = threadIdx.x; h < H; h += blockDim.x) {
    float acc = 0;
    for (int j = 0; j < k; ++j) {
      const int s = t * k + order[j];
      acc += w[s] * y[size_t(sorted_pos[s]) * H + h];
    }
    out[size_t(t) * H + h] = acc;
  }
}

// Token t's k (expert row, weight) pairs in ascending expert id (HF's index_add_ order; a stable insertion sort),
// for one thread to fill the block's shared lists before a barrier.
__device__ void combine_sources(const int32_t* idx, const float* w, const int32_t* sorted_pos, int t, int k,
                                int* src_row, float* src_w) {
  int order[kMaxTopK];
  for (int j = 0; j < k; ++j) order[j] = j;
  for (int j = 1; j < k; ++j)
    for (int i = j; i > 0 && idx[t * k + order[i]] < idx[t * k + order[i - 1]]; --i) {
      const int tmp = order[i];
      order[i] = order[i - 1];
      order[i - 1] = tmp;
    }
  for (int j = 0; j < k; ++j) src_row[j] = sorted_pos[t * k + order[j]], src_w[j] = w[t * k + order[j]];
}

// moe_combine_k and ffn_combine_k (kernels_rows.cu) in one pass per token: the combined expert row m2 stays in shared
// memory instead of a [T, H] f32 round trip through global memory and a second launch. Same arithmetic and order.
__global__ void moe_combine_ffn_k(const float* y, const int32_t* idx, const float* w, const int32_t* sorted_pos, int k,
                                  float* h, const bf16* m1, int H, const float* w1, const float* w2, const float* wn,
                                  float eps, float scalar) {
  extern __shared__ float row[];  // [H]: m2, then the pre-norm sum
  __shared__ int src_row[kMaxTopK];
  __shared__ float src_w[kMaxTopK];
  const int t = blockIdx.x;
  if (threadIdx.x == 0) combine_sources(idx, w, sorted_pos, t, k, src_row, src_w);
  __syncthreads();
  const size_t off = size_t(t) * H;
  float s1 = 0, s2 = 0;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    float acc = 0;
    for (int j = 0; j < k; ++j) acc += src_w[j] * y[size_t(src_row[j]) * H + i];
    row[i] = acc;
    const float a = __bfloat162float(m1[off + i]);
    s1 += a * a;
    s2 += acc * acc;
  }
  const float inv1 = rsqrtf(block_sum(s1) / float(H) + eps);
  const float inv2 = rsqrtf(block_sum(s2) / float(H) + eps);
  float s3 = 0;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    const float v = __bfloat162float(m1[off + i]) * inv1 * w1[i] + row[i] * inv2 * w2[i];
    row[i] = v;
    s3 += v * v;
  }
  const float inv3 = rsqrtf(block_sum(s3) / float(H) + eps);
  for (int i = threadIdx.x; i < H; i += blockDim.x) h[off + i] = (h[off + i] + row[i] * inv3 * wn[i]) * scalar;
}

// The same with the row in registers and the k expert rows of one 16-byte chunk loaded before they are summed
// (the scalar loop above waits on one 4-byte load per expert and element: ~30 us per layer at T = 256).
constexpr int kCombineThreads = 256;
template <int NV, int KMAX>
__global__ void __launch_bounds__(kCombineThreads) moe_combine_ffn_vec_k(
    const float* y, const int32_t* idx, const float* w, const int32_t* sorted_pos, int k, float* h, const bf16* m1,
    int H, const float* w1, const float* w2, const float* wn, float eps, float scalar) {
  __shared__ int src_row[KMAX];
  __shared__ float src_w[KMAX];
  const int t = blockIdx.x, H4 = H / 4;
  if (threadIdx.x == 0) combine_sources(idx, w, sorted_pos, t, k, src_row, src_w);
  __syncthreads();
  const size_t off = size_t(t) * H;
  float4 m2[NV], a1[NV];
  float s1 = 0, s2 = 0;
#pragma unroll
  for (int q = 0; q < NV; ++q) {
    const int c = threadIdx.x + q * kCombineThreads;
    float4 acc = make_float4(0, 0, 0, 0), a = acc;
    if (c < H4) {
      float4 ys[KMAX];
#pragma unroll
      for (int j = 0; j < KMAX; ++j)
        if (j < k) ys[j] = reinterpret_cast<const float4*>(y + size_t(src_row[j]) * H)[c];
#pragma unroll
      for (int j = 0; j < KMAX; ++j)
        if (j < k) {
          acc.x += src_w[j] * ys[j].x;
          acc.y += src_w[j] * ys[j].y;
          acc.z += src_w[j] * ys[j].z;
          acc.w += src_w[j] * ys[j].w;
        }
      const uint2 u = reinterpret_cast<const uint2*>(m1 + off)[c];
      const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
      const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
      a = make_float4(lo.x, lo.y, hi.x, hi.y);
    }
    m2[q] = acc, a1[q] = a;
    s1 += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
    s2 += acc.x * acc.x + acc.y * acc.y + acc.z * acc.z + acc.w * acc.w;
  }
  const float inv1 = rsqrtf(block_sum(s1) / float(H) + eps);
  const float inv2 = rsqrtf(block_sum(s2) / float(H) + eps);
  float s3 = 0;
#pragma unroll
  for (int q = 0; q < NV; ++q) {
    const int c = threadIdx.x + q * kCombineThreads;
    if (c < H4) {
      const float4 p = reinterpret_cast<const float4*>(w1)[c], r = reinterpret_cast<const float4*>(w2)[c];
      m2[q] = make_float4(a1[q].x * inv1 * p.x + m2[q].x * inv2 * r.x, a1[q].y * inv1 * p.y + m2[q].y * inv2 * r.y,
                          a1[q].z * inv1 * p.z + m2[q].z * inv2 * r.z, a1[q].w * inv1 * p.w + m2[q].w * inv2 * r.w);
      s3 += m2[q].x * m2[q].x + m2[q].y * m2[q].y + m2[q].z * m2[q].z + m2[q].w * m2[q].w;
    }
  }
  const float inv3 = rsqrtf(block_sum(s3) / float(H) + eps);
#pragma unroll
  for (int q = 0; q < NV; ++q) {
    const int c = threadIdx.x + q * kCombineThreads;
    if (c < H4) {
      const float4 p = reinterpret_cast<const float4*>(wn)[c];
      float4 hv = reinterpret_cast<float4*>(h + off)[c];
      hv.x = (hv.x + m2[q].x * inv3 * p.x) * scalar;
      hv.y = (hv.y + m2[q].y * inv3 * p.y) * scalar;
      hv.z = (hv.z + m2[q].z * inv3 * p.z) * scalar;
      hv.w = (hv.w + m2[q].w * inv3 * p.w) * scalar;
      reinterpret_cast<float4*>(h + off)[c] = hv;
    }
  }
}

}  // namespace

void router_logits_partial(const float* x, int T, int H, const float* W, int E, float* part, cudaStream_t s) {
  if (T == 0) return;
  if (H % 4 != 0) throw_cuda_error("router_logits_partial", "hidden size must be a multiple of 4", 0, __FILE__, __LINE__);
  const dim3 grid((T + kRtTile - 1) / kRtTile, (E + kRtTile - 1) / kRtTile, kRouterSplits);
  router_partial_k<<<grid, 256, 0, s>>>(x, T, H, W, E, part);
  CUDA_CHECK_LAUNCH();
}

void route_top_k_split(const float* part, int nsplit, int T, int E, int k, const float* per_expert_scale,
                       int32_t* idx, float* w, float* logits_out, cudaStream_t s) {
  if (T == 0) return;
  if (k > kMaxTopK || k > E || E > 4096 || nsplit < 1)
    throw_cuda_error("route_top_k", "unsupported expert count / top-k / split count", 0, __FILE__, __LINE__);
  if (E <= 32 * kPerLane && k <= 32) {
    constexpr int kWarps = 8;
    route_top_k_warp_k<<<(T + kWarps - 1) / kWarps, 32 * kWarps, 0, s>>>(part, nsplit, T, E, k, per_expert_scale,
                                                                         idx, w, logits_out);
    CUDA_CHECK_LAUNCH();
    return;
  }
  const float* logits = part;
  if (nsplit > 1) {  // the block kernel reads plain logits: sum the slabs first
    if (!logits_out)
      throw_cuda_error("route_top_k_split", "more than 256 experts needs logits_out", 0, __FILE__, __LINE__);
    sum_slabs_k<<<unsigned((size_t(T) * E + 255) / 256), 256, 0, s>>>(part, nsplit, size_t(T) * E, logits_out);
    CUDA_CHECK_LAUNCH();
    logits = logits_out;
  } else if (logits_out) {
    CUDA_CHECK(cudaMemcpyAsync(logits_out, part, size_t(T) * E * sizeof(float), cudaMemcpyDeviceToDevice, s));
  }
  route_top_k(logits, T, E, k, per_expert_scale, idx, w, s);
}

void route_top_k(const float* logits, int T, int E, int k, const float* per_expert_scale, int32_t* idx, float* w,
                 cudaStream_t s) {
  if (T == 0) return;
  if (k > kMaxTopK || k > E || E > 4096)
    throw_cuda_error("route_top_k", "unsupported expert count / top-k", 0, __FILE__, __LINE__);
  if (E <= 32 * kPerLane && k <= 32) {
    constexpr int kWarps = 8;
    route_top_k_warp_k<<<(T + kWarps - 1) / kWarps, 32 * kWarps, 0, s>>>(logits, 1, T, E, k, per_expert_scale, idx,
                                                                         w, nullptr);
  } else {
    int threads = E >= 1024 ? 1024 : (E + 31) / 32 * 32;
    route_top_k_k<<<T, threads, size_t(E) * sizeof(float), s>>>(logits, E, k, per_expert_scale, idx, w);
  }
  CUDA_CHECK_LAUNCH();
}

void moe_group_padded(const int32_t* idx, int T, int k, int E, const bf16* x, int H, int M, int32_t* ovf_offsets,
                      int32_t* sorted_pos, bf16* xs, cudaStream_t s) {
  const int P = T * k;
  moe_assign_k<<<1, 1024, size_t(E) * sizeof(int), s>>>(idx, P, E, M, ovf_offsets, sorted_pos);
  CUDA_CHECK_LAUNCH();
  if (P == 0) return;
  moe_gather_k<<<P, 128, 0, s>>>(sorted_pos, k, reinterpret_cast<const uint4*>(x), H / 8, reinterpret_cast<uint4*>(xs));
  CUDA_CHECK_LAUNCH();
}

void moe_group(const int32_t* idx, int T, int k, int E, const bf16* x, int H, int32_t* offsets, int32_t* sorted_pos,
               bf16* xs, cudaStream_t s) {
  moe_group_padded(idx, T, k, E, x, H, /*M=*/0, offsets, sorted_pos, xs, s);
}

void moe_combine(const float* y, const int32_t* idx, const float* w, const int32_t* sorted_pos, int T, int k, int H,
                 float* out, cudaStream_t s) {
  if (T == 0) return;
  moe_combine_k<<<T, 256, 0, s>>>(y, idx, w, sorted_pos, k, H, out);
  CUDA_CHECK_LAUNCH();
}

void moe_combine_ffn(const float* y, const int32_t* idx, const float* w, const int32_t* sorted_pos, int T, int k,
                     float* h, const bf16* m1, int H, const float* w1, const float* w2, const float* w_post, float eps,
                     float scalar, cudaStream_t s) {
  if (T == 0) return;
  if (k > kMaxTopK) throw_cuda_error("moe_combine_ffn", "top-k above 32", 0, __FILE__, __LINE__);
  const int nv = H % 4 == 0 ? (H / 4 + kCombineThreads - 1) / kCombineThreads : 0;
  if (k <= 8 && nv >= 1 && nv <= 3) {
    auto* kern = nv == 1 ? moe_combine_ffn_vec_k<1, 8> : nv == 2 ? moe_combine_ffn_vec_k<2, 8> : moe_combine_ffn_vec_k<3, 8>;
    kern<<<T, kCombineThreads, 0, s>>>(y, idx, w, sorted_pos, k, h, m1, H, w1, w2, w_post, eps, scalar);
  } else {
    moe_combine_ffn_k<<<T, 256, size_t(H) * sizeof(float), s>>>(y, idx, w, sorted_pos, k, h, m1, H, w1, w2, w_post,
                                                                 eps, scalar);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace dg::cuda
