// Build (no GPU needed): /usr/local/cuda/bin/nvcc -std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a -I src --expt-relaxed-constexpr -cudart static tools/gpu/microbench/experts_wgmma_bench.cu -lcublasLt -o build-mb/experts_wgmma_bench
//
// Hopper (sm_90a) expert GEMMs at decode shapes: TMA (cp.async.bulk.tensor 2D, 128B swizzle) into a multi-stage
// mbarrier ring, one producer warp, one consumer warpgroup issuing wgmma in the "swap AB" form (weights are the
// wgmma M side, the 32 padded token rows of the expert are the N side). Checked against a CPU double reference and
// against cuBLASLt on every expert, run twice for bitwise determinism, and timed next to cuBLASLt strided-batched
// GEMMs of the same shapes (the production path: 249 us gate_up / 130 us down per layer on the H200, 4.07 / 3.9
// TB/s; a plain read reaches ~4.5 TB/s; the hand-written cp.async + mma.sync kernels reached ~3.4 TB/s, see the
// header of src/backend/cuda/kernels_experts.cu).
//
// STATUS (H200, 2026-11-30, docs/BENCHMARKS.md): every variant passes (vs CPU double on sampled experts, vs cuBLASLt
// on all experts, bitwise repeatable, padded rows unwritten, empty experts skipped), and none is meaningfully faster
// than cuBLASLt, so the engine keeps cuBLASLt. Medians of 20, ms per layer (TB/s of weights):
//   cuBLASLt best            gate_up 0.2503 (4.06)   down 0.1369 (3.71)
//   s4-persist               gate_up 0.2502 (4.06)   down 0.1444 (3.52)
//   tiled-s4-persist         gate_up 0.2453 (4.14)   down 0.1373 (3.70)
//   tiled-s5-grid            gate_up 0.2485 (4.08)   down 0.1356 (3.74)
//   plain read of the layer  gate_up 0.2288 (4.44)   down 0.1185 (4.28)
// "tiled-": the weights repacked into stream order (each stage's 128 rows x 64 k contiguous, 16 KB), which the
// engine cannot adopt without moving its grouped kernels (prefill, overflow rows) to the same layout. Wired into the
// engine (branch wip/tma-experts-engine: gate_up with GELU fused, down, both SM-limited beside the dense MLP), the
// 4K denoise step stayed at 19.3 ms. The ~8% to a plain read is per-kernel ramp and tail, not the inner loop.
// Guards: every mbarrier wait traps after 2 s instead of hanging the GPU call, leaving block, stage, parity and role
// in pinned host memory that the host prints (no device printf: it would serialize the wgmmas); kernels trap on a
// misaligned ring or a wrong block size; outputs are poisoned (NaN) before each run and every written element is
// checked, as is every padded (unwritten) row staying poisoned.
//
// How to run (build here, carry the binary; also built by CMake as microbench_experts_wgmma):
//   mkdir -p build-mb && <build line above>
//   run(command="L=$(dirname $(find /usr/local/cuda*/ /opt /usr/lib -name 'libcublasLt.so.13*' | head -1));
//                LD_LIBRARY_PATH=$L:$LD_LIBRARY_PATH timeout 300 build-mb/experts_wgmma_bench",
//       carry=["build-mb/experts_wgmma_bench"])
// An optional argument keeps only the variants whose name contains it (e.g. `experts_wgmma_bench tiled-s4`).
//
// Design (per block: 160 threads = consumer warpgroup (warps 0-3) + producer warp 4):
// - A tile is 128 weight rows of one expert: gate_up = 64 gate rows n0..n0+63 and the matching 64 up rows
//   I+n0..I+n0+63 (so gelu(gate) * up is formed in registers and only bf16 act leaves the block); down = 128
//   consecutive output rows. Tiles: gate_up 11 per expert (I = 704 = 11 * 64), down 22 (H = 2816 = 22 * 128).
// - A stage is one 64-wide k slice: two 64x64 bf16 weight boxes (8 KB each) + the expert's 32x64 token box (4 KB)
//   = 20 KB, 128B-swizzled by TMA. S stages per block (template), all in flight: S = 3 -> 60 KB, 3 blocks/SM
//   (180 KB/SM); S = 4 -> 80 KB, 2 blocks/SM (160 KB/SM); S = 5 -> 100 KB, 2 blocks/SM (200 KB/SM); S = 10 ->
//   200 KB, 1 block/SM. The program prints the occupancy it actually got for each variant.
// - Per stage the consumer warpgroup issues 4 k16 steps x 2 wgmma.m64n32k16 (gate/first-64 and up/second-64 rows
//   against the same token tile), 2 x 16 f32 accumulators per thread, then waits and frees the stage. Estimate (not
//   measured): 8 wgmmas (0.5 MFLOP, ~70 ns at 1/132 of the chip's bf16 rate) plus the wait latency, against ~1.2 us
//   for a block's 20 KB stage at 4.5 TB/s shared by 2 blocks/SM, so the math is not overlapped further
//   (wait_group 0 per stage).
// - Weights are loaded with an L2 evict_first hint (read once); the token tile uses the default policy since the
//   other n-tiles of the same expert re-read it (tile order is expert-major so they run close together).
// - Grid: one block per tile (non-persistent), or persistent (resident blocks stride over the tile list with the
//   ring running on across tiles, so the next tile's loads overlap this tile's epilogue). Experts with 0 rows are
//   skipped (no weight reads). Each output element is computed by one block in a fixed k order: deterministic.
#include <cublasLt.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/hopper_tma.cuh"

