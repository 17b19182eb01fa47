// Grouped expert GEMMs on tensor cores (bf16, f32 accumulate) with the GELU-tanh gate fused into the gate_up
// epilogue. Rows arrive grouped by expert (kernels_moe.cu moe_group).
//
// Two kernels, picked by the average rows per expert (kStreamMinAvgRows):
// - moe_tiled_k (decode, ~16 rows per expert at L = 256 top-8 of 128): WMMA 64x128x64 tiles, one block per
//   (n-tile, expert), a 4-stage cp.async ring, 2 blocks per SM. It reads every expert's weights each launch and is
//   memory-bound (~3.37 / 3.02 TB/s gate_up / down on the H200, 2026-11-30, tools/gpu/microbench/experts_bench.cu).
// - moe_stream_k (prefill, >= kStreamMinAvgRows rows per expert): the same tile and ring, but mma.sync m16n8k16 fed
//   by ldmatrix, M in 16-row fragments, the epilogue straight from the accumulator registers (each warp holds gate
//   columns and the matching up columns), and one cp.async ring that runs on across the 64-row m-tiles of its
//   item instead of draining per m-tile. At P = 32768 it is bit-identical to moe_tiled_k and ~8% (gate_up) / ~15%
//   (down) faster; at decode it is ~15% slower, hence the split.
// What did NOT help at decode (same bench, same day): making moe_stream_k persistent (grid = resident blocks
// walking a static item list, ring running across items: 1.2-2.7 TB/s), deeper rings (11 stages, 80 KB in flight
// per SM: slowest), rotating each item's k start to break lockstep. Per block, an iteration took ~1 us whatever the
// ring depth; throughput grew only with resident blocks. The next thing to try is taking the weight loads off the
// per-thread cp.async path (TMA bulk copies completing on an mbarrier, or register-direct loads).
// Tried next (same bench, 2026-11-30, not kept): (1) register-direct loads: each warp streams 16 weight rows with
// 16-byte ld.global.nc.L1::no_allocate straight into m16n8k16 B fragments (k permuted identically for A and B so one
// load is two mma steps' fragments), 4-12 chunks of 32 k in flight per warp, X of the expert in shared memory:
// gate_up 2.7-3.1 TB/s (worse), down 3.35-3.47 TB/s (3-7% better, not worth a third kernel); (2) repacking the
// expert weights so one warp's fragments of a 32-k chunk are 512 contiguous bytes: the tiled kernel fell to
// 2.88 / 2.80 TB/s and register-direct gained ~5%. Contiguity per row group is not what limits these kernels.
// Both kernels compute every output element in one block in a fixed k order (no atomics): deterministic.
#include <mma.h>

#include <algorithm>
#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/expert_layout.h"
#include "backend/cuda/launch.cuh"
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
// on the H200, docs/BENCHMARKS.md 2026-11-29.) Used for decode shapes; see the file header.
constexpr int kMoeStages = 4;
constexpr int kStageBytes = (GM + GN) * LDX * 2;
constexpr int kMoeSmem = kMoeStages * kStageBytes > GM * LDC * 4 ? kMoeStages * kStageBytes : GM * LDC * 4;

