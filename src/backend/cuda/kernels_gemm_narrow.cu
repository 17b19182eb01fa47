// A bf16 GEMM in small blocks, for work that must run BESIDE a kernel holding most of every SM: the dense MLP's down
// projection beside the fused expert launch (kernels_experts_tma.cu). Three expert blocks an SM leave ~30 KB of
// shared memory and ~23K registers; cuBLASLt's kernels for this shape want ~220 KB, so they could only start when
// the expert kernel ended, on the step's critical path (~12 us a layer, docs/BENCHMARKS.md session 11). These blocks
// (128 threads, 24 KB) fit beside it and finish long before it does; the tensor cores they use sit idle in the
// weight-streaming expert kernel.
//
// Block tile 64 rows x 64 output columns, 4 warps of 32 x 32 (mma.sync m16n8k16 fed by ldmatrix), k in slices of 32
// through a 3-stage cp.async ring. A row of a slice is 64 B (four 16-byte chunks), chunk c stored at c ^ ((r / 2) % 4):
// the 8 rows an ldmatrix reads then cover all 32 banks. Every output element is one thread's f32 sum in a fixed k
// order, rounded once to bf16: deterministic, and the same arithmetic as cuBLASLt up to the order of the f32 sums.
#include <algorithm>
#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/cuda_util.cuh"
#include "backend/cuda/launch.cuh"

namespace dg::cuda {
namespace {

constexpr int kBM = 64, kBN = 64, kBK = 32, kStages = 3, kThreads = 128;
constexpr uint32_t kOperandBytes = kBM * kBK * 2;        // one operand's slice: 4 KB
constexpr uint32_t kStageBytes = 2 * kOperandBytes;      // A then W
constexpr size_t kSmemBytes = size_t(kStages) * kStageBytes;  // 24 KB

// Byte offset of 16-byte chunk c (0..3) of row r inside one operand's slice.
__device__ __forceinline__ uint32_t slice_offset(int r, int c) {
  return uint32_t(r * 64 + ((c ^ ((r >> 1) & 3)) << 4));
}

// C[T, N] = A[T, K] W[N, K]^T. K % 8 == 0 and N % 8 == 0 (gemm_narrow_supported): a 16-byte chunk is wholly inside
// or outside K, and an output column pair never straddles N.
__global__ void __launch_bounds__(kThreads) gemm_narrow_k(const bf16* __restrict__ A, int T,
                                                          const bf16* __restrict__ W, int N, int K,
                                                          bf16* __restrict__ C) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int m0 = int(blockIdx.y) * kBM, n0 = int(blockIdx.x) * kBN;
  const int nk = (K + kBK - 1) / kBK;

  // Slice kt into ring slot `slot`: 256 chunks an operand, two a thread; rows past T / N and k past K read nothing
  // and land as zeros.
  auto load = [&](int slot, int kt) {
    const uint32_t sa = base + uint32_t(slot) * kStageBytes, sw = sa + kOperandBytes;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int ch = tid + i * kThreads, r = ch >> 2, c = ch & 3, k = kt * kBK + c * 8;
      const int ra = m0 + r, rw = n0 + r;
      const bool va = k < K && ra < T, vw = k < K && rw < N;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa + slice_offset(r, c)),
                   "l"(A + (va ? size_t(ra) * size_t(K) + size_t(k) : 0)), "r"(va ? 16 : 0)
                   : "memory");
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sw + slice_offset(r, c)),
                   "l"(W + (vw ? size_t(rw) * size_t(K) + size_t(k) : 0)), "r"(vw ? 16 : 0)
                   : "memory");
    }
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nk) load(s, s);
    cp_async_commit();  // an empty group past nk keeps the wait count below uniform
  }

  float acc[2][4][4] = {};
  const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
  for (int kt = 0; kt < nk; ++kt) {
    cp_async_wait<kStages - 2>();  // slice kt has landed (this thread's part) ...
    __syncthreads();               // ... everyone's, and every warp is done with slot (kt - 1) % kStages
    if (kt + kStages - 1 < nk) load((kt + kStages - 1) % kStages, kt + kStages - 1);
    cp_async_commit();
    const uint32_t sa = base + uint32_t(kt % kStages) * kStageBytes, sw = sa + kOperandBytes;
#pragma unroll
    for (int ks = 0; ks < kBK / 16; ++ks) {
      uint32_t a[2][4], b[4][2];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)  // a0..a3: rows 0-7 / 8-15 at k 0-7, then at k 8-15
        ldsm_x4(a[mi], sa + slice_offset(wm + mi * 16 + (lane & 15), ks * 2 + (lane >> 4)));
#pragma unroll
      for (int nj = 0; nj < 2; ++nj) {  // b0, b1 of two n8 tiles: W rows 0-7 at k 0-7, 8-15, then rows 8-15
        uint32_t t[4];
        ldsm_x4(t, sw + slice_offset(wn + nj * 16 + (lane & 7) + ((lane >> 4) << 3), ks * 2 + ((lane >> 3) & 1)));
        b[2 * nj][0] = t[0], b[2 * nj][1] = t[1], b[2 * nj + 1][0] = t[2], b[2 * nj + 1][1] = t[3];
      }
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) mma_bf16(acc[mi][ni], a[mi], b[ni][0], b[ni][1]);
    }
  }
  cp_async_wait<0>();  // only empty groups can be pending; nothing may be in flight at exit

#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      const int col = n0 + wn + ni * 8 + (lane & 3) * 2;
      if (col >= N) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + wm + mi * 16 + (lane >> 2) + h * 8;
        if (row < T)
          *reinterpret_cast<__nv_bfloat162*>(C + size_t(row) * size_t(N) + size_t(col)) =
              __floats2bfloat162_rn(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
      }
    }
}

}  // namespace

bool gemm_narrow_supported(int N, int K) { return N > 0 && K > 0 && N % 8 == 0 && K % 8 == 0; }

void gemm_bf16_narrow(const bf16* A, int T, const bf16* W, int N, int K, bf16* C, cudaStream_t s) {
  if (!gemm_narrow_supported(N, K))
    throw_cuda_error("gemm_bf16_narrow", "needs N % 8 == 0 and K % 8 == 0 (use the cuBLASLt GEMM)", 0, __FILE__,
                     __LINE__);
  if (((reinterpret_cast<uintptr_t>(A) | reinterpret_cast<uintptr_t>(W) | reinterpret_cast<uintptr_t>(C)) & 15) != 0)
    throw_cuda_error("gemm_bf16_narrow", "A, W and C must be 16-byte aligned", 0, __FILE__, __LINE__);
  if (T <= 0) return;
  const dim3 grid(unsigned((N + kBN - 1) / kBN), unsigned((T + kBM - 1) / kBM));
  launch_pdl(gemm_narrow_k, grid, dim3(kThreads), kSmemBytes, s, A, T, W, N, K, C);
}

}  // namespace dg::cuda
