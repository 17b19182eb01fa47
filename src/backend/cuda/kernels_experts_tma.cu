// Hopper (sm_90a) expert GEMMs for canvas-sized passes, on the padded layout of moe_group_padded with M = 32 rows per
// expert: gate_up with act = bf16(gelu_tanh(gate) * up) formed from the f32 accumulators in registers (neither an f32
// gate/up buffer nor a separate GELU pass), and down (f32 y). One kernel template for both.
//
// Layout of a block (160 threads): warps 0-3 are one consumer warpgroup issuing wgmma in the "swap AB" form (the
// expert's weights are the M side, its 32 token rows the N side: wgmma.m64n32k16); warp 4 is the producer, one
// thread issuing every TMA load (2D tensor maps, 128B swizzle) into a 4-stage mbarrier ring. A tile is 128 weight rows
// of one expert (gate_up: 64 gate rows n0..n0+63 and the matching 64 up rows; down: 128 consecutive output rows); a
// stage is one 64-wide k slice of them (2 x 8 KB) plus the expert's 32 x 64 token box (4 KB). Blocks are persistent (2
// per SM, or 1 per SM on a given number of SMs) and stride over the tiles, the ring running on across tiles, so the
// next tile's loads overlap this tile's epilogue. Experts with 0 rows are skipped (no weight reads). Every output
// element is computed by one block in a fixed k order: bitwise deterministic.
//
// Padding rows (t >= rows of the expert) hold whatever the buffer held: a wgmma output column depends only on its own
// token row, and those columns are never stored.
//
// H200, one layer at E 128 / H 2816 / I 704 (tools/gpu/microbench/experts_wgmma_bench.cu, 2026-11-30): gate_up
// 0.250 ms (4.06 TB/s of weights) against cuBLASLt bf16-out 0.250 ms before the f32 write and GELU pass the cuBLASLt
// path adds; down 0.137-0.144 ms, as cuBLASLt. A plain read of the same bytes takes 0.229 / 0.119 ms. Weights
// repacked into stream order (16 KB contiguous per stage) reached 0.245 / 0.136 ms: not done, the grouped kernels of
// prefill and overflow rows read the checkpoint layout.
//
// Programmatic dependent launch: both kernels are launched with the
// PDL attribute and trigger at once, and the producer requests the first stages' WEIGHT boxes before
// griddepcontrol.wait. The weights are constants, independent of the router (at 256 tokens x top 8 of 128 every
// expert is used every step), so the launch gap after the gather (gate_up) or after gate_up (down) and the ring's
// ramp can overlap the predecessor's tail. Everything the predecessor writes (the token rows, the per-expert row
// counts) is read only after the wait, and nothing is written before it. It hides the ~4.6 us gap a layer before the
// cuBLASLt gate_up GEMM (which cannot be PDL-launched) and the ring's ramp. In the engine (H200, session 5,
// docs/BENCHMARKS.md) gate_up on this kernel is the default (4K step -0.1 to -0.2 ms); down on it was slower than
// cuBLASLt (+0.3 ms a step), so down stays on cuBLASLt. Deeper or shallower rings and other grids were no faster.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/cuda_util.cuh"
#include "backend/cuda/expert_layout.h"
#include "backend/cuda/hopper_tma.cuh"
#include "backend/cuda/launch.cuh"

