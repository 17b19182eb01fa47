// Hopper (sm_90a) expert GEMMs for prefill chunks, on moe_group's grouped layout (expert e's rows [offsets[e],
// offsets[e + 1]) of xs, act and y): gate_up with act = bf16(gelu_tanh(gate) * up) formed in registers, and down (y).
// Why: a 4096-token chunk gives each expert ~256 token rows (top-8 of 128), where the grouped mma.sync kernels
// (kernels_experts.cu, moe_stream_k) reach ~140 TFLOP/s: gate_up 1.73-1.86 ms and down 0.92-0.98 ms a layer on the
// H200, ~80 ms of a 131 ms 4K prefill. These issue wgmma from a TMA-fed ring instead.
//
// A block (288 threads, one an SM) has two consumer warpgroups (warps 0-7) and a producer warp (8), one thread of
// which issues every load into a 4-stage mbarrier ring. An item is (expert e, weight tile nt, token tile j): the
// tile's 128 weight rows (gate_up: gate rows nt 64 .. + 63 and the matching up rows; down: rows nt 128 .. + 127, the
// tiles of the TMA expert kernels and of expert_layout.h's packed stages) against the expert's token rows j 256 ..
// j 256 + 255, warpgroup w taking rows j 256 + 128 w .. + 127. A stage is one 64-wide k slice: the weight rows (16
// KB: two 64-row TMA boxes, or the packed stage as one 1D bulk copy) and one or two 128-row token boxes (16 KB each).
// Each warpgroup issues wgmma in the "swap AB" form (weights the M side, its tokens the N side) as m64nNk16 with N =
// 128, 64 or 32 by its row count, so a short last tile does not pay for 128 columns; gate and up of one output
// element then sit in one thread. Token boxes may run past the expert's rows into the next expert's, or past P (zero
// filled by the TMA unit): those columns are computed and never stored (an output column depends only on its own
// token row). The ring runs on across items, so the next item's loads overlap this item's epilogue; each warpgroup
// keeps one slice's wgmmas in flight while it waits for the next.
//
// Items are numbered expert by expert, an expert's (nt, j) with j fastest, and blocks take them in order: the token
// tiles that share a weight tile run at the same time on neighbouring blocks (one DRAM read, the others from L2), and
// an expert's token rows are re-read from L2 by its weight tiles. With item counters, a block's producer claims its
// next item from a counter (its first is its block index) and hands each stage's item to the consumers beside the
// stage, so a block that starts late (its SM held by the dense MLP's GEMMs on the side stream) takes fewer items;
// without, blocks stride over the items. Every output element is one warpgroup's sum in a
// fixed k order: deterministic, though not bitwise the grouped kernels' (another f32 summation order).
#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstring>
#include <type_traits>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/cuda_util.cuh"
#include "backend/cuda/expert_items.h"
#include "backend/cuda/expert_layout.h"
#include "backend/cuda/hopper_tma.cuh"
#include "backend/cuda/launch.cuh"

