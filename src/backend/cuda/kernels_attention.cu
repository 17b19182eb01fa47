// Flash attention on tensor cores, FlashAttention-2 style: rows are (query, head-of-the-group) pairs of one kv head,
// so the K/V tiles of a kv head serve all its query heads. Four kernels (launch<D> picks):
//   attention_ws_k<512>   Hopper (sm_90a build loaded), D = 512: attention_ws_k (below) in clusters of two blocks per
//                         128-row tile, each with half the head dim, the partial S swapped through distributed shared
//                         memory as attention_wgx_k does (WsCfg::pair). The default at D = 512 (set_attention_ws512).
//   attention_wgx_k<512>  Hopper, D = 512: the same split of the head dim over a cluster pair, not warp-specialized
//                         (every thread loads by cp.async, one block barrier a tile; below).
//   attention_ws_k<256>   Hopper, D = 256: attention_wg_k's math, warp-specialized (a loading warpgroup, two computing
//                         warpgroups; below). The one used at D = 256 on Hopper.
//   attention_wg_k<256>   Hopper, D = 256: wgmma (Q, K, V from shared memory, P from registers), 128-row blocks
//                         (kWs256 false).
//   attention_k<D>        everything else (other GPUs, other head dims): mma.sync m16n8k16, described here.
// All of them: f32 online softmax, P rounded to bf16 for the P.V product (as HF's eager path does), the row sum from the
// unrounded f32 p, the same split-KV with a fixed-order combine; bitwise deterministic (results differ from one kernel
// to another by the tensor cores' summation order, and the wgmma kernels' exp is ex2(s log2 e - m log2 e):
// mask_softmax).
//
// The two wgmma kernels (below) run a software pipeline, FA3's intra-warpgroup overlap: iteration i issues
// S(i) = Q K(i)^T and O += P(i-1) V(i-1) back to back, waits for S(i) only, and does the (D = 512: S exchange and)
// softmax of tile i while the tensor cores run P(i-1) V(i-1); K is loaded one tile ahead of V, so the 2-stage K and V
// rings still fit. H200 (attention_bench; "before" = the kernels before this, built into the same binary; 04:11Z),
// per layer: sliding denoise 43.0 -> 40.0 us, full denoise kv 512 / 4096 / 32768 58.9 -> 50.9 us, 0.242 -> 0.184
// ms, 1.656 -> 1.254 ms, prefill T 4096 sliding 0.364 -> 0.299 ms, full 1.691 -> 1.284 ms; per denoise step (25
// sliding + 5 full) kv 512 / 4096 / 32768 1.369 -> 1.254, 2.285 -> 1.922, 9.356 -> 7.271 ms. Roughly (kv 4096 full
// layer): the pipeline alone 0.242 -> 0.237 ms; load addresses without per-row 64-bit index math (load_tile's fast
// path) and the st.async / mbarrier S exchange of attention_wgx_k (XA) -> 0.218; the folded exp -> 0.206; the XA
// "buffer free" arrive at .release.cta instead of .release.cluster (which compiled to MEMBAR.ALL.GPU, waiting for
// the thread's in-flight loads, once per tile) and stepped wgmma descriptors -> 0.184 ms.
// What limits them now (ncu at kv 4096, before the last step): tensor pipe ~18% active, issue slots ~20% busy,
// ~1170 instructions per warp per 64-key tile, stalls on fixed-latency dependencies and the S wait: two warps per
// scheduler, both warpgroups in lockstep through one __syncthreads per tile. (The producer warpgroup + mbarrier ring
// and ping-pong that this pointed to: attention_ws_k, below.)
//
// Warp specialization and 128-byte swizzled tiles (wip/attn-ws). ncu of the kernels above (H200, sliding denoise,
// attention_wg_k, 36.0 us): the loop's cp.async issue and the wait for it held ~33% of the warps' stall samples, the
// prologue (Q load) 15%, the f32 split-KV stores 12%; every 16-byte cp.async into the core-matrix layout cost 32
// shared-memory wavefronts instead of 4 (a warp wrote 8 rows x 64 bytes: 66% of all wavefronts were excess; the same in
// attention_wgx_k). Splitting that launch 2 / 3 / 4 ways (10 / 7 / 5 key tiles a block): 51.1 / 42.0 / 40.4 us, i.e.
// ~2.1 us a tile and ~30 us fixed (prologue, epilogue, combine, launch). Changes, each measured in one GPU call
// (attention_bench; "main" = the kernels before, built into the same binary; all variants bitwise equal to main, det
// and graph replay bitwise, all checks OK):
//   attention_ws_k (producer warpgroup + mbarrier ring, setmaxnreg), core-matrix layout: sliding 41.2 vs 40.6 us
//     (nothing), sliding prefill T 4096 0.270 vs 0.302 ms; 3 K stages instead of 2: the same.
//   kXWaitCta alone (attention_wgx_k's cluster-scope waits compiled to CCTL.IVALL, 15% of its stall samples): full
//     kv 4096 0.185 vs 0.185 ms (nothing).
//   128-byte swizzle (kWsSw128, kWgxSw128: a warp's cp.async reads 4 rows x 128 contiguous bytes and writes 4 whole
//     128-byte rows; excess wavefronts 2.75 M -> 1.8 K): sliding 38.4 us, full kv 512 / 4096 / 32768 40.0 us,
//     0.141, 0.944 ms (from 50.8 us, 0.186, 1.260), prefill T 4096 sliding 0.238, full 0.984 ms (from 0.302, 1.283).
//   + ping-pong of the two consumer warpgroups (kWsPingPong): sliding 37.6 us, prefill sliding 0.233 ms.
// Final (this file as committed, bin C of that call), main -> now, per layer: sliding denoise 40.3 -> 37.6 us; full
// denoise kv 512 / 4096 / 32768 51.2 -> 39.9 us, 0.186 -> 0.141 ms, 1.257 -> 0.944 ms; prefill T 4096 sliding 0.302
// -> 0.233 ms, full 1.285 -> 0.982 ms; per denoise step (25 sliding + 5 full) kv 512 / 4096 / 32768 1.264 -> 1.139,
// 1.937 -> 1.643, 7.291 -> 5.660 ms; prefill 4096-token chunk 13.98 -> 10.73 ms. (ncu: attention_ws_k 31.6 us,
// attention_wgx_k at kv 4096 135.6 us.) The split-KV combine (~6 us at the sliding shape) is unchanged.
// What limits attention_ws_k now (ncu, before ping-pong): the consumers wait on the full mbarriers (~21% of samples:
// Q 5%, K 7%, V 10%) while the producer waits for its own previous load (it signals one load behind, after
// cp.async.wait_group, so only ~2 loads are in flight). Next: signal with cp.async.mbarrier.arrive.noinc (and the
// proxy fence on the consumer side) or load by TMA (the swizzled layout is what a SWIZZLE_128B tensor map with a
// 64-column box writes: one thread, 4 copies a tile), so that the ring runs a full stage ahead; the same producer for
// attention_wgx_k; the Q load (15% before) off the first tile's critical path.
// Measured since (H200, session 7): the producer signalling with cp.async.mbarrier.arrive.noinc, the consumers fencing
// to the async proxy after each full wait (so every ring stage can be in flight): bitwise the same, no faster
// (sliding denoise 38.1 vs 38.3 us alone, 4K step 17.60 / 17.62 vs 17.60 / 17.67 ms): not kept. ncu of the denoise
// launch (4 x 8 x 4 blocks, 32 us): SMs active 73% of the time, issue slots 24% busy, ~0.45 eligible warps per
// scheduler; the loads in flight are not what holds it.
// Session 8 (a timeline build, attention_bench's TIMELINE=1): every 64-key tile of 128 rows took ~3.1 us a block at any
// block count, and half of it was the consumers waiting for K / V from the cp.async producer. The producer now loads
// each tile whose 64 keys are contiguous in one tensor by TMA (WsKvMaps, one thread, D / 64 boxes straight into the
// swizzled layout), bitwise the same results: sliding denoise 34.8 -> 31.4 us, sliding prefill T 4096 0.228 -> 0.173
// ms (attention_bench, H200). attention_wgx_k still loads by cp.async from all its threads.
// Session 14 (timeline per block): the tiles left on cp.async (the ring's wrap, the cache / canvas boundary, the ragged
// last tile) cost ~3.5 us each, so the split holding two of them set the launch's span (23.5 vs 14.5 us a block).
// Denoise launches now tile the keys by ring run (`runs`, below: every tile one TMA box) and the producer loads Q by
// TMA (`q_tma`): sliding denoise 29.8 -> 24.4 us per layer with its combine, sliding prefill 0.164 -> 0.159 ms (Q
// only), 4K step 16.01 -> 15.80 ms in the same call.
// Tried here and dropped: the split-KV merged inside a cluster of the nsplit CTAs through DSMEM (no workspace, no
// combine launch): bitwise equal to the combine kernel, but the H200 holds only 30 clusters of 4 CTAs with this shared
// memory (15 of 8), and the denoise grids need 32, so it never applied at model shapes; issuing the V loads after
// the softmax (kLateV) was slower (step kv 4096 2.079 vs 2.037 ms).
//
// attention_k layout. A block has 8 warps; each warp owns 16 rows and DW = min(D, 256) columns of the head dim:
//   D <= 256: one warp per 16 rows (BM = 128 rows a block), O = 16 x D f32 in registers (128 / lane at D = 256);
//   D == 512: two warps per 16 rows (BM = 64), each with half the head dim (16 x 512 f32 of O per warp would not
//   fit in registers).
// S = Q K^T stays in registers: its accumulator fragments are re-packed as the bf16 A fragments of P.V (no S/P trip
// through shared memory, as the previous kernel did). At D = 512 each warp of a pair computes the partial S over its
// half of D; the pair swaps partials through a small shared buffer (fragment order, conflict free) behind a
// 64-thread named barrier, and both add them (commutative, so both hold bitwise the same S). Q, K (ldmatrix.x4) and V
// (ldmatrix.x4.trans) fragments come from shared memory; Q plus two stages of K/V fit in <= 212 KB (1 block / SM,
// ~240 registers, no spills).
//
// Loads: 16-byte cp.async, one key tile ahead into a 2-stage K/V ring, one __syncthreads per key tile. (Tried on
// the H200: bulk TMA row copies issued by one warp with full/empty mbarriers and no block barrier in the loop, so
// that warps drift apart. Correct, but slower: sliding denoise 52.8 vs 44.7 us, sliding prefill 0.54 vs 0.39 ms,
// full layers unchanged.) The O rescale is skipped when no row max of the warp moved (alpha == 1 is exact).
//
// H200 (tools/gpu/microbench/attention_bench.cu), per layer, first kernel -> attention_k -> now (wgmma kernels):
// sliding denoise (T 256, 1279 keys) 100 -> 44.3 -> 42.9 us; full denoise at kv 512 / 4096 / 32768: 101 -> 67.7 ->
// 58.5 us, 0.54 -> 0.309 -> 0.242 ms, 4.08 -> 2.146 -> 1.663 ms; prefill T 4096: sliding 0.78 -> 0.390 -> 0.365 ms,
// full 4.29 -> 1.977 -> 1.694 ms. Per denoise step (25 sliding + 5 full): kv 512 3.03 -> 1.445 -> 1.366 ms, kv 4096
// 5.24 -> 2.653 -> 2.284 ms, kv 32768 22.9 -> 11.84 -> 9.39 ms. (attention_k numbers: the same binary with kWgmma off.)
// Tried and dropped (H200, correct but slower): clusters of 2 / 4 row tiles that each load 1/CL of every K/V tile
// into registers and store it into all blocks' shared memory (DSMEM broadcast, one cluster barrier per tile): L2
// traffic fell (ncu L2 busy 72% -> 10%) but time rose: D = 512 kv 4096 0.354 ms (CL 2) / 0.645 ms (CL 4) vs 0.306,
// sliding 71 us (CL 4) vs 43 us.
//
// Split-KV (flash-decoding): a denoise step has T = 256 queries, i.e. only 32 (sliding, g = 2) or 64 (full, g = 8)
// row tiles; when the grid would leave more than half the SMs idle, each row tile's key range is cut into nsplit
// contiguous, BN-aligned chunks (blockIdx.z) that write unnormalized f32 O plus (m, l) to a static workspace, and a
// small combine kernel merges the chunks in fixed order. No atomics anywhere: bitwise deterministic.
//
// Scores are raw dot products (no 1/sqrt(D)), the softmax is f32 online (row max / sum), P is rounded to bf16 for
// the P.V product (as HF's eager path does); the row sum uses the unrounded f32 p.
#include <algorithm>
#include <iterator>
#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/cuda_util.cuh"

namespace dg::cuda {
namespace {

constexpr int kThreads = 256, kWarps = 8;
// Split-KV workspace (partial O in f32 and per-row (m, l)), sized for the largest split the launcher picks: it
// splits only when the grid is small (<= half the SMs), so nsplit * blocks * BM * D stays far below this. One
// attention call at a time uses it (the engine runs its kernels on one stream); a launch that would not fit runs
// unsplit.
constexpr size_t kWsFloats = size_t(8) << 20, kMlFloats = size_t(1) << 20;
__device__ float g_ws_o[kWsFloats];
__device__ float g_ws_ml[kMlFloats];

struct Split {
  int nsplit;
  float* ws_o;   // [nsplit][nkv][rows][D]
  float* ws_ml;  // [nsplit][nkv][rows][2]
  bool discard_o = false;  // set_attention_discard_partials: the combine drops ws_o's lines from L2 once read
};

// Per-block phase timestamps, only in builds with -DDG_ATTN_TIMELINE (tools/gpu/microbench/attention_bench.cu prints
// them; attention_timeline() below): slot 0 / 1 the block's %globaltimer (ns) at entry / after its last store, the
// others clock64 of one consumer thread (kTlEntry and kTlProducerDone: thread 0, on the same SM).
// attention_ws_k also sums, over its tiles, the cycles of each step of the loop (kTlLap*, in loop order).
enum TlSlot {
  kTlEntryNs, kTlEndNs, kTlEntry, kTlSetup, kTlQ, kTlFirstK, kTlFirstTile, kTlLoopEnd, kTlLastPv, kTlStored,
  kTlProducerDone, kTlTiles, kTlLapWaitK, kTlLapPingPong, kTlLapIssueS, kTlLapWaitV, kTlLapIssuePv, kTlLapWaitS,
  kTlLapSoftmax, kTlLapWaitPv, kTlLapPack, kTlSlots
};
#ifdef DG_ATTN_TIMELINE
constexpr int kTlBlocks = 4096;
__device__ long long g_attn_tl[kTlBlocks][kTlSlots];
__device__ __forceinline__ long long tl_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return static_cast<long long>(t);
}
#define DG_TL(cond, slot, value)                                                                                    \
  do {                                                                                                              \
    if (cond) {                                                                                                     \
      const unsigned tl_b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);                         \
      if (tl_b < unsigned(kTlBlocks)) g_attn_tl[tl_b][slot] = (value);                                              \
    }                                                                                                               \
  } while (0)