namespace dg::cuda {

namespace {

// The tile timeline (experts_timeline_begin / _end): null unless a caller asked for one. Consumer thread 0 of each
// block appends one record per tile (and one per block: tile -1, its entry and its griddepcontrol.wait's return).
__device__ ExpertsTimelineRecord* g_etl = nullptr;
__device__ unsigned g_etl_n = 0, g_etl_cap = 0;
// Host side: the recording buffer and its capacity while a timeline is on (the TL instantiation is launched then).
ExpertsTimelineRecord* g_etl_buf = nullptr;
unsigned g_etl_buf_cap = 0;

constexpr int kTok = 32;                          // token rows of a token tile (one wgmma N; M of moe_group_padded)
constexpr int kBK = 64;                           // k per stage: 64 bf16 = 128 B, one 128B-swizzle row
constexpr int kWBoxBytes = 64 * kBK * 2;          // 8192: 64 weight rows
constexpr int kXBoxBytes = kTok * kBK * 2;        // 4096: a token tile's rows
constexpr int kStageBytes = 2 * kWBoxBytes + kXBoxBytes;
// The fused launch serves kFusedExpertRows (cuda_kernels.h) rows an expert as two token tiles of kTok over the same
// staged weights, so an expert's weights are read once for up to 64 tokens (see the kernel).
static_assert(kFusedExpertRows == 2 * kTok, "the consumer's second accumulator set serves exactly one more token tile");
constexpr int kThreads = 160;
// Two blocks per SM of 4 (80 KB each) or 5 stages (100 KB), or three of 3 (60 KB), when the kernel has the GPU;
// one block per SM of 8 stages (160 KB: no second block fits, so a grid of n blocks stays on n SMs) when it leaves
// SMs to a concurrent stream.
constexpr int kStagesShared = 4, kStagesShared3 = 3, kStagesShared5 = 5, kStagesOwn = 8;
// alignment slack, the ring, its full and empty barriers (8 bytes each), and a tile slot per stage (GATHER: the
// tile and its row count)
constexpr int smem_bytes(int stages) { return 1024 + stages * kStageBytes + stages * 16 + stages * 8; }
static_assert(kStageBytes % 1024 == 0, "128B-swizzled boxes need 1024-byte alignment");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DG_EXPERTS_TMA 1
using namespace hopper;
// The tile timeline's clock and its append (the kernel's TL instantiation).
__device__ __forceinline__ unsigned long long etl_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void etl_put(ExpertsTimelineRecord* buf, int tile, unsigned long long t_req,
                                        unsigned long long t0, unsigned long long t1) {
  const unsigned i = atomicAdd(&g_etl_n, 1u);
  if (i >= g_etl_cap) return;
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  buf[i] = ExpertsTimelineRecord{int(blockIdx.x), int(sm), tile, 0, t_req, t0, t1};
}
// The fused kernel's wait for a count (ld.acquire: the writes released before the count's increments are visible to
// this thread's loads after it).
__device__ __forceinline__ void wait_count(const unsigned* p, unsigned target) {
  spin_until<255u>([&] {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    if (v >= target) return true;
    __nanosleep(100);
    return false;
  });
}
#endif

// GATED (gate_up): tmW = all experts' gate_up weights as [E * 2I, H], tile = 64 gate rows + the matching 64 up rows,
// act[e 32 + t][I] = bf16(gelu(gate) * up). Else (down): tmW = [E * H, I], tile = 128 consecutive rows, y[e 32 + t][H]
// (f32, or bf16 with y_bf16: ExpertRows). tmX: the expert's padded token rows [E * 32, K], box {64, 32}. rows[e] =
// valid token rows of expert e (<= 32).
// GATHER (gate_up only): the token rows come straight from xg [T, H] (slot_token[e 32 + t] = the token in slot t <
// rows[e], moe_assign_padded) instead of a gathered copy through tmX: the whole producer warp loads them, lane t one
// row of 128 bytes per stage (eight 16-byte cp.async into the 128-byte swizzled layout a TMA box would have written),
// and each lane arrives on a stage's full barrier once its copies have landed (cp.async.wait_group, then
// fence.proxy.async so that the tensor cores see them), one stage behind its last issue, as attention_ws_k's producer
// does. The full barrier then counts 1 + 32 arrivals: the weight boxes' expect_tx, and the 32 lanes. This removes the
// gather kernel (and its launch) from the critical path between the router and the experts.
// With GATHER the producer also picks the tiles and names each one, with its expert's row count, to the consumers in
// a per-stage slot of shared memory (written before the producer's arrivals on the tile's first stage; tile -1 in one
// extra stage ends the block). A block's first tile is blockIdx.x, as without GATHER; the next ones come by the fixed
// stride (tile_ctr null) or, with tile_ctr (two zeroed unsigneds: the next tile past the grid's first round, and the
// blocks done), from an atomic counter, so that blocks which start late (their SMs held by the dense MLP's GEMMs on
// the other stream) take fewer tiles instead of finishing late. The last block to finish zeroes tile_ctr again.
// Tiles of experts without rows are skipped either way (after the first). Each tile is still computed by one block
// in the fixed k order, so results do not depend on which block takes it.
// FUSED with TWO serves up to kFusedExpertRows = 64 rows an expert, slot t in row e 64 + t of act and y (without TWO:
// 32, in row e 32 + t, as the other kernels; rows past them are the overflow kernels'): an expert with more
// than 32 rows runs each of its tiles as one instance over two token tiles, every k slice taking two ring uses (the
// weights and token tile 0's box in the first, token tile 1's box in the second's) and the consumer a second
// accumulator set over the same staged weights, so those weights are still read once. A block's first tile is the
// exception: its first stages were requested (one use a slice) before the row counts were known, so when its expert
// has more than 32 rows it runs again for token tile 1, re-reading the weights. The per-expert done count is bumped
// by a tile's last instance only. Either way each output column is one token row's dot products in the fixed k order:
// the same bits whichever block or instance computes it.
// With GATHER and masks (router_top_k's expert_masks, mask_words = ceil(T / 32) <= 32 words an expert): an expert's
// tokens are the set bits of its mask in ascending order (the token order moe_assign_padded's slots have), its row
// count their number capped at 32 (TWO: 64); rows and slot_token are not read. The producer lanes hold one mask word
// each and find their slot's token with a prefix count, so no assignment kernel stands between the router and gate_up.

// TWO (FUSED only; TmaExpertsPlan::two_token_tiles): up to kFusedExpertRows rows an expert, see above. Its second
// accumulator set takes ~106 registers a thread (the others ~70), which still leaves room for the 256-thread
// assignment (moe_assign_k, 40 registers) beside three blocks an SM as long as it stays at most 112. Its one-tile path
// is ~3 us a layer slower than this kernel without TWO (the registers, the extra branches): so it is a separate
// instantiation, which the backend launches only for steps whose routing concentrates
// (CudaOptions::auto_two_token_tiles_heavy).
// TL: also the tile timeline (g_etl; its own instantiation, so the others keep their registers).
template <bool GATED, int kStages, bool GATHER = false, bool FUSED = false, bool TL = false, bool TWO = false>
__global__ void __launch_bounds__(kThreads, 1)
    experts_tma_k(const __grid_constant__ CUtensorMap tmW, const __grid_constant__ CUtensorMap tmX,
                  const int32_t* __restrict__ rows, int E, int H, int I, bf16* __restrict__ act, void* __restrict__ y,
                  bool y_bf16,
                  int l2_prefetch_slices, int prewait_stages, const bf16* __restrict__ xg,
                  const int32_t* __restrict__ slot_token,
                  unsigned* tile_ctr, const unsigned* __restrict__ masks, int mask_words,
                  const bf16* __restrict__ gu_packed, const bf16* __restrict__ dn_packed, int claim_ahead,
                  int first_stride, int rows_l2) {
  static_assert(!GATHER || GATED, "token rows are gathered for gate_up only");
  static_assert(!FUSED || (GATED && GATHER), "the fused kernel is the gathered gate_up followed by down");
  static_assert(!TWO || FUSED, "two token tiles an expert in the fused launch only");
#if defined(DG_EXPERTS_TMA)
  // kTT token tiles of kTok rows an expert (FUSED: two), its padded rows kRows apart in act and y.
  constexpr int kTT = TWO ? 2 : 1, kRows = kTT * kTok;
  const int rows_per_expert = GATED ? 2 * I : H, tiles_n = GATED ? I / 64 : H / 128, K = GATED ? H : I;
  // FUSED: tiles [0, n_gate) are gate_up's (tmW), then E * H / 128 down tiles (tmX holds the down weights).
  const int n_gate = E * tiles_n, n_tiles = FUSED ? n_gate + E * (H / 128) : n_gate, nk = K / kBK;
  const int down_tiles_n = H / 128, down_nk = I / kBK;
  unsigned* const expert_done = FUSED ? tile_ctr + 2 : nullptr;  // per expert: consumer warps done with its gate_up
  const unsigned gate_done = 4u * unsigned(tiles_n);             // ... when all its gate_up tiles are stored
  extern __shared__ unsigned char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t full0 = base + kStages * kStageBytes, empty0 = full0 + 8 * kStages, slot0 = empty0 + 8 * kStages;
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  auto weight_rows = [&](int tile, int& row_a, int& row_b) {
    if (FUSED && tile >= n_gate) {
      const int d = tile - n_gate, e = d / down_tiles_n, nt = d % down_tiles_n;
      row_a = e * H + nt * 128;
      row_b = row_a + 64;
      return;
    }
    const int e = tile / tiles_n, nt = tile % tiles_n;
    row_a = e * rows_per_expert + nt * (GATED ? 64 : 128);
    row_b = row_a + (GATED ? I : 64);
  };
  // FUSED: the expert of a tile, whether it is a down tile, and its k slices.
  auto is_down = [&](int tile) { return FUSED && tile >= n_gate; };
  auto expert_of = [&](int tile) { return is_down(tile) ? (tile - n_gate) / down_tiles_n : tile / tiles_n; };
  auto slices_of = [&](int tile) { return is_down(tile) ? down_nk : nk; };
  // Without GATHER: expert e's valid rows, rows[e] or (masks) its tokens capped at 32. warp: the calling warp's 32
  // lanes all call (one mask word a lane), else one thread alone. After griddepcontrol.wait only.
  auto rows_of = [&](int e, bool warp_wide) {
    if (!masks) return int(__ldcg(rows + e));
    int c = 0;
    if (warp_wide) {
      const int ln = int(threadIdx.x) & 31;
      c = __reduce_add_sync(0xffffffffu,
                            ln < mask_words ? __popc(__ldcg(masks + size_t(e) * mask_words + ln)) : 0);
    } else {
      for (int w = 0; w < mask_words; ++w) c += __popc(__ldcg(masks + size_t(e) * mask_words + w));
    }
    return c < kRows ? c : kRows;
  };
  // The block's first tile is run whatever its expert's row count: its first stages' weights are requested before
  // the row counts may be read (below), so both roles must consume them. An empty expert's first tile then costs one
  // tile of wasted reads and math and stores nothing (cnt <= 0 in the epilogue). Later tiles of empty experts are
  // skipped, as before.
  // TmaExpertsPlan::first_tile_stride (coprime to the grid: a permutation of the first round's tiles).
  const int first = int((long long)blockIdx.x * first_stride % gridDim.x);
  // Ring uses 0 .. npre-1 (stage s = use) are the first tile's first stages, whose weights are requested before
  // griddepcontrol.wait.
  // prewait_stages >= 0 caps them (TmaExpertsPlan::prewait_stages).
  const int ring_pre = nk < kStages ? nk : kStages;
  const int npre = first < n_tiles ? (prewait_stages >= 0 && prewait_stages < ring_pre ? prewait_stages : ring_pre) : 0;
  // The packed stage image (expert_layout.h) of k slice kt of tile `tile`, or null if those weights are not packed.
  // Packed stages are in tile order: gate_up tiles (and a down kernel's) by their own index, the fused kernel's down
  // tiles by their index among the down tiles.
  auto packed_stage = [&](int tile, int kt) -> const bf16* {
    const bool gate_tile = GATED && !(FUSED && tile >= n_gate);
    const bf16* w = gate_tile ? gu_packed : dn_packed;
    if (!w) return nullptr;
    const bool fused_down = FUSED && !gate_tile;
    return w + expert_packed_stage(size_t(fused_down ? tile - n_gate : tile), fused_down ? down_nk : nk, kt);
  };
  // One stage's weights (k slice kt of tile `tile`, rows row_a / row_b), after one arrive.expect_tx of `expect` bytes
  // on its full barrier: two 2D boxes through the tensor map, or (packed weights) the stage's 16 KB image as one 1D
  // bulk copy, which lands the same bytes in the same places.
  auto issue_weights = [&](uint32_t st, uint32_t full, int tile, int kt, int row_a, int row_b, uint32_t expect,
                           uint64_t policy, bool down = false) {
    mbar_arrive_expect_tx(full, expect);
    if (const bf16* src = packed_stage(tile, kt)) {
      bulk_load(st, src, 2 * kWBoxBytes, full, policy);
      return;
    }
    const CUtensorMap* map = FUSED && down ? &tmX : &tmW;
    tma_load_2d(st, map, kt * kBK, row_a, full, policy);
    tma_load_2d(st + kWBoxBytes, map, kt * kBK, row_b, full, policy);
  };
  // Warms L2 with the first tile's weight slices [npre, npre + l2_prefetch_slices) before griddepcontrol.wait (no
  // shared memory, no barrier: a hint; the ring's loads of those slices then hit L2). Weights only.
  auto prefetch_first_tile = [&](int row_a, int row_b) {
    const int pf_end = npre + l2_prefetch_slices < nk ? npre + l2_prefetch_slices : nk;
    for (int kt = npre; kt < pf_end; ++kt) {
      if (const bf16* src = packed_stage(first, kt)) {
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(2 * kWBoxBytes) : "memory");
        continue;
      }
      tma_prefetch_l2_2d(&tmW, kt * kBK, row_a);
      tma_prefetch_l2_2d(&tmW, kt * kBK, row_b);
    }
  };