template <bool GATED>
// expert_list != null: the block column walks the listed experts (list[0] of them, ids list[1..]) with stride
// gridDim.y instead of taking expert blockIdx.y (the padded path's few overflow experts on a small grid).
// packed: W in the packed layout (expert_layout.h): a block's 128 weight rows x 64 k of a stage are then one packed
// stage, read chunk by chunk at expert_packed_in_stage.
__global__ void __launch_bounds__(kGemmThreads, 2) moe_tiled_k(const bf16* X, const int32_t* offsets, const bf16* W,
                                                              int N, int K, bf16* act, void* y, bool y_bf16,
                                                              const int32_t* expert_list, bool packed) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  extern __shared__ __align__(128) unsigned char smem[];
  float* Cs = reinterpret_cast<float*>(smem);  // epilogue only: aliases the drained stages
  const int tid = threadIdx.x, warp = tid >> 5;
  const int n0 = blockIdx.x * (GATED ? GN / 2 : GN);
  const int w_rows_total = GATED ? 2 * N : N;
  const int kvec = K / 8, nk = (K + GK - 1) / GK;
  constexpr int WV = GN * (GK / 8) / kGemmThreads;
  const int n_items = expert_list ? expert_list[0] : 1, step = expert_list ? int(gridDim.y) : 1;
  for (int item = expert_list ? int(blockIdx.y) : 0; item < n_items; item += step) {
    const int e = expert_list ? expert_list[1 + item] : int(blockIdx.y), start = offsets[e], end = offsets[e + 1];
    const bf16* We = W + size_t(e) * w_rows_total * K;

    for (int m0 = start; m0 < end; m0 += GM) {
      const int m_valid = min(GM, end - m0), m_rows = (m_valid + 15) & ~15;
      // One k-tile into stage st: X rows past m_valid (up to the 16-row fragment edge) and k past K are zero-filled;
      // X rows past that edge are never read by the MMAs and are not loaded.
      auto load_stage = [&](int st, int k0) {
        bf16* Xs = reinterpret_cast<bf16*>(smem + st * kStageBytes);
        bf16* Ws = Xs + GM * LDX;
        // packed: this block's tile is tile blockIdx.x of expert e (gridDim.x tiles an expert), slice k0 / 64
        const bf16* Wp = W + expert_packed_stage(size_t(e) * gridDim.x + blockIdx.x, K / GK, k0 / GK);
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
          const bf16* src = !ok       ? We
                            : packed ? Wp + expert_packed_in_stage(r, c * 8)
                                     : We + size_t(wr) * K + size_t(kc) * 8;
          cp_async16(Ws + r * LDX + c * 8, src, ok);
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
        if (mi * 16 < m_valid)
          wmma::store_matrix_sync(Cs + mi * 16 * LDC + warp * 16, acc[mi], LDC, wmma::mem_row_major);
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
          if (n0 + c < N) store_expert_row(y, y_bf16, size_t(m0 + r) * N + n0 + c, Cs[r * LDC + c]);
        }
      }
      __syncthreads();  // Cs is read before the next m-tile's loads overwrite it
    }
  }
}

// Above 48 KB of dynamic shared memory a kernel must opt in, once per kernel (and device; we use one).
template <bool GATED>
void raise_smem_limit() {
  static bool done = false;  // one flag per instantiation
  if (!done) {
    CUDA_CHECK(cudaFuncSetAttribute(moe_tiled_k<GATED>, cudaFuncAttributeMaxDynamicSharedMemorySize, kMoeSmem));
    done = true;
  }
}

// ---- streaming kernel (prefill shapes; persistent mode kept for the bench, see the file header) ----
// A block walks items blockIdx.x, blockIdx.x + gridDim.x, ... (item = expert * n-tiles + n-tile), each item's
// 64-row m-tiles, and each m-tile's k-tiles, as one stream of k-tiles through the cp.async ring.
constexpr int kStreamThreads = 256;  // 8 warps: 2 (32-row halves of the 64-row m-tile) x 4 (column groups)
constexpr int SM_ = 64;              // rows per m-tile

template <int GNI, int SK, int S>
struct StreamCfg {
  static constexpr int LD = SK + 8;  // padded row (elements): ldmatrix rows land in distinct banks
  static constexpr int kStage = (SM_ + GNI) * LD * 2;
  static constexpr int kRing = S * kStage;
  static int smem(int E) { return kRing + (E + 1) * 4; }
};