// Adds the cycles since the previous lap to tl_lap[slot - kTlLapWaitK] (attention_ws_k's loop).
#define DG_TL_LAP(slot)                                     \
  do {                                                      \
    const long long tl_now = clock64();                     \
    tl_lap[(slot) - kTlLapWaitK] += tl_now - tl_last;       \
    tl_last = tl_now;                                       \
  } while (0)
#else
#define DG_TL(cond, slot, value) \
  do {                           \
  } while (0)
#define DG_TL_LAP(slot) \
  do {                  \
  } while (0)
#endif

template <int D>
struct Cfg {
  static constexpr int NS = D > 256 ? D / 256 : 1;  // warps sharing 16 rows (split over the head dim)
  static constexpr int DW = D / NS;                 // head-dim columns per warp
  static constexpr int BM = 16 * kWarps / NS;       // rows per block
  static constexpr int BN = D > 256 ? 32 : 64;      // keys per tile
  static constexpr int LD = D + 8;                  // smem row stride (bf16): 16 B pad, conflict-free ldmatrix
  static constexpr size_t q_bytes = size_t(BM) * LD * 2, kv_bytes = size_t(BN) * LD * 2;
  static constexpr size_t x_bytes = NS > 1 ? size_t(kWarps) * 16 * BN * 4 : 0;
  static constexpr size_t smem = q_bytes + 4 * kv_bytes + x_bytes;
};


// The keys (cache-window indices [jb, je)) that query rows m0 .. m0 + BM - 1 of a kv head see, and the bounds of
// those rows' positions: all keys, or causal with an optional window; then this block's share of them when the keys
// are split (whole BN-key tiles, split after split).
struct KeyRange {
  int64_t q_min, q_max, jb, je;
};
template <int BM, int BN>
__device__ __forceinline__ KeyRange key_range(const AttentionArgs& a, const Split& sp, int split, int m0,
                                              int rows_total, int g) {
  const int last_row = min(rows_total, m0 + BM) - 1;
  KeyRange r{a.q_pos0 + m0 / g, a.q_pos0 + last_row / g, 0, a.n_old + a.T_new};
  if (a.causal) {
    r.je = min(r.je, r.q_max - a.first_pos + 1);
    if (a.window > 0) r.jb = max(int64_t(0), r.q_min - a.window + 1 - a.first_pos);
  }
  if (sp.nsplit > 1) {
    const int64_t tiles = r.je > r.jb ? (r.je - r.jb + BN - 1) / BN : 0;
    const int64_t tps = (tiles + sp.nsplit - 1) / sp.nsplit;
    const int64_t s0 = r.jb + split * tps * BN;
    r.je = min(r.je, s0 + tps * BN);
    r.jb = s0;
  }
  return r;
}

// Where a block of an attention kernel works: the GQA group size g (query heads per kv head), its kv head and key
// split (blockIdx y, z), its first query row m0 (row tile `tile` of `tiles`; causal passes take the latest queries,
// the heaviest tiles, first) and its keys (key_range).
struct BlockPlace {
  int g, kvh, split, rows_total, m0;
  KeyRange kr;
};
template <int BM, int BN>
__device__ __forceinline__ BlockPlace block_place(const AttentionArgs& a, const Split& sp, int tile, int tiles) {
  BlockPlace p;
  p.g = a.nh / a.nkv, p.kvh = int(blockIdx.y), p.split = int(blockIdx.z), p.rows_total = a.T * p.g;
  p.m0 = (a.causal ? tiles - 1 - tile : tile) * BM;
  p.kr = key_range<BM, BN>(a, sp, p.split, p.m0, p.rows_total, p.g);
  return p;
}
// The query positions of a thread's two rows row0 and row0 + 8 (for the causal mask; rows past the last one, the
// tile's padding, take the last row's).
__device__ __forceinline__ void row_positions(const AttentionArgs& a, int row0, int rows_total, int g,
                                              int64_t (&qp)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) qp[h] = a.q_pos0 + min(row0 + h * 8, rows_total - 1) / g;
}

// The end of every attention kernel for one thread: its two rows' l (lane-partial until here) summed over the quad
// (commutative order: all 4 lanes agree bitwise), then the rows written, the normalized bf16 output when the keys
// are not split, else this split's f32 partial O and (m, l). row0: the thread's first row (the second is row0 + 8);
// col0: its first head-dim column (then every 8th, OT of them); o_at(t, c): its accumulator for column chunk t and
// entry c (0..3: row h = c / 2, column col0 + 8 t + c % 2); ml_writer: the one thread per row that writes (m, l).
template <int D, int OT, class OAt>
__device__ __forceinline__ void finish_rows(const AttentionArgs& a, const Split& sp, int split, int kvh, int g,
                                            int rows_total, int row0, int col0, bool ml_writer, const float (&m_r)[2],
                                            float (&l_r)[2], OAt o_at) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_r[h] += __shfl_xor_sync(0xffffffffu, l_r[h], 1);
    l_r[h] += __shfl_xor_sync(0xffffffffu, l_r[h], 2);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int gr = row0 + h * 8;
    if (gr >= rows_total) continue;
    if (sp.nsplit == 1) {
      const float inv = l_r[h] > 0 ? 1.0f / l_r[h] : 0.0f;
      bf16* dst = a.out + (size_t(gr / g) * a.nh + kvh * g + gr % g) * D + col0;
#pragma unroll
      for (int t = 0; t < OT; ++t)
        *reinterpret_cast<__nv_bfloat162*>(dst + t * 8) =
            __floats2bfloat162_rn(o_at(t, 2 * h) * inv, o_at(t, 2 * h + 1) * inv);
    } else {
      const size_t row = (size_t(split) * a.nkv + kvh) * rows_total + gr;
      float* dst = sp.ws_o + row * D + col0;
#pragma unroll
      for (int t = 0; t < OT; ++t)
        *reinterpret_cast<float2*>(dst + t * 8) = make_float2(o_at(t, 2 * h), o_at(t, 2 * h + 1));
      if (ml_writer) *reinterpret_cast<float2*>(sp.ws_ml + row * 2) = make_float2(m_r[h], l_r[h]);
    }
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads, 1) attention_k(AttentionArgs a, Split sp) {
  using C = Cfg<D>;
  constexpr int NS = C::NS, DW = C::DW, BM = C::BM, BN = C::BN, LD = C::LD, NT = BN / 8, OT = DW / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* Qs = reinterpret_cast<bf16*>(smem);
  bf16* KVs = reinterpret_cast<bf16*>(smem + C::q_bytes);  // K0, V0, K1, V1
  float* Xs = reinterpret_cast<float*>(smem + C::q_bytes + 4 * C::kv_bytes);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, grp = lane >> 2, tig = lane & 3;
  const int rg = warp / NS, dp = warp % NS;
  const BlockPlace bp = block_place<BM, BN>(a, sp, int(blockIdx.x), int(gridDim.x));
  const int g = bp.g, kvh = bp.kvh, split = bp.split, rows_total = bp.rows_total, m0 = bp.m0;
  const int64_t q_min = bp.kr.q_min, q_max = bp.kr.q_max;
  int64_t jb = bp.kr.jb, je = bp.kr.je;

  // The lane's two rows (grp, grp + 8 of its 16) and their query positions (for the causal mask).
  int64_t qp[2];
  row_positions(a, m0 + rg * 16 + grp, rows_total, g, qp);
  float o[OT][4];
#pragma unroll
  for (int t = 0; t < OT; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.0f;
  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};

  const uint32_t q_base = static_cast<uint32_t>(__cvta_generic_to_shared(Qs));
  const uint32_t kv_base = static_cast<uint32_t>(__cvta_generic_to_shared(KVs));
  // Q tile (rows past the end zero-filled) in the same cp.async group as the first K/V tile.
  for (int i = tid; i < BM * (D / 8); i += kThreads) {
    const int r = i / (D / 8), c = i % (D / 8), gr = m0 + r;
    const bool ok = gr < rows_total;
    const bf16* src = a.q;
    if (ok) src = a.q + (size_t(gr / g) * a.nh + kvh * g + gr % g) * D + c * 8;
    cp_async16(Qs + r * LD + c * 8, src, ok);
  }
  const int64_t ntiles = je > jb ? (je - jb + BN - 1) / BN : 0;
  auto load_kv = [&](int stage, int64_t j0) {  // rows past the range zero-filled
    bf16* Kd = KVs + size_t(stage * 2) * BN * LD;
    bf16* Vd = Kd + size_t(BN) * LD;
    const int64_t slot0 = (a.first_pos + j0) % a.cap;
    for (int i = tid; i < BN * (D / 8); i += kThreads) {
      const int r = i / (D / 8), c = i % (D / 8);
      const int64_t j = j0 + r;
      const bool ok = j < je;
      const bf16 *ks = a.k_new, *vs = a.v_new;
      if (ok) {
        if (j < a.n_old) {
          int64_t slot = slot0 + r;
          while (slot >= a.cap) slot -= a.cap;
          const size_t off = (size_t(slot) * a.nkv + kvh) * D + c * 8;
          ks = a.k_cache + off, vs = a.v_cache + off;
        } else {
          const size_t off = (size_t(j - a.n_old) * a.nkv + kvh) * D + c * 8;
          ks = a.k_new + off, vs = a.v_new + off;
        }
      }
      cp_async16(Kd + r * LD + c * 8, ks, ok);
      cp_async16(Vd + r * LD + c * 8, vs, ok);
    }
  };
  if (ntiles > 0) load_kv(0, jb);
  cp_async_commit();
  // ldmatrix lane addresses (bytes, relative to the tile). Q (A, x4): rows (lane & 7) + 8 * bit3, cols 8 * bit4.
  const uint32_t q_off = ((rg * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + dp * DW + (lane >> 4) * 8) * 2;
  // K (B, x4): keys (lane & 7) + 8 * bit4, cols 8 * bit3 -> b0, b1 of key tile n0 and of n0 + 8.
  const uint32_t k_off = (((lane & 7) + (lane >> 4) * 8) * LD + dp * DW + ((lane >> 3) & 1) * 8) * 2;
  // V (B, x4.trans): keys (lane & 7) + 8 * bit3, cols 8 * bit4 -> b0, b1 of head-dim tile d0 and of d0 + 8.
  const uint32_t v_off = (((lane & 7) + ((lane >> 3) & 1) * 8) * LD + dp * DW + (lane >> 4) * 8) * 2;

  for (int64_t i = 0; i < ntiles; ++i) {
    const int stage = int(i & 1);
    const int64_t j0 = jb + i * BN;
    cp_async_wait<0>();
    __syncthreads();  // tile i visible to all; every warp is done with the other stage
    if (i + 1 < ntiles) load_kv(stage ^ 1, j0 + BN);
    cp_async_commit();
    const uint32_t k_tile = kv_base + uint32_t(stage * 2) * BN * LD * 2, v_tile = k_tile + BN * LD * 2;

    float s[NT][4];
#pragma unroll
    for (int t = 0; t < NT; ++t) s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.0f;
#pragma unroll 4
    for (int kk = 0; kk < DW; kk += 16) {
      uint32_t qa[4];
      ldsm_x4(qa, q_base + q_off + kk * 2);
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t kb[4];
        ldsm_x4(kb, k_tile + k_off + (np * 16 * LD + kk) * 2);
        mma_bf16(s[2 * np], qa, kb[0], kb[1]);
        mma_bf16(s[2 * np + 1], qa, kb[2], kb[3]);
      }
    }
    if constexpr (NS > 1) {  // swap partial S with the other warp of the pair (warps 2 rg, 2 rg + 1)
      float* mine = Xs + size_t(warp) * NT * 4 * 32;
      const float* other = Xs + size_t(warp ^ 1) * NT * 4 * 32;
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) mine[(t * 4 + e) * 32 + lane] = s[t][e];
      asm volatile("bar.sync %0, 64;\n" ::"r"(1 + rg) : "memory");
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[t][e] += other[(t * 4 + e) * 32 + lane];
    }

    // Mask: keys past the range, and causal / window outside the tile's fully visible part.
    const int64_t kp_lo = a.first_pos + j0, kp_hi = kp_lo + BN - 1;
    const bool full_vis = !a.causal || (kp_hi <= q_min && (a.window == 0 || q_max - kp_lo < a.window));
    if (j0 + BN > je || !full_vis) {
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t j = j0 + t * 8 + tig * 2 + (e & 1), kp = a.first_pos + j, q = qp[e >> 1];
          bool ok = j < je;
          if (a.causal) ok = ok && kp <= q && (a.window == 0 || q - kp < a.window);
          if (!ok) s[t][e] = -INFINITY;
        }
    }

    // Online softmax per row (the 4 lanes of a quad share a row).
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int t = 0; t < NT; ++t) mx = fmaxf(mx, fmaxf(s[t][2 * h], s[t][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_r[h], mx);
      alpha[h] = 1.0f;
      if (m_new != -INFINITY) alpha[h] = m_r[h] == -INFINITY ? 0.0f : __expf(m_r[h] - m_new);
      m_r[h] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          const float p = s[t][e] == -INFINITY ? 0.0f : __expf(s[t][e] - m_new);
          sum += p;
          s[t][e] = p;
        }
      l_r[h] = l_r[h] * alpha[h] + sum;
    }
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {  // once the max settles: skipped
#pragma unroll
      for (int t = 0; t < OT; ++t) {
        o[t][0] *= alpha[0], o[t][1] *= alpha[0];
        o[t][2] *= alpha[1], o[t][3] *= alpha[1];
      }
    }

    // O += P V: the S accumulators of key tiles 2kc, 2kc + 1 are the A fragment of keys kc*16 .. kc*16 + 15.