  // The GATHER producer (all 32 lanes of warp 4; see above the kernel). Lane 0 also issues the weight boxes.
  auto produce_gathered = [&](int ln) {
    const bool leader = ln == 0;
    uint64_t evict_first = 0;
    if (leader) {
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tmW)) : "memory");
      if (FUSED) asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tmX)) : "memory");
      asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(evict_first));
    }
    constexpr uint32_t kWBytes = 2 * kWBoxBytes;
    // Before griddepcontrol.wait: the first stages' weight boxes only (constants), as the TMA producer does.
    if (leader && npre > 0) {
      int row_a, row_b;
      weight_rows(first, row_a, row_b);
      for (int kt = 0; kt < npre; ++kt)
        issue_weights(base + uint32_t(kt) * kStageBytes, full0 + 8 * kt, first, kt, row_a, row_b, kWBytes,
                      evict_first);
      prefetch_first_tile(row_a, row_b);
    }
    pdl_wait();  // the row counts and slot_token (the assign kernel) and xg (the pre-FFN norm) are final now
    uint32_t it = 0, pend = 0;
    bool have_pend = false;
    const int swz = (ln & 7) * 16;  // 128-byte swizzle: 16-byte chunk c of row ln sits at chunk c ^ (ln & 7)
    // Expert e's rows (cnt, at most kRows) and, with `token`, for lane ln the tokens of its slots ln + kTok j (-1
    // past cnt).
    auto slot_token_of = [&](int e, int& cnt, bool token, int (&tok)[kTT]) {
#pragma unroll
      for (int j = 0; j < kTT; ++j) tok[j] = -1;
      if (!masks) {
        cnt = min(int(__ldcg(rows + e)), kRows);
#pragma unroll
        for (int j = 0; j < kTT; ++j)
          if (token && ln + kTok * j < cnt) tok[j] = __ldcg(slot_token + e * kRows + ln + kTok * j);
        return;
      }
      const unsigned word = ln < mask_words ? __ldcg(masks + size_t(e) * mask_words + ln) : 0u;
      const int pc = __popc(word);
      int incl = pc;  // inclusive prefix of the set bits over the lanes' words
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (ln >= o) incl += v;
      }
      cnt = min(__shfl_sync(0xffffffffu, incl, 31), kRows);
      if (!token) return;
      for (int w = 0; w < mask_words; ++w) {  // the word that holds set bit number ln + kTok j, then the bit
        const unsigned bits = __shfl_sync(0xffffffffu, word, w);
        const int before = __shfl_sync(0xffffffffu, incl - pc, w);
#pragma unroll
        for (int j = 0; j < kTT; ++j) {
          const int slot = ln + kTok * j, r = slot - before;
          if (slot < cnt && r >= 0 && r < __popc(bits)) {
            unsigned b = bits;
            for (int i = 0; i < r; ++i) b &= b - 1u;
            tok[j] = w * 32 + __ffs(int(b)) - 1;
          }
        }
      }
    };
    // The tile after `tile` (n_tiles or past: none left), by the stride or from the counter.
    auto next_tile = [&](int tile) {
      if (!tile_ctr) return tile + int(gridDim.x);
      int t = 0;
      if (leader) t = claim_after_first_round(tile_ctr);
      return __shfl_sync(0xffffffffu, t, 0);
    };
    // What the producer needs of a tile before its first stage: its expert, its rows and this lane's source row,
    // and (down tiles) whether this lane has already seen the expert's gate_up complete (an acquire load: the lane's
    // cp.async reads of the activation rows come after it in program order).
    // src_row[j] / src[j]: this lane's row of token tile j (slot ln + kTok j), -1 for a padding slot (zero-filled).
    struct TileInfo {
      int tile, e, cnt, src_row[kTT];
      const bf16* src[kTT];
      bool down, done;
    };
    auto prepare = [&](int tile) {
      TileInfo t{tile, 0, 0, {}, {}, false, true};
#pragma unroll
      for (int j = 0; j < kTT; ++j) t.src_row[j] = -1, t.src[j] = nullptr;
      if (tile >= n_tiles) return t;
      t.e = expert_of(tile);
      t.down = is_down(tile);
      // A down tile's rows are the expert's own act rows, slot ln in row ln: only the count is wanted.
      int tok[kTT];
      slot_token_of(t.e, t.cnt, !t.down, tok);
#pragma unroll
      for (int j = 0; j < kTT; ++j) {
        const int slot = ln + kTok * j;
        t.src_row[j] = t.down ? (slot < t.cnt ? slot : -1) : tok[j];
        t.src[j] = t.down ? act + (size_t(t.e) * kRows + size_t(t.src_row[j] >= 0 ? t.src_row[j] : 0)) * size_t(I)
                          : xg + (tok[j] >= 0 ? size_t(tok[j]) * size_t(H) : 0);
      }
      if (t.down && t.cnt > 0) {
        unsigned v;
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(expert_done + t.e) : "memory");
        t.done = v >= gate_done;
      }
      return t;
    };
    // The next tile with rows (an expert without rows is skipped: no reads), claimed and prepared.
    auto claim_after = [&](int tile) {
      TileInfo t = prepare(next_tile(tile));
      while (t.tile < n_tiles && t.cnt <= 0) t = prepare(next_tile(t.tile));
      return t;
    };
    // The next tile is claimed and prepared claim_ahead stages before this tile's last stage is issued (its atomic,
    // mask and count loads overlap the ring's waits; TmaExpertsPlan::claim_ahead), not only at the boundary: there,
    // those ~3 dependent L2 round trips kept consumers waiting for a tile's first stage, most in the down tiles' phase
    // (11 stages a tile; the tile timeline of session 13: ~16 us a block a layer).
    const int ahead = claim_ahead > 1 ? claim_ahead : 1;
    // The block's first tile runs even without rows (its first stages' weights were requested before the wait).
    TileInfo cur = first < n_tiles ? prepare(first) : claim_after(first);
    // A tile is run as one instance over token tiles j0 .. j0 + ntt - 1 (tile_instance): ntt = 2 for an expert with
    // more than kTok rows (FUSED), each k slice then taking two ring uses, the weights and token tile 0 in the first,
    // token tile 1 in the second's token box. The block's first tile cannot: its first stages were requested as one use
    // a slice before the row counts were known; when its expert has more than kTok rows it runs again for token tile 1
    // (j0 = 1), re-reading its weights (first tiles only).
    bool first_instance = first < n_tiles;
    int j0 = 0;
    while (cur.tile < n_tiles) {
      const int tile = cur.tile, e = cur.e, cnt = cur.cnt;
      const bool down = cur.down;
      const int ntt = kTT > 1 && j0 == 0 && cnt > kTok && !first_instance ? 2 : 1;
      const bool again = kTT > 1 && j0 == 0 && ntt == 1 && cnt > kTok;  // token tile 1 in an instance of its own
      int row_a, row_b;
      weight_rows(tile, row_a, row_b);
      if (down && cnt > 0 && !__all_sync(0xffffffffu, cur.done)) {
        // The expert's activation rows, once every gate_up tile of the expert is stored (the consumer warps count
        // them in expert_done with release semantics; this acquire pairs with them). Each lane waits for itself:
        // its own cp.async reads below are then ordered after the acquire. The stage still pending its arrival goes
        // first: this block's own consumers may be on one of those gate_up tiles, and they need it to finish.
        if (have_pend) {
          asm volatile("cp.async.wait_group 0;\n" ::: "memory");
          asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
          mbar_arrive(pend);
          have_pend = false;
        }
        wait_count(expert_done + e, gate_done);
        cur.done = true;  // (a second instance of the tile needs no second wait)
      }
      const int tile_nk = slices_of(tile);
      const int claim_at = tile_nk > ahead ? tile_nk - ahead : 0;
      TileInfo nxt = prepare(n_tiles);  // none; set at kt == claim_at (in the tile's last instance)
      // This instance's token tiles' sources (selects, not a dynamic index: the arrays stay in registers).
      const bf16* const src_a = kTT > 1 && j0 > 0 ? cur.src[kTT - 1] : cur.src[0];
      const bf16* const src_b = cur.src[kTT - 1];
      const uint32_t bytes_a = (kTT > 1 && j0 > 0 ? cur.src_row[kTT - 1] : cur.src_row[0]) >= 0 ? 16u : 0u;
      const uint32_t bytes_b = cur.src_row[kTT - 1] >= 0 ? 16u : 0u;
      for (int kt = 0; kt < tile_nk; ++kt) {
        for (int jj = 0; jj < ntt; ++jj, ++it) {
          const int s = int(it % kStages);
          const uint32_t st = base + uint32_t(s) * kStageBytes, full = full0 + 8 * s;
          if (!(first_instance && kt < npre)) {  // else: stage kt of the fresh ring, its weights already requested
            mbar_wait(empty0 + 8 * s, ((it / kStages) & 1u) ^ 1u);
            if (leader && jj == 0) issue_weights(st, full, tile, kt, row_a, row_b, kWBytes, evict_first, down);
            if (leader && jj == 1) mbar_arrive(full);  // a token-only use: the leader's arrival carries no bytes
          }
          // before the leader's lane arrival, which every phase of the stage waits for
          if (leader && kt == 0 && jj == 0) {
            st_shared_s32(slot0 + 8 * s, tile);
            st_shared_s32(slot0 + 8 * s + 4, cnt | (j0 << 8) | (ntt << 12));
          }
          const uint32_t xrow = st + 2 * kWBoxBytes + uint32_t(ln) * 128u;
          const bf16* srow = (jj == 0 ? src_a : src_b) + size_t(kt) * kBK;  // use jj: token tile j0 + jj
          const uint32_t bytes = jj == 0 ? bytes_a : bytes_b;
#pragma unroll
          for (int c = 0; c < 8; ++c) {
            const uint32_t dst = xrow + (uint32_t(c * 16) ^ uint32_t(swz));
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(srow + c * 8), "r"(bytes)
                         : "memory");
          }
          asm volatile("cp.async.commit_group;\n" ::: "memory");
          if (have_pend) {  // the previous stage's rows have landed: make them visible to wgmma, then arrive
            asm volatile("cp.async.wait_group 1;\n" ::: "memory");
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            mbar_arrive(pend);
          }
          pend = full, have_pend = true;
        }
        if (kt == claim_at && !again) nxt = claim_after(tile);
      }
      first_instance = false;
      if (again) {
        j0 = 1;
      } else {
        j0 = 0;
        cur = nxt;
      }
    }
    if (have_pend) {
      asm volatile("cp.async.wait_group 0;\n" ::: "memory");
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      mbar_arrive(pend);
    }
    // One more stage, without data: slot -1 ends the consumers' loop. Its 1 + 32 arrivals, no transaction bytes.
    const int s = int(it % kStages);
    mbar_wait(empty0 + 8 * s, ((it / kStages) & 1u) ^ 1u);
    if (leader) {
      st_shared_s32(slot0 + 8 * s, -1);
      mbar_arrive(full0 + 8 * s);
    }
    __syncwarp();
    mbar_arrive(full0 + 8 * s);
    // every fetch of this block is done; the last block to run out of tiles resets the counters
    const bool last = tile_ctr && leader && finish_claims(tile_ctr);
    if constexpr (FUSED) {
      // The last block also zeroes expert_done. Every count has its final value by now: each expert with rows has
      // down tiles, whose producers (all finished before this block's count above) waited for all its gate_up
      // tiles; experts without rows are never counted.
      if (__shfl_sync(0xffffffffu, last, 0))
        for (int e = ln; e < E; e += 32) atomicExch(expert_done + e, 0u);
    }
  };

  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full0 + 8 * s, GATHER ? 33 : 1);  // the producer's expect_tx arrive + the TMA bytes (+ 32 lanes)
      mbar_init(empty0 + 8 * s, 4);  // one arrive per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  // PDL (launch.cuh), in the opposite order to our other kernels: trigger first, so the next kernel in the stream
  // (down after gate_up) is scheduled as soon as every block of this grid has started, and can stream its own
  // weights into its ring while this grid still runs (it gets SMs as this grid's blocks exit: two blocks of this
  // kernel fill an SM's shared memory). That is safe because the successor's griddepcontrol.wait waits for this grid
  // to COMPLETE and its writes to be flushed, not for the trigger: down never sees a partial act. Triggering before
  // our own wait also lets the successor start before our predecessor has finished; it reads nothing but constant
  // weights before its own wait either, and every other kernel waits before touching global memory.
  pdl_trigger();

  if (warp == 4) {
    if constexpr (GATHER) {
      produce_gathered(lane);
      return;
    }
    if (lane != 0) return;
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tmW)) : "memory");
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&tmX)) : "memory");
    uint64_t evict_first;  // the weights are read once per pass; the token box is re-read by the expert's other tiles
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(evict_first));
    uint64_t evict_normal;
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(evict_normal));

    // ---- before griddepcontrol.wait: constant weights only ----
    // The expert weights do not depend on the router (nor on anything any kernel of a pass writes), so the first
    // npre stages of the first tile get their two weight boxes now, while the predecessor (the gather for gate_up,
    // gate_up for down) is still running. Nothing here reads an activation, the row counts or any other buffer a
    // predecessor writes, and nothing writes global memory.
    //
    // mbarrier accounting: a stage's full barrier (arrival count 1) gets ONE arrive.expect_tx of the WHOLE stage
    // (kStageBytes = the two weight boxes + the token box) before any of its copies is issued. Its phase completes
    // only when the pending arrival count is 0 and the transaction count is back to 0, i.e. after all three boxes
    // have landed; with the token box issued only after the wait below, the weight boxes alone (kStageBytes -
    // kXBoxBytes) leave the count at kXBoxBytes > 0, so no consumer can see a stage whose token box is missing or
    // stale. A TMA box always completes its full byte count (out-of-bounds parts are zero-filled and counted).
    // These are ring uses it = 0 .. npre-1 (stage s = it), the fresh ring's first round: no empty barrier to wait
    // for (the loop below would pass it at once, parity 1 on a fresh barrier).
    if (npre > 0) {
      int row_a, row_b;
      weight_rows(first, row_a, row_b);
      for (int kt = 0; kt < npre; ++kt)
        issue_weights(base + uint32_t(kt) * kStageBytes, full0 + 8 * kt, first, kt, row_a, row_b, kStageBytes,
                      evict_first);
      prefetch_first_tile(row_a, row_b);
    }

    // ---- the predecessor has completed and its writes are visible (to this thread's TMA reads too) ----
    pdl_wait();

    uint32_t it = 0;  // stage use counter across tiles, as the consumer's
    for (int tile = first; tile < n_tiles; tile += int(gridDim.x)) {
      const int e = tile / tiles_n;
      if (tile != first && rows_of(e, false) <= 0) continue;
      int row_a, row_b;
      weight_rows(tile, row_a, row_b);
      for (int kt = 0; kt < nk; ++kt, ++it) {
        if (tile == first && kt < npre) {  // it == kt: stage kt, its weights and expect_tx already issued
          tma_load_2d(base + uint32_t(kt) * kStageBytes + 2 * kWBoxBytes, &tmX, kt * kBK, e * kTok, full0 + 8 * kt,
                      evict_normal);
          continue;
        }
        const int s = int(it % kStages);
        mbar_wait(empty0 + 8 * s, ((it / kStages) & 1u) ^ 1u);  // first round passes on the fresh barrier
        const uint32_t st = base + uint32_t(s) * kStageBytes, full = full0 + 8 * s;
        issue_weights(st, full, tile, kt, row_a, row_b, kStageBytes, evict_first);
        tma_load_2d(st + 2 * kWBoxBytes, &tmX, kt * kBK, e * kTok, full, evict_normal);
      }
    }
    return;
  }

  // Consumers read the row counts and write act / y: both only after the predecessor has completed. (The row counts
  // are loaded with ld.global.cg, not the read-only path __restrict__ const would allow: this grid may have started
  // while its predecessor was still writing them.)
  ExpertsTimelineRecord* const etl = TL && threadIdx.x == 0 ? g_etl : nullptr;
  const unsigned long long etl_entry = etl ? etl_now() : 0;
  pdl_wait();
  if (etl) etl_put(etl, -1, etl_entry, etl_entry, etl_now());
  uint32_t it = 0;
  // GATHER: every tile, and its row count, is named by the producer in the slot of its first stage (the first one is
  // blockIdx.x when there is one); -1 ends. Else the fixed stride, skipping experts without rows after the first tile.
  int tile = first < n_tiles ? first : n_tiles;
  for (;;) {
    int cnt, j0 = 0, ntt = 1;  // the instance's token tiles j0 .. j0 + ntt - 1 (the producer's tile_instance)
    const unsigned long long etl_req = etl ? etl_now() : 0;
    if constexpr (GATHER) {
      const int s = int(it % kStages);
      mbar_wait(full0 + 8 * s, (it / kStages) & 1u);
      tile = ld_shared_s32(slot0 + 8 * s);
      if (tile < 0) break;
      const int word = ld_shared_s32(slot0 + 8 * s + 4);
      cnt = word & 0xFF;
      if constexpr (kTT > 1) j0 = (word >> 8) & 0xF, ntt = word >> 12;
    } else {
      if (tile >= n_tiles) break;
      cnt = rows_of(tile / tiles_n, true);  // .cg: L2, never a stale L1 / non-coherent line of a grid we overlapped
      if (tile != first && cnt <= 0) {  // the first tile is consumed regardless (its stages were issued)
        tile += int(gridDim.x);
        continue;
      }
    }
    const bool down = is_down(tile);
    const int e = expert_of(tile), nt = down ? (tile - n_gate) % down_tiles_n : tile % tiles_n;
    // Token tile j0: d0 = tile rows 0-63 (gate / first half), d1 = rows 64-127 (up / second half); FUSED with
    // ntt = 2: d2 / d3 the same for token tile 1 (slots 32-63), its rows in the token box of each slice's second use.
    float d0[16], d1[16], d2[16], d3[16];
    const bool two = kTT > 1 && ntt == 2;
#pragma unroll
    for (int i = 0; i < 16; ++i) d0[i] = 0.f, d1[i] = 0.f;
    if (two)
#pragma unroll
      for (int i = 0; i < 16; ++i) d2[i] = 0.f, d3[i] = 0.f;
    const unsigned long long etl_t0 = etl ? etl_now() : 0;
    const int tile_nk = slices_of(tile);
    // The slices' loop, one instantiation a token tile count: a one-tile instance runs the loop of a kernel without
    // the second tile (no fences or branches for d2 / d3 on its path).
    auto run_slices = [&](auto two_tiles) {
      constexpr bool kTwo = decltype(two_tiles)::value;
      for (int kt = 0; kt < tile_nk; ++kt, it += kTwo ? 2 : 1) {
        const int s = int(it % kStages);
        if (!(GATHER && kt == 0)) mbar_wait(full0 + 8 * s, (it / kStages) & 1u);  // GATHER: waited for above
        const int s1 = kTwo ? int((it + 1) % kStages) : s;
        if constexpr (kTwo) mbar_wait(full0 + 8 * s1, ((it + 1) / kStages) & 1u);
        __syncwarp();  // wgmma is .sync.aligned
        const uint32_t st = base + uint32_t(s) * kStageBytes;
        const uint64_t da = desc_sw128(st), db = desc_sw128(st + kWBoxBytes), dx = desc_sw128(st + 2 * kWBoxBytes);
        fence_acc(d0), fence_acc(d1);
        if constexpr (kTwo) fence_acc(d2), fence_acc(d3);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        // kTwo: the same weights against token tile 1, interleaved by k16 step (fewer descriptors live at once)
        const uint64_t dx1 = kTwo ? desc_sw128(base + uint32_t(s1) * kStageBytes + 2 * kWBoxBytes) : 0;
#pragma unroll
        for (int j = 0; j < kBK / 16; ++j) {
          wgmma_m64n32k16(d0, da + 2 * j, dx + 2 * j);
          wgmma_m64n32k16(d1, db + 2 * j, dx + 2 * j);
          if constexpr (kTwo) {
            wgmma_m64n32k16(d2, da + 2 * j, dx1 + 2 * j);
            wgmma_m64n32k16(d3, db + 2 * j, dx1 + 2 * j);
          }
        }
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");  // bandwidth-bound: no deeper math pipeline
        fence_acc(d0), fence_acc(d1);
        if constexpr (kTwo) fence_acc(d2), fence_acc(d3);
        __syncwarp();
        if (lane == 0) {
          mbar_arrive(empty0 + 8 * s);
          if constexpr (kTwo) mbar_arrive(empty0 + 8 * s1);
        }
      }
    };
    if (kTT > 1 && two)
      run_slices(std::integral_constant<bool, kTT == 2>{});
    else
      run_slices(std::false_type{});
    // Accumulator fragment of thread (warp w, lane l): d[4j + 2i + c] = D[row 16w + l/4 + 8i][token 8j + 2(l%4) + c];
    // for gate_up, gate and up of one output element sit in the same thread.
    const int r0 = warp * 16 + (lane >> 2), t0 = (lane & 3) * 2;
    // TmaExpertsPlan::rows_evict_last: bits 1 (y, bf16 only) and 2 (act) store with an evict_last policy.
    const bool y_last = (rows_l2 & 1) && y_bf16, act_last = (rows_l2 & 2) != 0;
    uint64_t last_policy = 0;
    if (y_last || act_last) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(last_policy));
    auto store_tile = [&](int tok0, const float(&lo)[16], const float(&hi)[16]) {
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int tok = tok0 + 8 * j + t0 + c, idx = 4 * j + 2 * i + c, r = r0 + 8 * i;
            if (tok >= cnt) continue;
            const size_t row = size_t(e) * kRows + tok;
            if (GATED && !down) {
              const bf16 a = __float2bfloat16(gelu_tanh(lo[idx]) * hi[idx]);
              if (act_last)
                st_bf16_l2_policy(act + row * I + nt * 64 + r, a, last_policy);
              else
                act[row * I + nt * 64 + r] = a;
            } else if (y_last) {
              bf16* const yr = static_cast<bf16*>(y) + row * H + nt * 128 + r;
              st_bf16_l2_policy(yr, __float2bfloat16(lo[idx]), last_policy);
              st_bf16_l2_policy(yr + 64, __float2bfloat16(hi[idx]), last_policy);
            } else {
              store_expert_row(y, y_bf16, row * H + nt * 128 + r, lo[idx]);
              store_expert_row(y, y_bf16, row * H + nt * 128 + 64 + r, hi[idx]);
            }
          }
    };
    if (kTT == 1 || (j0 == 0 && !two)) {  // (the common case with constant slots)
      store_tile(0, d0, d1);
    } else {
      store_tile(kTok * j0, d0, d1);
      if (two) store_tile(kTok, d2, d3);
    }
    // Release this warp's act stores to the down tiles' producers, once a tile's last instance has stored (program
    // order covers the earlier instance's stores of the same warp).
    if (FUSED && !down && cnt > 0 && kTok * (j0 + ntt) >= cnt) {
      __syncwarp();
      if (lane == 0) {
        __threadfence();
        atomicAdd(expert_done + e, 1u);
      }
    }
    if (etl) etl_put(etl, tile, etl_req, etl_t0, etl_now());
    if constexpr (!GATHER) tile += int(gridDim.x);
  }