namespace dg::cuda {

namespace {

constexpr int kBK = 64;                             // k per stage: 64 bf16 = one 128-byte swizzle row
constexpr int kTokWG = 128;                         // token rows of a warpgroup (its widest wgmma N)
[[maybe_unused]] constexpr int kTokItem = 2 * kTokWG;  // token rows of an item (device code only)
constexpr int kWBytes = 128 * kBK * 2;              // 16384: the weight tile's k slice (two 64-row halves)
constexpr int kXBytes = kTokWG * kBK * 2;           // 16384: a warpgroup's token box
constexpr int kStageBytes = kWBytes + 2 * kXBytes;  // 49152
constexpr int kStages = 4;
constexpr int kThreads = 288;
constexpr int kMaxExperts = 512;
// alignment slack, the ring, its full and empty barriers, each stage's item, the experts' row offsets and item starts
// (E + 1 each)
constexpr int kSmemBytes = 1024 + kStages * kStageBytes + kStages * 16 + kStages * 4 + 2 * (kMaxExperts + 1) * 4;
static_assert(kWBytes % 1024 == 0 && kXBytes % 1024 == 0, "128B-swizzled boxes need 1024-byte alignment");
static_assert(kWBytes == 2 * kExpertPackedStageElems, "a packed stage is the weight tile's k slice");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DG_EXPERTS_PREFILL 1
using namespace hopper;
#endif

// GATED (gate_up): tmW = the gate_up weights as [E 2I, H] (box {64, 64}), act[row][I] = bf16(gelu(gate) * up). Else
// (down): tmW = [E H, I], y[row][H] (f32, or bf16 with y_bf16). w_packed: the same weights in expert_layout.h's
// packed stages (then tmW is not read). tmX: the token rows (xs [P, H] or act [P, I]), box {64, 128}. item_ctr (may
// be null: static stride): two zeroed unsigneds, the claim count and the blocks done; the last block zeroes both.
template <bool GATED>
__global__ void __launch_bounds__(kThreads, 1)
    experts_prefill_k(const __grid_constant__ CUtensorMap tmW, const __grid_constant__ CUtensorMap tmX,
                      const bf16* __restrict__ w_packed, const int32_t* __restrict__ offsets, int E, int H, int I,
                      bf16* __restrict__ act, void* __restrict__ y, bool y_bf16, unsigned* __restrict__ item_ctr) {
#if defined(DG_EXPERTS_PREFILL)
  const int tiles_n = GATED ? I / 64 : H / 128, K = GATED ? H : I, nk = K / kBK;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw), base = (raw + 1023u) & ~1023u;
  const uint32_t full0 = base + kStages * kStageBytes, empty0 = full0 + 8 * kStages, item0 = empty0 + 8 * kStages;
  int* const offs = reinterpret_cast<int*>(smem_raw + (item0 + 4 * kStages - raw));  // E + 1
  int* const item_start = offs + (E + 1);                                              // E + 1
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;

  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full0 + 8 * s, 1);   // the producer's arrive.expect_tx, then the stage's bytes
      mbar_init(empty0 + 8 * s, 8);  // one arrive per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  pdl_wait();  // offsets and the token rows are the predecessors' (moe_group, gate_up)
  pdl_trigger();
  // Items before expert e's: tiles_n x (its token tiles), in expert order.
  if (warp == 0) {
    int carry = 0;
    for (int e0 = 0; e0 < E; e0 += 32) {
      const int e = e0 + lane;
      int n = 0;
      if (e < E) {
        const int start = __ldcg(offsets + e), rows = __ldcg(offsets + e + 1) - start;
        offs[e] = start;
        n = expert_prefill_items(rows, tiles_n, kTokItem);
      }
      int incl = n;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
      }
      if (e < E) item_start[e] = carry + incl - n;
      carry += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) item_start[E] = carry, offs[E] = __ldcg(offsets + E);
  }
  __syncthreads();
  const int n_items = item_start[E];
  // Item -> expert, weight tile, first token row and its token rows (<= 256): expert_items.h.
  auto decode = [&](int item) { return expert_prefill_item_at(item, item_start, offs, E, kTokItem); };

  if (warp == 8) {
    if (lane != 0) return;
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tmW)) : "memory");
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tmX)) : "memory");
    uint64_t policy;  // weights and token rows are both re-read (by the other token tiles / weight tiles) from L2
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(policy));
    uint32_t it = 0;
    for (int item = int(blockIdx.x); item < n_items;
         item = item_ctr ? claim_after_first_round(item_ctr) : item + int(gridDim.x)) {
      const ExpertPrefillItem m = decode(item);
      const bool second = m.rows > kTokWG;  // warpgroup 1 has rows: its token box too
      const int row_a = GATED ? m.e * 2 * I + m.nt * 64 : m.e * H + m.nt * 128;
      const int row_b = GATED ? row_a + I : row_a + 64;
      const size_t tile = size_t(m.e) * size_t(tiles_n) + size_t(m.nt);
      for (int kt = 0; kt < nk; ++kt, ++it) {
        const int s = int(it % kStages);
        mbar_wait(empty0 + 8 * s, ((it / kStages) & 1u) ^ 1u);  // the fresh ring's first round passes at once
        const uint32_t st = base + uint32_t(s) * kStageBytes, full = full0 + 8 * s;
        st_shared_s32(item0 + 4 * s, item);  // published by the arrive below (release) to the consumers' wait
        mbar_arrive_expect_tx(full, uint32_t(kWBytes + (second ? 2 : 1) * kXBytes));
        if (w_packed) {
          bulk_load(st, w_packed + expert_packed_stage(tile, nk, kt), kWBytes, full, policy);
        } else {
          tma_load_2d(st, &tmW, kt * kBK, row_a, full, policy);
          tma_load_2d(st + kWBytes / 2, &tmW, kt * kBK, row_b, full, policy);
        }
        tma_load_2d(st + kWBytes, &tmX, kt * kBK, m.row0, full, policy);
        if (second) tma_load_2d(st + kWBytes + kXBytes, &tmX, kt * kBK, m.row0 + kTokWG, full, policy);
      }
    }
    // The consumers learn that no item is left from the next stage's item slot.
    const int s = int(it % kStages);
    mbar_wait(empty0 + 8 * s, ((it / kStages) & 1u) ^ 1u);
    st_shared_s32(item0 + 4 * s, -1);
    mbar_arrive(full0 + 8 * s);
    if (item_ctr) finish_claims(item_ctr);
    return;
  }

  const int wg = warp >> 2, wl = warp & 3;
  uint32_t it = 0;
  for (;;) {
    const int s0 = int(it % kStages);  // the item's first stage: full until this warpgroup hands it back
    mbar_wait(full0 + 8 * s0, (it / kStages) & 1u);
    const int item = ld_shared_s32(item0 + 4 * s0);
    if (item < 0) break;
    const ExpertPrefillItem m = decode(item);
    const int mine = min(max(m.rows - wg * kTokWG, 0), kTokWG);  // this warpgroup's token rows
    const int row0 = m.row0 + wg * kTokWG;
    // One instantiation a wgmma width: d0 = weight rows 0-63 (gate / first half), d1 = rows 64-127.
    auto run = [&](auto width) {
      constexpr int N = decltype(width)::value;
      constexpr int R = N > 0 ? N / 2 : 1;
      float d0[R], d1[R];
#pragma unroll
      for (int i = 0; i < R; ++i) d0[i] = 0.f, d1[i] = 0.f;
      int prev = -1;
      for (int kt = 0; kt < nk; ++kt, ++it) {
        const int s = int(it % kStages);
        mbar_wait(full0 + 8 * s, (it / kStages) & 1u);
        if constexpr (N == 0) {  // no rows here: hand the stage back at once
          __syncwarp();
          if (lane == 0) mbar_arrive(empty0 + 8 * s);
          continue;
        } else {
          __syncwarp();  // wgmma is .sync.aligned
          const uint32_t st = base + uint32_t(s) * kStageBytes;
          const uint64_t da = desc_sw128(st), db = desc_sw128(st + kWBytes / 2),
                         dx = desc_sw128(st + kWBytes + uint32_t(wg) * kXBytes);
          fence_acc(d0), fence_acc(d1);
          asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
          for (int j = 0; j < kBK / 16; ++j) {
            if constexpr (N == 128) {
              wgmma_m64n128k16(d0, da + 2 * j, dx + 2 * j);
              wgmma_m64n128k16(d1, db + 2 * j, dx + 2 * j);
            } else if constexpr (N == 64) {
              wgmma_m64n64k16(d0, da + 2 * j, dx + 2 * j);
              wgmma_m64n64k16(d1, db + 2 * j, dx + 2 * j);
            } else {
              wgmma_m64n32k16(d0, da + 2 * j, dx + 2 * j);
              wgmma_m64n32k16(d1, db + 2 * j, dx + 2 * j);
            }
          }
          asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
          // The previous slice's wgmmas are done (this one's may still run): its stage goes back to the producer.
          asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
          fence_acc(d0), fence_acc(d1);
          __syncwarp();
          if (prev >= 0 && lane == 0) mbar_arrive(empty0 + 8 * prev);
          prev = s;
        }
      }
      if constexpr (N > 0) {
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        fence_acc(d0), fence_acc(d1);
        __syncwarp();
        if (prev >= 0 && lane == 0) mbar_arrive(empty0 + 8 * prev);
        // Fragment of thread (warp wl, lane l): d[4j + 2i + c] = D[weight row 16 wl + l/4 + 8i][token 8j + 2(l%4) + c].
        const int r0 = wl * 16 + (lane >> 2), t0 = (lane & 3) * 2;
#pragma unroll
        for (int j = 0; j < N / 8; ++j)
#pragma unroll
          for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const int tok = 8 * j + t0 + c, idx = 4 * j + 2 * i + c, r = r0 + 8 * i;
              if (tok >= mine) continue;
              const size_t row = size_t(row0 + tok);
              if constexpr (GATED) {
                act[row * size_t(I) + size_t(m.nt * 64 + r)] = __float2bfloat16(gelu_tanh(d0[idx]) * d1[idx]);
              } else {
                store_expert_row(y, y_bf16, row * size_t(H) + size_t(m.nt * 128 + r), d0[idx]);
                store_expert_row(y, y_bf16, row * size_t(H) + size_t(m.nt * 128 + 64 + r), d1[idx]);
              }
            }
      }
    };
    if (mine > 64)
      run(std::integral_constant<int, 128>{});
    else if (mine > 32)
      run(std::integral_constant<int, 64>{});
    else if (mine > 0)
      run(std::integral_constant<int, 32>{});
    else
      run(std::integral_constant<int, 0>{});
  }