#pragma unroll
    for (int kc = 0; kc < BN / 16; ++kc) {
      const uint32_t pa[4] = {pack_bf16(s[2 * kc][0], s[2 * kc][1]), pack_bf16(s[2 * kc][2], s[2 * kc][3]),
                              pack_bf16(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                              pack_bf16(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
      for (int dt = 0; dt < OT / 2; ++dt) {
        uint32_t vb[4];
        ldsm_x4_t(vb, v_tile + v_off + (kc * 16 * LD + dt * 16) * 2);
        mma_bf16(o[2 * dt], pa, vb[0], vb[1]);
        mma_bf16(o[2 * dt + 1], pa, vb[2], vb[3]);
      }
    }
  }
  cp_async_wait<0>();

  finish_rows<D, OT>(a, sp, split, kvh, g, rows_total, m0 + rg * 16 + grp, dp * DW + tig * 2, dp == 0 && tig == 0,
                     m_r, l_r, [&](int t, int c) { return o[t][c]; });
}

// Key j's row of kv head kvh from head-dim column col0: in the ring cache (j < n_old, slot (first_pos + j) % cap;
// fp_mod = first_pos % cap) or among the new keys.
// (Unused where the wgmma kernels compile to nothing: sm_80 / sm_89 builds.)
[[maybe_unused]] __device__ __forceinline__ const bf16* key_row(const bf16* cache, const bf16* fresh,
                                                                const AttentionArgs& a, int D, int kvh, int col0,
                                                                int64_t j, int64_t fp_mod) {
  if (j < a.n_old) {
    int64_t slot = fp_mod + j;
    while (slot >= a.cap) slot -= a.cap;
    return cache + (size_t(slot) * a.nkv + kvh) * D + col0;
  }
  return fresh + (size_t(j - a.n_old) * a.nkv + kvh) * D + col0;
}
// Keys j0 .. j0 + 63 as one strided run in one tensor (all valid, no ring wrap, not across the cache / new
// boundary): the first one's row (as key_row), else null. The tile loaders' fast path.
[[maybe_unused]] __device__ __forceinline__ const bf16* contiguous_keys(const bf16* cache, const bf16* fresh,
                                                                        const AttentionArgs& a, int D, int kvh,
                                                                        int col0, int64_t j0, int64_t je,
                                                                        int64_t fp_mod) {
  if (j0 + 64 > je) return nullptr;
  if (j0 + 64 <= a.n_old) {
    int64_t s0 = fp_mod + j0;
    if (s0 >= a.cap) s0 -= a.cap;
    return s0 + 64 <= a.cap ? cache + (size_t(s0) * a.nkv + kvh) * D + col0 : nullptr;
  }
  return j0 >= a.n_old ? fresh + (size_t(j0 - a.n_old) * a.nkv + kvh) * D + col0 : nullptr;
}

// ---- the split-KV merge (attention_combine_k) ----------------------------------------------------------------------
// Row `row` (kv head * rows_total + its row) of the nsplit partials (split s at s * stride + row): its splits' weights
// exp(m_s - max m) in split order (0 for a split that saw no key of the row), 1 / sum w_s l_s, and then four columns
// of the merged, normalized output. (Session 14 also ran these at the end of the attention blocks themselves, each
// block merging its share of its row tile's rows once all the tile's splits had counted in: bitwise the same, but
// no faster than this kernel: 4K step 15.83-15.88 vs 15.80-15.81 ms.)
constexpr int kCombineSplits = 8;
struct CombineWeights {
  float w[kCombineSplits];
  float inv;
  unsigned live;  // bit s: split s saw a key of the row (m_s > -inf)
};
// The weights from the ns <= N splits' (m, l) pairs, already loaded.
template <int N>
__device__ __forceinline__ CombineWeights combine_weights_of(const float2 (&ml)[N], int ns) {
  CombineWeights cw;
  float mx = -INFINITY;
#pragma unroll
  for (int s = 0; s < N; ++s)
    if (s < ns) mx = fmaxf(mx, ml[s].x);
  float L = 0.0f;
  cw.live = 0;
#pragma unroll
  for (int s = 0; s < N; ++s) {
    cw.w[s] = 0.0f;
    if (s < ns && ml[s].x != -INFINITY) {
      cw.w[s] = __expf(ml[s].x - mx);
      L += cw.w[s] * ml[s].y;
      cw.live |= 1u << s;
    }
  }
  cw.inv = L > 0 ? 1.0f / L : 0.0f;
  return cw;
}
__device__ __forceinline__ CombineWeights combine_weights(const Split& sp, size_t stride, int64_t row) {
  float2 ml[kCombineSplits];
#pragma unroll
  for (int s = 0; s < kCombineSplits; ++s)
    if (s < sp.nsplit) ml[s] = *reinterpret_cast<const float2*>(sp.ws_ml + (s * stride + row) * 2);
  return combine_weights_of(ml, sp.nsplit);
}
// Four merged, normalized columns from the ns <= N splits' partial chunks v (already loaded; dead splits unused),
// stored as bf16 at dst.
template <int N>
__device__ __forceinline__ void combine_store4(const float4 (&v)[N], int ns, const CombineWeights& cw, bf16* dst) {
  float4 acc = make_float4(0, 0, 0, 0);
#pragma unroll
  for (int s = 0; s < N; ++s)
    if (s < ns && (cw.live >> s & 1u))
      acc.x += cw.w[s] * v[s].x, acc.y += cw.w[s] * v[s].y, acc.z += cw.w[s] * v[s].z, acc.w += cw.w[s] * v[s].w;
  *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(acc.x * cw.inv, acc.y * cw.inv);
  *reinterpret_cast<__nv_bfloat162*>(dst + 2) = __floats2bfloat162_rn(acc.z * cw.inv, acc.w * cw.inv);
}
__device__ __forceinline__ void combine_chunk(const Split& sp, size_t stride, int64_t row, int D, int c,
                                              const CombineWeights& cw, bf16* dst) {
  float4 v[kCombineSplits];
#pragma unroll
  for (int s = 0; s < kCombineSplits; ++s)
    if (s < sp.nsplit && (cw.live >> s & 1u))
      v[s] = *reinterpret_cast<const float4*>(sp.ws_o + (s * stride + row) * D + c);
  combine_store4(v, sp.nsplit, cw, dst + c);
}

// ---- shared by the wgmma kernels ------------------------------------------------------------------------------------
// One 64-key x W-column bf16 tile (K or V rows j0 .. j0 + 63 of kv head kvh, head-dim columns col0 .. col0 + W - 1;
// rows at or past je zero-filled) into the no-swizzle core-matrix layout (16 W bytes per 8-row group): 16-byte chunk
// i = tid + 256 k -> row 8 (hi / (W / 16)) + (lo & 7), column chunk 2 (hi % (W / 16)) + (lo >> 3), lo = i & 15,
// hi = i >> 4 (8 consecutive threads fill one 128-byte core matrix: no bank conflicts). fp_mod = first_pos % cap;
// cached keys are j < n_old <= cap.
template <int W>
__device__ __forceinline__ void load_tile(unsigned char* dst, const bf16* cache, const bf16* fresh,
                                          const AttentionArgs& a, int D, int kvh, int col0, int64_t j0, int64_t je,
                                          int64_t fp_mod, int tid) {
  constexpr int kChunks = 64 * W / 8 / kThreads;
  // Fast path (all but the boundary tiles): the 64 keys are valid and contiguous in one tensor (no ring wrap, not
  // across the cache / new boundary), so a row's address is the tile's plus r rows.
  const bf16* tb = contiguous_keys(cache, fresh, a, D, kvh, col0, j0, je, fp_mod);
  if (tb) {  // chunk k of this thread: row r0 + k * (2048 / W), the same column chunk; 4096 bytes further in smem
    static_assert(W <= 256 && 256 % W == 0, "");
    const int lo = tid & 15, hi = tid >> 4;
    const int r0 = (hi / (W / 16)) * 8 + (lo & 7), c8 = (hi % (W / 16)) * 2 + (lo >> 3);
    const size_t step = size_t(2048 / W) * a.nkv * D;
    const bf16* src = tb + size_t(r0) * a.nkv * D + c8 * 8;
    unsigned char* d = dst + (r0 >> 3) * (W * 16) + c8 * 128 + (r0 & 7) * 16;
#pragma unroll
    for (int k = 0; k < kChunks; ++k, src += step) cp_async16(d + k * 4096, src, true);
    return;
  }
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int i = tid + k * kThreads, lo = i & 15, hi = i >> 4;
    const int r = (hi / (W / 16)) * 8 + (lo & 7), c8 = (hi % (W / 16)) * 2 + (lo >> 3);
    const int64_t j = j0 + r;
    const bool ok = j < je;
    const bf16* src = ok ? key_row(cache, fresh, a, D, kvh, col0, j, fp_mod) + c8 * 8 : fresh;
    cp_async16(dst + (r >> 3) * (W * 16) + c8 * 128 + (r & 7) * 16, src, ok);
  }
}

// The 128-row Q tile (rows m0 .. m0 + 127 of kv head kvh's (query, head) rows, head-dim columns col0 .. col0 + W - 1;
// rows past rows_total zero-filled) in the same layout and chunk mapping as load_tile: thread tid fills rows
// r0 + k (2048 / W), stepping (query, head) = (row / g, row % g) without a division per row.
template <int W>
__device__ __forceinline__ void load_q_tile(unsigned char* dst, const AttentionArgs& a, int D, int kvh, int g, int col0,
                                            int m0, int rows_total, int tid) {
  static_assert(W <= 256 && 256 % W == 0, "");
  constexpr int kChunks = 128 * W / 8 / kThreads, kStep = 2048 / W;
  const int lo = tid & 15, hi = tid >> 4;
  const int r0 = (hi / (W / 16)) * 8 + (lo & 7), c8 = (hi % (W / 16)) * 2 + (lo >> 3);
  unsigned char* d = dst + (r0 >> 3) * (W * 16) + c8 * 128 + (r0 & 7) * 16;
  int gr = m0 + r0, qt = gr / g, hh = gr % g;
  const int dq = kStep / g, dh = kStep % g;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const bool ok = gr < rows_total;
    const bf16* src = a.q;
    if (ok) src = a.q + (size_t(qt) * a.nh + kvh * g + hh) * D + col0 + c8 * 8;
    cp_async16(d + k * 4096, src, ok);
    gr += kStep, qt += dq, hh += dh;
    if (hh >= g) hh -= g, ++qt;
  }
}

// The wgmma loops issue the cp.async loads of K(i+1) right after the wgmmas of iteration i; V(i) with them
// (kLateV false) or after the softmax of tile i (true: the softmax starts sooner, V has less time to land).
[[maybe_unused]] constexpr bool kLateV = false;

// Mask (keys past je; causal / window outside the tile's fully visible part) and the online softmax of one S tile in
// wgmma accumulator order (s[4 t + e]: key 8 t + 2 tig + (e & 1), row grp + 8 (e >> 1) of the warp's 16): row max
// over the quad, alpha = exp(m_old - m_new), p = exp(s - m_new) written back into s, lane-partial row sums.
template <int NT>
__device__ __forceinline__ void mask_softmax(float (&s)[NT * 4], float (&alpha)[2], float (&m_r)[2], float (&l_r)[2],
                                             const AttentionArgs& a, int64_t j0, int64_t je, int64_t q_min,
                                             int64_t q_max, const int64_t (&qp)[2], int tig) {
  constexpr int BN = NT * 8;
  const int64_t kp_lo = a.first_pos + j0, kp_hi = kp_lo + BN - 1;
  const bool full_vis = !a.causal || (kp_hi <= q_min && (a.window == 0 || q_max - kp_lo < a.window));
  if (j0 + BN > je || !full_vis) {
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t j = j0 + t * 8 + tig * 2 + (e & 1), kp = a.first_pos + j, q = qp[e >> 1];
        bool ok = j < je;
        if (a.causal) ok = ok && kp <= q && (a.window == 0 || q - kp < a.window);
        if (!ok) s[t * 4 + e] = -INFINITY;
      }
  }
  // exp(x - m) as ex2(x log2 e - m log2 e): one FFMA + MUFU per element (s = -inf -> ex2(-inf) = 0; a row with
  // no visible key yet (m = -inf) uses 0 for the max); max and sum in two independent chains.
  constexpr float kL2e = 1.4426950408889634f;
  auto ex2_approx = [](float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
  };
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int t = 0; t < NT; t += 2) {
      mx0 = fmaxf(mx0, fmaxf(s[t * 4 + 2 * h], s[t * 4 + 2 * h + 1]));
      mx1 = fmaxf(mx1, fmaxf(s[t * 4 + 4 + 2 * h], s[t * 4 + 4 + 2 * h + 1]));
    }
    float mx = fmaxf(mx0, mx1);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_r[h], mx);
    const float mb = m_new == -INFINITY ? 0.0f : m_new * kL2e;
    alpha[h] = 1.0f;
    if (m_new != -INFINITY) alpha[h] = m_r[h] == -INFINITY ? 0.0f : ex2_approx(m_r[h] * kL2e - mb);
    m_r[h] = m_new;
    float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float p0 = ex2_approx(s[t * 4 + 2 * h] * kL2e - mb), p1 = ex2_approx(s[t * 4 + 2 * h + 1] * kL2e - mb);
      s[t * 4 + 2 * h] = p0, s[t * 4 + 2 * h + 1] = p1;
      if (t & 1) sum1 += p0 + p1;
      else sum0 += p0 + p1;
    }
    l_r[h] = l_r[h] * alpha[h] + (sum0 + sum1);
  }
}

// After a tile's softmax (wgmma accumulator order): O rescaled by alpha (skipped while no row of the warp has a new
// max), and P rounded to bf16 into the A fragments of the P.V wgmma.
template <int NO, int NS, int NP>
__device__ __forceinline__ void rescale_o_pack_p(float (&o)[NO], const float (&alpha)[2], const float (&s)[NS],
                                                 uint32_t (&pa)[NP][4]) {
  static_assert(NO % 4 == 0 && NS == 8 * NP, "wgmma accumulator shapes");
  if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
    for (int t = 0; t < NO / 4; ++t) {
      o[t * 4 + 0] *= alpha[0], o[t * 4 + 1] *= alpha[0];
      o[t * 4 + 2] *= alpha[1], o[t * 4 + 3] *= alpha[1];
    }
  }
#pragma unroll
  for (int kc = 0; kc < NP; ++kc)
#pragma unroll
    for (int r = 0; r < 4; ++r) pa[kc][r] = pack_bf16(s[8 * kc + 2 * r], s[8 * kc + 2 * r + 1]);
}

