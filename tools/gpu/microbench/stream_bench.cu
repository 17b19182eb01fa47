// Build (no GPU needed): the CMake target microbench_stream (it links the engine's CUDA library for its tensor maps).
//
// How fast can one layer's gate_up expert weights (128 x 1408 x 2816 bf16, 1.015 GB) be streamed into shared memory,
// by load mechanism, with no math? The TMA expert ring (kernels_experts_tma.cu) with its consumers reduced to "wait
// and free" measured ~5% behind a plain __ldcs read of the same bytes (docs/BENCHMARKS.md, session 8); this asks
// whether the gap is the TMA unit, the tile access pattern (64 rows x 128 B at a 5632 B stride per box), or the ring.
// Variants, all persistent blocks striding over the 1408 tiles of 44 k slices (a stage = one slice of the tile's 64
// gate + 64 up rows, 16 KB), consumers = 4 warps that wait for a stage and free it:
//   plain          grid-stride __ldcs of uint4 over the buffer (no shared memory): the reference rate
//   tma-sS-bB      one thread issues two 2D TMA boxes a stage (the engine's producer), S stages, B blocks an SM
//   ldgsts-pP-sS   P producer warps issue 16-byte cp.async.cg in the same tile pattern, each thread then
//                  cp.async.mbarrier.arrive.noinc on the stage's full barrier (no TMA unit)
//   ldgsts-contig  the same over contiguous 16 KB stages (stream order): the pattern without the stride
//   bulk-contig    one cp.async.bulk (1D, TMA unit, no tensor map) of 16 KB contiguous a stage
// RESULT (H200, 2026-11-30, session 10; docs/BENCHMARKS.md): plain 4.50-4.54 TB/s; tma 4.18-4.27 (every ring depth
// and occupancy); ldgsts 3.93 (one warp), 4.35 (4 warps, 2 blocks/SM), 4.46 (8 warps, 12 stages); ldgsts-contig 4.46;
// bulk-contig 4.46-4.49. So the 2D boxes themselves cost ~6%, not the rows' stride: the engine's gate_up weights are
// now stored packed (src/backend/cuda/expert_layout.h) and read by 1D bulk copies.
// Prints median ms of 20 and TB/s. The reads feed a sink the compiler cannot drop (the buffer is a constant, so no
// result is checked: this is a timing probe, not a kernel).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/hopper_tma.cuh"

#include "microbench_check.h"

using namespace dg::cuda::hopper;


namespace {

constexpr int kE = 128, kH = 2816, kI = 704;
constexpr int kRows = kE * 2 * kI;           // 180224 weight rows of kH bf16
constexpr int kTilesN = kI / 64, kTiles = kE * kTilesN, kNk = kH / 64;
constexpr int kStage = 16384;                // two 64 x 64 bf16 boxes
constexpr int kConsumerWarps = 4;

__global__ void plain_k(const uint4* __restrict__ p, size_t n16, unsigned* sink) {
  unsigned x = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    const uint4 a = __ldcs(p + i), b = __ldcs(p + i + stride), c = __ldcs(p + i + 2 * stride),
                d = __ldcs(p + i + 3 * stride);
    x ^= a.x ^ b.y ^ c.z ^ d.w;
  }
  for (; i < n16; i += stride) x ^= __ldcs(p + i).x;
  if (x == 0x12345678u) atomicAdd(sink, 1u);  // keeps the loads; practically never taken
}

enum Mode { kTma = 0, kLdgsts = 1, kLdgstsContig = 2, kBulkContig = 3 };

// Byte offset of 16-byte chunk c (0..1023) of stage (tile, kt): the tile pattern (box = c / 512, row, 16-byte column)
// or stream order.
__device__ __forceinline__ size_t chunk_offset(int mode, int tile, int kt, int c) {
  if (mode == kLdgstsContig || mode == kBulkContig) return (size_t(tile) * kNk + kt) * kStage + size_t(c) * 16;
  const int e = tile / kTilesN, nt = tile % kTilesN, box = c >> 9, row = (c >> 3) & 63, col = c & 7;
  const size_t r = size_t(e) * 2 * kI + nt * 64 + (box ? kI : 0) + row;
  return r * kH * 2 + size_t(kt) * 128 + col * 16;
}

