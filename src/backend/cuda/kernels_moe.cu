// MoE: router top-k, token->expert grouping, grouped expert GEMMs on tensor cores (WMMA bf16, f32 accumulate) with
// the GELU-tanh gate fused into the gate_up epilogue, and the weighted combine in ascending expert id order.
#include <mma.h>

#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/cuda_util.cuh"

namespace dg::cuda {
namespace {

using namespace nvcuda;

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

constexpr int GM = 64, GN = 128, GK = 64, kGemmThreads = 256;
constexpr int LDX = GK + 8, LDC = GN + 4;

// The expert GEMMs read ~1.5 GB of weights per layer at ~16 rows per expert (L = 256, top-8 of 128): they must run
// at memory bandwidth, which needs many bytes in flight per SM. Rows [offsets[e], offsets[e+1]) of X times 128
// weight rows of expert e. GATED: the 128 rows are 64 gate rows (n0..n0+63) and the matching 64 up rows (I+n0..),
// and the epilogue writes gelu(gate) * up; otherwise they are output columns n0..n0+127 written as f32. The X and W
// tiles stream through a kMoeStages-deep cp.async ring in shared memory: 3 tiles (~55 KB) in flight per block,
// 2 blocks per SM. (The previous version staged one tile per block through registers: ~3.0 instead of ~3.3 TB/s
// on the H200, docs/BENCHMARKS.md 2026-11-29.)
constexpr int kMoeStages = 4;
constexpr int kStageBytes = (GM + GN) * LDX * 2;
constexpr int kMoeSmem = kMoeStages * kStageBytes > GM * LDC * 4 ? kMoeStages * kStageBytes : GM * LDC * 4;

template <bool GATED>
__global__ void __launch_bounds__(kGemmThreads, 2) moe_gemm_k(const bf16* X, const int32_t* offsets, const bf16* W,
                                                              int N, int K, bf16* act, float* y) {
  extern __shared__ __align__(128) unsigned char smem[];
  float* Cs = reinterpret_cast<float*>(smem);  // epilogue only: aliases the drained stages
  const int e = blockIdx.y, start = offsets[e], end = offsets[e + 1];
  if (start == end) return;
  const int tid = threadIdx.x, warp = tid >> 5;
  const int n0 = blockIdx.x * (GATED ? GN / 2 : GN);
  const int w_rows_total = GATED ? 2 * N : N;
  const bf16* We = W + size_t(e) * w_rows_total * K;
  const int kvec = K / 8, nk = (K + GK - 1) / GK;
  constexpr int WV = GN * (GK / 8) / kGemmThreads;

  for (int m0 = start; m0 < end; m0 += GM) {
    const int m_valid = min(GM, end - m0), m_rows = (m_valid + 15) & ~15;
    // One k-tile into stage st: X rows past m_valid (up to the 16-row fragment edge) and k past K are zero-filled;
    // X rows past that edge are never read by the MMAs and are not loaded.
    auto load_stage = [&](int st, int k0) {
      bf16* Xs = reinterpret_cast<bf16*>(smem + st * kStageBytes);
      bf16* Ws = Xs + GM * LDX;
      for (int i = tid; i < m_rows * (GK / 8); i += kGemmThreads) {
        const int r = i / (GK / 8), c = i % (GK / 8), kc = k0 / 8 + c;
        const bool ok = r < m_valid && kc < kvec;
        cp_async16(Xs + r * LDX + c * 8, ok ? X + size_t(m0 + r) * K + size_t(kc) * 8 : X, ok);
      }
#pragma unroll
      for (int u = 0; u < WV; ++u) {
        const int i = tid + u * kGemmThreads, r = i / (GK / 8), c = i % (GK / 8), kc = k0 / 8 + c;
        int wr;
        bool ok;
        if (GATED) {
          const int col = n0 + (r & (GN / 2 - 1));
          ok = col < N;
          wr = r < GN / 2 ? col : N + col;
        } else {
          wr = n0 + r;
          ok = wr < N;
        }
        ok = ok && kc < kvec;
        cp_async16(Ws + r * LDX + c * 8, ok ? We + size_t(wr) * K + size_t(kc) * 8 : We, ok);
      }
    };

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[GM / 16];
#pragma unroll
    for (int i = 0; i < GM / 16; ++i) wmma::fill_fragment(acc[i], 0.0f);
    // Every iteration commits one group (possibly empty), so "all but the newest kMoeStages - 2 groups done"
    // always means "tile kt has landed".
#pragma unroll
    for (int st = 0; st < kMoeStages - 1; ++st) {
      if (st < nk) load_stage(st, st * GK);
      cp_async_commit();
    }
    for (int kt = 0; kt < nk; ++kt) {
      cp_async_wait<kMoeStages - 2>();
      __syncthreads();  // tile kt visible to all warps; stage (kt - 1) % kMoeStages is no longer read
      if (kt + kMoeStages - 1 < nk) load_stage((kt + kMoeStages - 1) % kMoeStages, (kt + kMoeStages - 1) * GK);
      cp_async_commit();
      const bf16* Xs = reinterpret_cast<const bf16*>(smem + (kt % kMoeStages) * kStageBytes);
      const bf16* Ws = Xs + GM * LDX;
#pragma unroll
      for (int kk = 0; kk < GK; kk += 16) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fb;
        wmma::load_matrix_sync(fb, Ws + warp * 16 * LDX + kk, LDX);
#pragma unroll
        for (int mi = 0; mi < GM / 16; ++mi) {
          if (mi * 16 >= m_valid) break;
          wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa;
          wmma::load_matrix_sync(fa, Xs + mi * 16 * LDX + kk, LDX);
          wmma::mma_sync(acc[mi], fa, fb, acc[mi]);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // all stages drained and read: Cs may alias them
#pragma unroll
    for (int mi = 0; mi < GM / 16; ++mi)
      if (mi * 16 < m_valid) wmma::store_matrix_sync(Cs + mi * 16 * LDC + warp * 16, acc[mi], LDC, wmma::mem_row_major);
    __syncthreads();
    if (GATED) {
      for (int i = tid; i < m_valid * (GN / 2); i += kGemmThreads) {
        const int r = i / (GN / 2), c = i % (GN / 2);
        if (n0 + c < N)
          act[size_t(m0 + r) * N + n0 + c] = __float2bfloat16(gelu_tanh(Cs[r * LDC + c]) * Cs[r * LDC + GN / 2 + c]);
      }
    } else {
      for (int i = tid; i < m_valid * GN; i += kGemmThreads) {
        const int r = i / GN, c = i % GN;
        if (n0 + c < N) y[size_t(m0 + r) * N + n0 + c] = Cs[r * LDC + c];
      }
    }
    __syncthreads();  // Cs is read before the next m-tile's loads overwrite it
  }
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

// Above 48 KB of dynamic shared memory a kernel must opt in, once per kernel (and device; we use one).
template <bool GATED>
void raise_smem_limit() {
  static bool done = false;  // one flag per instantiation
  if (!done) {
    CUDA_CHECK(cudaFuncSetAttribute(moe_gemm_k<GATED>, cudaFuncAttributeMaxDynamicSharedMemorySize, kMoeSmem));
    done = true;
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

void moe_gate_up(const bf16* xs, const int32_t* offsets, int E, int P, const bf16* Wgu, int H, int I, bf16* act,
                 cudaStream_t s) {
  if (P == 0) return;
  if (H % 8 != 0) throw_cuda_error("moe_gate_up", "hidden size must be a multiple of 8", 0, __FILE__, __LINE__);
  dim3 grid((I + GN / 2 - 1) / (GN / 2), E);
  raise_smem_limit<true>();
  moe_gemm_k<true><<<grid, kGemmThreads, kMoeSmem, s>>>(xs, offsets, Wgu, I, H, act, nullptr);
  CUDA_CHECK_LAUNCH();
}

void moe_down(const bf16* act, const int32_t* offsets, int E, int P, const bf16* Wd, int H, int I, float* y,
              cudaStream_t s) {
  if (P == 0) return;
  if (I % 8 != 0) throw_cuda_error("moe_down", "expert width must be a multiple of 8", 0, __FILE__, __LINE__);
  dim3 grid((H + GN - 1) / GN, E);
  raise_smem_limit<false>();
  moe_gemm_k<false><<<grid, kGemmThreads, kMoeSmem, s>>>(act, offsets, Wd, H, I, nullptr, y);
  CUDA_CHECK_LAUNCH();
}

void moe_combine(const float* y, const int32_t* idx, const float* w, const int32_t* sorted_pos, int T, int k, int H,
                 float* out, cudaStream_t s) {
  if (T == 0) return;
  moe_combine_k<<<T, 256, 0, s>>>(y, idx, w, sorted_pos, k, H, out);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dg::cuda