// ---- wgmma path (sm_90a), D = 256 ---------------------------------------------------------------------------------
// A block is 2 warpgroups, each owning 64 rows (BM = 128), O = 64 x 256 f32 (128 registers / thread). S = Q K^T:
// wgmma m64n64k16 with Q and K from shared memory (K-major); O += P V: wgmma m64n256k16 with P (bf16, the S
// accumulators re-packed exactly as in the mma.sync kernel) from registers and V from shared memory (MN-major, the
// transpose bit). Tiles are stored in the no-swizzle core-matrix layout: element (r, c) at
// (r / 8) * RS + (c / 8) * 128 + (r % 8) * 16 + (c % 8) * 2 bytes, RS = 16 D, written by 16-byte cp.async (each 8
// consecutive threads fill one 128-byte core matrix: no bank conflicts). Descriptors: K-major LBO = 128 (next 8
// columns), SBO = RS (next 8 rows); V (MN-major) LBO = RS (next 8 keys), SBO = 128 (next 8 columns); the swapped pair
// reads past shared memory (seen: illegal address). Same tiles, split and combine as attention_k. The same kernel with
// two warpgroups splitting D = 512 over one 64-row tile (partial S swapped through shared memory) was measured and
// dropped: no faster than attention_k (kv 4096 0.306 vs 0.309 ms, kv 512 72.7 vs 68.4 us, causal prefill 2.19 vs
// 1.98 ms), both L2 bound.
template <int D>
struct WgCfg {
  static_assert(D == 256, "O = 64 rows x D f32 per warpgroup: 128 registers a thread at D = 256");
  static constexpr int BM = 128, BN = 64;
  static constexpr int RS = D * 16;  // bytes of an 8-row group
  static constexpr size_t q_bytes = size_t(BM) * D * 2, kv_bytes = size_t(BN) * D * 2;
  static constexpr size_t smem = q_bytes + 4 * kv_bytes;  // 192 KB
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DG_ATTN_WGMMA 1
// Shared-memory matrix descriptor, no swizzle: start, leading (LBO) and stride (SBO) byte offsets.
// (saddr >> 4 stays below 2^14 for any shared-memory address of these kernels, so a descriptor plus n is the
// descriptor of saddr + 16 n: the loops step descriptors instead of rebuilding them.)
__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((saddr >> 4) & 0x3FFFu) | (uint64_t((lbo >> 4) & 0x3FFFu) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFFu) << 32);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void reg_fence(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
__device__ __forceinline__ void wg_ss_n64(float (&d)[32], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(1));
}
__device__ __forceinline__ void wg_rs_n128_t(float (&d)[64], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
__device__ __forceinline__ void wg_rs_n256_t(float (&d)[128], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, {%128,%129,%130,%131}, %132, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
#endif

// attention_wgx_k's mbarrier waits: acquire at CTA scope (true), as CUTLASS's ClusterBarrier::wait does for data that
// a peer's async stores bring (st.async / TMA multicast, complete_tx) and for remote "empty" arrives, or at cluster
// scope (false: the wait compiled to a CCTL.IVALL, an L1 invalidate that first waited for the thread's in-flight K/V
// cp.async loads, every tile; ncu at kv 4096: 15% of the warps' stall samples on it). Alone it changed nothing
// measurable (kv 4096 0.185 ms either way); it is on in the measured configuration (with kWgxSw128).
[[maybe_unused]] constexpr bool kXWaitCta = true;
#if defined(DG_ATTN_WGMMA)
// Waits for the phase of parity `parity` of a shared-memory mbarrier to complete (see kXWaitCta).
__device__ __forceinline__ void mbar_wait(uint32_t addr, uint32_t parity) {
  if constexpr (kXWaitCta) {
    asm volatile(
        "{\n.reg .pred P1;\nLAB_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
        "@P1 bra DONE;\nbra LAB_WAIT;\nDONE:\n}\n" ::"r"(addr),
        "r"(parity)
        : "memory");
    return;
  }
  asm volatile(
      "{\n.reg .pred P1;\nLAB_WAIT:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra DONE;\nbra LAB_WAIT;\nDONE:\n}\n" ::"r"(addr),
      "r"(parity)
      : "memory");
}
#endif
#if defined(DG_ATTN_WGMMA)
__device__ __forceinline__ void cluster_sync_all() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// A partial S value rounded to its top 24 bits (sign, exponent, 15 mantissa bits; to nearest, ties away from zero),
// as the exchange below carries it: relative error <= 2^-16, far below the bf16 rounding of P that follows.
__device__ __forceinline__ uint32_t s24_bits(float x) { return (__float_as_uint(x) + 0x80u) >> 8; }
__device__ __forceinline__ float s24_value(uint32_t u) { return __uint_as_float(u << 8); }
// Four 24-bit values in three words (big end first), and back.
__device__ __forceinline__ void s24_pack4(const uint32_t (&u)[4], uint32_t* w) {
  w[0] = (u[0] << 8) | (u[1] >> 16), w[1] = (u[1] << 16) | (u[2] >> 8), w[2] = (u[2] << 24) | u[3];
}
__device__ __forceinline__ void s24_unpack4(const uint32_t* w, uint32_t (&u)[4]) {
  u[0] = w[0] >> 8, u[1] = ((w[0] & 0xffu) << 16) | (w[1] >> 16);
  u[2] = ((w[1] & 0xffffu) << 8) | (w[2] >> 24), u[3] = w[2] & 0xffffffu;
}

// The D = 512 cluster pairs' S exchange by st.async (XA; attention_wgx_k, attention_ws_k): a warpgroup stores its
// partial S of tile i into the partner block's buffer, completing on the partner's xfull; once the partner's has
// landed here (xfull) it adds it, then tells the partner that this warpgroup has read its buffer (xfree there; the
// partner waits on it before storing tile i + 1's). The partner's thread `slot` holds the same (row, key) elements.
// bar_id: the warpgroup's 128-thread named barrier.
// The partials cross as 24-bit values (s24_bits), four in three words: the exchange is bound by DSMEM bandwidth (H200,
// attention_bench at kv 4096: half the bytes 100.6 -> 88.0 us, 24-bit values 94.3, no exchange ~80), and each block
// rounds its own partial the same way before adding, so both hold bitwise the same S = r(a) + r(b) (commutative),
// hence the same P, m and l. Thread `slot`'s word quad k sits at (k * 256 + slot) in the two warpgroups' buffer.
template <int NT>
__device__ __forceinline__ void swap_partial_s(float (&s)[NT * 4], int64_t i, int slot, const float* x_local,
                                               uint32_t x_remote, uint32_t xfull, uint32_t xfull_remote, uint32_t xfree,
                                               uint32_t xfree_remote, int bar_id) {
  static_assert(NT % 4 == 0, "whole 16-byte stores of three words per four values");
  constexpr int kQuads = NT * 3 / 4;
  if (i > 0) mbar_wait(xfree, uint32_t((i - 1) & 1));  // the partner's warpgroup is done reading tile i - 1
  uint32_t w[NT * 3];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    uint32_t u[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) u[q] = s24_bits(s[4 * t + q]), s[4 * t + q] = s24_value(u[q]);
    s24_pack4(u, w + 3 * t);
  }
#pragma unroll
  for (int k = 0; k < kQuads; ++k)
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1,%2,%3,%4}, [%5];\n" ::"r"(
                     x_remote + uint32_t((k * 256 + slot) * 16)),
                 "r"(w[4 * k]), "r"(w[4 * k + 1]), "r"(w[4 * k + 2]), "r"(w[4 * k + 3]), "r"(xfull_remote)
                 : "memory");
  if ((slot & 127) == 0)
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(xfull), "n"(kQuads * 16 * 128)
                 : "memory");
  mbar_wait(xfull, uint32_t(i & 1));
#pragma unroll
  for (int k = 0; k < kQuads; ++k) {
    const uint4 x = *reinterpret_cast<const uint4*>(x_local + (k * 256 + slot) * 4);
    w[4 * k] = x.x, w[4 * k + 1] = x.y, w[4 * k + 2] = x.z, w[4 * k + 3] = x.w;
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    uint32_t u[4];
    s24_unpack4(w + 3 * t, u);
#pragma unroll
    for (int q = 0; q < 4; ++q) s[4 * t + q] += s24_value(u[q]);
  }
  asm volatile("bar.sync %0, 128;\n" ::"r"(bar_id) : "memory");  // the warpgroup's reads are done
  if ((slot & 127) == 0) asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(xfree_remote) : "memory");
}
#endif

template <int D>
__global__ void __launch_bounds__(kThreads, 1) attention_wg_k(AttentionArgs a, Split sp) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
#if defined(DG_ATTN_WGMMA)
  using C = WgCfg<D>;
  constexpr int BM = C::BM, BN = C::BN, RS = C::RS, NT = BN / 8, OT = D / 8;
  constexpr uint32_t kVLbo = RS, kVSbo = 128;  // V (MN-major): LBO between 8-key groups, SBO between 8-column groups
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* KVs = smem + C::q_bytes;  // K0, V0, K1, V1
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, grp = lane >> 2, tig = lane & 3;
  const int wg = tid >> 7, wwarp = warp & 3;
  const int rbase = wg * 64;  // first row of this warpgroup in the block's tile
  const BlockPlace bp = block_place<BM, BN>(a, sp, int(blockIdx.x), int(gridDim.x));
  const int g = bp.g, kvh = bp.kvh, split = bp.split, rows_total = bp.rows_total, m0 = bp.m0;
  const int64_t q_min = bp.kr.q_min, q_max = bp.kr.q_max;
  int64_t jb = bp.kr.jb, je = bp.kr.je;
  int64_t qp[2];
  row_positions(a, m0 + rbase + wwarp * 16 + grp, rows_total, g, qp);
  float o[OT * 4];
#pragma unroll
  for (int t = 0; t < OT * 4; ++t) o[t] = 0.0f;
  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};

  const uint32_t q_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t kv_base = q_base + uint32_t(C::q_bytes);
  const uint64_t qd = wg_desc(q_base + uint32_t(rbase / 8) * RS, 128, RS);  // this warpgroup's 64 rows of Q
  load_q_tile<D>(smem, a, D, kvh, g, 0, m0, rows_total, tid);
  const int64_t ntiles = je > jb ? (je - jb + BN - 1) / BN : 0;
  const int64_t fp_mod = a.first_pos % a.cap;
  auto load_k = [&](int stage, int64_t j0) {
    load_tile<D>(KVs + size_t(stage * 2) * C::kv_bytes, a.k_cache, a.k_new, a, D, kvh, 0, j0, je, fp_mod, tid);
  };
  auto load_v = [&](int stage, int64_t j0) {
    load_tile<D>(KVs + size_t(stage * 2 + 1) * C::kv_bytes, a.v_cache, a.v_new, a, D, kvh, 0, j0, je, fp_mod, tid);
  };
  if (ntiles > 0) load_k(0, jb);
  cp_async_commit();

  // Software pipeline (FA3's intra-warpgroup overlap): iteration i issues S(i) = Q K(i)^T and then O += P(i-1) V(i-1)
  // back to back, waits for S(i) only, runs the softmax of tile i while the tensor cores do P(i-1) V(i-1), then
  // rescales O. Same operations on O in the same order as the plain loop (O += P(i-1)V(i-1); O *= alpha(i); ...).
  // K runs one tile ahead of V: iteration i loads K(i+1) and V(i) (stages: K(i+1) over K(i-1), V(i) over V(i-2)).
  uint32_t pa[BN / 16][4];  // P(i-1) as the A fragments of P.V
  for (int64_t i = 0; i < ntiles; ++i) {
    const int stage = int(i & 1);
    const int64_t j0 = jb + i * BN;
    cp_async_wait<0>();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async writes -> wgmma reads
    __syncthreads();  // K(i), V(i-1) visible; both warpgroups are done with K(i-1) and V(i-2)
    const uint32_t k_tile = kv_base + uint32_t(stage * 2 * C::kv_bytes);

    float s[NT * 4];
#pragma unroll
    for (int t = 0; t < NT * 4; ++t) s[t] = 0.0f;
    wg_fence();
    const uint64_t kd = wg_desc(k_tile, 128, RS);
#pragma unroll
    for (int kk = 0; kk < D; kk += 16) wg_ss_n64(s, qd + uint64_t(kk), kd + uint64_t(kk));  // + kk * 16 bytes
    wg_commit();
    if (i > 0) {
      const uint64_t vd = wg_desc(kv_base + uint32_t(((stage ^ 1) * 2 + 1) * C::kv_bytes), kVLbo, kVSbo);
#pragma unroll
      for (int kc = 0; kc < BN / 16; ++kc) wg_rs_n256_t(o, pa[kc], vd + uint64_t(kc * 2 * RS / 16));
    }
    wg_commit();
    if (i + 1 < ntiles) load_k(stage ^ 1, j0 + BN);
    if constexpr (!kLateV) load_v(stage, j0);
    wg_wait<1>();  // S(i) done; P(i-1) V(i-1) may still run
    reg_fence(s);

    float alpha[2];
    mask_softmax<NT>(s, alpha, m_r, l_r, a, j0, je, q_min, q_max, qp, tig);
    if constexpr (kLateV) load_v(stage, j0);
    cp_async_commit();
    wg_wait<0>();
    reg_fence(o);
    rescale_o_pack_p(o, alpha, s, pa);
  }
  if (ntiles > 0) {  // O += P(last) V(last)
    cp_async_wait<0>();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    const uint32_t v_last = kv_base + uint32_t((int((ntiles - 1) & 1) * 2 + 1) * C::kv_bytes);
    wg_fence();
#pragma unroll
    for (int kc = 0; kc < BN / 16; ++kc)
      wg_rs_n256_t(o, pa[kc], wg_desc(v_last, kVLbo, kVSbo) + uint64_t(kc * 2 * RS / 16));
    wg_commit();
    wg_wait<0>();
    reg_fence(o);
  } else {
    cp_async_wait<0>();
  }

  finish_rows<D, OT>(a, sp, split, kvh, g, rows_total, m0 + rbase + wwarp * 16 + grp, tig * 2, tig == 0, m_r, l_r,
                     [&](int t, int c) { return o[t * 4 + c]; });
#else
  static_assert(WgCfg<D>::RS > 0, "");  // (no wgmma on this target: the launcher never picks this kernel)
#endif
}

