// Hopper (sm_90a) dense GEMM for canvas-sized passes (T <= 256 token rows): the sliding layers' qkv projection and
// every layer's o_proj, as split-K f32 partial sums that the next kernel (qkv_norm_rope, add_rms_norm_pre_ffn) adds
// up in a fixed order while it reads them. Why not cuBLASLt: its kernels cannot be launched with programmatic
// dependent launch, so each of these GEMMs started only after its predecessor had drained and then ramped its
// weight stream from nothing (qkv 20.7 us in the step for 19.0 alone, o_proj 14.5 for 11.0; session 15 profile).
// Here the producer requests its first stages' weights (constants) before griddepcontrol.wait, so the launch and
// the ring's ramp overlap the predecessor's tail.
//
// A block (288 threads) computes a tile of 128 weight rows x all 256 token columns over one k range: warps 0-7 are
// two consumer warpgroups, each issuing wgmma.m64n256k16 in the "swap AB" form (64 weight rows are the M side, the
// tokens the N side: 128 f32 accumulators a thread); warp 8 is the producer, one thread issuing TMA loads into a
// 4-stage mbarrier ring (a stage: the 128 x 64 weight box, 16 KB, and the 256 x 64 token box, 32 KB; 128-byte
// swizzle). The token box is the same for every block of a split: with clusters of CL = 2 blocks (adjacent weight
// tiles, the same k range) each block loads half of it and multicasts it to both, which halves the token traffic
// from L2. Grid: (N / 128) x splits blocks in one wave. Every output element is one block's fixed-order sum, and
// the readers add the splits in order: bitwise deterministic.
//
// Status (H200, session 16, bench-kernels; docs/PERFORMANCE.md): slower than cuBLASLt, so CudaOptions::dense_tma is
// off. qkv (sliding, 2 splits) 23.1 vs 19.8 us, o_proj 16.0 vs 14.0 (sliding), 22.8 vs 22.5 (full); clusters of 2
// 24.2 / 17.4 us. ncu of the qkv launch: the consumers wait on the full barriers (34% of stall samples) with DRAM at
// 43% and L2 at 64% of peak: the 4-stage ring (all the shared memory) does not keep enough of the stream in flight.
// L2 prefetch of the weights ahead of the ring and k rotation between tiles were slower. In the 4K step: 15.78 vs
// 15.59 ms (the PDL start does not make up for it). What it would take: more bytes in flight per SM (cluster
// multicast that does not lockstep the pair, or a deeper ring of narrower k slices); then the q/k norm + rope could
// move into the qkv epilogue (a tile of 128 weight rows is half a head of 256).
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/cuda_util.cuh"
#include "backend/cuda/hopper_tma.cuh"
#include "backend/cuda/launch.cuh"

namespace dg::cuda {

namespace {

constexpr int kBK = 64;                         // k per stage: 64 bf16 = one 128-byte swizzle row
constexpr int kWRows = 128;                     // weight rows a block (two consumer warpgroups of 64)
constexpr int kTok = 256;                       // token columns (wgmma N)
constexpr int kWBytes = kWRows * kBK * 2;       // 16384
constexpr int kXBytes = kTok * kBK * 2;         // 32768
constexpr int kStageBytes = kWBytes + kXBytes;  // 49152
constexpr int kStages = 4;
constexpr int kThreads = 288;
constexpr int kSmemBytes = 1024 + kStages * kStageBytes + kStages * 16;
static_assert(kWBytes % 1024 == 0 && kXBytes % 1024 == 0, "128B-swizzled boxes need 1024-byte alignment");
static_assert(2 * kTok * (64 + 4) * 4 <= kStages * kStageBytes, "the epilogue's staged tile fits the ring");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DG_DENSE_TMA 1
using namespace hopper;
#endif

// part[(split T + t) N + n] = sum over k in the split's range of x[t][k] w[n][k] (t < T). tmW: W [N, K], box {64,
// 128}; tmX: X [T, K], box {64, 256 / CL} (rows past T zero-filled by the TMA unit).
template <int CL>
__global__ void __launch_bounds__(kThreads, 1)
    dense_tma_k(const __grid_constant__ CUtensorMap tmW, const __grid_constant__ CUtensorMap tmX, int T, int N, int K,
                int splits, float* __restrict__ part) {
#if defined(DG_DENSE_TMA)
  const int n_tiles = N / kWRows, tile = int(blockIdx.x) % n_tiles, split = int(blockIdx.x) / n_tiles;
  const int nkb = K / kBK, kb0 = split * nkb / splits, kb1 = (split + 1) * nkb / splits, nk = kb1 - kb0;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t full0 = base + kStages * kStageBytes, empty0 = full0 + 8 * kStages;
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  const uint32_t rank = CL > 1 ? cluster_ctarank() : 0u;

  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full0 + 8 * s, 1);            // the producer's arrive.expect_tx; then the stage's bytes
      mbar_init(empty0 + 8 * s, 8 * CL);      // every consumer warp of every block of the cluster
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if constexpr (CL > 1) cluster_sync();  // the peer's barriers exist before any multicast or remote arrive
  else __syncthreads();
  // The successor (the kernel reading the partials) may be scheduled now; its griddepcontrol.wait still waits for
  // this grid to complete. It reads only constants before that wait.
  pdl_trigger();