#endif
}

}  // namespace

namespace {
// Blocks an SM of each kernel instantiation at its shared memory, as experts_tma_supported found them (0: unknown).
constexpr int kMaxInstantiations = 32;
std::pair<const void*, int> g_blocks_per_sm[kMaxInstantiations];
int blocks_per_sm_of(const void* kernel) {
  for (const auto& [k, n] : g_blocks_per_sm)
    if (k == kernel) return n;
  return 0;
}
}  // namespace

bool experts_tma_supported(int M, int H, int I) {
  if (M != kTok || H % 128 != 0 || I % 64 != 0 || H <= 0 || I <= 0) return false;
  static const bool ok = [] {
    if (!sm90a_image_of(experts_tma_k<true, kStagesShared>)) return false;
    for (auto [k, stages] : {std::pair{experts_tma_k<true, kStagesShared>, kStagesShared},
                             std::pair{experts_tma_k<false, kStagesShared>, kStagesShared},
                             std::pair{experts_tma_k<true, kStagesShared3>, kStagesShared3},
                             std::pair{experts_tma_k<false, kStagesShared3>, kStagesShared3},
                             std::pair{experts_tma_k<true, kStagesShared5>, kStagesShared5},
                             std::pair{experts_tma_k<false, kStagesShared5>, kStagesShared5},
                             std::pair{experts_tma_k<true, kStagesOwn>, kStagesOwn},
                             std::pair{experts_tma_k<false, kStagesOwn>, kStagesOwn},
                             std::pair{experts_tma_k<true, kStagesShared, true>, kStagesShared},
                             std::pair{experts_tma_k<true, kStagesShared3, true>, kStagesShared3},
                             std::pair{experts_tma_k<true, kStagesShared5, true>, kStagesShared5},
                             std::pair{experts_tma_k<true, kStagesOwn, true>, kStagesOwn},
                             std::pair{experts_tma_k<true, kStagesShared, true, true>, kStagesShared},
                             std::pair{experts_tma_k<true, kStagesShared3, true, true>, kStagesShared3},
                             std::pair{experts_tma_k<true, kStagesShared5, true, true>, kStagesShared5},
                             std::pair{experts_tma_k<true, kStagesOwn, true, true>, kStagesOwn},
                             std::pair{experts_tma_k<true, kStagesShared3, true, true, true>, kStagesShared3},
                             std::pair{experts_tma_k<true, kStagesShared, true, true, false, true>, kStagesShared},
                             std::pair{experts_tma_k<true, kStagesShared3, true, true, false, true>, kStagesShared3},
                             std::pair{experts_tma_k<true, kStagesShared5, true, true, false, true>, kStagesShared5},
                             std::pair{experts_tma_k<true, kStagesOwn, true, true, false, true>, kStagesOwn},
                             std::pair{experts_tma_k<true, kStagesShared3, true, true, true, true>, kStagesShared3}})
    {
      CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes(stages)));
      int per_sm = 0;
      CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, kThreads, size_t(smem_bytes(stages))));
      static int n = 0;
      if (n < kMaxInstantiations) g_blocks_per_sm[n++] = {reinterpret_cast<const void*>(k), std::max(per_sm, 1)};
    }
    return true;
  }();
  return ok;
}