// ---- warp-specialized wgmma path (sm_90a), D = 256 ----------------------------------------------------------------
// attention_ws_k: attention_wg_k's math (same tiles, same pipeline per warpgroup, same softmax, same split: bitwise
// the same results), but a block of 3 warpgroups: warpgroup 0 only loads (K one tile ahead of V, 16-byte
// cp.async) and signals "full" mbarriers; warpgroups 1 and 2 (64 rows each) load their own Q rows first, then only
// compute, each on its own (no block barrier in the loop), and arrive on "empty" mbarriers (one arrive per warp) once
// their wgmmas have read a stage.
// setmaxnreg: consumers kWsConsRegs, producer kWsProdRegs (its loads run unrolled 1 so that it does not spill). Each
// producer thread signals a load only after cp.async.wait_group and fence.proxy.async (its own copies landed and are
// visible to the tensor cores' proxy), one load behind the last one issued. NK K stages (2 or 3; V has 2). SW: the
// 128-byte swizzled tiles (ws_rc). Measured: see the file's header.
constexpr int kWsThreads = 384;
[[maybe_unused]] constexpr int kWsProdRegs = 40, kWsConsRegs = 232;
// Ping-pong (FA3): the two consumer warpgroups take turns issuing their wgmmas (S(i) and P(i-1) V(i-1)), through
// two named barriers (ids 2, 3; 256 threads: the one waiting and the other one arriving), so one's softmax runs while
// the other's wgmmas occupy the tensor cores.
[[maybe_unused]] constexpr bool kWsPingPong = true;
// D = 512 (`pair`): a cluster of two blocks per 128-row tile, each with half the head dim (DH = 256, the D = 256
// block's tiles and registers), the two partial S = Q_half K_half^T swapped through distributed shared memory as in
// attention_wgx_k (XA: st.async into the partner's buffer, completing on its mbarrier; a "buffer free" arrive back),
// each consumer warpgroup with its partner's. x_bytes: the buffer the partner's partial S lands in.
// H200 (session 28, bench-kernels, kv 4096, 256 queries x 4352 keys): denoise 102.8 us against 136.1 for
// attention_wgx_k (the cuBLASLt GEMM path: 90.6, still the denoise step's), causal (a commit) 99.3 against 137.2:
// a commit at 4K 0.25-0.38 ms faster. Per 64-key tile ~3 us a block against ~2 for the D = 256 kernel: the partial
// S crossing DSMEM every tile sits inside the softmax phase that ping-pong hides behind the other warpgroup's wgmmas,
// and its time follows its bytes (session 29, attention_bench timeline: the softmax lap 1.58 us a tile against 0.63
// for D = 256; without the exchange kv 4096 ran in ~80 us). Since then 12 KB a warpgroup a tile instead of 16
// (24-bit partials, swap_partial_s): kv 4096 100.6 -> 94.3 us, kv 32768 658 -> 618, causal T 4096 687 -> 667.
template <int D, int NK>
struct WsCfg {
  static_assert(D == 256 || D == 512, "");
  static constexpr bool pair = D == 512;
  static constexpr int DH = pair ? D / 2 : D;
  static constexpr int BM = 128, BN = 64, RS = DH * 16;
  static constexpr size_t q_bytes = size_t(BM) * DH * 2, kv_bytes = size_t(BN) * DH * 2;
  static constexpr size_t x_off = q_bytes + size_t(NK + 2) * kv_bytes, x_bytes = pair ? size_t(BM) * BN * 4 : 0;
  static constexpr size_t bar_off = x_off + x_bytes;
  // K / V full and empty, two Q full; pair: xfull and xfree of each consumer warpgroup
  static constexpr size_t smem = bar_off + 8 * (2 * NK + 6) + (pair ? 32 : 0);
};

// load_tile / load_q_tile for NTH threads: chunk i = t + NTH k of a ROWS x W tile -> row r, 16-byte column chunk c8,
// byte offset in shared memory. SW false: load_tile's core-matrix layout and mapping. SW true: the 128-byte swizzle
// (wgmma's SWIZZLE_128B, K-major): W / 64 atoms of ROWS rows x 128 bytes, chunk c of row r at atom + 128 r +
// 16 (c ^ (r & 7)); 8 consecutive threads read one row's 128 contiguous bytes and write one 128-byte row.
template <bool SW, int W, int ROWS>
__device__ __forceinline__ void ws_rc(int i, int& r, int& c8, int& off) {
  if constexpr (SW) {
    const int c = i & 7, at = i / (8 * ROWS);
    r = (i >> 3) % ROWS, c8 = at * 8 + c;
    off = at * (ROWS * 128) + r * 128 + ((c ^ (r & 7)) << 4);
  } else {
    const int lo = i & 15, hi = i >> 4;
    r = (hi / (W / 16)) * 8 + (lo & 7), c8 = (hi % (W / 16)) * 2 + (lo >> 3);
    off = (r >> 3) * (W * 16) + c8 * 128 + (r & 7) * 16;
  }
}
template <bool SW, int W, int NTH>
__device__ __forceinline__ void ws_load_tile(unsigned char* dst, const bf16* cache, const bf16* fresh,
                                             const AttentionArgs& a, int D, int kvh, int col0, int64_t j0, int64_t je,
                                             int64_t fp_mod, int t) {
  constexpr int kChunks = 64 * W / 8 / NTH;
  const bf16* tb = contiguous_keys(cache, fresh, a, D, kvh, col0, j0, je, fp_mod);
  if (tb) {
    const size_t rstride = size_t(a.nkv) * D;
#pragma unroll(NTH >= 256 ? kChunks : 1)
    for (int k = 0; k < kChunks; ++k) {
      int r, c8, off;
      ws_rc<SW, W, 64>(t + NTH * k, r, c8, off);
      cp_async16(dst + off, tb + size_t(r) * rstride + c8 * 8, true);
    }
    return;
  }
#pragma unroll(NTH >= 256 ? kChunks : 1)
  for (int k = 0; k < kChunks; ++k) {
    int r, c8, off;
    ws_rc<SW, W, 64>(t + NTH * k, r, c8, off);
    const int64_t j = j0 + r;
    const bool ok = j < je;
    const bf16* src = ok ? key_row(cache, fresh, a, D, kvh, col0, j, fp_mod) + c8 * 8 : fresh;
    cp_async16(dst + off, src, ok);
  }
}
// The (query, head) of row gr is (gr / g, gr % g): shifts when g is a power of two (the model's groups of 2 and 8),
// since an integer division per 16-byte chunk held up the Q load, the first thing every consumer waits for (ncu
// source view: consumers waiting on the Q barrier were ~13% of the sliding kernel's stall samples).
// half >= 0: only the tile's rows half .. half + 63 (a consumer warpgroup's own), each of the NTH threads taking every
// NTH-th chunk of the whole tile and skipping the other half's.
template <bool SW, int W, int NTH>
__device__ __forceinline__ void ws_load_q(unsigned char* dst, const AttentionArgs& a, int D, int kvh, int g,
                                          int col0, int m0, int rows_total, int t, int half = -1) {
  constexpr int kChunks = 128 * W / 8 / NTH;
  const bool pow2 = (g & (g - 1)) == 0;
  const int gs = __ffs(g) - 1;
#pragma unroll(NTH >= 256 ? kChunks : 1)
  for (int k = 0; k < kChunks; ++k) {
    int r, c8, off;
    ws_rc<SW, W, 128>(t + NTH * k, r, c8, off);
    if (half >= 0 && (r < half || r >= half + 64)) continue;
    const int gr = m0 + r;
    const bool ok = gr < rows_total;
    const bf16* src = a.q;
    if (ok) {
      const int qt = pow2 ? gr >> gs : gr / g, hh = pow2 ? gr & (g - 1) : gr % g;
      src = a.q + (size_t(qt) * a.nh + kvh * g + hh) * D + col0 + c8 * 8;
    }
    cp_async16(dst + off, src, ok);
  }
}

#if defined(DG_ATTN_WGMMA)
__device__ __forceinline__ void mbar_init(uint32_t addr, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(addr), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t addr) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(addr) : "memory");
}
__device__ __forceinline__ void mbar_wait_cta(uint32_t addr, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred P1;\nWS_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra WS_DONE;\nbra WS_WAIT;\nWS_DONE:\n}\n" ::"r"(addr),
      "r"(parity)
      : "memory");
}
[[maybe_unused]] __device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t addr, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(addr), "r"(bytes) : "memory");
}
// The box at coordinates (c0, c1, c2) of a 3D tensor map (tma_map_bf16_heads: column, head, row) into shared memory,
// completing `bar`'s transaction count by the box's bytes.
[[maybe_unused]] __device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* map, int c0, int c1, int c2,
                                                             uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
#endif

// TMA: attention_ws_k's producer loads every K / V tile whose 64 keys are contiguous in one tensor (contiguous_keys:
// not across the cache ring's wrap, the cache / canvas boundary or the keys' end) by TMA instead of cp.async: one
// thread issues D / 64 boxes of 64 columns x 64 keys (the swizzled tile layout, 1024-byte aligned), the tile's full
// barrier completes on their bytes. The other tiles keep the cp.async path. kc / vc: the layer's cache [cap, nkv, D]
// (or the fresh rows when there is no cache), kn / vn: the fresh rows [T_new, nkv, D] (tma_map_bf16_heads, 64-row
// boxes).
//
// Key runs (`runs`, non-causal launches only, i.e. denoise): the keys are tiled by where they lie instead of by key
// index, so that every tile is one TMA box. The keys are three runs of rows: the cache ring's rows from the window's
// first slot to the ring's end (A), the ring's rows from slot 0 on when the window wraps (B), and the fresh rows (C);
// each run is cut into 64-row tiles from its start, and only a run's last tile is partial: the box's rows past the
// run are masked (they are zero-filled past the tensor's end, other rows of the same zero-initialized or written
// ring otherwise, so finite: a masked key's P = 0 times its V must not be NaN). Tiling by key index put the ring's
// wrap, the cache / fresh boundary and the ragged end inside tiles that the producer had to load by cp.async, ~3.5
// us more each (H200, attention_bench timeline: the split holding two such tiles took 23.5 us, an all-TMA split
// 14.5). The splits take contiguous ranges of the run tiles, as even as the count allows. The summation order over
// the keys differs from the index tiling, so the results are not bitwise those of `runs` off.
// Q by TMA (`q_tma`, where 64 % g == 0): the producer loads each consumer warpgroup's 64 Q rows as D / 64 boxes of 64
// columns x g heads x 64 / g queries of q [T, nh, D] (tma_map_bf16_heads with box_heads g), which is the tile's
// (query, head) row order; queries past T read as zeros, as the consumers' own cp.async load zero-fills them. The
// same bytes land in shared memory, so the results are bitwise those of the cp.async load.
struct WsKvMaps {
  TmaMap kc, vc, kn, vn, q;
  int runs;   // 1: key runs (above); the launcher sets it only for non-causal launches
  int q_tma;  // 1: Q by TMA (above)
};
struct KeyRuns {
  int64_t start_a, len_a, len_b, tiles_a, tiles_b, tiles;
};
#if defined(DG_ATTN_WGMMA)  // attention_ws_k's helpers: the other architectures' passes compile its body out
__device__ __forceinline__ KeyRuns key_runs(const AttentionArgs& a, int64_t fp_mod) {
  KeyRuns r;
  r.start_a = fp_mod;
  r.len_a = min(a.n_old, a.cap - fp_mod);
  r.len_b = a.n_old - r.len_a;
  r.tiles_a = (r.len_a + 63) / 64, r.tiles_b = (r.len_b + 63) / 64;
  r.tiles = r.tiles_a + r.tiles_b + (a.T_new + 63) / 64;
  return r;
}
// Run tile t: the tensor (cache or fresh), its first row there, and how many of its 64 rows are keys.
struct RunTile {
  bool cached;
  int64_t row0;
  int valid;
};
__device__ __forceinline__ RunTile run_tile(const KeyRuns& r, const AttentionArgs& a, int64_t t) {
  if (t < r.tiles_a) return {true, r.start_a + 64 * t, int(min(int64_t(64), r.len_a - 64 * t))};
  t -= r.tiles_a;
  if (t < r.tiles_b) return {true, 64 * t, int(min(int64_t(64), r.len_b - 64 * t))};
  t -= r.tiles_b;
  return {false, 64 * t, int(min(int64_t(64), a.T_new - 64 * t))};
}
#endif