#define CK(x)                                                                                          \
  do {                                                                                                 \
    auto e_ = (x);                                                                                     \
    if (e_ != 0) {                                                                                     \
      std::printf("FAIL: error %d (%s) at %s:%d\n", int(e_), #x, __FILE__, __LINE__);                   \
      print_diag();                                                                                    \
      std::exit(1);                                                                                    \
    }                                                                                                  \
  } while (0)

using bf16 = __nv_bfloat16;

// Host view of the kernels' trap diagnostics (g_diag below), in pinned mapped memory.
static int* h_diag = nullptr;
static void print_diag() {
  if (h_diag == nullptr || h_diag[0] == 0) return;
  const volatile int* d = h_diag;
  std::printf("kernel trap: %s, block %d thread %d stage %d parity %d role %s stage-use %d aux %d\n",
              d[0] == 1 ? "mbarrier wait timed out" : "bad launch configuration", d[1], d[2], d[3], d[4],
              d[5] == 1 ? "producer(empty)" : d[5] == 0 ? "consumer(full)" : "-", d[6], d[7]);
}

namespace {

constexpr int kE = 128, kT = 32, kH = 2816, kI = 704;  // experts, padded token rows, hidden, expert intermediate
constexpr int kBK = 64;                                // k per stage: 64 bf16 = 128 B = one 128B-swizzle row
constexpr int kBoxRows = 64;                           // weight rows per TMA box and per wgmma (the M side)
constexpr int kWBoxBytes = kBoxRows * kBK * 2;         // 8192
constexpr int kXBoxBytes = kT * kBK * 2;               // 4096
constexpr int kStageBytes = 2 * kWBoxBytes + kXBoxBytes;  // 20480, a multiple of 1024 so every box stays aligned
constexpr int kThreads = 160;                          // warps 0-3: consumer warpgroup; warp 4: producer
static_assert(kStageBytes % 1024 == 0 && kWBoxBytes % 1024 == 0, "128B-swizzled tiles need 1024-byte alignment");
static_assert(kH % kBK == 0 && kI % kBK == 0 && kI % 64 == 0 && kH % 128 == 0, "shapes must tile exactly");

constexpr int smem_bytes(int stages) { return 1024 /* alignment slack */ + stages * kStageBytes + stages * 16; }

// ---------------------------------------------------------------------------------------------------------------
// PTX wrappers: the shared ones in src/backend/cuda/hopper_tma.cuh, the bench-only ones here.
using namespace dg::cuda::hopper;

// Diagnostics for a trapped kernel: device printf is a function call, and any call in the kernel makes ptxas
// serialize the wgmmas (warning C7510), so a failing guard writes what it saw into pinned, mapped host memory
// (readable by the host after the trap has killed the context) and traps. Layout: {code (1 = mbarrier timeout,
// 2 = bad launch), block, thread, stage, parity, role (0 consumer / 1 producer), stage use counter, aux}.
__device__ volatile int* g_diag = nullptr;
__device__ __forceinline__ void diag_trap(int code, int stage, int parity, int role, int it, int aux) {
  volatile int* d = g_diag;
  if (d != nullptr) {
    d[1] = int(blockIdx.x), d[2] = int(threadIdx.x), d[3] = stage, d[4] = parity, d[5] = role, d[6] = it;
    d[7] = aux;
    __threadfence_system();
    d[0] = code;
    __threadfence_system();
  }
  __trap();
}
// Waits until the phase with parity `parity` of the barrier has completed. A wrong parity or byte count would hang
// the GPU call; instead trap after ~2 s, leaving which wait it was in g_diag.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity, int stage, int role, uint32_t it) {
  uint64_t t0 = 0;
  for (uint32_t spin = 0;; ++spin) {
    if (mbar_try_wait(bar, parity)) return;
    if ((spin & 1023) == 0) {
      const uint64_t t = globaltimer();
      if (spin == 0) t0 = t;
      else if (t - t0 > 2000000000ull) diag_trap(1, stage, int(parity), role, int(it), 0);
    }
  }
}

__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
// tma_load_2d without an L2 policy, beside hopper_tma.cuh's with one (the using-declaration keeps both overloads
// visible here).
using dg::cuda::hopper::tma_load_2d;
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ float gelu_tanh(float x) {  // same formula as src/backend/cuda/cuda_util.cuh
  const float k = 0.7978845608028654f;
  return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

// ---------------------------------------------------------------------------------------------------------------
// The kernel. Tensor maps (2D, bf16, 128B swizzle): tmW over all experts' weights as [E * rows_per_expert, K]
// (gate_up: rows_per_expert = 2I, K = H; down: rows_per_expert = H, K = I), box {64, 64}; tmX over the padded token
// rows [E * 32, K], box {64, 32}. Tile t = e * tiles_n + nt (expert-major). GATED: act[e][tok][nt*64 + r] (bf16,
// row length I); else y[e][tok][nt*128 + r] (f32, row length H). Only token rows < counts[e] are written.
// PROBE (timing only; what bounds the ring): bit 0 drops the token box after the first STAGES loads (so the weights
// alone cross L2 -> shared memory; wrong results), bit 1 drops the wgmmas (the consumer only waits and frees; wrong
// results), bit 2 loads the weights without the evict_first hint (same results). The variant's weight map picks the
// L2 promotion (Variant::promo).
template <int STAGES, bool GATED, bool TILED, int PROBE = 0>
__global__ void __launch_bounds__(kThreads, 1)
    experts_wgmma_k(const __grid_constant__ CUtensorMap tmW, const __grid_constant__ CUtensorMap tmX,
                    const int32_t* __restrict__ counts, int K, bf16* __restrict__ act, float* __restrict__ y) {
  constexpr int rows_per_expert = GATED ? 2 * kI : kH;
  constexpr int tiles_n = GATED ? kI / 64 : kH / 128;
  constexpr int out_ld = GATED ? kI : kH;
  const int n_tiles = kE * tiles_n;

  extern __shared__ unsigned char smem_raw[];
  // Dynamic shared memory is only guaranteed 16-byte aligned; the swizzled tiles need 1024 (smem_bytes() adds slack).
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t full0 = base + STAGES * kStageBytes, empty0 = full0 + 8 * STAGES;  // mbarriers, 8 B each
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  const int nk = K / kBK;

  if (threadIdx.x == 0) {
    if (blockDim.x != kThreads || (base & 1023u) != 0 || K % kBK != 0 ||
        empty0 + 8 * STAGES - smem_u32(smem_raw) > uint32_t(smem_bytes(STAGES))) {
      diag_trap(2, -1, -1, -1, K, int(blockDim.x));
    }
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, 1);   // one arrive (the producer's expect_tx) + the TMA bytes
      mbar_init(empty0 + 8 * s, 4);  // one arrive per consumer warp after its wgmmas on the stage completed
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // inits visible to the async (TMA) proxy
  }
  __syncthreads();

  if (warp == 4) {
    // ---------------- producer: one thread issues every TMA load ----------------
    if (lane != 0) return;
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tmW)) : "memory");
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tmX)) : "memory");
    const uint64_t evict_first = l2_evict_first_policy();
    uint32_t it = 0;  // stage use counter, continued across tiles (must match the consumer's exactly)
    for (int tile = int(blockIdx.x); tile < n_tiles; tile += int(gridDim.x)) {
      const int e = tile / tiles_n, nt = tile % tiles_n;
      if (counts[e] <= 0) continue;  // the consumer skips the same tiles
      const int row_a = e * rows_per_expert + nt * (GATED ? 64 : 128);
      const int row_b = row_a + (GATED ? kI : 64);  // gate_up: the matching up rows; down: the next 64 rows
      for (int kt = 0; kt < nk; ++kt, ++it) {
        const int s = int(it % STAGES);
        const uint32_t round = it / STAGES;
        mbar_wait(empty0 + 8 * s, (round & 1u) ^ 1u, s, 1, it);  // round 0: passes at once (fresh barrier)
        const uint32_t st = base + uint32_t(s) * kStageBytes, full = full0 + 8 * s;
        const bool load_x = (PROBE & 1) == 0 || it < uint32_t(STAGES);
        mbar_arrive_expect_tx(full, load_x ? kStageBytes : 2 * kWBoxBytes);
        if constexpr (TILED) {
          // Repacked weights: the stage's 128 rows x 64 k are 16 KB contiguous, tiles and k slices in stream order.
          tma_load_2d(st, &tmW, 0, (tile * nk + kt) * 128, full, evict_first);
        } else if constexpr ((PROBE & 4) != 0) {
          tma_load_2d(st, &tmW, kt * kBK, row_a, full);
          tma_load_2d(st + kWBoxBytes, &tmW, kt * kBK, row_b, full);
        } else {
          tma_load_2d(st, &tmW, kt * kBK, row_a, full, evict_first);
          tma_load_2d(st + kWBoxBytes, &tmW, kt * kBK, row_b, full, evict_first);
        }
        if (load_x) tma_load_2d(st + 2 * kWBoxBytes, &tmX, kt * kBK, e * kT, full);
      }
    }
    return;
  }

  // ---------------- consumer warpgroup (warps 0-3) ----------------
  uint32_t it = 0;
  for (int tile = int(blockIdx.x); tile < n_tiles; tile += int(gridDim.x)) {
    const int e = tile / tiles_n, nt = tile % tiles_n;
    const int cnt = counts[e];
    if (cnt <= 0) continue;
    float acc0[16], acc1[16];  // rows 0-63 of the tile (gate / first 64) and rows 64-127 (up / next 64)
#pragma unroll
    for (int i = 0; i < 16; ++i) acc0[i] = 0.f, acc1[i] = 0.f;
    for (int kt = 0; kt < nk; ++kt, ++it) {
      const int s = int(it % STAGES);
      const uint32_t round = it / STAGES;
      mbar_wait(full0 + 8 * s, round & 1u, s, 0, it);
      __syncwarp();  // the spin above may leave the warp diverged; wgmma is .sync.aligned
      const uint32_t st = base + uint32_t(s) * kStageBytes;
      const uint64_t da = desc_sw128(st), db = desc_sw128(st + kWBoxBytes), dx = desc_sw128(st + 2 * kWBoxBytes);
      if constexpr ((PROBE & 2) == 0) {
        fence_acc(acc0), fence_acc(acc1);
        wgmma_fence();  // prior register writes to the accumulators are ordered before the wgmmas read them
#pragma unroll
        for (int j = 0; j < kBK / 16; ++j) {
          wgmma_m64n32k16(acc0, da + 2 * j, dx + 2 * j);  // +2 in the encoded address = +32 B = +16 bf16 along k
          wgmma_m64n32k16(acc1, db + 2 * j, dx + 2 * j);
        }
        wgmma_commit();
        wgmma_wait<0>();  // this stage's smem reads are done after this; the math is far from the bottleneck
        fence_acc(acc0), fence_acc(acc1);
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(empty0 + 8 * s);  // 4 arrivals (one per warp) free the stage
    }

    // Epilogue straight from the accumulators. Thread (warp w, lane l) holds, for j in 0..3, i in 0..1, c in 0..1:
    // d[4j + 2i + c] = D[row 16w + l/4 + 8i][token 8j + 2(l%4) + c]. acc0 and acc1 hold the same (row, token)
    // positions of the two 64-row halves, so for gate_up gate and up of one output element sit in one thread.
    const int r0 = warp * 16 + (lane >> 2), t0 = (lane & 3) * 2;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int tok = 8 * j + t0 + c, r = r0 + 8 * i, idx = 4 * j + 2 * i + c;
          if (tok >= cnt) continue;
          const size_t row = size_t(e) * kT + tok;
          if constexpr (GATED) {
            act[row * out_ld + nt * 64 + r] = __float2bfloat16(gelu_tanh(acc0[idx]) * acc1[idx]);
          } else {
            y[row * out_ld + nt * 128 + r] = acc0[idx];
            y[row * out_ld + nt * 128 + 64 + r] = acc1[idx];
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Host side.
PFN_cuTensorMapEncodeTiled_v12000 g_encode = nullptr;

// 2D bf16 tensor map over a row-major [rows, cols] matrix, box {64 cols, box_rows}, 128B swizzle.
CUtensorMap make_map(const bf16* p, uint64_t rows, uint64_t cols, uint32_t box_rows,
                     CUtensorMapL2promotion promo = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
  CUtensorMap m;
  std::memset(&m, 0, sizeof m);
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {cols * sizeof(bf16)};  // bytes, dimension 1; must be a multiple of 16
  const cuuint32_t box[2] = {uint32_t(kBK), box_rows};
  const cuuint32_t estr[2] = {1, 1};
  if (strides[0] % 16 != 0 || (reinterpret_cast<uintptr_t>(p) & 15) != 0 || box_rows > 256 || kBK * 2 > 128) {
    std::printf("FAIL: tensor map preconditions\n");
    std::exit(1);
  }
  const CUresult r = g_encode(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<bf16*>(p), dims, strides, box, estr,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              promo, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::printf("FAIL: cuTensorMapEncodeTiled returned %d (rows %llu cols %llu box_rows %u)\n", int(r),
                (unsigned long long)rows, (unsigned long long)cols, box_rows);
    std::exit(1);
  }
  return m;
}

template <int S, bool G, bool T, int P = 0>
void launch(const CUtensorMap& tw, const CUtensorMap& tx, const int32_t* counts, int grid, bf16* act, float* y) {
  experts_wgmma_k<S, G, T, P><<<grid, kThreads, smem_bytes(S)>>>(tw, tx, counts, G ? kH : kI, act, y);
}
// Repack [E][rows_per_expert][K] weights into stream order: for tile (e, nt) and k slice kt, 128 rows x 64 k
// contiguous (gate_up: 64 gate rows then the matching 64 up rows; down: 128 consecutive rows).
template <bool G>
__global__ void repack_k(const bf16* __restrict__ src, bf16* __restrict__ dst, int K) {
  constexpr int rows_per_expert = G ? 2 * kI : kH, tiles_n = G ? kI / 64 : kH / 128;
  const int nk = K / kBK;
  const size_t total = size_t(kE) * rows_per_expert * K;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x) {
    const int kk = int(i % kBK);
    size_t q = i / kBK;
    const int r = int(q % 128);
    q /= 128;
    const int kt = int(q % nk);
    const size_t tile = q / nk;
    const int e = int(tile / tiles_n), nt = int(tile % tiles_n);
    const int row = G ? (r < 64 ? nt * 64 + r : kI + nt * 64 + r - 64) : nt * 128 + r;
    dst[i] = src[(size_t(e) * rows_per_expert + row) * K + size_t(kt) * kBK + kk];
  }
}

struct Variant {
  std::string name;
  int stages;
  bool persistent;
  void (*gu)(const CUtensorMap&, const CUtensorMap&, const int32_t*, int, bf16*, float*);
  void (*dn)(const CUtensorMap&, const CUtensorMap&, const int32_t*, int, bf16*, float*);
  int occ_gu = 0, occ_dn = 0;  // resident blocks per SM
  bool tiled = false;
  int probe = 0;  // timing-only PROBE variant: not checked
  int promo = 2;  // the weight maps' L2 promotion: 0 none, 1 128 B, 2 256 B
};
template <int S, bool T = false, int P = 0>
Variant variant(bool persistent, int promo = 2) {
  CK(cudaFuncSetAttribute(experts_wgmma_k<S, true, T, P>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          smem_bytes(S)));
  CK(cudaFuncSetAttribute(experts_wgmma_k<S, false, T, P>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          smem_bytes(S)));
  char name[48];  // (snprintf: GCC 12 -Wrestrict misfires on "s" + std::to_string)
  std::snprintf(name, sizeof name, "%ss%d-%s%s%s%s%s", T ? "tiled-" : "", S, persistent ? "persist" : "grid",
                P & 1 ? "-noX" : "", P & 2 ? "-noMMA" : "", P & 4 ? "-evnormal" : "",
                promo == 0 ? "-promo0" : promo == 1 ? "-promo128" : "");
  Variant v{name, S, persistent, launch<S, true, T, P>, launch<S, false, T, P>};
  v.tiled = T;
  v.probe = P;
  v.promo = promo;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v.occ_gu, experts_wgmma_k<S, true, T, P>, kThreads,
                                                   smem_bytes(S)));
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v.occ_dn, experts_wgmma_k<S, false, T, P>, kThreads,
                                                   smem_bytes(S)));
  return v;
}