#endif
}

template <bool GATED>
void launch_prefill(const char* who, const TmaMap& w, const bf16* w_packed, const bf16* x, int x_cols,
                    const int32_t* offsets, int E, int P, int H, int I, bf16* act, ExpertRows y, unsigned* item_ctr,
                    cudaStream_t s) {
  if (P <= 0) return;
  if (!experts_prefill_supported(E, H, I))
    throw_cuda_error(who, "needs an sm_90a device, E <= 512, H a multiple of 128 and I of 64", E, __FILE__, __LINE__);
  if ((reinterpret_cast<uintptr_t>(w_packed) & 15) != 0)
    throw_cuda_error(who, "packed expert weights must be 16-byte aligned", 0, __FILE__, __LINE__);
  const TmaMap xm = tma_map_bf16_rows(x, P, x_cols, kTokWG);
  CUtensorMap mw, mx;
  std::memcpy(&mw, &w, sizeof mw);
  std::memcpy(&mx, &xm, sizeof mx);
  launch_pdl(experts_prefill_k<GATED>, dim3(unsigned(sm_count())), dim3(kThreads), size_t(kSmemBytes), s, mw, mx,
             w_packed, offsets, E, H, I, act, y.p, y.is_bf16, item_ctr);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

bool experts_prefill_supported(int E, int H, int I) {
  if (E < 1 || E > kMaxExperts || H <= 0 || I <= 0 || H % 128 != 0 || I % 64 != 0) return false;
  static const bool ok = [] {
    if (!sm90a_image_of(experts_prefill_k<true>)) return false;
    CUDA_CHECK(cudaFuncSetAttribute(experts_prefill_k<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    CUDA_CHECK(
        cudaFuncSetAttribute(experts_prefill_k<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    return true;
  }();
  return ok;
}

void moe_gate_up_prefill_tma(const TmaMap& w, const bf16* w_packed, const bf16* xs, const int32_t* offsets, int E,
                             int P, int H, int I, bf16* act, cudaStream_t s, unsigned* item_counters) {
  launch_prefill<true>("moe_gate_up_prefill_tma", w, w_packed, xs, H, offsets, E, P, H, I, act, nullptr,
                       item_counters, s);
}

void moe_down_prefill_tma(const TmaMap& w, const bf16* w_packed, const bf16* act, const int32_t* offsets, int E,
                          int P, int H, int I, ExpertRows y, cudaStream_t s, unsigned* item_counters) {
  launch_prefill<false>("moe_down_prefill_tma", w, w_packed, act, I, offsets, E, P, H, I, nullptr, y, item_counters,
                        s);
}

}  // namespace dg::cuda