template <int D, int NK, bool SW, bool TMA = false>
__global__ void __launch_bounds__(kWsThreads, 1) attention_ws_k(AttentionArgs a, Split sp,
                                                                const __grid_constant__ WsKvMaps maps) {
  DG_TL(threadIdx.x == 0, kTlEntryNs, tl_ns());
  DG_TL(threadIdx.x == 0, kTlEntry, clock64());
#if defined(DG_ATTN_WGMMA)
  // Everything up to pdl_wait() below (the block's place, its key tiles, the barriers, the tensor maps' prefetch)
  // reads only the kernel's parameters and shared memory, so it runs while the predecessor finishes.
  using C = WsCfg<D, NK>;
  constexpr bool kPair = C::pair;
  constexpr int DH = C::DH, BM = C::BM, BN = C::BN, RS = C::RS, NT = BN / 8, OT = DH / 8;
  static_assert(!kPair || SW, "D = 512 pairs use the 128-byte swizzled tiles");
  constexpr uint32_t kVLbo = RS, kVSbo = 128;
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x;
  uint32_t rank = 0;  // pair: this block's half of the head dim
  if constexpr (kPair) asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  const int colh = int(rank) * DH;  // the first head-dim column this block loads and writes
  // pair: a cluster shares one row tile, tile blockIdx.x / 2 of gridDim.x / 2
  const BlockPlace bp = kPair ? block_place<BM, BN>(a, sp, int(blockIdx.x) >> 1, int(gridDim.x) >> 1)
                              : block_place<BM, BN>(a, sp, int(blockIdx.x), int(gridDim.x));
  const int g = bp.g, kvh = bp.kvh, split = bp.split, rows_total = bp.rows_total, m0 = bp.m0;
  const int64_t q_min = bp.kr.q_min, q_max = bp.kr.q_max;
  int64_t jb = bp.kr.jb, je = bp.kr.je;
  const bool runs = TMA && maps.runs;
  const int64_t fp_mod = a.cap > 0 ? a.first_pos % a.cap : 0;
  KeyRuns kr{};
  int64_t run0 = 0;  // runs: this split's first run tile
  int64_t ntiles = je > jb ? (je - jb + BN - 1) / BN : 0;
  if (runs) {
    kr = key_runs(a, fp_mod);
    run0 = int(kr.tiles) * split / sp.nsplit;
    ntiles = int(kr.tiles) * (split + 1) / sp.nsplit - run0;
  }
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t kbuf = base + uint32_t(C::q_bytes), vbuf = kbuf + uint32_t(NK * C::kv_bytes);
  const uint32_t bars = base + uint32_t(C::bar_off);
  auto full_k = [&](int s) { return bars + 8u * uint32_t(s); };
  auto empty_k = [&](int s) { return bars + 8u * uint32_t(NK + s); };
  auto full_v = [&](int s) { return bars + 8u * uint32_t(2 * NK + s); };
  auto empty_v = [&](int s) { return bars + 8u * uint32_t(2 * NK + 2 + s); };
  auto full_q = [&](int w) { return bars + 8u * uint32_t(2 * NK + 4 + w); };
  auto xfull = [&](int w) { return bars + 8u * uint32_t(2 * NK + 6 + w); };  // pair: the partner's S has landed
  auto xfree = [&](int w) { return bars + 8u * uint32_t(2 * NK + 8 + w); };  // pair: the partner read ours
  const bool q_tma = TMA && maps.q_tma;
  if (tid == 0) {
    for (int s = 0; s < NK; ++s) mbar_init(full_k(s), 128), mbar_init(empty_k(s), 8);
    for (int s = 0; s < 2; ++s) mbar_init(full_v(s), 128), mbar_init(empty_v(s), 8);
    for (int w = 0; w < 2; ++w) mbar_init(full_q(w), 1);
    if constexpr (kPair) {
      for (int w = 0; w < 2; ++w) mbar_init(xfull(w), 1), mbar_init(xfree(w), 1);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    if constexpr (TMA) {
      for (const TmaMap* m : {&maps.kc, &maps.vc, &maps.kn, &maps.vn})
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(m)) : "memory");
      if (q_tma) asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&maps.q)) : "memory");
    }
  }
  if constexpr (kPair) cluster_sync_all();  // the partner's barriers exist before any DSMEM store into them
  else __syncthreads();
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();

  if (tid < 128) {  // ---- producer warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kWsProdRegs));
    // Q: by TMA from thread 0 before the first K tile (q_tma), else by the consumers themselves (below), so that the
    // first K tile goes out at once.
    uint32_t pend = 0;  // the barrier of the last load issued, signalled after the next one is issued
    auto signal = [&](uint32_t next) {
      cp_async_commit();
      cp_async_wait<1>();
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      if (pend) mbar_arrive(pend);
      pend = next;
    };
    // Signals the last cp.async load now (its copies landed), with none left pending.
    auto flush = [&] {
      cp_async_commit();
      cp_async_wait<0>();
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      if (pend) mbar_arrive(pend);
      pend = 0;
    };
    // One K or V tile of keys j0 .. j0 + 63 into the stage at `dst`, completing barrier `bar`.
    // Thread 0: the 64 key rows from `row` of map m (the block's DH head-dim columns) into the stage at dst, by TMA.
    auto tma_tile = [&](unsigned char* dst, const TmaMap& m, int64_t row, uint32_t bar) {
      mbar_arrive_expect_tx(bar, uint32_t(64 * DH * 2));
      const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
#pragma unroll
      for (int c = 0; c < DH / 64; ++c) tma_load_3d(d + uint32_t(c * 64 * 128), &m, colh + c * 64, kvh, int(row), bar);
    };
    auto load = [&](unsigned char* dst, bool is_k, int64_t j0, uint32_t bar) {
      const bf16 *cache = is_k ? a.k_cache : a.v_cache, *fresh = is_k ? a.k_new : a.v_new;
      if constexpr (TMA) {
        if (runs) {  // j0: the run tile's index
          if (tid == 0) {
            const RunTile rt = run_tile(kr, a, j0);
            tma_tile(dst, rt.cached ? (is_k ? maps.kc : maps.vc) : (is_k ? maps.kn : maps.vn), rt.row0, bar);
          } else {
            mbar_arrive(bar);
          }
          return;
        }
        if (contiguous_keys(cache, fresh, a, D, kvh, colh, j0, je, fp_mod)) {
          flush();  // the previous cp.async tile's barrier first, then this one at once
          if (tid == 0) {
            const bool cached = j0 + 64 <= a.n_old;
            int64_t row = cached ? fp_mod + j0 : j0 - a.n_old;
            if (cached && row >= a.cap) row -= a.cap;
            tma_tile(dst, cached ? (is_k ? maps.kc : maps.vc) : (is_k ? maps.kn : maps.vn), row, bar);
          } else {
            mbar_arrive(bar);
          }
          return;
        }
      }
      ws_load_tile<SW, DH, 128>(dst, cache, fresh, a, D, kvh, colh, j0, je, fp_mod, tid);
      signal(bar);
    };
    if (q_tma && tid == 0) {  // both warpgroups' Q rows first: the consumers wait for nothing else to start
      if constexpr (TMA) {
#pragma unroll
        for (int w = 0; w < 2; ++w) {
          mbar_arrive_expect_tx(full_q(w), uint32_t(64 * DH * 2));
#pragma unroll
          for (int c = 0; c < DH / 64; ++c)
            tma_load_3d(base + uint32_t(c * BM * 128 + w * 64 * 128), &maps.q, colh + c * 64, kvh * g,
                        (m0 + w * 64) / g, full_q(w));
        }
      }
    }
    // Tile i's first key (runs: its run tile's index).
    auto tile_j0 = [&](int64_t i) { return runs ? run0 + i : jb + i * BN; };
    if (ntiles > 0) load(smem + C::q_bytes, true, tile_j0(0), full_k(0));
    for (int64_t i = 0; i < ntiles; ++i) {
      if (i + 1 < ntiles) {
        const int64_t n = i + 1;
        const int s = int(n % NK);
        if (n >= NK) mbar_wait_cta(empty_k(s), uint32_t((n / NK - 1) & 1));
        load(smem + C::q_bytes + s * C::kv_bytes, true, tile_j0(n), full_k(s));
      }
      const int s = int(i & 1);
      if (i >= 2) mbar_wait_cta(empty_v(s), uint32_t((i / 2 - 1) & 1));
      load(smem + C::q_bytes + (NK + s) * C::kv_bytes, false, tile_j0(i), full_v(s));
    }
    flush();
    DG_TL(tid == 0, kTlProducerDone, clock64());
  } else {  // ---- consumer warpgroups
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kWsConsRegs));
    const int ct = tid - 128, warp = ct >> 5, lane = ct & 31, grp = lane >> 2, tig = lane & 3;
    const int wg = ct >> 7, wwarp = warp & 3, rbase = wg * 64;
    DG_TL(ct == 0, kTlSetup, clock64());
    // pair: the partner's exchange buffer and this warpgroup's barriers there
    uint32_t x_remote = 0, xfull_remote = 0, xfree_remote = 0;
    if constexpr (kPair) {
      const uint32_t peer = rank ^ 1u;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(x_remote) : "r"(base + uint32_t(C::x_off)), "r"(peer));
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(xfull_remote) : "r"(xfull(wg)), "r"(peer));
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(xfree_remote) : "r"(xfree(wg)), "r"(peer));
    }
    int64_t qp[2];
    row_positions(a, m0 + rbase + wwarp * 16 + grp, rows_total, g, qp);
    float o[OT * 4];
#pragma unroll
    for (int t = 0; t < OT * 4; ++t) o[t] = 0.0f;
    float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};
    // Descriptors. SW: 128-byte swizzle (layout type 1 in bits 62-63), K-major Q / K: SBO 1024 (8 rows of 128 B),
    // a 16-column step inside an atom +32 B, the next 64-column atom + rows * 128 B; V (MN-major): LBO 8192 (the next
    // 64 head-dim columns), SBO 1024 (the next 8 keys), a 16-key step +2048 B. Otherwise the core-matrix layout.
    constexpr uint64_t kSw = SW ? uint64_t(1) << 62 : 0;
    auto kstep = [](int kk, int rows) -> uint64_t {  // descriptor step (16-byte units) of columns kk .. kk + 15
      return SW ? uint64_t((kk / 64) * rows * 8 + (kk % 64) / 8) : uint64_t(kk);
    };
    if constexpr (SW) {
      if (base & 1023u) __trap();  // the swizzle atoms need 1024-byte alignment
    }
    const uint64_t qd = SW ? wg_desc(base + uint32_t(rbase) * 128u, 16, 1024) | kSw
                           : wg_desc(base + uint32_t(rbase / 8) * RS, 128, RS);
    const uint32_t v_lbo = SW ? 8192u : kVLbo, v_sbo = SW ? 1024u : kVSbo;
    constexpr int kVStep = SW ? 2048 / 16 : 2 * RS / 16;  // descriptor step of 16 keys
    // q_tma: wait for this warpgroup's Q boxes. Otherwise each warpgroup loads its own 64 Q rows while the producer
    // starts on K (the producer loading all of Q by cp.async first kept every consumer waiting through the Q load and
    // the first K tile's issue: ~13% of the stall samples), then makes them visible to its wgmma reads: its own copies
    // landed, the proxy fence, a barrier of its 128 threads.
    if (q_tma) {
      mbar_wait_cta(full_q(wg), 0);
    } else {
      ws_load_q<SW, DH, 128>(smem, a, D, kvh, g, colh, m0, rows_total, ct & 127, rbase);
      cp_async_commit();
      cp_async_wait<0>();
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      asm volatile("bar.sync %0, 128;\n" ::"r"(4 + wg) : "memory");
    }
    DG_TL(ct == 0, kTlQ, clock64());
    if constexpr (kWsPingPong) {  // warpgroup 0 goes first
      if (wg == 1) asm volatile("bar.arrive 2, 256;\n" ::: "memory");
    }
    uint32_t pa[BN / 16][4];
#ifdef DG_ATTN_TIMELINE
    long long tl_lap[kTlSlots - kTlLapWaitK] = {}, tl_last = clock64();
#endif
    for (int64_t i = 0; i < ntiles; ++i) {
      const int ks = int(i % NK);
      // runs: the mask sees the tile's keys as 0 .. 63 with its valid rows first (non-causal: j < je is all it tests)
      const int64_t j0 = runs ? 0 : jb + i * BN, tile_je = runs ? run_tile(kr, a, run0 + i).valid : je;
      mbar_wait_cta(full_k(ks), uint32_t((i / NK) & 1));
      DG_TL(ct == 0 && i == 0, kTlFirstK, clock64());
      DG_TL_LAP(kTlLapWaitK);
      if constexpr (kWsPingPong) asm volatile("bar.sync %0, 256;\n" ::"r"(2 + wg) : "memory");
      DG_TL_LAP(kTlLapPingPong);
      float s[NT * 4];
#pragma unroll
      for (int t = 0; t < NT * 4; ++t) s[t] = 0.0f;
      wg_fence();
      const uint64_t kd = SW ? wg_desc(kbuf + uint32_t(ks * C::kv_bytes), 16, 1024) | kSw
                             : wg_desc(kbuf + uint32_t(ks * C::kv_bytes), 128, RS);
#pragma unroll
      for (int kk = 0; kk < DH; kk += 16) wg_ss_n64(s, qd + kstep(kk, BM), kd + kstep(kk, BN));
      wg_commit();
      DG_TL_LAP(kTlLapIssueS);
      if (i > 0) {
        const int vs = int((i - 1) & 1);
        mbar_wait_cta(full_v(vs), uint32_t(((i - 1) / 2) & 1));
        DG_TL_LAP(kTlLapWaitV);
        const uint64_t vd = wg_desc(vbuf + uint32_t(vs * C::kv_bytes), v_lbo, v_sbo) | kSw;
#pragma unroll
        for (int kc = 0; kc < BN / 16; ++kc) wg_rs_n256_t(o, pa[kc], vd + uint64_t(kc * kVStep));
      }
      wg_commit();
      if constexpr (kWsPingPong) asm volatile("bar.arrive %0, 256;\n" ::"r"(3 - wg) : "memory");  // other's turn
      DG_TL_LAP(kTlLapIssuePv);
      wg_wait<1>();
      reg_fence(s);
      DG_TL_LAP(kTlLapWaitS);
      if (lane == 0) mbar_arrive(empty_k(ks));
      if constexpr (kPair)  // S = our partial + the partner's
        swap_partial_s<NT>(s, i, ct, reinterpret_cast<const float*>(smem + C::x_off), x_remote, xfull(wg),
                           xfull_remote, xfree(wg), xfree_remote, 6 + wg);
      float alpha[2];
      mask_softmax<NT>(s, alpha, m_r, l_r, a, j0, tile_je, q_min, q_max, qp, tig);
      DG_TL_LAP(kTlLapSoftmax);
      wg_wait<0>();
      reg_fence(o);
      DG_TL_LAP(kTlLapWaitPv);
      if (i > 0 && lane == 0) mbar_arrive(empty_v(int((i - 1) & 1)));
      rescale_o_pack_p(o, alpha, s, pa);
      DG_TL_LAP(kTlLapPack);
      DG_TL(ct == 0 && i == 0, kTlFirstTile, clock64());
    }
#ifdef DG_ATTN_TIMELINE
    for (int k = 0; k < kTlSlots - kTlLapWaitK; ++k) DG_TL(ct == 0, kTlLapWaitK + k, tl_lap[k]);
#endif
    DG_TL(ct == 0, kTlLoopEnd, clock64());
    if constexpr (kWsPingPong) {  // warpgroup 1's last arrive on barrier 2 (1 + ntiles arrives, ntiles syncs so far)
      if (wg == 0) asm volatile("bar.sync 2, 256;\n" ::: "memory");
    }
    if (ntiles > 0) {
      const int vs = int((ntiles - 1) & 1);
      mbar_wait_cta(full_v(vs), uint32_t(((ntiles - 1) / 2) & 1));
      wg_fence();
      const uint64_t vd = wg_desc(vbuf + uint32_t(vs * C::kv_bytes), v_lbo, v_sbo) | kSw;
#pragma unroll
      for (int kc = 0; kc < BN / 16; ++kc) wg_rs_n256_t(o, pa[kc], vd + uint64_t(kc * kVStep));
      wg_commit();
      wg_wait<0>();
      reg_fence(o);
    }
    DG_TL(ct == 0, kTlLastPv, clock64());
    finish_rows<D, OT>(a, sp, split, kvh, g, rows_total, m0 + rbase + wwarp * 16 + grp, colh + tig * 2,
                       rank == 0 && tig == 0, m_r, l_r, [&](int t, int c) { return o[t * 4 + c]; });
    DG_TL(ct == 0, kTlStored, clock64());
    DG_TL(ct == 0, kTlEndNs, tl_ns());
    DG_TL(ct == 0, kTlTiles, ntiles);
  }
  if constexpr (kPair) cluster_sync_all();  // no block leaves while its partner may still arrive on its mbarriers
#else
  static_assert(WsCfg<D, NK>::RS > 0 && (SW || !SW), "");
#endif
}

// ---- D = 512 as two half-D blocks (a cluster of 2) -----------------------------------------------------------------
// A 64-row D = 512 block (attention_k, or wgmma with 2 warpgroups on half D each) is bound by L2 -> SM traffic: O of
// 64 rows x 512 f32 fills half the register file, so a block holds only 64 rows and each K/V byte is re-read for every
// 64 rows (ncu at kv 4096: L2 ~72% busy, SM ~34%, ~1.9 TB/s out of L2). Here a cluster of two blocks shares a 128-row
// tile: block rank dp keeps O[:, DH dp .. DH dp + DH - 1] (DH = D / 2; 2 warpgroups x 64 rows, the D = 256 kernel's
// registers) and loads only its half of Q, K and V; the two partial S = Q_half K_half^T (128 x 64 f32) are swapped
// through distributed shared memory (st.shared::cluster into the partner's buffer, fragment order; cluster barriers:
// release/acquire after the stores, and a "done reading" arrive that the next tile's stores wait on) and both blocks
// add them (a + b == b + a: bitwise the same S, hence the same P, m and l in both). L2 traffic per row-key drops from
// 32 to 8 bytes, plus 4 bytes of DSMEM (3 since the partials cross as 24-bit values: swap_partial_s); 224 KB of
// shared memory. H200, per layer, attention_k -> this: kv 512 / 4096 / 32768 denoise 67.7 -> 58.5 us, 0.309 ->
// 0.242 ms, 2.146 -> 1.663 ms; causal prefill T 4096 1.977 -> 1.694 ms (ncu kv 4096: L2 50% busy, SM 28%: now
// latency bound, S -> exchange -> softmax -> P.V in lockstep, no overlap). Since
// then: the software pipeline of attention_wg_k and the XA exchange (below), see the file's header.
// D = 256 through this kernel (DH = 128, kWgx256) was measured and is off: sliding denoise 60.3 vs 42.9 us for
// attention_wg_k, sliding prefill 0.61 vs 0.36 ms.
template <int D_>
struct WgxCfg {
  static constexpr int D = D_, DH = D / 2, BM = 128, BN = 64, RS = DH * 16;
  static constexpr size_t q_bytes = size_t(BM) * DH * 2, kv_bytes = size_t(BN) * DH * 2;
  static constexpr size_t x_bytes = size_t(BM) * BN * 4;
  static constexpr size_t smem = q_bytes + 4 * kv_bytes + x_bytes + 32;  // 224 KB + 4 mbarriers
};