// Minimal cuBLASLt strided-batched setup (as tools/gpu/microbench/batched_bench.cu): C[e] (m x n col-major, i.e.
// [n tokens][m rows]) = W[e] (row-major [m, k], op T) x X[e] (row-major [n, k]).
struct Lt {
  cublasLtMatmulDesc_t op{};
  cublasLtMatrixLayout_t la{}, lb{}, lc{};
  cublasLtMatmulHeuristicResult_t res[8]{};
  int found = 0;
  void init(cublasLtHandle_t h, int m, int n, int k, cudaDataType_t ct, size_t ws_bytes) {
    CK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, k, m, k));
    CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, k, n, k));
    CK(cublasLtMatrixLayoutCreate(&lc, ct, m, n, m));
    int32_t batch = kE;
    const int64_t sa = int64_t(m) * k, sb = int64_t(k) * n, sc = int64_t(m) * n;
    for (auto [l, s] : {std::pair{la, sa}, std::pair{lb, sb}, std::pair{lc, sc}}) {
      CK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof batch));
      CK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &s, sizeof s));
    }
    cublasLtMatmulPreference_t pref;
    CK(cublasLtMatmulPreferenceCreate(&pref));
    CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                            sizeof ws_bytes));
    CK(cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, lc, lc, pref, 8, res, &found));
    cublasLtMatmulPreferenceDestroy(pref);
    if (found == 0) {
      std::printf("FAIL: cuBLASLt found no algorithm (m %d n %d k %d)\n", m, n, k);
      std::exit(1);
    }
  }
  int run(cublasLtHandle_t h, const void* W, const void* X, void* C, int algo, void* ws, size_t ws_bytes) const {
    const float alpha = 1, beta = 0;
    return int(cublasLtMatmul(h, op, &alpha, W, la, X, lb, &beta, C, lc, C, lc, &res[algo].algo, ws, ws_bytes, 0));
  }
};

