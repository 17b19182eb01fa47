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

// Single block: counts, exclusive scan and row assignment.
__global__ void moe_assign_k(const int32_t* idx, int P, int E, int32_t* offsets, int32_t* sorted_pos) {
  extern __shared__ int cnt[];  // [E] counts, then cursors
  for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < P; i += blockDim.x) atomicAdd(&cnt[idx[i]], 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int run = 0;
    for (int e = 0; e < E; ++e) {
      const int c = cnt[e];
      offsets[e] = run;
      cnt[e] = run;
      run += c;
    }
    offsets[E] = run;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < P; i += blockDim.x) sorted_pos[i] = atomicAdd(&cnt[idx[i]], 1);
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

}  // namespace

void route_top_k(const float* logits, int T, int E, int k, const float* per_expert_scale, int32_t* idx, float* w,
                 cudaStream_t s) {
  if (T == 0) return;
  if (k > kMaxTopK || k > E || E > 4096)
    throw_cuda_error("route_top_k", "unsupported expert count / top-k", 0, __FILE__, __LINE__);
  int threads = E >= 1024 ? 1024 : (E + 31) / 32 * 32;
  route_top_k_k<<<T, threads, size_t(E) * sizeof(float), s>>>(logits, E, k, per_expert_scale, idx, w);
  CUDA_CHECK_LAUNCH();
}

void moe_group(const int32_t* idx, int T, int k, int E, const bf16* x, int H, int32_t* offsets, int32_t* sorted_pos,
               bf16* xs, cudaStream_t s) {
  const int P = T * k;
  moe_assign_k<<<1, 1024, size_t(E) * sizeof(int), s>>>(idx, P, E, offsets, sorted_pos);
  CUDA_CHECK_LAUNCH();
  if (P == 0) return;
  moe_gather_k<<<P, 128, 0, s>>>(sorted_pos, k, reinterpret_cast<const uint4*>(x), H / 8, reinterpret_cast<uint4*>(xs));
  CUDA_CHECK_LAUNCH();
}

void moe_combine(const float* y, const int32_t* idx, const float* w, const int32_t* sorted_pos, int T, int k, int H,
                 float* out, cudaStream_t s) {
  if (T == 0) return;
  moe_combine_k<<<T, 256, 0, s>>>(y, idx, w, sorted_pos, k, H, out);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dg::cuda