// XA: the partial-S exchange by st.async into the partner's buffer, completing on its mbarrier (per warpgroup), and an
// mbarrier "buffer free" arrive back, instead of cluster-wide barriers (no release fence after the stores, and the two
// warpgroups exchange independently). The "free" arrive keeps the default .release.cta (it only has to order this
// warpgroup's reads of its buffer, done at the named barrier, before the partner's next writes; as CUTLASS's
// consumer_release): .release.cluster compiles to MEMBAR.ALL.GPU, which waited for the thread's in-flight K/V loads
// each tile (0.206 -> 0.184 ms at kv 4096 with the stepped descriptors).
template <int D_, bool XA, bool SW>
__global__ void __launch_bounds__(kThreads, 1) attention_wgx_k(AttentionArgs a, Split sp) {
  DG_TL(threadIdx.x == 0, kTlEntryNs, tl_ns());
  DG_TL(threadIdx.x == 0, kTlEntry, clock64());
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
#if defined(DG_ATTN_WGMMA)
  using C = WgxCfg<D_>;
  constexpr int D = C::D, DH = C::DH, BM = C::BM, BN = C::BN, RS = C::RS, NT = BN / 8, OT = DH / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* KVs = smem + C::q_bytes;  // K0, V0, K1, V1 (this block's half of the head dim)
  float* Xs = reinterpret_cast<float*>(smem + C::q_bytes + 4 * C::kv_bytes);  // the partner's partial S
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, grp = lane >> 2, tig = lane & 3;
  const int wg = tid >> 7, wwarp = warp & 3, rbase = wg * 64;
  uint32_t dp;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(dp));
  // a cluster pair shares one row tile: tile blockIdx.x / 2 of gridDim.x / 2
  const BlockPlace bp = block_place<BM, BN>(a, sp, int(blockIdx.x) >> 1, int(gridDim.x) >> 1);
  const int g = bp.g, kvh = bp.kvh, split = bp.split, rows_total = bp.rows_total, m0 = bp.m0;
  const int64_t q_min = bp.kr.q_min, q_max = bp.kr.q_max;
  int64_t jb = bp.kr.jb, je = bp.kr.je;
  int64_t qp[2];
  row_positions(a, m0 + rbase + wwarp * 16 + grp, rows_total, g, qp);
  float o[OT * 4];
#pragma unroll
  for (int t = 0; t < OT * 4; ++t) o[t] = 0.0f;
  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};

  const uint32_t q_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t kv_base = q_base + uint32_t(C::q_bytes);
  const uint32_t x_local = q_base + uint32_t(C::q_bytes + 4 * C::kv_bytes);
  // SW: the 128-byte swizzled tiles and descriptors of attention_ws_k (there, SW true).
  constexpr uint64_t kSw = SW ? uint64_t(1) << 62 : 0;
  auto kstep = [](int kk, int rows) -> uint64_t { return SW ? uint64_t((kk / 64) * rows * 8 + (kk % 64) / 8) : uint64_t(kk); };
  if constexpr (SW) {
    if (q_base & 1023u) __trap();
  }
  const uint64_t qd = SW ? wg_desc(q_base + uint32_t(rbase) * 128u, 16, 1024) | kSw
                         : wg_desc(q_base + uint32_t(rbase / 8) * RS, 128, RS);  // this warpgroup's 64 rows of Q half
  uint32_t x_remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(x_remote) : "r"(x_local), "r"(dp ^ 1u));
  // XA: mbarriers after the exchange buffer: xfull[wg] (the partner's S has landed here), xfree[wg] (the partner is
  // done reading what this block stored into its buffer).
  const uint32_t xfull = x_local + uint32_t(C::x_bytes) + 8u * uint32_t(wg), xfree = xfull + 16u;
  uint32_t xfull_remote = 0, xfree_remote = 0;
  if constexpr (XA) {
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(xfull_remote) : "r"(xfull), "r"(dp ^ 1u));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(xfree_remote) : "r"(xfree), "r"(dp ^ 1u));
    if ((tid & 127) == 0) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(xfull) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(xfree) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  const int colh = int(dp) * DH;  // first head-dim column of this block
  if constexpr (SW) ws_load_q<true, DH, kThreads>(smem, a, D, kvh, g, colh, m0, rows_total, tid);
  else load_q_tile<DH>(smem, a, D, kvh, g, colh, m0, rows_total, tid);
  const int64_t ntiles = je > jb ? (je - jb + BN - 1) / BN : 0;
  const int64_t fp_mod = a.first_pos % a.cap;
  auto load_k = [&](int stage, int64_t j0) {
    unsigned char* dst = KVs + size_t(stage * 2) * C::kv_bytes;
    if constexpr (SW) ws_load_tile<true, DH, kThreads>(dst, a.k_cache, a.k_new, a, D, kvh, colh, j0, je, fp_mod, tid);
    else load_tile<DH>(dst, a.k_cache, a.k_new, a, D, kvh, colh, j0, je, fp_mod, tid);
  };
  auto load_v = [&](int stage, int64_t j0) {
    unsigned char* dst = KVs + size_t(stage * 2 + 1) * C::kv_bytes;
    if constexpr (SW) ws_load_tile<true, DH, kThreads>(dst, a.v_cache, a.v_new, a, D, kvh, colh, j0, je, fp_mod, tid);
    else load_tile<DH>(dst, a.v_cache, a.v_new, a, D, kvh, colh, j0, je, fp_mod, tid);
  };
  auto pv = [&](uint32_t v_tile, const uint32_t (&p)[BN / 16][4]) {
    const uint64_t vd = SW ? wg_desc(v_tile, 8192, 1024) | kSw : wg_desc(v_tile, RS, 128);
#pragma unroll
    for (int kc = 0; kc < BN / 16; ++kc) {
      const uint64_t db = vd + uint64_t(SW ? kc * 128 : kc * 2 * RS / 16);
      if constexpr (DH == 256) wg_rs_n256_t(o, p[kc], db);
      else wg_rs_n128_t(o, p[kc], db);
    }
  };
  cluster_sync_all();  // the partner runs before any DSMEM store into it
  DG_TL(tid == 0, kTlSetup, clock64());
  if (ntiles > 0) load_k(0, jb);
  cp_async_commit();

  // The software pipeline of attention_wg_k (S(i) and P(i-1) V(i-1) issued back to back; the S exchange and the
  // softmax of tile i overlap P(i-1) V(i-1) on the tensor cores; K one tile ahead of V).
  uint32_t pa[BN / 16][4];
  for (int64_t i = 0; i < ntiles; ++i) {
    const int stage = int(i & 1);
    const int64_t j0 = jb + i * BN;
    cp_async_wait<0>();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async writes -> wgmma reads
    __syncthreads();  // K(i), V(i-1) visible; both warpgroups are done with K(i-1) and V(i-2)
    DG_TL(tid == 0 && i == 0, kTlFirstK, clock64());
    const uint32_t k_tile = kv_base + uint32_t(stage * 2 * C::kv_bytes);

    float s[NT * 4];
#pragma unroll
    for (int t = 0; t < NT * 4; ++t) s[t] = 0.0f;
    wg_fence();
    const uint64_t kd = SW ? wg_desc(k_tile, 16, 1024) | kSw : wg_desc(k_tile, 128, RS);
#pragma unroll
    for (int kk = 0; kk < DH; kk += 16) wg_ss_n64(s, qd + kstep(kk, BM), kd + kstep(kk, BN));
    wg_commit();
    if (i > 0) pv(kv_base + uint32_t(((stage ^ 1) * 2 + 1) * C::kv_bytes), pa);
    wg_commit();
    if (i + 1 < ntiles) load_k(stage ^ 1, j0 + BN);
    if constexpr (!kLateV) load_v(stage, j0);
    wg_wait<1>();  // partial S(i) done; P(i-1) V(i-1) may still run
    reg_fence(s);
    // Swap partial S with the partner block: the same thread of the partner holds the same (row, key) elements.
    if constexpr (XA) {
      static_assert(kThreads == 256, "swap_partial_s: two warpgroups' slots");
      swap_partial_s<NT>(s, i, tid, Xs, x_remote, xfull, xfull_remote, xfree, xfree_remote, 1 + wg);
    } else {
      if (i > 0) asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");  // partner done reading its buffer
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const uint32_t addr = x_remote + uint32_t((t * kThreads + tid) * 16);
        asm volatile("st.shared::cluster.v4.f32 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "f"(s[4 * t]), "f"(s[4 * t + 1]),
                     "f"(s[4 * t + 2]), "f"(s[4 * t + 3])
                     : "memory");
      }
      asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const float4 x = *reinterpret_cast<const float4*>(Xs + (t * kThreads + tid) * 4);
        s[4 * t] += x.x, s[4 * t + 1] += x.y, s[4 * t + 2] += x.z, s[4 * t + 3] += x.w;
      }
      asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");  // done reading: the partner may write
    }

    float alpha[2];
    mask_softmax<NT>(s, alpha, m_r, l_r, a, j0, je, q_min, q_max, qp, tig);
    if constexpr (kLateV) load_v(stage, j0);
    cp_async_commit();
    wg_wait<0>();
    reg_fence(o);
    rescale_o_pack_p(o, alpha, s, pa);
    DG_TL(tid == 0 && i == 0, kTlFirstTile, clock64());
  }
  DG_TL(tid == 0, kTlLoopEnd, clock64());
  if (ntiles > 0) {  // O += P(last) V(last)
    cp_async_wait<0>();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    wg_fence();
    pv(kv_base + uint32_t((int((ntiles - 1) & 1) * 2 + 1) * C::kv_bytes), pa);
    wg_commit();
    wg_wait<0>();
    reg_fence(o);
    if constexpr (!XA) asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");  // pairs the last arrive
  } else {
    cp_async_wait<0>();
  }
  // XA: no block leaves while its partner may still arrive on its mbarriers
  if constexpr (XA) cluster_sync_all();
  DG_TL(tid == 0, kTlLastPv, clock64());

  finish_rows<D, OT>(a, sp, split, kvh, g, rows_total, m0 + rbase + wwarp * 16 + grp, colh + tig * 2,
                     dp == 0 && tig == 0, m_r, l_r, [&](int t, int c) { return o[t * 4 + c]; });
  DG_TL(tid == 0, kTlStored, clock64());
  DG_TL(tid == 0, kTlEndNs, tl_ns());
  DG_TL(tid == 0, kTlTiles, ntiles);
#else
  static_assert(WgxCfg<D_>::D == D_ && WgxCfg<D_>::RS > 0 && (SW || !SW), "");  // (no wgmma on this target: never picked)
#endif
}

// Merges the nsplit partial results of each row in split order: one warp per (kv head, row) (combine_weights,
// combine_chunk). Up to kCombineSplits
// splits, every (m, l) pair and then every partial O chunk of a lane is loaded before any is used (all of a warp's
// loads in flight at once; the loop that loaded them one dependent round trip at a time took ~7.5 us at the sliding
// denoise shape, ncu, session 6).
// A combine kernel's warp: its row (kv head * rows_total + the row), the splits' stride and the row's output; false
// for a warp past the last row.
struct CombineRow {
  int64_t row;
  size_t stride;
  bf16* dst;
};
__device__ __forceinline__ bool combine_row(const AttentionArgs& a, int D, CombineRow& r) {
  const int g = a.nh / a.nkv, rows_total = a.T * g;
  r.row = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (r.row >= int64_t(a.nkv) * rows_total) return false;
  const int kvh = int(r.row / rows_total), gr = int(r.row % rows_total);
  r.stride = size_t(a.nkv) * rows_total;
  r.dst = a.out + (size_t(gr / g) * a.nh + kvh * g + gr % g) * D;
  return true;
}
__global__ void attention_combine_k(AttentionArgs a, Split sp) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  const int D = a.D, lane = threadIdx.x & 31;
  CombineRow cr;
  if (!combine_row(a, D, cr)) return;
  const int64_t row = cr.row;
  const size_t stride = cr.stride;
  bf16* dst = cr.dst;
  if (sp.nsplit <= kCombineSplits) {
    const CombineWeights cw = combine_weights(sp, stride, row);
    for (int c = lane * 4; c < D; c += 128) combine_chunk(sp, stride, row, D, c, cw, dst);
    return;
  }
  float mx = -INFINITY;
  for (int s = 0; s < sp.nsplit; ++s) mx = fmaxf(mx, sp.ws_ml[(s * stride + row) * 2]);
  float L = 0.0f;
  for (int s = 0; s < sp.nsplit; ++s) {
    const float m = sp.ws_ml[(s * stride + row) * 2];
    if (m != -INFINITY) L += __expf(m - mx) * sp.ws_ml[(s * stride + row) * 2 + 1];
  }
  const float inv = L > 0 ? 1.0f / L : 0.0f;
  for (int c = lane * 4; c < D; c += 128) {
    float4 acc = make_float4(0, 0, 0, 0);
    for (int s = 0; s < sp.nsplit; ++s) {
      const float m = sp.ws_ml[(s * stride + row) * 2];
      if (m == -INFINITY) continue;
      const float w = __expf(m - mx);
      const float4 v = *reinterpret_cast<const float4*>(sp.ws_o + (s * stride + row) * D + c);
      acc.x += w * v.x, acc.y += w * v.y, acc.z += w * v.z, acc.w += w * v.w;
    }
    *reinterpret_cast<__nv_bfloat162*>(dst + c) = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
    *reinterpret_cast<__nv_bfloat162*>(dst + c + 2) = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
  }
}