  if (warp == 8) {
    if (lane == 0) {
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tmW)) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tmX)) : "memory");
      uint64_t evict_first, evict_last;  // weights: read once a pass; tokens: re-read by every block of the split
      asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(evict_first));
      asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(evict_last));
      // Before griddepcontrol.wait: the first stages' weight boxes only (constants), each after ONE arrive.expect_tx
      // of the whole stage, so that no phase can complete before the token box (issued after the wait) has landed
      // too. With CL > 1 the peer's half of the token box lands on this block's barrier as well; its bytes are part
      // of kStageBytes, and a complete_tx that comes before this block's expect_tx only makes the count negative for
      // a while (the phase still needs this block's arrival).
      const int npre = nk < kStages ? nk : kStages;
      for (int kt = 0; kt < npre; ++kt) {
        mbar_arrive_expect_tx(full0 + 8 * kt, kStageBytes);
        tma_load_2d(base + uint32_t(kt) * kStageBytes, &tmW, (kb0 + kt) * kBK, tile * kWRows, full0 + 8 * kt,
                    evict_first);
      }
      pdl_wait();  // the token rows (the predecessor's output) are final now
      for (int kt = 0; kt < nk; ++kt) {
        const int s = kt % kStages;
        const uint32_t st = base + uint32_t(s) * kStageBytes, full = full0 + 8 * s;
        if (kt >= npre) {
          // every consumer warp of the cluster is done with this stage's previous round (its token box is written
          // into the peer's ring as well)
          mbar_wait(empty0 + 8 * s, ((kt / kStages) & 1u) ^ 1u);
          mbar_arrive_expect_tx(full, kStageBytes);
          tma_load_2d(st, &tmW, (kb0 + kt) * kBK, tile * kWRows, full, evict_first);
        }
        if constexpr (CL > 1) {
          constexpr int kHalf = kTok / CL;
          tma_load_2d_multicast(st + kWBytes + rank * uint32_t(kHalf * kBK * 2), &tmX, (kb0 + kt) * kBK,
                                int(rank) * kHalf, full, uint16_t((1u << CL) - 1u), evict_last);
        } else {
          tma_load_2d(st + kWBytes, &tmX, (kb0 + kt) * kBK, 0, full, evict_last);
        }
      }
    }
    __syncwarp();  // the warp reconverges before the cluster barrier (.aligned)
  } else {
    const int g = warp >> 2;  // consumer warpgroup: weight rows 64 g .. 64 g + 63 of the tile
    float d[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = 0.f;
    for (int kt = 0; kt < nk; ++kt) {
      const int s = kt % kStages;
      mbar_wait(full0 + 8 * s, (kt / kStages) & 1u);
      const uint32_t st = base + uint32_t(s) * kStageBytes;
      const uint64_t da = desc_sw128(st + uint32_t(g) * (kWBytes / 2)), dx = desc_sw128(st + kWBytes);
      fence_acc(d);
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int j = 0; j < kBK / 16; ++j) wgmma_m64n256k16(d, da + 2 * j, dx + 2 * j);
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      // One stage of math in flight: the previous stage's wgmmas are done once at most this one is pending.
      asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
      fence_acc(d);
      if (kt > 0 && lane == 0) {
        const uint32_t prev = empty0 + 8 * uint32_t((kt - 1) % kStages);
        if constexpr (CL == 1) {
          mbar_arrive(prev);
        } else {
#pragma unroll
          for (int c = 0; c < CL; ++c) mbar_arrive_cluster(prev, uint32_t(c));
        }
      }
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    fence_acc(d);
    // (The last stage is not released: nothing loads into it again.)
    // The tile goes out through shared memory, so that each token's 64 outputs of a warpgroup leave as 256
    // contiguous bytes (the fragments hold 8 consecutive outputs of 4 tokens a warp store). The ring is free once
    // both warpgroups' last wgmma has read it (named barrier 1: the 256 consumer threads).
    asm volatile("bar.sync 1, 256;" ::: "memory");
    // Fragment of thread (warp w of the warpgroup, lane l): d[4j + 2i + c] = D[row 16w + l/4 + 8i][token 8j +
    // 2(l%4) + c], rows being weight rows (output columns n), tokens the output rows. Staged as [token][64 + 4]
    // floats (the padding spreads a warp's 32 stores over 32 banks).
    constexpr int kLd = 64 + 4;
    float* const stage = reinterpret_cast<float*>(smem_raw + (base - smem_u32(smem_raw))) + g * kTok * kLd;
    const int r0 = (warp & 3) * 16 + (lane >> 2), t0 = (lane & 3) * 2;
#pragma unroll
    for (int j = 0; j < 32; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        stage[(8 * j + t0 + c) * kLd + r0] = d[4 * j + c];
        stage[(8 * j + t0 + c) * kLd + r0 + 8] = d[4 * j + 2 + c];
      }
    asm volatile("bar.sync %0, 128;" ::"r"(2 + g) : "memory");  // this warpgroup's tile is staged
    pdl_wait();  // nothing of this grid's predecessor is overwritten before it has completed (part is scratch)
    float* const out = part + size_t(split) * size_t(T) * size_t(N) + size_t(tile) * kWRows + g * 64;
    const int tid = int(threadIdx.x) & 127;
    for (int i = tid; i < T * 16; i += 128) {  // 16 float4 a token row of 64 outputs
      const int tok = i >> 4, q = i & 15;
      reinterpret_cast<float4*>(out + size_t(tok) * N)[q] = *reinterpret_cast<const float4*>(stage + tok * kLd + 4 * q);
    }
  }
  // No block leaves while its peer may still multicast into it or arrive on its barriers.
  if constexpr (CL > 1) cluster_sync();
#endif
}