// GNI weight rows per item (GATED: GNI/2 gate rows n0.. and the matching GNI/2 up rows I + n0..; otherwise output
// columns n0..n0+GNI-1), SK-deep k-tiles, an S-stage ring. ROT: item i walks its k-tiles starting at i % nk
// (a fixed order per item, so still deterministic), so that blocks running in lockstep do not all read the same
// column of their weight rows at once.
template <bool GATED, int GNI, int SK, int S, bool ROT>
__global__ void __launch_bounds__(kStreamThreads, 1)
    moe_stream_k(const bf16* X, const int32_t* offsets, int E, const bf16* W, int N, int K, bf16* act, void* y,
                 bool y_bf16, bool packed) {
  using C = StreamCfg<GNI, SK, S>;
  constexpr int LD = C::LD, NF = GNI / 32, NO = GATED ? GNI / 2 : GNI;  // NF: n8 fragments per warp
  extern __shared__ __align__(128) unsigned char smem[];
  int* offs = reinterpret_cast<int*>(smem + C::kRing);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 2, wn = warp & 3;
  for (int i = tid; i <= E; i += kStreamThreads) offs[i] = offsets[i];
  __syncthreads();
  const int ntn = (N + NO - 1) / NO, items = E * ntn, kvec = K / 8, nk = (K + SK - 1) / SK;
  const int w_rows_total = GATED ? 2 * N : N;

  // A position in this block's stream of k-tiles: item (expert * ntn + n-tile), m-tile start row, k-tile.
  struct Cur {
    int item, m0, kt;
  };
  auto first = [&](int it) {  // first item >= it of this block's stride with rows
    while (it < items && offs[it / ntn + 1] == offs[it / ntn]) it += gridDim.x;
    return Cur{it, it < items ? offs[it / ntn] : 0, 0};
  };
  auto next = [&](Cur c) {
    if (++c.kt < nk) return c;
    c.kt = 0;
    c.m0 += SM_;
    if (c.m0 < offs[c.item / ntn + 1]) return c;
    return first(c.item + gridDim.x);
  };
  // Frame row (0..GNI-1 in the stage's W tile) of this warp's n8 fragment j.
  auto frow = [&](int j) {
    if (GATED) return (j < NF / 2 ? 0 : GNI / 2) + wn * (NF / 2) * 8 + (j % (NF / 2)) * 8;
    return wn * NF * 8 + j * 8;
  };

  auto load_stage = [&](int st, const Cur& c) {
    bf16* Xs = reinterpret_cast<bf16*>(smem + st * C::kStage);
    bf16* Ws = Xs + SM_ * LD;
    const int e = c.item / ntn, nt = c.item % ntn, m_valid = min(SM_, offs[e + 1] - c.m0);
    int kt = c.kt;
    if (ROT) {
      kt += c.item % nk;
      if (kt >= nk) kt -= nk;
    }
    const int m_rows = (m_valid + 15) & ~15, kc0 = kt * (SK / 8);
    const bf16* We = W + size_t(e) * w_rows_total * K;
    // packed (GNI 128, SK 64: launch_stream checks): the item's stage kt is packed stage item nk + kt
    const bf16* Wp = W + expert_packed_stage(size_t(c.item), nk, kt);
    for (int i = tid; i < m_rows * (SK / 8); i += kStreamThreads) {
      const int r = i / (SK / 8), cc = i % (SK / 8), kc = kc0 + cc;
      const bool ok = r < m_valid && kc < kvec;
      cp_async16(Xs + r * LD + cc * 8, ok ? X + size_t(c.m0 + r) * K + size_t(kc) * 8 : X, ok);
    }
#pragma unroll
    for (int u = 0; u < GNI * (SK / 8) / kStreamThreads; ++u) {
      const int i = tid + u * kStreamThreads, r = i / (SK / 8), cc = i % (SK / 8), kc = kc0 + cc;
      int wr;
      bool ok;
      if (GATED) {
        const int col = nt * NO + (r % (GNI / 2));
        ok = col < N;
        wr = r < GNI / 2 ? col : N + col;
      } else {
        wr = nt * NO + r;
        ok = wr < N;
      }
      ok = ok && kc < kvec;
      const bf16* src = !ok       ? We
                        : packed ? Wp + expert_packed_in_stage(r, cc * 8)
                                 : We + size_t(wr) * K + size_t(kc) * 8;
      cp_async16(Ws + r * LD + cc * 8, src, ok);
    }
  };

  float acc[2][NF][4];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int j = 0; j < NF; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[mi][j][q] = 0.0f;

  Cur ld = first(blockIdx.x), cs = ld;
  // Every iteration commits one group (possibly empty), so "all but the newest S - 2 groups done" always means
  // "the tile about to be consumed has landed".
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (ld.item < items) {
      load_stage(st, ld);
      ld = next(ld);
    }
    cp_async_commit();
  }
  int st_c = 0, st_l = S - 1;
  while (cs.item < items) {
    cp_async_wait<S - 2>();
    __syncthreads();  // tile cs visible to all warps; stage st_l (consumed last iteration) is no longer read
    if (ld.item < items) {
      load_stage(st_l, ld);
      ld = next(ld);
    }
    cp_async_commit();
    st_l = st_l + 1 == S ? 0 : st_l + 1;

    const int e = cs.item / ntn, m_valid = min(SM_, offs[e + 1] - cs.m0);
    const bf16* Xs = reinterpret_cast<const bf16*>(smem + st_c * C::kStage);
    const bf16* Ws = Xs + SM_ * LD;
    st_c = st_c + 1 == S ? 0 : st_c + 1;
    if (wm * 32 < m_valid) {
      const bool two = wm * 32 + 16 < m_valid;
#pragma unroll
      for (int kk = 0; kk < SK; kk += 16) {
        uint32_t b[NF][2];
#pragma unroll
        for (int p = 0; p < NF / 2; ++p) {
          uint32_t t[4];
          ldsm_x4(t, smem_u32(Ws + (frow(2 * p + (lane >> 4)) + (lane & 7)) * LD + kk + ((lane >> 3) & 1) * 8));
          b[2 * p][0] = t[0], b[2 * p][1] = t[1], b[2 * p + 1][0] = t[2], b[2 * p + 1][1] = t[3];
        }
        uint32_t a[4];
        ldsm_x4(a, smem_u32(Xs + (wm * 32 + (lane & 15)) * LD + kk + (lane >> 4) * 8));
#pragma unroll
        for (int j = 0; j < NF; ++j) mma_bf16(acc[0][j], a, b[j][0], b[j][1]);
        if (two) {
          ldsm_x4(a, smem_u32(Xs + (wm * 32 + 16 + (lane & 15)) * LD + kk + (lane >> 4) * 8));
#pragma unroll
          for (int j = 0; j < NF; ++j) mma_bf16(acc[1][j], a, b[j][0], b[j][1]);
        }
      }
    }

    if (cs.kt == nk - 1) {  // epilogue from registers; the ring keeps streaming
      const int nt = cs.item % ntn;
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = wm * 32 + mi * 16 + h * 8 + (lane >> 2);
          if (r >= m_valid) continue;
          const size_t row = size_t(cs.m0 + r);
          if (GATED) {
#pragma unroll
            for (int j = 0; j < NF / 2; ++j) {
              const int col = nt * NO + wn * (NF / 2) * 8 + j * 8 + (lane & 3) * 2;
              const float v0 = gelu_tanh(acc[mi][j][2 * h]) * acc[mi][j + NF / 2][2 * h];
              const float v1 = gelu_tanh(acc[mi][j][2 * h + 1]) * acc[mi][j + NF / 2][2 * h + 1];
              if (col + 1 < N && (N & 1) == 0) {
                *reinterpret_cast<__nv_bfloat162*>(act + row * N + col) = __floats2bfloat162_rn(v0, v1);
              } else {
                if (col < N) act[row * N + col] = __float2bfloat16(v0);
                if (col + 1 < N) act[row * N + col + 1] = __float2bfloat16(v1);
              }
            }
          } else {
#pragma unroll
            for (int j = 0; j < NF; ++j) {
              const int col = nt * NO + wn * NF * 8 + j * 8 + (lane & 3) * 2;
              const float v0 = acc[mi][j][2 * h], v1 = acc[mi][j][2 * h + 1];
              const size_t o = row * N + col;
              if (col + 1 < N && (N & 1) == 0) {
                store_expert_row_pair(y, y_bf16, o, v0, v1);
              } else {
                if (col < N) store_expert_row(y, y_bf16, o, v0);
                if (col + 1 < N) store_expert_row(y, y_bf16, o + 1, v1);
              }
            }
          }
        }
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int j = 0; j < NF; ++j)
#pragma unroll
          for (int q = 0; q < 4; ++q) acc[mi][j][q] = 0.0f;
    }
    cs = next(cs);
  }
  cp_async_wait<0>();  // no copy may be in flight when the block exits
}