namespace {
// One thread per 16-byte chunk of the checkpoint layout: gate_up [E * 2I rows, H] or (DOWN) down [E * H rows, I].
template <bool DOWN>
__global__ void pack_expert_k(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t chunks, int H, int I) {
  const int rows = DOWN ? H : 2 * I, row_chunks = (DOWN ? I : H) / 8;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < chunks; i += size_t(gridDim.x) * blockDim.x) {
    const size_t row = i / size_t(row_chunks);
    const int kc = int(i % size_t(row_chunks)), e = int(row / size_t(rows)), r = int(row % size_t(rows));
    dst[(DOWN ? expert_down_packed_offset(e, r, kc * 8, H, I) : expert_gate_up_packed_offset(e, r, kc * 8, H, I)) /
        8] = src[i];
  }
}

template <bool DOWN>
void pack_expert(const char* what, const bf16* src, bf16* dst, int E, int H, int I, cudaStream_t s) {
  if (!(DOWN ? expert_down_packable(H, I) : expert_gate_up_packable(H, I)))
    throw_cuda_error(what, DOWN ? "needs H a multiple of 128 and I of 64" : "needs H and I multiples of 64", 0,
                     __FILE__, __LINE__);
  if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) != 0)
    throw_cuda_error(what, "src and dst must be 16-byte aligned", 0, __FILE__, __LINE__);
  const size_t chunks = size_t(E) * size_t(H) * size_t(I) * (DOWN ? 1 : 2) / 8;
  if (chunks == 0) return;
  const unsigned grid = unsigned(std::min<size_t>((chunks + 255) / 256, size_t(sm_count()) * 16));
  pack_expert_k<DOWN><<<grid, 256, 0, s>>>(reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst), chunks,
                                           H, I);
  CUDA_CHECK_LAUNCH();
}
}  // namespace