// Sets the kernel's shared memory; max_resident: the blocks (CL 1) or clusters that can be resident at once.
template <int CL>
bool configure(int& max_resident) {
  auto* k = dense_tma_k<CL>;
  if (!sm90a_image_of(k)) return false;
  CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  if (CL == 1) {
    max_resident = sm_count();  // one block an SM (its shared memory)
    return true;
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(CL * 64));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = kSmemBytes;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeClusterDimension;
  at[0].val.clusterDim.x = unsigned(CL), at[0].val.clusterDim.y = 1, at[0].val.clusterDim.z = 1;
  cfg.attrs = at, cfg.numAttrs = 1;
  int n = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, k, &cfg));
  max_resident = n;
  return n > 0;
}

struct DenseTmaSupport {
  bool ok1 = false, ok2 = false;
  int clusters1 = 0, clusters2 = 0;  // blocks (CL 1) / clusters of 2 that can be resident at once
};
const DenseTmaSupport& support() {
  static const DenseTmaSupport s = [] {
    DenseTmaSupport r;
    r.ok1 = configure<1>(r.clusters1);
    r.ok2 = r.ok1 && configure<2>(r.clusters2);
    return r;
  }();
  return s;
}

}  // namespace

bool dense_tma_supported(int T, int N, int K) {
  if (T < 1 || T > kTok || N < kWRows || N % (2 * kWRows) != 0 || K < kBK || K % kBK != 0) return false;
  return support().ok1;
}

int dense_tma_cluster(int cluster) { return cluster == 2 && support().ok2 ? 2 : 1; }

int dense_tma_splits(int N, int K, int cluster) {
  const DenseTmaSupport& sp = support();
  const int cl = dense_tma_cluster(cluster), tiles = N / kWRows;
  const int resident = cl == 2 ? 2 * sp.clusters2 : sp.clusters1;  // blocks in one wave
  int splits = std::max(1, resident / std::max(tiles, 1));
  return std::min(splits, K / kBK);
}

void dense_tma_splitk(const TmaMap& w, const TmaMap& x, int T, int N, int K, int splits, int cluster, float* part,
                      cudaStream_t s) {
  char msg[200];
  if (!dense_tma_supported(T, N, K) || splits < 1 || splits > K / kBK) {
    std::snprintf(msg, sizeof msg,
                  "T %d must be in [1, 256], N %d a multiple of 256, K %d of 64, splits %d in [1, K / 64]; or no "
                  "sm_90a image",
                  T, N, K, splits);
    throw_cuda_error("dense_tma_splitk", msg, 0, __FILE__, __LINE__);
  }
  const int cl = dense_tma_cluster(cluster);
  CUtensorMap mw, mx;
  std::memcpy(&mw, &w, sizeof mw);
  std::memcpy(&mx, &x, sizeof mx);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(N / kWRows * splits));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = kSmemBytes;
  cfg.stream = s;
  cudaLaunchAttribute at[2];
  int na = 0;
  if (pdl_enabled()) {
    at[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[na].val.programmaticStreamSerializationAllowed = 1;
    ++na;
  }
  if (cl > 1) {
    at[na].id = cudaLaunchAttributeClusterDimension;
    at[na].val.clusterDim.x = unsigned(cl), at[na].val.clusterDim.y = 1, at[na].val.clusterDim.z = 1;
    ++na;
  }
  cfg.attrs = at, cfg.numAttrs = unsigned(na);
  if (cl == 2)
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, dense_tma_k<2>, mw, mx, T, N, K, splits, part));
  else
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, dense_tma_k<1>, mw, mx, T, N, K, splits, part));
}

TmaMap dense_tma_weight_map(const bf16* w, int N, int K) { return tma_map_bf16_rows(w, N, K, kWRows); }
TmaMap dense_tma_token_map(const bf16* x, int T, int K, int cluster) {
  return tma_map_bf16_rows(x, T, K, kTok / dense_tma_cluster(cluster));
}

}  // namespace dg::cuda