// PERSIST: grid = resident blocks (at most one per item), each walking many items; otherwise one block per item
// (what moe_gate_up / moe_down use).
template <bool GATED, int GNI, int SK, int S, bool ROT, bool PERSIST = true>
void launch_stream(const bf16* X, const int32_t* offsets, int E, const bf16* W, int N, int K, bf16* act, ExpertRows y,
                   cudaStream_t s, bool packed = false) {
  using C = StreamCfg<GNI, SK, S>;
  if (packed && (GNI != 128 || SK != 64))
    throw_cuda_error("moe_stream_k", "packed weights need 128-row x 64-k stages", 0, __FILE__, __LINE__);
  static int grid_per_sm = 0, n_sm = 0, smem_set = 0;  // one set per instantiation
  const int smem = C::smem(E);
  if (smem > smem_set) {
    CUDA_CHECK(cudaFuncSetAttribute(moe_stream_k<GATED, GNI, SK, S, ROT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    smem));
    n_sm = sm_count();
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&grid_per_sm, moe_stream_k<GATED, GNI, SK, S, ROT>,
                                                             kStreamThreads, smem));
    if (grid_per_sm < 1) throw_cuda_error("moe_stream_k", "does not fit on an SM", 0, __FILE__, __LINE__);
    smem_set = smem;
  }
  const int items = E * ((N + (GATED ? GNI / 2 : GNI) - 1) / (GATED ? GNI / 2 : GNI));
  const int grid = PERSIST ? std::min(items, grid_per_sm * n_sm) : items;
  moe_stream_k<GATED, GNI, SK, S, ROT>
      <<<grid, kStreamThreads, smem, s>>>(X, offsets, E, W, N, K, act, y.p, y.is_bf16, packed);
  CUDA_CHECK_LAUNCH();
}