template <int MODE, int STAGES, int PWARPS>
__global__ void __launch_bounds__(32 * (kConsumerWarps + PWARPS))
    ring_k(const __grid_constant__ CUtensorMap tm, const char* __restrict__ w, unsigned* sink) {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t full0 = base + STAGES * kStage, empty0 = full0 + 8 * STAGES;
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  constexpr int kProducers = MODE == kTma || MODE == kBulkContig ? 1 : 32 * PWARPS;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, kProducers);
      mbar_init(empty0 + 8 * s, kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp >= kConsumerWarps) {
    const int pt = int(threadIdx.x) - 32 * kConsumerWarps;  // producer thread
    if (kProducers == 1 && pt != 0) return;
    uint64_t evict_first = 0;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(evict_first));
    uint32_t it = 0;
    for (int tile = int(blockIdx.x); tile < kTiles; tile += int(gridDim.x)) {
      for (int kt = 0; kt < kNk; ++kt, ++it) {
        const int s = int(it % STAGES);
        mbar_wait(empty0 + 8 * s, ((it / STAGES) & 1u) ^ 1u);
        const uint32_t st = base + uint32_t(s) * kStage, full = full0 + 8 * s;
        if constexpr (MODE == kTma) {
          const int e = tile / kTilesN, nt = tile % kTilesN, row_a = e * 2 * kI + nt * 64;
          mbar_arrive_expect_tx(full, kStage);
          tma_load_2d(st, &tm, kt * 64, row_a, full, evict_first);
          tma_load_2d(st + kStage / 2, &tm, kt * 64, row_a + kI, full, evict_first);
        } else if constexpr (MODE == kBulkContig) {
          mbar_arrive_expect_tx(full, kStage);
          const char* src = w + chunk_offset(MODE, tile, kt, 0);
          bulk_load(st, src, kStage, full, evict_first);
        } else {
          for (int c = pt; c < kStage / 16; c += kProducers) {
            const char* src = w + chunk_offset(MODE, tile, kt, c);
            const uint32_t dst = st + uint32_t(c) * 16u;
            asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                         "l"(evict_first)
                         : "memory");
          }
          asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(full) : "memory");
        }
      }
    }
    if constexpr (kProducers > 1) asm volatile("cp.async.wait_all;" ::: "memory");
    return;
  }
  unsigned x = 0;
  uint32_t it = 0;
  for (int tile = int(blockIdx.x); tile < kTiles; tile += int(gridDim.x)) {
    for (int kt = 0; kt < kNk; ++kt, ++it) {
      const int s = int(it % STAGES);
      mbar_wait(full0 + 8 * s, (it / STAGES) & 1u);
      __syncwarp();
      if (MODE != kTma) x ^= ld_shared_s32(base + uint32_t(s) * kStage + uint32_t(warp * 128 + lane) * 4u);
      __syncwarp();
      if (lane == 0) mbar_arrive(empty0 + 8 * s);
    }
  }
  if (x == 0x12345678u) atomicAdd(sink, 1u);
}

// The engine's tensor map of these rows (tensor_map.cpp): 64 x 64 boxes, 128-byte swizzle, L2 promotion 256 B.
CUtensorMap make_map(const void* p) {
  const dg::cuda::TmaMap t = dg::cuda::tma_map_bf16_rows(static_cast<const dg::cuda::bf16*>(p), kRows, kH, 64, 256);
  CUtensorMap m;
  std::memcpy(&m, &t, sizeof m);
  return m;
}

template <class Launch>
float median_ms(Launch launch) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) launch();
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  std::vector<float> t;
  for (int i = 0; i < 20; ++i) {
    CK(cudaEventRecord(a));
    launch();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

const double kBytes = double(kRows) * kH * 2;

void report(const char* name, float ms) { std::printf("%-22s %.4f ms  %.3f TB/s\n", name, ms, kBytes / ms / 1e9); }

template <int MODE, int STAGES, int PWARPS>
void run_ring(const char* name, const CUtensorMap& tm, const char* w, unsigned* sink, int blocks_per_sm, int sms) {
  const int smem = 1024 + STAGES * kStage + 16 * STAGES;
  auto k = ring_k<MODE, STAGES, PWARPS>;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int occ = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, k, 32 * (kConsumerWarps + PWARPS), smem));
  const int bps = std::min(blocks_per_sm, occ);
  const float ms = median_ms([&] { k<<<bps * sms, 32 * (kConsumerWarps + PWARPS), smem>>>(tm, w, sink); });
  char label[64];
  std::snprintf(label, sizeof label, "%s (%d/SM)", name, bps);
  report(label, ms);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string filter = argc > 1 ? argv[1] : "";
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  char* w = nullptr;
  unsigned* sink = nullptr;
  CK(cudaMalloc(&w, size_t(kBytes)));
  CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(w, 0x3c, size_t(kBytes)));
  const CUtensorMap tm = make_map(w);
  std::printf("stream_bench: %.3f GB (one layer's gate_up weights), %d SMs\n", kBytes / 1e9, sms);
  auto want = [&](const char* n) { return filter.empty() || std::string(n).find(filter) != std::string::npos; };
  if (want("plain"))
    for (int bps : {8, 16}) {
      const float ms = median_ms([&] {
        plain_k<<<bps * sms, 256>>>(reinterpret_cast<const uint4*>(w), size_t(kBytes) / 16, sink);
      });
      char label[64];
      std::snprintf(label, sizeof label, "plain (%d x 256/SM)", bps);
      report(label, ms);
    }
  if (want("tma")) {
    run_ring<kTma, 4, 1>("tma-s4", tm, w, sink, 2, sms);
    run_ring<kTma, 6, 1>("tma-s6", tm, w, sink, 2, sms);
    run_ring<kTma, 8, 1>("tma-s8", tm, w, sink, 1, sms);
    run_ring<kTma, 12, 1>("tma-s12", tm, w, sink, 1, sms);
    run_ring<kTma, 3, 1>("tma-s3", tm, w, sink, 4, sms);
  }
  if (want("ldgsts")) {
    run_ring<kLdgsts, 4, 1>("ldgsts-p1-s4", tm, w, sink, 2, sms);
    run_ring<kLdgsts, 4, 4>("ldgsts-p4-s4", tm, w, sink, 2, sms);
    run_ring<kLdgsts, 6, 4>("ldgsts-p4-s6", tm, w, sink, 2, sms);
    run_ring<kLdgsts, 12, 8>("ldgsts-p8-s12", tm, w, sink, 1, sms);
    run_ring<kLdgstsContig, 4, 4>("ldgsts-contig-p4-s4", tm, w, sink, 2, sms);
  }
  if (want("bulk")) {
    run_ring<kBulkContig, 4, 1>("bulk-contig-s4", tm, w, sink, 2, sms);
    run_ring<kBulkContig, 8, 1>("bulk-contig-s8", tm, w, sink, 1, sms);
  }
  CK(cudaDeviceSynchronize());
  std::printf("stream_bench: done\n");
  return 0;
}