__global__ void fill_k(bf16* p, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed ^ uint32_t(i >> 32) * 40503u;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
    p[i] = __float2bfloat16((float(h) * (1.0f / 4294967296.0f) * 2.0f - 1.0f) * scale);
  }
}
__global__ void read_k(const uint4* p, size_t n, unsigned* sink) {
  unsigned s = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(p + i);
    s ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (s == 0x12345678u) *sink = s;
}

int g_fail = 0;
void report(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
  if (!ok) ++g_fail;
}
float bf(bf16 x) { return __bfloat162float(x); }
double gelu_d(double x) { return 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }
template <class T>
std::vector<T> get(const T* p, size_t n) {
  std::vector<T> v(n);
  CK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}
bool is_poison(bf16 x) { uint16_t u; std::memcpy(&u, &x, 2); return u == 0xFFFF; }
bool is_poison(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u == 0xFFFFFFFFu; }
double val(bf16 x) { return bf(x); }
double val(float x) { return x; }

// Compares out (valid rows) with ref (same layout [E][32][ld], only experts in `experts`; ref_valid marks entries to
// compare) by max |out - ref| / max |ref|, requires finite outputs and padded rows still poisoned.
template <class T>
void check_out(const std::string& what, const std::vector<T>& out, const std::vector<double>& ref,
               const std::vector<int>& experts, const std::vector<int32_t>& counts, int ld, double tol) {
  double max_ref = 0, max_err = 0;
  long bad_written = 0, bad_pad = 0;
  for (int e : experts) {
    for (int t = 0; t < kT; ++t) {
      for (int c = 0; c < ld; ++c) {
        const size_t i = (size_t(e) * kT + t) * ld + c;
        if (t >= counts[size_t(e)]) {
          bad_pad += !is_poison(out[i]);
          continue;
        }
        const double o = val(out[i]);
        if (!std::isfinite(o)) {
          ++bad_written;
          continue;
        }
        max_ref = std::max(max_ref, std::fabs(ref[i]));
        max_err = std::max(max_err, std::fabs(o - ref[i]));
      }
    }
  }
  const double rel = max_ref > 0 ? max_err / max_ref : 1e30;
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s: max err / max ref = %.3e (max ref %.3g), unwritten/non-finite %ld, padded rows "
                "written %ld", what.c_str(), rel, max_ref, bad_written, bad_pad);
  const bool ok = rel <= tol && bad_written == 0 && bad_pad == 0 && max_ref > 0;
  report(ok, buf);
  if (ok) return;
  // The first few bad entries, to tell a permutation (descriptor / fragment mapping) from noise or unwritten tiles.
  int shown = 0;
  for (int e : experts)
    for (int t = 0; t < kT && shown < 8; ++t)
      for (int c = 0; c < ld && shown < 8; ++c) {
        const size_t i = (size_t(e) * kT + t) * ld + c;
        const bool pad = t >= counts[size_t(e)];
        if (pad ? !is_poison(out[i]) : !(std::fabs(val(out[i]) - ref[i]) <= tol * max_ref)) {
          std::printf("    expert %d token %d col %d: out %.6g ref %.6g%s\n", e, t, c, val(out[i]), ref[i],
                      pad ? " (padded row written)" : "");
          ++shown;
        }
      }
}

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int dev = 0;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  std::printf("device %s, sm_%d%d, %d SMs, smem/block optin %zu\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount, size_t(prop.sharedMemPerBlockOptin));
  if (prop.major != 9 || prop.minor != 0) {
    std::printf("FAIL: needs an sm_90 (Hopper) GPU\n");
    return 1;
  }
  {
    CK(cudaHostAlloc(&h_diag, 8 * sizeof(int), cudaHostAllocMapped));
    std::memset(h_diag, 0, 8 * sizeof(int));
    int* d_diag = nullptr;
    CK(cudaHostGetDevicePointer(&d_diag, h_diag, 0));
    CK(cudaMemcpyToSymbol(g_diag, &d_diag, sizeof d_diag));
  }
  {
    cudaDriverEntryPointQueryResult q;
    void* fn = nullptr;
    CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || fn == nullptr) {
      std::printf("FAIL: cuTensorMapEncodeTiled not found\n");
      return 1;
    }
    g_encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }

  constexpr int NL = 3;  // layers of weights, rotated while timing (3 x 1.5 GB >> L2)
  const size_t wgu = size_t(kE) * 2 * kI * kH, wdn = size_t(kE) * kH * kI;
  const size_t nx = size_t(kE) * kT * kH, na = size_t(kE) * kT * kI;
  bf16 *Wg, *Wd, *X, *Ain, *act, *act2, *cub_bf;
  float *y, *y2, *cub_f;
  int32_t* dcounts;
  CK(cudaMalloc(&Wg, wgu * NL * sizeof(bf16)));
  CK(cudaMalloc(&Wd, wdn * NL * sizeof(bf16)));
  CK(cudaMalloc(&X, nx * sizeof(bf16)));
  CK(cudaMalloc(&Ain, na * sizeof(bf16)));
  CK(cudaMalloc(&act, na * sizeof(bf16)));
  CK(cudaMalloc(&act2, na * sizeof(bf16)));
  CK(cudaMalloc(&y, nx * sizeof(float)));
  CK(cudaMalloc(&y2, nx * sizeof(float)));
  CK(cudaMalloc(&cub_bf, size_t(kE) * kT * 2 * kI * sizeof(bf16)));
  CK(cudaMalloc(&cub_f, size_t(kE) * kT * std::max(2 * kI, kH) * sizeof(float)));
  CK(cudaMalloc(&dcounts, kE * sizeof(int32_t)));
  size_t ws_bytes = 64 << 20;
  void* ws;
  CK(cudaMalloc(&ws, ws_bytes));
  unsigned* sink;
  CK(cudaMalloc(&sink, sizeof(unsigned)));

  // Weights: uniform in +-scale with scale ~ 1/sqrt(K) * sqrt(3) so the gate/up pre-activations are O(1).
  for (int l = 0; l < NL; ++l) {
    fill_k<<<4096, 256>>>(Wg + l * wgu, wgu, 0x1234u + l, 0.033f);
    fill_k<<<4096, 256>>>(Wd + l * wdn, wdn, 0x9876u + l, 0.065f);
  }
  CK(cudaGetLastError());

  // Rows per expert: all 32, a single row, and random partial fills; padded token rows are zero (as the engine's
  // padded rows would be) but never read by the checks. All experts have >= 1 row so both paths read every weight.
  std::mt19937 rng(42);
  std::vector<int32_t> counts(kE);
  for (int e = 0; e < kE; ++e) counts[size_t(e)] = e % 4 == 0 ? kT : e % 7 == 1 ? 1 : 1 + int(rng() % kT);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<bf16> hx(nx), ha(na);
  for (int e = 0; e < kE; ++e)
    for (int t = 0; t < kT; ++t) {
      const bool valid = t < counts[size_t(e)];
      for (int k = 0; k < kH; ++k) hx[(size_t(e) * kT + t) * kH + k] = __float2bfloat16(valid ? u(rng) : 0.f);
      for (int k = 0; k < kI; ++k) ha[(size_t(e) * kT + t) * kI + k] = __float2bfloat16(valid ? u(rng) : 0.f);
    }
  CK(cudaMemcpy(X, hx.data(), nx * sizeof(bf16), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(Ain, ha.data(), na * sizeof(bf16), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dcounts, counts.data(), kE * sizeof(int32_t), cudaMemcpyHostToDevice));

  CUtensorMap mWg0[NL], mWd0[NL], pWg[2][NL], pWd[2][NL];  // pW*: L2 promotion none / 128 B
  CUtensorMap* mWg = mWg0;
  CUtensorMap* mWd = mWd0;
  for (int l = 0; l < NL; ++l) {
    mWg[l] = make_map(Wg + l * wgu, uint64_t(kE) * 2 * kI, kH, kBoxRows);
    mWd[l] = make_map(Wd + l * wdn, uint64_t(kE) * kH, kI, kBoxRows);
    for (int pr = 0; pr < 2; ++pr) {
      const auto promo = pr == 0 ? CU_TENSOR_MAP_L2_PROMOTION_NONE : CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
      pWg[pr][l] = make_map(Wg + l * wgu, uint64_t(kE) * 2 * kI, kH, kBoxRows, promo);
      pWd[pr][l] = make_map(Wd + l * wdn, uint64_t(kE) * kH, kI, kBoxRows, promo);
    }
  }
  const CUtensorMap mX = make_map(X, uint64_t(kE) * kT, kH, kT), mA = make_map(Ain, uint64_t(kE) * kT, kI, kT);
  bf16 *Wgt, *Wdt;
  CK(cudaMalloc(&Wgt, wgu * NL * sizeof(bf16)));
  CK(cudaMalloc(&Wdt, wdn * NL * sizeof(bf16)));
  CUtensorMap tWg[NL], tWd[NL];
  for (int l = 0; l < NL; ++l) {
    repack_k<true><<<4096, 256>>>(Wg + l * wgu, Wgt + l * wgu, kH);
    repack_k<false><<<4096, 256>>>(Wd + l * wdn, Wdt + l * wdn, kI);
    tWg[l] = make_map(Wgt + l * wgu, wgu / kBK, kBK, 128);
    tWd[l] = make_map(Wdt + l * wdn, wdn / kBK, kBK, 128);
  }
  CK(cudaGetLastError());

  // ---- references ----
  // (a) CPU, double accumulation, on sampled experts (full, single-row and partial ones), layer 0.
  const std::vector<int> sample = {0, 1, 5, 8, 63, 127};
  std::vector<double> ref_act(na, 0.0), ref_y(nx, 0.0);
  for (int e : sample) {
    const auto w = get(Wg + size_t(e) * 2 * kI * kH, size_t(2) * kI * kH);
    const auto wd = get(Wd + size_t(e) * kH * kI, size_t(kH) * kI);
    std::vector<float> wf(w.size()), wdf(wd.size());
    for (size_t i = 0; i < w.size(); ++i) wf[i] = bf(w[i]);
    for (size_t i = 0; i < wd.size(); ++i) wdf[i] = bf(wd[i]);
    for (int t = 0; t < counts[size_t(e)]; ++t) {
      const bf16* xr = &hx[(size_t(e) * kT + t) * kH];
      const bf16* ar = &ha[(size_t(e) * kT + t) * kI];
      std::vector<double> xd(kH), ad(kI);
      for (int k = 0; k < kH; ++k) xd[size_t(k)] = bf(xr[k]);
      for (int k = 0; k < kI; ++k) ad[size_t(k)] = bf(ar[k]);
      for (int n = 0; n < kI; ++n) {
        double g = 0, up = 0;
        const float* wgr = &wf[size_t(n) * kH];
        const float* wur = &wf[size_t(kI + n) * kH];
        for (int k = 0; k < kH; ++k) g += xd[size_t(k)] * wgr[k], up += xd[size_t(k)] * wur[k];
        ref_act[(size_t(e) * kT + t) * kI + n] = gelu_d(g) * up;
      }
      for (int n = 0; n < kH; ++n) {
        double s = 0;
        const float* wr = &wdf[size_t(n) * kI];
        for (int k = 0; k < kI; ++k) s += ad[size_t(k)] * wr[k];
        ref_y[(size_t(e) * kT + t) * kH + n] = s;
      }
    }
  }
  // (b) cuBLASLt with f32 output on every expert (layer 0): act from its gate/up in double, y as is.
  cublasLtHandle_t h;
  CK(cublasLtCreate(&h));
  Lt gu_f, gu_bf, dn_f;
  gu_f.init(h, 2 * kI, kT, kH, CUDA_R_32F, ws_bytes);
  gu_bf.init(h, 2 * kI, kT, kH, CUDA_R_16BF, ws_bytes);  // the production configuration (bf16 out), timed
  dn_f.init(h, kH, kT, kI, CUDA_R_32F, ws_bytes);
  std::vector<int> all_experts(kE);
  for (int e = 0; e < kE; ++e) all_experts[size_t(e)] = e;
  std::vector<double> cub_act(na), cub_y(nx);
  {
    CK(gu_f.run(h, Wg, X, cub_f, 0, ws, ws_bytes));
    CK(cudaDeviceSynchronize());
    const auto c = get(cub_f, size_t(kE) * kT * 2 * kI);
    for (size_t row = 0; row < size_t(kE) * kT; ++row)
      for (int n = 0; n < kI; ++n)
        cub_act[row * kI + n] = gelu_d(c[row * 2 * kI + n]) * double(c[row * 2 * kI + kI + n]);
    CK(dn_f.run(h, Wd, Ain, cub_f, 0, ws, ws_bytes));
    CK(cudaDeviceSynchronize());
    const auto d = get(cub_f, nx);
    for (size_t i = 0; i < nx; ++i) cub_y[i] = d[i];
  }
  // The references agree with each other (sanity of the harness itself).
  {
    double m = 0, err = 0, my = 0, erry = 0;
    for (int e : sample)
      for (int t = 0; t < counts[size_t(e)]; ++t) {
        for (int n = 0; n < kI; ++n) {
          const size_t i = (size_t(e) * kT + t) * kI + n;
          m = std::max(m, std::fabs(ref_act[i])), err = std::max(err, std::fabs(ref_act[i] - cub_act[i]));
        }
        for (int n = 0; n < kH; ++n) {
          const size_t i = (size_t(e) * kT + t) * kH + n;
          my = std::max(my, std::fabs(ref_y[i])), erry = std::max(erry, std::fabs(ref_y[i] - cub_y[i]));
        }
      }
    char buf[160];
    std::snprintf(buf, sizeof buf, "harness: cuBLASLt vs CPU reference, act %.3e, y %.3e (rel to max)", err / m,
                  erry / my);
    report(err / m <= 1e-2 && erry / my <= 1e-2, buf);
  }

  // ---- variants: check, determinism, time ----
  std::vector<Variant> vars;
  for (Variant v : {variant<4>(false), variant<10>(false), variant<4>(true), variant<4, true>(false),
                    variant<3, true>(false), variant<5, true>(false), variant<8, true>(false), variant<10, true>(false),
                    variant<4, true>(true), variant<5, true>(true), variant<10, true>(true),
                    variant<4, false, 1>(true), variant<4, false, 2>(true), variant<4, false, 3>(true),
                    variant<4, true, 1>(true), variant<4, false, 4>(true), variant<4, false, 0>(true, 1),
                    variant<4, false, 0>(true, 0), variant<4, false, 4>(true, 0), variant<4, false, 4>(true, 1),
                    variant<3>(true), variant<5>(true)})
    if (argc < 2 || v.name.find(argv[1]) != std::string::npos) vars.push_back(v);  // optional name filter
  const int tiles_gu = kE * (kI / 64), tiles_dn = kE * (kH / 128);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto time_it = [&](auto&& fn) {  // median of 20, rotating layers; 3 warm-up runs
    for (int r = 0; r < 3; ++r) fn(r % NL);
    CK(cudaDeviceSynchronize());
    std::vector<float> ts;
    for (int r = 0; r < 20; ++r) {
      CK(cudaEventRecord(e0));
      fn(r % NL);
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      ts.push_back(ms);
    }
    CK(cudaGetLastError());
    return median(ts);
  };
  const double gu_bytes = double(wgu) * 2, dn_bytes = double(wdn) * 2;  // weight bytes per layer (as batched_bench)
  struct Row {
    std::string name;
    double gu_ms, dn_ms;
  };
  std::vector<Row> rows;

  for (const Variant& v : vars) {
    const CUtensorMap* mWg = v.tiled ? tWg : v.promo < 2 ? pWg[v.promo] : mWg0;
    const CUtensorMap* mWd = v.tiled ? tWd : v.promo < 2 ? pWd[v.promo] : mWd0;
    const int grid_gu = v.persistent ? std::min(tiles_gu, v.occ_gu * prop.multiProcessorCount) : tiles_gu;
    const int grid_dn = v.persistent ? std::min(tiles_dn, v.occ_dn * prop.multiProcessorCount) : tiles_dn;
    std::printf("--- %s: %d stages, %d KB smem/block, blocks/SM gate_up %d down %d, grid %d / %d, in flight/SM "
                "%d KB\n",
                v.name.c_str(), v.stages, smem_bytes(v.stages) / 1024, v.occ_gu, v.occ_dn, grid_gu, grid_dn,
                v.occ_gu * v.stages * kStageBytes / 1024);
    if (v.occ_gu < 1 || v.occ_dn < 1) {
      report(false, v.name + ": does not fit on an SM");
      continue;
    }
    // Correctness, layer 0: poison, run, check; run again into a second poisoned buffer, compare bitwise.
    if (v.probe != 0 || v.promo != 2) {  // timing only
      rows.push_back({v.name, time_it([&](int l) { v.gu(mWg[l], mX, dcounts, grid_gu, act, nullptr); }),
                      time_it([&](int l) { v.dn(mWd[l], mA, dcounts, grid_dn, nullptr, y); })});
      continue;
    }
    CK(cudaMemset(act, 0xFF, na * sizeof(bf16)));
    CK(cudaMemset(act2, 0xFF, na * sizeof(bf16)));
    CK(cudaMemset(y, 0xFF, nx * sizeof(float)));
    CK(cudaMemset(y2, 0xFF, nx * sizeof(float)));
    v.gu(mWg[0], mX, dcounts, grid_gu, act, nullptr);
    CK(cudaGetLastError());
    v.gu(mWg[0], mX, dcounts, grid_gu, act2, nullptr);
    CK(cudaGetLastError());
    v.dn(mWd[0], mA, dcounts, grid_dn, nullptr, y);
    CK(cudaGetLastError());
    v.dn(mWd[0], mA, dcounts, grid_dn, nullptr, y2);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    const auto ha1 = get(act, na), ha2 = get(act2, na);
    const auto hy1 = get(y, nx), hy2 = get(y2, nx);
    check_out(v.name + " gate_up vs CPU double (sampled experts)", ha1, ref_act, sample, counts, kI, 1e-2);
    check_out(v.name + " gate_up vs cuBLASLt (all experts)", ha1, cub_act, all_experts, counts, kI, 1e-2);
    check_out(v.name + " down vs CPU double (sampled experts)", hy1, ref_y, sample, counts, kH, 1e-2);
    check_out(v.name + " down vs cuBLASLt (all experts)", hy1, cub_y, all_experts, counts, kH, 1e-2);
    report(std::memcmp(ha1.data(), ha2.data(), na * sizeof(bf16)) == 0, v.name + " gate_up bitwise deterministic");
    report(std::memcmp(hy1.data(), hy2.data(), nx * sizeof(float)) == 0, v.name + " down bitwise deterministic");

    const double tg = time_it([&](int l) { v.gu(mWg[l], mX, dcounts, grid_gu, act, nullptr); });
    const double td = time_it([&](int l) { v.dn(mWd[l], mA, dcounts, grid_dn, nullptr, y); });
    rows.push_back({v.name, tg, td});
  }

  // Skipping empty experts: expert 3 with 0 rows must be left untouched and every other output unchanged.
  if (!vars.empty() && vars[0].probe == 0) {
    const Variant& v = vars[0];
    std::vector<int32_t> c2 = counts;
    c2[3] = 0;
    auto run_with = [&](const std::vector<int32_t>& c, bf16* a, float* yy) {  // poisoned outputs, then both GEMMs
      CK(cudaMemcpy(dcounts, c.data(), kE * sizeof(int32_t), cudaMemcpyHostToDevice));
      CK(cudaMemset(a, 0xFF, na * sizeof(bf16)));
      CK(cudaMemset(yy, 0xFF, nx * sizeof(float)));
      v.gu(mWg[0], mX, dcounts, tiles_gu, a, nullptr);
      v.dn(mWd[0], mA, dcounts, tiles_dn, nullptr, yy);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
    };
    run_with(c2, act2, y2);
    run_with(counts, act, y);
    const auto a1 = get(act, na), a2 = get(act2, na);
    const auto y1 = get(y, nx), yy2 = get(y2, nx);
    bool ok = true;
    for (int e = 0; e < kE; ++e) {
      const size_t ra = size_t(e) * kT * kI, ry = size_t(e) * kT * kH;
      if (e == 3) {
        for (size_t i = 0; i < size_t(kT) * kI; ++i) ok &= is_poison(a2[ra + i]);
        for (size_t i = 0; i < size_t(kT) * kH; ++i) ok &= is_poison(yy2[ry + i]);
      } else {
        ok &= std::memcmp(&a1[ra], &a2[ra], size_t(kT) * kI * sizeof(bf16)) == 0;
        ok &= std::memcmp(&y1[ry], &yy2[ry], size_t(kT) * kH * sizeof(float)) == 0;
      }
    }
    report(ok, vars[0].name + " expert with 0 rows skipped, others unchanged");
  }

  // ---- cuBLASLt and plain-read timings ----
  auto time_lt = [&](const Lt& lt, const bf16* Wbase, size_t wl, const bf16* B, void* C, double bytes,
                     const char* what) {
    double best = 1e30, first = -1;
    int bi = -1;
    for (int a = 0; a < lt.found; ++a) {
      if (lt.run(h, Wbase, B, C, a, ws, ws_bytes) != 0) continue;
      const double ms = time_it([&](int l) { lt.run(h, Wbase + l * wl, B, C, a, ws, ws_bytes); });
      if (first < 0) first = ms;
      if (ms < best) best = ms, bi = a;
    }
    if (bi < 0) {
      report(false, std::string("cuBLASLt ") + what + ": no algorithm ran");
      return 1e30;
    }
    std::printf("cuBLASLt %-8s algos %d  #0 %.4f ms (%.2f TB/s)  best #%d %.4f ms (%.2f TB/s)\n", what, lt.found,
                first, bytes / first / 1e9, bi, best, bytes / best / 1e9);
    return best;
  };
  const double lt_gu = time_lt(gu_bf, Wg, wgu, X, cub_bf, gu_bytes, "gate_up");
  const double lt_dn = time_lt(dn_f, Wd, wdn, Ain, cub_f, dn_bytes, "down");
  {
    const size_t n16 = (wgu * NL * sizeof(bf16)) / 16;
    const double ms = time_it([&](int) { read_k<<<prop.multiProcessorCount * 8, 512>>>((const uint4*)Wg, n16, sink); });
    std::printf("plain read of %.2f GB: %.4f ms (%.2f TB/s)\n", n16 * 16 / 1e9, ms, n16 * 16 / ms / 1e9);
    const size_t l16 = (wgu * sizeof(bf16)) / 16, d16 = (wdn * sizeof(bf16)) / 16;
    const double ml = time_it([&](int l) { read_k<<<prop.multiProcessorCount * 8, 512>>>((const uint4*)(Wg + l * wgu), l16, sink); });
    std::printf("plain read of one gate_up layer %.3f GB: %.4f ms (%.2f TB/s)\n", l16 * 16 / 1e9, ml, l16 * 16 / ml / 1e9);
    const double md = time_it([&](int l) { read_k<<<prop.multiProcessorCount * 8, 512>>>((const uint4*)(Wd + l * wdn), d16, sink); });
    std::printf("plain read of one down layer %.3f GB: %.4f ms (%.2f TB/s)\n", d16 * 16 / 1e9, md, d16 * 16 / md / 1e9);
  }

  std::printf("\n%-14s %12s %9s %12s %9s\n", "variant", "gate_up ms", "TB/s", "down ms", "TB/s");
  std::printf("%-14s %12.4f %9.2f %12.4f %9.2f\n", "cuBLASLt best", lt_gu, gu_bytes / lt_gu / 1e9, lt_dn,
              dn_bytes / lt_dn / 1e9);
  for (const Row& r : rows)
    std::printf("%-14s %12.4f %9.2f %12.4f %9.2f\n", r.name.c_str(), r.gu_ms, gu_bytes / r.gu_ms / 1e9, r.dn_ms,
                dn_bytes / r.dn_ms / 1e9);
  if (g_fail == 0) std::printf("ALL PASS\n");
  else std::printf("FAILED %d checks\n", g_fail);
  return g_fail == 0 ? 0 : 1;
}
