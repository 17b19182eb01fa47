#pragma once
// Hopper (sm_90a) PTX wrappers shared by the TMA expert kernels (kernels_experts_tma.cu) and their microbenches
// (tools/gpu/microbench/experts_wgmma_bench.cu, stream_bench.cu): shared-memory mbarriers and a trapping wait on
// them, 2D TMA loads into shared memory, the wgmma descriptor of a 128-byte-swizzled K-major tile, and wgmma
// m64n32k16. Spellings as in CUTLASS's cute/arch.
// Only code compiled for sm_90a may call them: the device passes of other architectures do not see them.
#include <cuda.h>

#include <cstdint>

#include "backend/cuda/cuda_util.cuh"

#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace dg::cuda::hopper {

using dg::cuda::smem_u32;  // cuda_util.cuh

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Whether the phase with parity `parity` of the barrier has completed (one try_wait).
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred P1;\n mbarrier.try_wait.parity.shared::cta.b64 P1, [%1], %2;\n selp.b32 %0, 1, 0, P1;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
// A 32-bit word of shared memory by its shared-window address, ordered with the mbarrier operations around it (the
// "memory" clobbers) so that a value written before an arrive is the one a thread reads after its wait.
__device__ __forceinline__ void st_shared_s32(uint32_t addr, int v) {
  asm volatile("st.shared.s32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ int ld_shared_s32(uint32_t addr) {
  int v;
  asm volatile("ld.shared.s32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins until ready() holds. A lost TMA transaction or count would otherwise hang the process with the GPU busy:
// after 10 s (the clock read every kCheckMask + 1 spins) the kernel traps instead, a launch error the caller reports.
template <uint32_t kCheckMask, class Ready>
__device__ __forceinline__ void spin_until(Ready ready) {
  uint64_t t0 = 0;
  for (uint32_t spin = 0;; ++spin) {
    if (ready()) return;
    if ((spin & kCheckMask) == 0) {
      const uint64_t t = globaltimer();
      if (spin == 0) t0 = t;
      else if (t - t0 > 10000000000ull) __trap();
    }
  }
}
// Waits for the phase of parity `parity` of the barrier.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  spin_until<1023u>([&] { return mbar_try_wait(bar, parity); });
}

// 2D tile load: the box at coordinates (c0 = column, c1 = row) of the tensor map into shared memory, completing
// `bar`'s transaction count by the box's bytes; `policy` an L2 cache policy (createpolicy).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar,
                                            uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "l"(policy)
      : "memory");
}
// L2 prefetch of one box (no shared memory, no completion to wait for).
__device__ __forceinline__ void tma_prefetch_l2_2d(const CUtensorMap* map, int c0, int c1) {
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global [%0, {%1, %2}];" ::"l"(reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1)
               : "memory");
}

// wgmma shared-memory descriptor of a K-major tile whose rows are 128 B (64 bf16), laid out as TMA writes them with
// CU_TENSOR_MAP_SWIZZLE_128B (16-byte chunk c of row r at chunk c ^ (r % 8), 8-row groups 1024 B apart):
//   bits  0-13: start address >> 4     bits 16-29: leading byte offset >> 4 (unused by swizzled K-major; 1)
//   bits 32-45: stride byte offset >> 4 = 1024 >> 4     bits 62-63: layout 1 (128B swizzle)
// The k16 step j of a 64-wide slice starts 32 j bytes into the row: add 2 j to the descriptor. The hardware applies
// the swizzle to the computed address, so the tile itself must be 1024-byte aligned.
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}
// Keeps the compiler from moving accesses of the accumulators across wgmma issue / wait (CUTLASS's
// warpgroup_fence_operand).
__device__ __forceinline__ void fence_acc(float (&d)[16]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// D[64 x 32] f32 += A[64 x 16] * B[16 x 32]: A and B K-major in shared memory (descriptors da, db), no transposes,
// scale-d 1 (accumulate: the caller zeroes the accumulators).
__device__ __forceinline__ void wgmma_m64n32k16(float (&d)[16], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(da), "l"(db), "r"(1));
}

}  // namespace dg::cuda::hopper
#endif
