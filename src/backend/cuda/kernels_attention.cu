// Flash attention on tensor cores (mma.sync m16n8k16 bf16, f32 accumulate), FlashAttention-2 style: rows are
// (query, head-of-the-group) pairs of one kv head, so the K/V tiles of a kv head serve all its query heads.
//
// Layout. A block has 8 warps; each warp owns 16 rows and DW = min(D, 256) columns of the head dim:
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
// H200 (tools/gpu/microbench/attention_bench.cu), previous kernel -> this one, per layer: sliding denoise (T 256,
// 1279 keys) 100 -> 45 us; full denoise at kv 512 / 4096 / 32768: 101 -> 68 us, 0.53 -> 0.31 ms, 4.07 -> 2.16 ms;
// prefill T 4096: sliding 0.78 -> 0.39 ms, full 4.29 -> 1.99 ms. Per denoise step (25 sliding + 5 full) at kv 4096:
// 5.2 -> 2.7 ms. Still ~3x off the tensor-core bound: 8 warps / SM (O in registers caps occupancy) in lockstep.
//
// Split-KV (flash-decoding): a denoise step has T = 256 queries, i.e. only 32 (sliding, g = 2) or 64 (full, g = 8)
// row tiles; when the grid would leave more than half the SMs idle, each row tile's key range is cut into nsplit
// contiguous, BN-aligned chunks (blockIdx.z) that write unnormalized f32 O plus (m, l) to a static workspace, and a
// small combine kernel merges the chunks in fixed order. No atomics anywhere: bitwise deterministic.
//
// Scores are raw dot products (no 1/sqrt(D)), the softmax is f32 online (row max / sum), P is rounded to bf16 for
// the P.V product (as HF's eager path does); the row sum uses the unrounded f32 p.
#include <algorithm>
#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_kernels.h"
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
};

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
  const int g = a.nh / a.nkv, kvh = blockIdx.y, split = blockIdx.z;
  const int rows_total = a.T * g;
  // causal: the heaviest row tiles (latest queries) first
  const int bx = a.causal ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
  const int m0 = bx * BM;

  const int last_row = min(rows_total, m0 + BM) - 1;
  const int64_t q_min = a.q_pos0 + m0 / g, q_max = a.q_pos0 + last_row / g;
  const int64_t nk = a.n_old + a.T_new;
  int64_t jb = 0, je = nk;
  if (a.causal) {
    je = min(nk, q_max - a.first_pos + 1);
    if (a.window > 0) jb = max(int64_t(0), q_min - a.window + 1 - a.first_pos);
  }
  if (sp.nsplit > 1) {
    const int64_t tiles = je > jb ? (je - jb + BN - 1) / BN : 0;
    const int64_t tps = (tiles + sp.nsplit - 1) / sp.nsplit;
    const int64_t s0 = jb + split * tps * BN;
    je = min(je, s0 + tps * BN);
    jb = s0;
  }

  // The lane's two rows (grp, grp + 8 of its 16) and their query positions (for the causal mask).
  int64_t qp[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int gr = min(m0 + rg * 16 + grp + h * 8, rows_total - 1);
    qp[h] = a.q_pos0 + gr / g;
  }
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

  // Row sums: lane-partial until here; the quad adds them (commutative order: all 4 lanes agree bitwise).
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_r[h] += __shfl_xor_sync(0xffffffffu, l_r[h], 1);
    l_r[h] += __shfl_xor_sync(0xffffffffu, l_r[h], 2);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int gr = m0 + rg * 16 + grp + h * 8;
    if (gr >= rows_total) continue;
    const int col0 = dp * DW + tig * 2;
    if (sp.nsplit == 1) {
      const float inv = l_r[h] > 0 ? 1.0f / l_r[h] : 0.0f;
      bf16* dst = a.out + (size_t(gr / g) * a.nh + kvh * g + gr % g) * D + col0;
#pragma unroll
      for (int t = 0; t < OT; ++t)
        *reinterpret_cast<__nv_bfloat162*>(dst + t * 8) =
            __floats2bfloat162_rn(o[t][2 * h] * inv, o[t][2 * h + 1] * inv);
    } else {
      const size_t row = (size_t(split) * a.nkv + kvh) * rows_total + gr;
      float* dst = sp.ws_o + row * D + col0;
#pragma unroll
      for (int t = 0; t < OT; ++t)
        *reinterpret_cast<float2*>(dst + t * 8) = make_float2(o[t][2 * h], o[t][2 * h + 1]);
      if (dp == 0 && tig == 0) *reinterpret_cast<float2*>(sp.ws_ml + row * 2) = make_float2(m_r[h], l_r[h]);
    }
  }
}

// Merges the nsplit partial results of each row in split order: one warp per (kv head, row).
__global__ void attention_combine_k(AttentionArgs a, Split sp) {
  const int g = a.nh / a.nkv, rows_total = a.T * g, D = a.D;
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= int64_t(a.nkv) * rows_total) return;
  const int kvh = int(row / rows_total), gr = int(row % rows_total);
  const size_t stride = size_t(a.nkv) * rows_total;
  float mx = -INFINITY;
  for (int s = 0; s < sp.nsplit; ++s) mx = fmaxf(mx, sp.ws_ml[(s * stride + row) * 2]);
  float L = 0.0f;
  for (int s = 0; s < sp.nsplit; ++s) {
    const float m = sp.ws_ml[(s * stride + row) * 2];
    if (m != -INFINITY) L += __expf(m - mx) * sp.ws_ml[(s * stride + row) * 2 + 1];
  }
  const float inv = L > 0 ? 1.0f / L : 0.0f;
  bf16* dst = a.out + (size_t(gr / g) * a.nh + kvh * g + gr % g) * D;
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

int sm_count() {
  static const int n = [] {
    int dev = 0, v = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return v;
  }();
  return n;
}

template <int D>
void launch(const AttentionArgs& a, cudaStream_t s) {
  using C = Cfg<D>;
  static bool raised = false;  // dynamic shared memory opt-in, per kernel
  if (!raised) {
    CUDA_CHECK(cudaFuncSetAttribute(attention_k<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(C::smem)));
    raised = true;
  }
  const int rows = a.T * (a.nh / a.nkv);
  const int row_tiles = (rows + C::BM - 1) / C::BM, base = row_tiles * a.nkv;
  const int64_t tiles = (a.n_old + a.T_new + C::BN - 1) / C::BN;
  Split sp{1, nullptr, nullptr};
  const int sms = sm_count();
  if (2 * base <= sms) {
    int ns = int(std::min<int64_t>({int64_t(sms / base), tiles / 2, 16}));
    while (ns > 1 && (size_t(ns) * a.nkv * rows * D > kWsFloats || size_t(ns) * a.nkv * rows * 2 > kMlFloats)) --ns;
    if (ns > 1) {
      static float *ws_o = nullptr, *ws_ml = nullptr;
      if (!ws_o) {
        CUDA_CHECK(cudaGetSymbolAddress(reinterpret_cast<void**>(&ws_o), g_ws_o));
        CUDA_CHECK(cudaGetSymbolAddress(reinterpret_cast<void**>(&ws_ml), g_ws_ml));
      }
      sp = Split{ns, ws_o, ws_ml};
    }
  }
  attention_k<D><<<dim3(row_tiles, a.nkv, sp.nsplit), kThreads, C::smem, s>>>(a, sp);
  CUDA_CHECK_LAUNCH();
  if (sp.nsplit > 1) {
    const int64_t nrows = int64_t(a.nkv) * rows;
    attention_combine_k<<<unsigned((nrows + 7) / 8), 256, 0, s>>>(a, sp);
    CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

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
