#pragma once
// Device helpers shared by the kernel files.
#include <cuda_bf16.h>

#include <cstdint>

namespace dg::cuda {

// Work claimed from a counter by persistent blocks (the TMA expert kernels' tiles, the prefill expert kernels' items):
// ctr = two unsigneds, zero at launch, left zero at exit. A block's first unit is its block index; each later one
// comes from claim_after_first_round. Once a block has made its last claim, finish_claims counts it done, and the last
// block to do so zeroes both words for the next launch (returning true only there).
__device__ __forceinline__ int claim_after_first_round(unsigned* ctr) {
  return int(atomicAdd(ctr, 1u)) + int(gridDim.x);
}
__device__ __forceinline__ bool finish_claims(unsigned* ctr) {
  __threadfence();
  const bool last = atomicAdd(ctr + 1, 1u) == gridDim.x - 1;
  if (last) {
    atomicExch(ctr, 0u);
    atomicExch(ctr + 1, 0u);
  }
  return last;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum_d(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
template <class T>
__device__ T block_sum(T v) {
  __shared__ T part[32];
  __shared__ T total;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();  // part[] may still be read by a previous call
  if (lane == 0) part[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T x = lane < nw ? part[lane] : T(0);
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    if (lane == 0) total = x;
  }
  __syncthreads();
  return total;
}

__device__ __forceinline__ float gelu_tanh(float x) {
  const float k = 0.7978845608028654f;
  return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

// 16-byte global -> shared copies that do not occupy registers (sm_80+). All copies of a tile are issued before the
// first wait, so a tile costs one memory round trip instead of one per loop iteration. valid == false zero-fills
// the 16 bytes without reading (gmem must still be a mapped address).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// The shared-memory address (what ldmatrix, cp.async and the mbarrier / TMA instructions take) of a generic pointer
// into shared memory.
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
// Tensor-core fragments (sm_80+): D += A B for one m16n8k16 tile (bf16 in, f32 accumulate); four 8x8 b16 matrices
// from shared memory (lane l gives the address of row l % 8 of matrix l / 8), plain or transposed.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

// The experts' output rows (cuda::ExpertRows): element i as f32, or rounded to bf16 (to nearest even) when bf16_rows.
__device__ __forceinline__ void store_expert_row(void* y, bool bf16_rows, size_t i, float v) {
  if (bf16_rows)
    static_cast<__nv_bfloat16*>(y)[i] = __float2bfloat16(v);
  else
    static_cast<float*>(y)[i] = v;
}
// Elements i and i + 1 in one store (i even).
__device__ __forceinline__ void store_expert_row_pair(void* y, bool bf16_rows, size_t i, float v0, float v1) {
  if (bf16_rows)
    *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(y) + i) = __floats2bfloat162_rn(v0, v1);
  else
    *reinterpret_cast<float2*>(static_cast<float*>(y) + i) = make_float2(v0, v1);
}
// A bf16 store with an L2 cache policy (createpolicy), and an L2 line (128 bytes, 128-aligned) dropped without its
// write-back: its contents are undefined afterwards, so only for data that nobody reads again.
__device__ __forceinline__ void st_bf16_l2_policy(__nv_bfloat16* p, __nv_bfloat16 v, uint64_t policy) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("st.global.L2::cache_hint.b16 [%0], %1, %2;" ::"l"(p), "h"(__bfloat16_as_ushort(v)), "l"(policy)
               : "memory");
#else
  *p = v;
#endif
}
__device__ __forceinline__ void discard_l2_line(const void* p) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("discard.global.L2 [%0], 128;" ::"l"(p) : "memory");
#endif
}
__device__ __forceinline__ float load_expert_row(const void* y, bool bf16_rows, size_t i) {
  return bf16_rows ? __bfloat162float(static_cast<const __nv_bfloat16*>(y)[i]) : static_cast<const float*>(y)[i];
}

}  // namespace dg::cuda