// Measured on the H200 (tools/gpu/microbench/experts_bench.cu, 2026-11-30): 128 weight rows x 64 k per stage,
// 4 stages, one block per item, no k rotation.
constexpr int kStreamGNI = 128, kStreamSK = 64, kStreamStages = 4;
constexpr bool kStreamRot = false, kStreamPersist = false;
// Average rows per expert from which moe_stream_k is used (measured: faster at 256, slower at 16; between, untested).
constexpr int kStreamMinAvgRows = 64;

}  // namespace

// Here rather than beside the packing kernels (kernels_experts_tma.cu): the grouped kernels' microbench includes this
// file alone.
bool expert_gate_up_packable(int H, int I) { return H > 0 && I > 0 && H % 64 == 0 && I % 64 == 0; }
bool expert_down_packable(int H, int I) { return H > 0 && I > 0 && H % 128 == 0 && I % 64 == 0; }

// Block columns for an expert list: a few overflow experts of a few rows each (the padded path's M is twice the mean).
constexpr int kListBlocksY = 8;

void moe_gate_up(const bf16* xs, const int32_t* offsets, int E, int P, const bf16* Wgu, int H, int I, bf16* act,
                 cudaStream_t s, const int32_t* expert_list, bool packed) {
  if (P == 0) return;
  if (H % 8 != 0) throw_cuda_error("moe_gate_up", "hidden size must be a multiple of 8", 0, __FILE__, __LINE__);
  if (packed && !expert_gate_up_packable(H, I))
    throw_cuda_error("moe_gate_up", "packed weights need H and I multiples of 64", 0, __FILE__, __LINE__);
  if (!expert_list && P >= kStreamMinAvgRows * E) {
    launch_stream<true, kStreamGNI, kStreamSK, kStreamStages, kStreamRot, kStreamPersist>(xs, offsets, E, Wgu, I, H,
                                                                                          act, nullptr, s, packed);
    return;
  }
  // One block column per expert, or a few walking the expert list.
  const dim3 grid((I + GN / 2 - 1) / (GN / 2), expert_list ? std::min(E, kListBlocksY) : E);
  raise_smem_limit<true>();
  launch_pdl(moe_tiled_k<true>, dim3(grid), dim3(kGemmThreads), kMoeSmem, s, xs, offsets, Wgu, I, H, act, nullptr,
             false, expert_list, packed);
  CUDA_CHECK_LAUNCH();
}

void moe_down(const bf16* act, const int32_t* offsets, int E, int P, const bf16* Wd, int H, int I, ExpertRows y,
              cudaStream_t s, const int32_t* expert_list, bool packed) {
  if (P == 0) return;
  if (I % 8 != 0) throw_cuda_error("moe_down", "expert width must be a multiple of 8", 0, __FILE__, __LINE__);
  if (packed && !expert_down_packable(H, I))
    throw_cuda_error("moe_down", "packed weights need H a multiple of 128 and I of 64", 0, __FILE__, __LINE__);
  if (!expert_list && P >= kStreamMinAvgRows * E) {
    launch_stream<false, kStreamGNI, kStreamSK, kStreamStages, kStreamRot, kStreamPersist>(act, offsets, E, Wd, H, I,
                                                                                           nullptr, y, s, packed);
    return;
  }
  const dim3 grid((H + GN - 1) / GN, expert_list ? std::min(E, kListBlocksY) : E);
  raise_smem_limit<false>();
  launch_pdl(moe_tiled_k<false>, dim3(grid), dim3(kGemmThreads), kMoeSmem, s, act, offsets, Wd, H, I, nullptr, y.p,
             y.is_bf16, expert_list, packed);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dg::cuda
