// Grouped expert GEMMs on tensor cores (WMMA bf16, f32 accumulate) with the GELU-tanh gate fused into the gate_up
// epilogue. Rows arrive grouped by expert (kernels_moe.cu moe_group).
#include <mma.h>

#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/cuda_util.cuh"

namespace dg::cuda {
namespace {

using namespace nvcuda;

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

}  // namespace dg::cuda