void pack_expert_gate_up(const bf16* src, bf16* dst, int E, int H, int I, cudaStream_t s) {
  pack_expert<false>("pack_expert_gate_up", src, dst, E, H, I, s);
}
void pack_expert_down(const bf16* src, bf16* dst, int E, int H, int I, cudaStream_t s) {
  pack_expert<true>("pack_expert_down", src, dst, E, H, I, s);
}

namespace {
// The grid of a launch that shares every SM (plan.sms <= 0): the blocks of `kernel` resident at once on every SM
// (its shared memory and registers decide), or plan.grid, capped at the tile count. Block b's first tile is tile b.
// Never more than fit at once: the fused launch's down tiles wait for gate_up tiles that every block's first tile
// holds, so a block that could not start until another one leaves would deadlock it.
// The occupancy is queried once per kernel (experts_tma_supported, before any launch or stream capture).
template <class Kernel>
int shared_sm_grid(Kernel kernel, int smem, const TmaExpertsPlan& plan, int tiles) {
  int per_sm = blocks_per_sm_of(reinterpret_cast<const void*>(kernel));
  if (per_sm <= 0) {
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, size_t(smem)));
    per_sm = std::max(per_sm, 1);
  }
  return std::min(tiles, plan.grid > 0 ? std::min(plan.grid, per_sm * sm_count()) : per_sm * sm_count());
}