// attention_combine_k for D = 256 and NS <= 4 splits (the sliding denoise launches) in one round trip: every (m, l)
// pair and both of a lane's partial O chunks of every split are loaded at once (a split that saw no key of the row
// is loaded too and then not used), then attention_combine_k's arithmetic (combine_weights_of, combine_store4): the
// same bits. 56 registers at NS = 4, so the 512 blocks of a sliding denoise launch are resident at once.
// attention_bench (H200, session 14): sliding denoise with its combine 24.3 -> 22.4 us.
template <int NS>
__global__ void attention_combine256_k(AttentionArgs a, Split sp) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  constexpr int D = 256;
  const int lane = threadIdx.x & 31;
  CombineRow cr;
  if (!combine_row(a, D, cr)) return;
  const int64_t row = cr.row;
  const size_t stride = cr.stride;
  bf16* dst = cr.dst;
  float2 ml[NS];
  float4 v[2][NS];
#pragma unroll
  for (int s = 0; s < NS; ++s) {
    ml[s] = *reinterpret_cast<const float2*>(sp.ws_ml + (s * stride + row) * 2);
#pragma unroll
    for (int h = 0; h < 2; ++h)
      v[h][s] = *reinterpret_cast<const float4*>(sp.ws_o + (s * stride + row) * D + lane * 4 + h * 128);
  }
  const CombineWeights cw = combine_weights_of(ml, NS);
#pragma unroll
  for (int h = 0; h < 2; ++h) combine_store4(v[h], NS, cw, dst + lane * 4 + h * 128);
  // The partial rows are dead once combined; this warp alone read them (its 1 KB a split, 8 lines). Dropped without
  // their write-back, ~17 MB a sliding denoise layer stays out of the o_proj's and the expert stream's DRAM traffic.
  __syncwarp();  // every lane's loads are in
  if (sp.discard_o && lane < 8 * NS) discard_l2_line(sp.ws_o + ((lane >> 3) * stride + row) * D + (lane & 7) * 32);
}

// Paths: D = 256 -> attention_ws_k (or attention_wg_k), D = 512 -> attention_wgx_k (cluster pairs), where the sm_90a
// build is the one loaded (Hopper); everything else, and those where it is not, -> attention_k (mma.sync).
constexpr bool kWgmma = true;      // master switch of the wgmma paths
constexpr bool kWgx256 = false;    // D = 256 through attention_wgx_k (cluster pairs of half-D blocks)
constexpr bool kWg256 = true;      // D = 256 through attention_wg_k (when not the above)
constexpr bool kWs256 = true;      // D = 256 through attention_ws_k (warp-specialized; before attention_wg_k)
constexpr int kWsK = 2;            // ... its K stages (2 or 3)
constexpr bool kWsTma = true;      // ... K / V tiles by TMA where contiguous (WsKvMaps; set_attention_tma)
constexpr bool kWsSw128 = true;   // ... with 128-byte swizzled tiles (else the core-matrix layout)
constexpr bool kWgx512 = true;     // D = 512 through attention_wgx_k
constexpr bool kWgxCausal = true;  // ... causal (prefill) launches too
constexpr int64_t kWgxMinKeys = 0;  // ... when the launch has at least this many keys
constexpr bool kXAsync = true;         // attention_wgx_k: S exchange by st.async + mbarriers (XA)
constexpr bool kWgxSw128 = true;      // attention_wgx_k: 128-byte swizzled tiles (as attention_ws_k with kWsSw128)

// Split-KV count for a grid of `base` blocks over `tiles` key tiles (1: no split).
int g_attention_splits = 0;  // set_attention_splits
bool g_attention_tma = true;  // set_attention_tma
bool g_attention_key_runs = true;  // set_attention_key_runs
bool g_attention_q_tma = true;     // set_attention_q_tma
bool g_attention_ws512 = true;     // set_attention_ws512
bool g_attention_discard_partials = true;  // set_attention_discard_partials

Split pick_split(const AttentionArgs& a, int base, int64_t tiles, int D) {
  const int rows = a.T * (a.nh / a.nkv);
  Split sp{1, nullptr, nullptr};
  const int sms = sm_count();
  if (2 * base <= sms) {
    const int64_t want = g_attention_splits > 0 ? g_attention_splits : sms / base;
    int ns = int(std::min<int64_t>({want, tiles / 2, 16}));
    while (ns > 1 && (size_t(ns) * a.nkv * rows * D > kWsFloats || size_t(ns) * a.nkv * rows * 2 > kMlFloats)) --ns;
    if (ns > 1) {
      static float *ws_o = nullptr, *ws_ml = nullptr;
      if (!ws_o) {
        CUDA_CHECK(cudaGetSymbolAddress(reinterpret_cast<void**>(&ws_o), g_ws_o));
        CUDA_CHECK(cudaGetSymbolAddress(reinterpret_cast<void**>(&ws_ml), g_ws_ml));
      }
      sp = Split{ns, ws_o, ws_ml, g_attention_discard_partials && (reinterpret_cast<uintptr_t>(ws_o) & 127) == 0};
    }
  }
  return sp;
}

void combine(const AttentionArgs& a, const Split& sp, cudaStream_t s) {
  if (sp.nsplit <= 1) return;
  const int64_t nrows = int64_t(a.nkv) * a.T * (a.nh / a.nkv);
  const dim3 grid(unsigned((nrows + 7) / 8));
  constexpr void (*k256[])(AttentionArgs, Split) = {nullptr, nullptr, attention_combine256_k<2>,
                                                      attention_combine256_k<3>, attention_combine256_k<4>};
  const bool one_trip = a.D == 256 && sp.nsplit < int(std::size(k256));
  launch_pdl(one_trip ? k256[sp.nsplit] : attention_combine_k, grid, dim3(256), 0, s, a, sp);
  CUDA_CHECK_LAUNCH();
}

// A launch in clusters of two blocks along x (the D = 512 kernels' half-D pairs), programmatic where PDL is on
// (launch.cuh).
template <class... Params, class... Args>
void launch_pairs(void (*kernel)(Params...), dim3 grid, int threads, size_t smem, cudaStream_t s, const Args&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute at[2];
  at[0].id = cudaLaunchAttributeClusterDimension;
  at[0].val.clusterDim.x = 2, at[0].val.clusterDim.y = 1, at[0].val.clusterDim.z = 1;
  at[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at, cfg.numAttrs = pdl_enabled() ? 2 : 1;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

// attention_ws_k loads K / V (and Q) tiles by TMA where it can (its TMA instantiation).
bool ws_tma() { return kWsTma && kWsSw128 && g_attention_tma; }

// attention_ws_k's tensor maps for a launch of head dim D (Q by TMA where the group size divides 64).
WsKvMaps ws_maps(const AttentionArgs& a, int D) {
  WsKvMaps maps{};
  const bool tma = ws_tma();
  maps.runs = tma && !a.causal && g_attention_key_runs ? 1 : 0;
  const int g = a.nh / a.nkv;
  maps.q_tma = tma && g_attention_q_tma && 64 % g == 0 ? 1 : 0;
  if (tma) {
    const int64_t fresh_rows = std::max<int64_t>(a.T_new, 1);
    maps.kn = tma_map_bf16_heads(a.k_new, fresh_rows, a.nkv, D, 64);
    maps.vn = tma_map_bf16_heads(a.v_new, fresh_rows, a.nkv, D, 64);
    const bool cache = a.k_cache && a.v_cache && a.cap > 0;
    maps.kc = cache ? tma_map_bf16_heads(a.k_cache, a.cap, a.nkv, D, 64) : maps.kn;
    maps.vc = cache ? tma_map_bf16_heads(a.v_cache, a.cap, a.nkv, D, 64) : maps.vn;
    if (maps.q_tma) maps.q = tma_map_bf16_heads(a.q, a.T, a.nh, D, 64 / g, g);
  }
  return maps;
}

template <int D>
void launch(const AttentionArgs& a, cudaStream_t s) {
  using C = Cfg<D>;
  const int rows = a.T * (a.nh / a.nkv);
  if constexpr (D == 512) {  // attention_ws_k in cluster pairs (WsCfg::pair)
    constexpr auto wsp = attention_ws_k<512, kWsK, true, false>;
    constexpr auto wsp_tma = attention_ws_k<512, kWsK, true, kWsTma>;
    static const bool ws = kWgmma && kWsSw128 && [] {
      if (!sm90a_image_of(wsp)) return false;
      for (auto k : {wsp, wsp_tma})
        CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(WsCfg<512, kWsK>::smem)));
      return true;
    }();
    if (ws && g_attention_ws512) {
      using W = WsCfg<512, kWsK>;
      const int row_tiles = (rows + W::BM - 1) / W::BM;
      const Split sp = pick_split(a, 2 * row_tiles * a.nkv, (a.n_old + a.T_new + W::BN - 1) / W::BN, D);
      const WsKvMaps maps = ws_maps(a, D);
      launch_pairs(ws_tma() ? wsp_tma : wsp, dim3(unsigned(2 * row_tiles), unsigned(a.nkv), unsigned(sp.nsplit)),
                   kWsThreads, W::smem, s, a, sp, maps);
      return combine(a, sp, s);
    }
  }
  if constexpr (D == 512 || D == 256) {
    constexpr auto kernel = attention_wgx_k<D, kXAsync, kWgxSw128>;
    static const bool wgx = kWgmma && (D == 512 ? kWgx512 : kWgx256) && [] {
      if (!sm90a_image_of(kernel)) return false;
      CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(WgxCfg<D>::smem)));
      return true;
    }();
    if (wgx && (!a.causal || kWgxCausal) && a.n_old + a.T_new >= kWgxMinKeys) {
      using W = WgxCfg<D>;
      const int row_tiles = (rows + W::BM - 1) / W::BM;
      const Split sp = pick_split(a, 2 * row_tiles * a.nkv, (a.n_old + a.T_new + W::BN - 1) / W::BN, D);
      launch_pairs(kernel, dim3(unsigned(2 * row_tiles), unsigned(a.nkv), unsigned(sp.nsplit)), kThreads, W::smem, s,
                   a, sp);
      return combine(a, sp, s);
    }
  }
  if constexpr (D == 256) {
    constexpr auto wsk = attention_ws_k<256, kWsK, kWsSw128, false>;
    constexpr auto wsk_tma = attention_ws_k<256, kWsK, kWsSw128, kWsTma && kWsSw128>;
    static const bool ws = kWgmma && kWs256 && [] {
      if (!sm90a_image_of(wsk)) return false;
      CUDA_CHECK(cudaFuncSetAttribute(wsk, cudaFuncAttributeMaxDynamicSharedMemorySize, int(WsCfg<256, kWsK>::smem)));
      CUDA_CHECK(cudaFuncSetAttribute(wsk_tma, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      int(WsCfg<256, kWsK>::smem)));
      return true;
    }();
    if (ws) {
      using W = WsCfg<256, kWsK>;
      const int row_tiles = (rows + W::BM - 1) / W::BM;
      const Split sp = pick_split(a, row_tiles * a.nkv, (a.n_old + a.T_new + W::BN - 1) / W::BN, D);
      const WsKvMaps maps = ws_maps(a, 256);
      launch_pdl(ws_tma() ? wsk_tma : wsk, dim3(row_tiles, a.nkv, sp.nsplit), dim3(kWsThreads), W::smem, s, a, sp,
                 maps);
      CUDA_CHECK_LAUNCH();
      return combine(a, sp, s);
    }
  }
  if constexpr (D == 256) {
    static const bool wg = kWgmma && kWg256 && [] {
      if (!sm90a_image_of(attention_wg_k<256>)) return false;
      CUDA_CHECK(cudaFuncSetAttribute(attention_wg_k<256>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      int(WgCfg<256>::smem)));
      return true;
    }();
    if (wg) {
      using W = WgCfg<256>;
      const int row_tiles = (rows + W::BM - 1) / W::BM;
      const Split sp = pick_split(a, row_tiles * a.nkv, (a.n_old + a.T_new + W::BN - 1) / W::BN, D);
      launch_pdl(attention_wg_k<256>, dim3(dim3(row_tiles, a.nkv, sp.nsplit)), dim3(kThreads), W::smem, s, a, sp);
      CUDA_CHECK_LAUNCH();
      return combine(a, sp, s);
    }
  }
  static bool raised = false;  // dynamic shared memory opt-in, per kernel
  if (!raised) {
    CUDA_CHECK(cudaFuncSetAttribute(attention_k<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(C::smem)));
    raised = true;
  }
  const int row_tiles = (rows + C::BM - 1) / C::BM;
  const Split sp = pick_split(a, row_tiles * a.nkv, (a.n_old + a.T_new + C::BN - 1) / C::BN, D);
  attention_k<D><<<dim3(row_tiles, a.nkv, sp.nsplit), kThreads, C::smem, s>>>(a, sp);
  CUDA_CHECK_LAUNCH();
  combine(a, sp, s);
}

}  // namespace

void set_attention_splits(int n) { g_attention_splits = n > 0 ? n : 0; }
void set_attention_tma(bool on) { g_attention_tma = on; }
void set_attention_key_runs(bool on) { g_attention_key_runs = on; }
void set_attention_q_tma(bool on) { g_attention_q_tma = on; }
void set_attention_ws512(bool on) { g_attention_ws512 = on; }
void set_attention_discard_partials(bool on) { g_attention_discard_partials = on; }

#ifdef DG_ATTN_TIMELINE
// The per-block timestamps of the last launch (TlSlot order, kTlSlots each); clear_attention_timeline() zeroes them.
int attention_timeline_slots() { return kTlSlots; }
void attention_timeline(long long* host, int blocks) {
  CUDA_CHECK(cudaMemcpyFromSymbol(host, g_attn_tl, size_t(std::min(blocks, kTlBlocks)) * kTlSlots * sizeof(long long)));
}
void clear_attention_timeline() {
  void* p = nullptr;
  CUDA_CHECK(cudaGetSymbolAddress(&p, g_attn_tl));
  CUDA_CHECK(cudaMemset(p, 0, sizeof(g_attn_tl)));
}
#endif

void attention(const AttentionArgs& a, cudaStream_t s) {
  if (a.T == 0) return;
  if (a.nh % a.nkv != 0) throw_cuda_error("attention", "nh must be a multiple of nkv", 0, __FILE__, __LINE__);
  switch (a.D) {
    case 16: return launch<16>(a, s);
    case 32: return launch<32>(a, s);
    case 48: return launch<48>(a, s);
    case 64: return launch<64>(a, s);
    case 80: return launch<80>(a, s);
    case 96: return launch<96>(a, s);
    case 112: return launch<112>(a, s);
    case 128: return launch<128>(a, s);
    case 256: return launch<256>(a, s);
    case 512: return launch<512>(a, s);
    default: throw_cuda_error("attention", "head_dim must be a multiple of 16 up to 128, 256 or 512", 0, __FILE__, __LINE__);
  }
}

}  // namespace dg::cuda