template <bool GATED, bool GATHER, bool FUSED = false, bool TWO = false>
void launch_experts_tma(const TmaMap& w, const TmaMap& x, const int32_t* rows, int E, int H, int I, bf16* act,
                        ExpertRows y, const TmaExpertsPlan& plan, cudaStream_t s, const bf16* xg = nullptr,
                        const int32_t* slot_token = nullptr, const unsigned* masks = nullptr, int mask_words = 0) {
  const int tiles = E * (GATED ? I / 64 : H / 128);
  if (tiles == 0) return;
  if (((reinterpret_cast<uintptr_t>(plan.gate_up_packed) | reinterpret_cast<uintptr_t>(plan.down_packed)) & 15) != 0)
    throw_cuda_error("experts_tma", "packed expert weights must be 16-byte aligned", 0, __FILE__, __LINE__);
  CUtensorMap mw, mx;
  std::memcpy(&mw, &w, sizeof mw);
  std::memcpy(&mx, &x, sizeof mx);
  const int pf = std::max(0, plan.l2_prefetch_slices);
  // With the PDL attribute (launch.cuh; dropped while pdl_enabled() is false): the kernel's producer streams its
  // first stages' weights before griddepcontrol.wait (see the kernel).
  auto go = [&](auto kernel, int stages, int grid) {
    const int stride = std::max(plan.first_tile_stride, 1);
    const int first_stride = std::gcd(stride, grid) == 1 ? stride : 1;  // a permutation of [0, grid) or none
    launch_pdl(kernel, dim3(unsigned(grid)), dim3(kThreads), size_t(smem_bytes(stages)), s, mw, mx, rows, E, H, I,
               act, y.p, y.is_bf16, pf, plan.prewait_stages, xg, slot_token, GATHER ? plan.tile_counters : nullptr,
               masks, mask_words, GATED ? plan.gate_up_packed : nullptr, FUSED || !GATED ? plan.down_packed : nullptr,
               plan.claim_ahead, first_stride, plan.rows_evict_last);
  };
  if (plan.sms <= 0 || plan.sms >= sm_count()) {
    // Every SM shared: the grid by the launched kernel's occupancy.
    auto go_shared = [&](auto kernel, int stages) {
      go(kernel, stages, shared_sm_grid(kernel, smem_bytes(stages), plan, tiles));
    };
    if constexpr (FUSED) {
      if (g_etl_buf && plan.stages == kStagesShared3) {  // experts_timeline_begin
        go_shared(experts_tma_k<GATED, kStagesShared3, GATHER, FUSED, true, TWO>, kStagesShared3);
        return;
      }
    }
    if (plan.stages == kStagesShared3)
      go_shared(experts_tma_k<GATED, kStagesShared3, GATHER, FUSED, false, TWO>, kStagesShared3);
    else if (plan.stages == kStagesShared5)
      go_shared(experts_tma_k<GATED, kStagesShared5, GATHER, FUSED, false, TWO>, kStagesShared5);
    else
      go_shared(experts_tma_k<GATED, kStagesShared, GATHER, FUSED, false, TWO>, kStagesShared);
  } else {
    go(experts_tma_k<GATED, kStagesOwn, GATHER, FUSED, false, TWO>, kStagesOwn, std::min(tiles, plan.sms));
  }
}

// Test support: sleeps, then copies (below).
__global__ void delayed_copy_k(const unsigned char* __restrict__ src0, unsigned char* __restrict__ dst0, size_t n0,
                               const unsigned char* __restrict__ src1, unsigned char* __restrict__ dst1, size_t n1,
                               unsigned long long delay_ns) {
  pdl_wait();     // as every kernel: its own predecessor first
  pdl_trigger();  // then let the kernel under test start while this one still sleeps
  if (delay_ns > 0) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
      __nanosleep(2000);
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < delay_ns);
  }
  const size_t stride = size_t(gridDim.x) * blockDim.x, first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  auto copy = [&](const unsigned char* src, unsigned char* dst, size_t n) {
    if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) | n) & 15) == 0) {
      const uint4* s4 = reinterpret_cast<const uint4*>(src);
      uint4* d4 = reinterpret_cast<uint4*>(dst);
      for (size_t i = first; i < n / 16; i += stride) d4[i] = s4[i];
    } else {
      for (size_t i = first; i < n; i += stride) dst[i] = src[i];
    }
  };
  copy(src0, dst0, n0);
  copy(src1, dst1, n1);
}
}  // namespace

void moe_gate_up_padded_tma(const TmaMap& w, const TmaMap& xs, const int32_t* rows, int E, int H, int I, bf16* act,
                            cudaStream_t s, const TmaExpertsPlan& plan) {
  launch_experts_tma<true, false>(w, xs, rows, E, H, I, act, nullptr, plan, s);
}

void moe_gate_up_padded_tma_gathered(const TmaMap& w, const bf16* x, const int32_t* slot_token, const int32_t* rows,
                                     int E, int H, int I, bf16* act, cudaStream_t s, const TmaExpertsPlan& plan) {
  if ((reinterpret_cast<uintptr_t>(x) & 15) != 0 || H % 8 != 0)
    throw_cuda_error("moe_gate_up_padded_tma_gathered", "x must be 16-byte aligned with H a multiple of 8", 0,
                     __FILE__, __LINE__);
  launch_experts_tma<true, true>(w, w, rows, E, H, I, act, nullptr, plan, s, x, slot_token);
}

void moe_gate_up_padded_tma_masked(const TmaMap& w, const bf16* x, const unsigned* expert_masks, int T, int E, int H,
                                   int I, bf16* act, cudaStream_t s, const TmaExpertsPlan& plan) {
  if ((reinterpret_cast<uintptr_t>(x) & 15) != 0 || H % 8 != 0 || T < 1 || T > 32 * 32)
    throw_cuda_error("moe_gate_up_padded_tma_masked", "x must be 16-byte aligned, H a multiple of 8, 1 <= T <= 1024",
                     0, __FILE__, __LINE__);
  launch_experts_tma<true, true>(w, w, nullptr, E, H, I, act, nullptr, plan, s, x, nullptr, expert_masks,
                                 (T + 31) / 32);
}

void moe_down_padded_tma(const TmaMap& w, const TmaMap& act, const int32_t* rows, int E, int H, int I, ExpertRows y,
                         cudaStream_t s, const TmaExpertsPlan& plan) {
  launch_experts_tma<false, false>(w, act, rows, E, H, I, nullptr, y, plan, s);
}

void moe_down_padded_tma_masked(const TmaMap& w, const TmaMap& act, const unsigned* expert_masks, int T, int E, int H,
                                int I, ExpertRows y, cudaStream_t s, const TmaExpertsPlan& plan) {
  if (T < 1 || T > 32 * 32)
    throw_cuda_error("moe_down_padded_tma_masked", "needs 1 <= T <= 1024", 0, __FILE__, __LINE__);
  launch_experts_tma<false, false>(w, act, nullptr, E, H, I, nullptr, y, plan, s, nullptr, nullptr, expert_masks,
                                   (T + 31) / 32);
}

void moe_experts_fused_tma_masked(const TmaMap& w_gate_up, const TmaMap& w_down, const bf16* x,
                                  const unsigned* expert_masks, int T, int E, int H, int I, bf16* act, ExpertRows y,
                                  cudaStream_t s, const TmaExpertsPlan& plan) {
  if ((reinterpret_cast<uintptr_t>(x) & 15) != 0 || (reinterpret_cast<uintptr_t>(act) & 15) != 0 || H % 8 != 0 ||
      T < 1 || T > 32 * 32)
    throw_cuda_error("moe_experts_fused_tma_masked",
                     "x and act must be 16-byte aligned, H a multiple of 8, 1 <= T <= 1024", 0, __FILE__, __LINE__);
  if (!plan.tile_counters)
    throw_cuda_error("moe_experts_fused_tma_masked", "needs plan.tile_counters (2 + E zeroed unsigneds)", 0,
                     __FILE__, __LINE__);
  // The grid is capped at the gate_up tile count (launch_experts_tma), so every block's first tile is a gate_up
  // tile and all gate_up tiles are handed out before any down tile.
  if (plan.two_token_tiles)
    launch_experts_tma<true, true, true, true>(w_gate_up, w_down, nullptr, E, H, I, act, y, plan, s, x, nullptr,
                                               expert_masks, (T + 31) / 32);
  else
    launch_experts_tma<true, true, true>(w_gate_up, w_down, nullptr, E, H, I, act, y, plan, s, x, nullptr,
                                         expert_masks, (T + 31) / 32);
}

void delayed_copy_for_test(const void* src0, void* dst0, size_t bytes0, const void* src1, void* dst1, size_t bytes1,
                           int delay_us, cudaStream_t s) {
  launch_pdl(delayed_copy_k, dim3(128), dim3(256), 0, s, static_cast<const unsigned char*>(src0),
             static_cast<unsigned char*>(dst0), bytes0, static_cast<const unsigned char*>(src1),
             static_cast<unsigned char*>(dst1), bytes1,
             static_cast<unsigned long long>(std::max(0, delay_us)) * 1000ull);
}

void experts_timeline_begin(size_t capacity) {
  experts_timeline_end();  // drop any earlier buffer
  const unsigned zero = 0, cap = unsigned(capacity);
  CUDA_CHECK(cudaMalloc(&g_etl_buf, std::max<size_t>(capacity, 1) * sizeof(ExpertsTimelineRecord)));
  g_etl_buf_cap = cap;
  CUDA_CHECK(cudaMemcpyToSymbol(g_etl_n, &zero, sizeof zero));
  CUDA_CHECK(cudaMemcpyToSymbol(g_etl_cap, &cap, sizeof cap));
  CUDA_CHECK(cudaMemcpyToSymbol(g_etl, &g_etl_buf, sizeof g_etl_buf));
}
bool experts_timeline_recording() { return g_etl_buf != nullptr; }
std::vector<ExpertsTimelineRecord> experts_timeline_end() {
  if (!g_etl_buf) return {};
  CUDA_CHECK(cudaDeviceSynchronize());
  unsigned n = 0;
  CUDA_CHECK(cudaMemcpyFromSymbol(&n, g_etl_n, sizeof n));
  std::vector<ExpertsTimelineRecord> out(std::min(n, g_etl_buf_cap));
  if (!out.empty())
    CUDA_CHECK(cudaMemcpy(out.data(), g_etl_buf, out.size() * sizeof(ExpertsTimelineRecord), cudaMemcpyDeviceToHost));
  ExpertsTimelineRecord* none = nullptr;
  CUDA_CHECK(cudaMemcpyToSymbol(g_etl, &none, sizeof none));
  CUDA_CHECK(cudaFree(g_etl_buf));
  g_etl_buf = nullptr, g_etl_buf_cap = 0;
  return out;
}

}  // namespace dg::cuda
