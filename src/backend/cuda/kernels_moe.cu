// MoE around the expert GEMMs (kernels_experts.cu): router top-k, token->expert grouping, and the weighted combine
// in ascending expert id order.
#include <algorithm>
#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/cuda_util.cuh"

namespace dg::cuda {
namespace {

constexpr int kMaxTopK = 32;

// One block per token; mirrors cpu::route_top_k (float exp, double sum, p = float(e / sum)).
__global__ void route_top_k_k(const float* logits, int E, int k, const float* pes, int32_t* idx, float* w) {
  extern __shared__ float p[];
  __shared__ float sel_v[kMaxTopK];
  __shared__ int sel_i[kMaxTopK];
  __shared__ float red_v[32];
  __shared__ int red_i[32];
  const float* l = logits + size_t(blockIdx.x) * E;
  float mx = -INFINITY;
  for (int e = threadIdx.x; e < E; e += blockDim.x) mx = fmaxf(mx, l[e]);
  mx = warp_max(mx);
  if ((threadIdx.x & 31) == 0) red_v[threadIdx.x >> 5] = mx;
  __syncthreads();
  mx = -INFINITY;
  for (int i = 0; i < int(blockDim.x >> 5); ++i) mx = fmaxf(mx, red_v[i]);
  double sum = 0;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    p[e] = expf(l[e] - mx);
    sum += p[e];
  }
  sum = block_sum(sum);
  for (int e = threadIdx.x; e < E; e += blockDim.x) p[e] = float(double(p[e]) / sum);
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int j = 0; j < k; ++j) {
    float bv = -1.0f;
    int bi = INT32_MAX;
    for (int e = threadIdx.x; e < E; e += blockDim.x)
      if (p[e] > bv || (p[e] == bv && e < bi)) bv = p[e], bi = e;
    for (int o = 16; o > 0; o >>= 1) {
      float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
    }
    if (lane == 0) red_v[warp] = bv, red_i[warp] = bi;
    __syncthreads();
    if (threadIdx.x == 0) {
      bv = red_v[0], bi = red_i[0];
      for (int i = 1; i < int(blockDim.x >> 5); ++i)
        if (red_v[i] > bv || (red_v[i] == bv && red_i[i] < bi)) bv = red_v[i], bi = red_i[i];
      sel_v[j] = bv, sel_i[j] = bi;
      p[bi] = -2.0f;  // taken
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    float total = 0;
    for (int j = 0; j < k; ++j) total += sel_v[j];
    for (int j = 0; j < k; ++j) {
      idx[size_t(blockIdx.x) * k + j] = sel_i[j];
      w[size_t(blockIdx.x) * k + j] = sel_v[j] / total * pes[sel_i[j]];
    }
  }
}

// One warp per token, the token's expert probabilities in registers (PL per lane, expert of slot j: eid(j), E <= 32 *
// PL): no shared memory and no block barriers, where route_top_k_k spends two barriers per selected expert. Same
// rules: float exp, double sum, p = float(e / sum), ties to the lower index. l[j]: the logit of expert eid(j) (any
// value where eid(j) >= E). eid must be ascending in j within a lane (the lane's first maximum is its lowest id).
// Returns the expert of slot `lane` (lanes < k).
template <int PL, class ExpertOf>
__device__ int warp_top_k(float (&l)[PL], ExpertOf eid, int E, int k, const float* pes, int32_t* idx, float* w) {
  const int lane = threadIdx.x & 31;
  float mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < PL; ++j) {
    if (eid(j) >= E) l[j] = -INFINITY;
    mx = fmaxf(mx, l[j]);
  }
  mx = warp_max(mx);
  double sum = 0;
  float p[PL];
#pragma unroll
  for (int j = 0; j < PL; ++j) {
    p[j] = eid(j) < E ? expf(l[j] - mx) : 0.0f;
    sum += p[j];
  }
  sum = warp_sum_d(sum);
#pragma unroll
  for (int j = 0; j < PL; ++j) p[j] = eid(j) < E ? float(double(p[j]) / sum) : -1.0f;
  float total = 0, my_v = 0;
  int my_i = 0;
  for (int s = 0; s < k; ++s) {
    float bv = -2.0f;
    int bi = INT32_MAX;
#pragma unroll
    for (int j = 0; j < PL; ++j)
      if (p[j] > bv) bv = p[j], bi = eid(j);  // ascending index within a lane: first wins ties
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
    }
    total += bv;
    if (lane == s) my_v = bv, my_i = bi;
#pragma unroll
    for (int j = 0; j < PL; ++j)
      if (eid(j) == bi) p[j] = -2.0f;  // taken
  }
  if (lane < k) {
    idx[lane] = my_i;
    w[lane] = my_v / total * pes[my_i];
  }
  return my_i;
}

constexpr int kPerLane = 8;
__global__ void route_top_k_warp_k(const float* logits, int T, int E, int k, const float* pes, int32_t* idx,
                                   float* w) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  const int lane = threadIdx.x & 31, t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (t >= T) return;
  const float* l = logits + size_t(t) * E;
  float v[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) v[j] = lane + 32 * j < E ? l[lane + 32 * j] : -INFINITY;
  warp_top_k(v, [lane](int j) { return lane + 32 * j; }, E, k, pes, idx + size_t(t) * k, w + size_t(t) * k);
}

// moe_assign_k, a single block: counts, exclusive scan and row assignment. Expert e's first M pairs go to rows
// e M .. e M + M - 1, the rest ("overflow") to rows from ovf[e] = E M + (overflow of the experts before e); ovf[E] =
// end of the overflow rows. M = 0 is the plain grouping: ovf is then the exclusive prefix of the counts (moe_group's
// offsets). meta (M > 0, may be null): see moe_group_padded.
//
// Two ways to number an expert's pairs (its slots):
// - ordered: slot = the number of earlier TOKENS routed to the expert, from a bit mask of its tokens (E x ceil(T / 32)
//   words of shared memory). Needs each token's k experts distinct (a top-k's are). The assignment is then a
//   function of idx alone: the same rows every run, so which pairs overflow M (and take the grouped kernels' path)
//   does not change from run to run either.
// - by atomics: slots in arrival order, for idx of any kind (moe_group's generic grouping of long prefill chunks).
// staged: idx copied into shared memory once (all loads of a thread in flight together) instead of read in each
// phase, each a dependent L2 round trip per pair a thread handles.
__device__ void scan_expert_rows(int E, int M, int32_t* ovf, int32_t* meta, const int* cnt, int heavy_rows,
                                 int32_t* heavy_out) {
  if (threadIdx.x >= 32) return;  // warp 0 scans the counts, 32 experts at a time, in ascending expert id
  const int lane = threadIdx.x;
  int run = E * M, n_ovf = 0, n_heavy = 0;
  for (int e0 = 0; e0 < E; e0 += 32) {
    const int e = e0 + lane, c = e < E ? cnt[e] : 0, over = max(0, c - M);
    int incl = over;  // inclusive scan of the overflow rows
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    const unsigned flagged = __ballot_sync(0xffffffffu, c > M);
    if (e < E) {
      ovf[e] = run + incl - over;
      if (meta) {
        if (c > M) meta[1 + n_ovf + __popc(flagged & ((1u << lane) - 1u))] = e;
        meta[1 + E + e] = min(c, M);
      }
    }
    run += __shfl_sync(0xffffffffu, incl, 31);
    n_ovf += __popc(flagged);
    n_heavy += __popc(__ballot_sync(0xffffffffu, c > heavy_rows));
  }
  if (lane == 0) {
    ovf[E] = run;
    if (meta) meta[0] = n_ovf;
    if (heavy_out) *heavy_out = n_heavy;
  }
}

// Shared memory of moe_assign_k: E counts, then (ordered) the E x ceil(T / 32) token masks, then (staged) T k idx.
size_t assign_smem_bytes(int T, int k, int E, bool ordered, bool staged) {
  return size_t(E) * sizeof(int) + (ordered ? size_t(E) * size_t((T + 31) / 32) * sizeof(unsigned) : 0) +
         (staged ? size_t(T) * size_t(k) * sizeof(int) : 0);
}
// Ordered and staged where they fit in the 48 KB of dynamic shared memory a launch gets without the opt-in
// attribute (with a margin), then ordered alone, then staged alone, else neither.
struct AssignLayout {
  bool ordered, staged;
  size_t bytes;
};
AssignLayout assign_layout(int T, int k, int E) {
  constexpr size_t kMaxBytes = 46 * 1024;
  for (auto [o, st] : {std::pair{true, true}, std::pair{true, false}, std::pair{false, true}})
    if (assign_smem_bytes(T, k, E, o, st) <= kMaxBytes) return {o, st, assign_smem_bytes(T, k, E, o, st)};
  return {false, false, assign_smem_bytes(T, k, E, false, false)};
}

__global__ void moe_assign_k(const int32_t* idx_global, int T, int k, int E, int M, int32_t* ovf, int32_t* sorted_pos,
                             int32_t* meta, int32_t* slot_token, bool ordered, bool staged, int heavy_rows,
                             int32_t* heavy_out) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  extern __shared__ int assign_smem[];  // AssignLayout
  int* cnt = assign_smem;
  unsigned* mask = ordered ? reinterpret_cast<unsigned*>(assign_smem + E) : nullptr;
  int* idx_smem = staged ? assign_smem + E + (ordered ? E * ((T + 31) / 32) : 0) : nullptr;
  const int P = T * k, W = (T + 31) / 32;
  if (staged) {
#pragma unroll 8
    for (int i = threadIdx.x; i < P; i += blockDim.x) idx_smem[i] = __ldcg(idx_global + i);
  }  // published by the first barrier below
  auto load_idx = [&](int i) { return staged ? idx_smem[i] : __ldcg(idx_global + i); };
  if (ordered) {
    for (int i = threadIdx.x; i < E * W; i += blockDim.x) mask[i] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < P; i += blockDim.x) {
      const int t = i / k;
      atomicOr(&mask[load_idx(i) * W + (t >> 5)], 1u << (t & 31));
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      int c = 0;
      for (int w = 0; w < W; ++w) c += __popc(mask[e * W + w]);
      cnt[e] = c;
    }
  } else {
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < P; i += blockDim.x) atomicAdd(&cnt[load_idx(i)], 1);
  }
  __syncthreads();
  scan_expert_rows(E, M, ovf, meta, cnt, heavy_rows, heavy_out);
  __syncthreads();
  if (!ordered)
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;  // the slot cursors
  __syncthreads();
  for (int i = threadIdx.x; i < P; i += blockDim.x) {
    const int e = load_idx(i), t = i / k;
    int slot;
    if (ordered) {
      const unsigned* m = mask + e * W;
      slot = __popc(m[t >> 5] & ((1u << (t & 31)) - 1u));
      for (int w = 0; w < (t >> 5); ++w) slot += __popc(m[w]);
    } else {
      slot = atomicAdd(&cnt[e], 1);
    }
    sorted_pos[i] = slot < M ? e * M + slot : ovf[e] + slot - M;
    if (slot_token && slot < M) slot_token[e * M + slot] = t;
  }
}

// ---- the router of canvas-sized passes (router_top_k): two launches ----
// router_partials_k: the partial logits of kRtTok tokens x all kRtExp experts over one kRtKc-wide k slice of H, f32
// FMAs in ascending k, written to partial[split][t][0..kRtExp). Every block copies its two tiles into shared memory
// at once (cp.async, zero-filled past T, E and H) and multiplies them: a single wave of ~350 short blocks at the
// canvas shape. Warp w takes tokens w + 8 i, lane l experts l + 32 j: the token rows are broadcast reads, and the
// 68-float row stride puts the expert rows of a quarter warp's 16-byte reads in distinct banks. Block (0, 0) also
// clears the expert masks for the route kernel.
// router_route_k: four warps per token add a quarter of the split partials each (in split order, all loads of a warp
// in flight at once), one adds the four sums (in warp order), writes the logits, routes the token (warp_top_k) and
// sets the token's bit in each chosen expert's mask. No assignment here: gate_up reads each expert's tokens straight
// from its mask, and moe_assign_padded (token order, so the same rows) runs beside it on the side stream for the
// combine and the overflow rows.
// History (docs/BENCHMARKS.md): session 4's version (k split 16 ways through a double buffer; the assignment by the
// route kernel's last block, with atomics) measured 15.2 + 20.2 us a layer; session 6's first rewrite (this GEMM, the
// assignment still in the last block, token-ordered) 27.9 us alone (bench-kernels), as cuBLASLt's chain (29.2).
struct RouterArgs {
  const float* x;
  const float* W;
  const float* pes;
  int T, H, E, k;
  float* partial;
  float* logits;
  int32_t* idx;
  float* w;
  unsigned* masks;  // [E][ceil(T / 32)]
};
constexpr int kRtTok = 32, kRtExp = 128, kRtKc = 64, kRtThreads = 256, kRtWarps = kRtThreads / 32;
constexpr int kRtPad = kRtKc + 4;  // shared row stride (floats): 16-byte aligned, quarter-warp reads conflict-free
// router_route_k: TOK tokens a block (route_tokens_per_block), kRouteWarpsPerToken warps a token, each with up to
// kRouteLoads split loads in flight (44 splits at H 2816: 11 a warp, one round). 8 tokens a block (1024 threads, the
// whole register file of an SM) put the 256 tokens of a canvas on 32 SMs, none shared with the expert blocks that
// start beside it (PDL); 2 tokens a block put them on 128 SMs in blocks of 256 threads: 6.2 instead of 10.2 us alone
// on the H200, the step unchanged (session 11).
constexpr int kRouteWarpsPerToken = 4, kRouteLoads = 11;
static_assert(kRtTok % kRtWarps == 0 && kRtExp % 32 == 0, "tile shape");

// Token tiles of kRtTok and k slices of kRtKc.
struct RouterSplit {
  int tiles, splits;
};
RouterSplit router_split(int T, int H) { return {(T + kRtTok - 1) / kRtTok, (H + kRtKc - 1) / kRtKc}; }

// 3xTF32 on the tensor cores (mma.sync m16n8k8): v = hi + lo with hi = tf32(v), lo = tf32(v - hi); a b ~ ahi bhi +
// ahi blo + alo bhi (the lo lo term is below f32's rounding), summed in f32 in a fixed order: about f32's accuracy
// (relative error ~2^-22 a product) at a fraction of the FMA kernel's instruction count.
__device__ __forceinline__ uint32_t tf32_of(float v) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
  return r;
}
__device__ __forceinline__ void split_tf32(float v, uint32_t& hi, uint32_t& lo) {
  hi = tf32_of(v);
  lo = tf32_of(v - __uint_as_float(hi));
}
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// TC: the products on the tensor cores (3xTF32, sm_80+); else f32 FMAs on the CUDA cores.
template <bool TC>
__global__ void __launch_bounds__(kRtThreads) router_partials_k(RouterArgs a) {
  __shared__ __align__(16) float xs[kRtTok][kRtPad];
  __shared__ __align__(16) float ws[kRtExp][kRtPad];
  const int tid = threadIdx.x, t0 = blockIdx.x * kRtTok, split = blockIdx.y, k0 = split * kRtKc;
  constexpr int kQuads = kRtKc / 4;
  // The router weights' tile is a constant: requested before griddepcontrol.wait, so only the token tile's copies
  // remain after it (H % 4 == 0: a quad is in or out).
  for (int i = tid; i < kRtExp * kQuads; i += kRtThreads) {
    const int r = i / kQuads, c = (i % kQuads) * 4;
    const bool ok = k0 + c < a.H && r < a.E;
    cp_async16(&ws[r][c], ok ? a.W + size_t(r) * a.H + k0 + c : a.W, ok);
  }
  pdl_wait();  // launch.cuh: only the constant weights above were read before it
  pdl_trigger();
  if (blockIdx.x == 0 && blockIdx.y == 0)  // the route kernel (after this grid completes) sets the bits
    for (int i = tid; i < a.E * ((a.T + 31) / 32); i += kRtThreads) a.masks[i] = 0u;
  for (int i = tid; i < kRtTok * kQuads; i += kRtThreads) {
    const int r = i / kQuads, c = (i % kQuads) * 4;
    const bool ok = k0 + c < a.H && t0 + r < a.T;
    cp_async16(&xs[r][c], ok ? a.x + size_t(t0 + r) * a.H + k0 + c : a.x, ok);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  const int warp = tid >> 5, lane = tid & 31;
  if constexpr (TC) {
    // warp w: experts 16 w .. 16 w + 15 (two n8 tiles) x all 32 tokens (two m16 tiles); fragments of m16n8k8 with
    // g = lane / 4, q = lane % 4: A (tokens x k) rows g, g + 8, columns q, q + 4; B (k x experts) row q, q + 4,
    // column g; C rows g, g + 8, columns 2q, 2q + 1. The 68-float row stride puts all 32 lanes in distinct banks.
    static_assert(kRtTok == 32 && kRtExp == 16 * kRtWarps && kRtKc % 8 == 0, "tile shape of the tensor-core path");
    const int g = lane >> 2, q = lane & 3;
    float c[2][2][4] = {};  // [token m16 tile][expert n8 tile][fragment]
#pragma unroll 2
    for (int kk = 0; kk < kRtKc; kk += 8) {
      uint32_t ah[2][4], al[2][4], bh[2][2], bl[2][2];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        split_tf32(xs[16 * mi + g][kk + q], ah[mi][0], al[mi][0]);
        split_tf32(xs[16 * mi + g + 8][kk + q], ah[mi][1], al[mi][1]);
        split_tf32(xs[16 * mi + g][kk + q + 4], ah[mi][2], al[mi][2]);
        split_tf32(xs[16 * mi + g + 8][kk + q + 4], ah[mi][3], al[mi][3]);
      }
#pragma unroll
      for (int ni = 0; ni < 2; ++ni) {
        const int e = 16 * warp + 8 * ni + g;
        split_tf32(ws[e][kk + q], bh[ni][0], bl[ni][0]);
        split_tf32(ws[e][kk + q + 4], bh[ni][1], bl[ni][1]);
      }
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 2; ++ni) {
          mma_tf32(c[mi][ni], al[mi], bh[ni][0], bh[ni][1]);
          mma_tf32(c[mi][ni], ah[mi], bl[ni][0], bl[ni][1]);
          mma_tf32(c[mi][ni], ah[mi], bh[ni][0], bh[ni][1]);
        }
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int t = t0 + 16 * mi + g + 8 * h;
        if (t >= a.T) continue;
#pragma unroll
        for (int ni = 0; ni < 2; ++ni)
          *reinterpret_cast<float2*>(a.partial + (size_t(split) * a.T + t) * kRtExp + 16 * warp + 8 * ni + 2 * q) =
              make_float2(c[mi][ni][2 * h], c[mi][ni][2 * h + 1]);
      }
    return;
  }
  constexpr int kTi = kRtTok / kRtWarps, kEj = kRtExp / 32;
  float acc[kTi][kEj] = {};
#pragma unroll 4
  for (int kk = 0; kk < kRtKc; kk += 4) {
    float4 xv[kTi], wv[kEj];
#pragma unroll
    for (int i = 0; i < kTi; ++i) xv[i] = *reinterpret_cast<const float4*>(&xs[warp + kRtWarps * i][kk]);
#pragma unroll
    for (int j = 0; j < kEj; ++j) wv[j] = *reinterpret_cast<const float4*>(&ws[lane + 32 * j][kk]);
#pragma unroll
    for (int i = 0; i < kTi; ++i)
#pragma unroll
      for (int j = 0; j < kEj; ++j) {
        float v = acc[i][j];
        v = fmaf(xv[i].x, wv[j].x, v);
        v = fmaf(xv[i].y, wv[j].y, v);
        v = fmaf(xv[i].z, wv[j].z, v);
        acc[i][j] = fmaf(xv[i].w, wv[j].w, v);
      }
  }
#pragma unroll
  for (int i = 0; i < kTi; ++i) {
    const int t = t0 + warp + kRtWarps * i;
    if (t < a.T)
#pragma unroll
      for (int j = 0; j < kEj; ++j) a.partial[(size_t(split) * a.T + t) * kRtExp + lane + 32 * j] = acc[i][j];
  }
}

template <int TOK>
__global__ void __launch_bounds__(32 * TOK * kRouteWarpsPerToken) router_route_k(RouterArgs a, int splits) {
  __shared__ __align__(16) float psum[TOK][kRouteWarpsPerToken][kRtExp];
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tl = warp / kRouteWarpsPerToken, q = warp % kRouteWarpsPerToken, t = blockIdx.x * TOK + tl;
  if (t < a.T) {  // warp q adds splits q, q + 4, ... in that order, every load of the warp in flight at once
    auto part = [&](int sp) {
      return reinterpret_cast<const float4*>(a.partial + (size_t(sp) * a.T + t) * kRtExp)[lane];
    };
    float4 v[kRouteLoads], sum = make_float4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < kRouteLoads; ++u) {
      const int sp = q + kRouteWarpsPerToken * u;
      if (sp < splits) v[u] = part(sp);
    }
    for (int sp0 = q; sp0 < splits; sp0 += kRouteWarpsPerToken * kRouteLoads) {
#pragma unroll
      for (int u = 0; u < kRouteLoads; ++u) {
        const int sp = sp0 + kRouteWarpsPerToken * u;
        if (sp < splits) sum.x += v[u].x, sum.y += v[u].y, sum.z += v[u].z, sum.w += v[u].w;
      }
#pragma unroll
      for (int u = 0; u < kRouteLoads; ++u) {  // the next round's loads (splits > 4 kRouteLoads only)
        const int sp = sp0 + kRouteWarpsPerToken * (kRouteLoads + u);
        if (sp < splits) v[u] = part(sp);
      }
    }
    reinterpret_cast<float4*>(psum[tl][q])[lane] = sum;
  }
  __syncthreads();
  if (t >= a.T || q != 0) return;
  float l[4];  // the four sums added in warp order, then the token's top-k
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float x = psum[tl][0][lane * 4 + j];
#pragma unroll
    for (int w = 1; w < kRouteWarpsPerToken; ++w) x += psum[tl][w][lane * 4 + j];
    l[j] = x;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j)
    if (lane * 4 + j < a.E) a.logits[size_t(t) * a.E + lane * 4 + j] = l[j];
  const int e = warp_top_k(l, [lane](int j) { return lane * 4 + j; }, a.E, a.k, a.pes, a.idx + size_t(t) * a.k,
                           a.w + size_t(t) * a.k);
  if (lane < a.k) atomicOr(a.masks + size_t(e) * ((a.T + 31) / 32) + (t >> 5), 1u << (t & 31));
}

// act = bf16(gelu_tanh(gate) * up) over the padded rows that hold a pair (slot < valid[e]); gate/up in f32.
__global__ void moe_gelu_mul_padded_k(const float* gu, int E, int M, int I, const int32_t* valid, bf16* act) {
  for (int r = blockIdx.y; r < E * M; r += gridDim.y) {
    if (r % M >= valid[r / M]) continue;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < I; i += gridDim.x * blockDim.x) {
      const float g = gu[size_t(r) * 2 * I + i], u = gu[size_t(r) * 2 * I + I + i];
      act[size_t(r) * I + i] = __float2bfloat16(gelu_tanh(g) * u);
    }
  }
}

// The same over float4 quads of gate and up (I % 4 == 0): blockIdx.x = expert, blockIdx.y strides its valid rows,
// several quads in flight per thread. The scalar kernel above spent ~13 us a layer at the 4K step (H200 profile):
// one element per thread, a block per (row, 256 columns), half of them padding rows that exit at once.
constexpr int kGeluQuadThreads = 256, kGeluRowSplit = 2;
__global__ void __launch_bounds__(kGeluQuadThreads) moe_gelu_mul_padded_quad_k(const float* gu, int M, int I,
                                                                                const int32_t* valid, bf16* act) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  const int e = blockIdx.x, rows = valid[e], I4 = I / 4;
  const int n = ((rows - int(blockIdx.y) + kGeluRowSplit - 1) / kGeluRowSplit) * I4;  // quads of this block
#pragma unroll 4
  for (int q = threadIdx.x; q < n; q += kGeluQuadThreads) {
    const int r = e * M + int(blockIdx.y) + (q / I4) * kGeluRowSplit, c = q % I4;
    const float4 g = reinterpret_cast<const float4*>(gu + size_t(r) * 2 * I)[c];
    const float4 u = reinterpret_cast<const float4*>(gu + size_t(r) * 2 * I + I)[c];
    const __nv_bfloat162 lo = __floats2bfloat162_rn(gelu_tanh(g.x) * u.x, gelu_tanh(g.y) * u.y);
    const __nv_bfloat162 hi = __floats2bfloat162_rn(gelu_tanh(g.z) * u.z, gelu_tanh(g.w) * u.w);
    uint2 o;
    o.x = *reinterpret_cast<const uint32_t*>(&lo);
    o.y = *reinterpret_cast<const uint32_t*>(&hi);
    reinterpret_cast<uint2*>(act + size_t(r) * I)[c] = o;
  }
}

__global__ void moe_gather_k(const int32_t* sorted_pos, int k, const uint4* x, int hvec, uint4* xs, int min_row) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  const int pair = blockIdx.x, t = pair / k, row = sorted_pos[pair];
  if (row < min_row) return;
  const size_t dst = size_t(row) * hvec;
  for (int i = threadIdx.x; i < hvec; i += blockDim.x) xs[dst + i] = x[size_t(t) * hvec + i];
}

__global__ void moe_combine_k(const void* y, bool y_bf16, const int32_t* idx, const float* w,
                              const int32_t* sorted_pos, int k, int H, float* out) {
  const int t = blockIdx.x;
  int order[kMaxTopK];
  for (int j = 0; j < k; ++j) order[j] = j;
  for (int j = 1; j < k; ++j)  // insertion sort by expert id: HF's index_add_ order
    for (int i = j; i > 0 && idx[t * k + order[i]] < idx[t * k + order[i - 1]]; --i) {
      int tmp = order[i];
      order[i] = order[i - 1];
      order[i - 1] = tmp;
    }
  for (int h = threadIdx.x; h < H; h += blockDim.x) {
    float acc = 0;
    for (int j = 0; j < k; ++j) {
      const int s = t * k + order[j];
      acc += w[s] * load_expert_row(y, y_bf16, size_t(sorted_pos[s]) * H + h);
    }
    out[size_t(t) * H + h] = acc;
  }
}

// Token t's k (expert row, weight) pairs in ascending expert id (HF's index_add_ order; a stable insertion sort),
// for one thread to fill the block's shared lists before a barrier.
__device__ void combine_sources(const int32_t* idx, const float* w, const int32_t* sorted_pos, int t, int k,
                                int* src_row, float* src_w) {
  int order[kMaxTopK];
  for (int j = 0; j < k; ++j) order[j] = j;
  for (int j = 1; j < k; ++j)
    for (int i = j; i > 0 && idx[t * k + order[i]] < idx[t * k + order[i - 1]]; --i) {
      const int tmp = order[i];
      order[i] = order[i - 1];
      order[i - 1] = tmp;
    }
  for (int j = 0; j < k; ++j) src_row[j] = sorted_pos[t * k + order[j]], src_w[j] = w[t * k + order[j]];
}

// moe_combine_k and ffn_combine_k (kernels_rows.cu) in one pass per token: the combined expert row m2 stays in shared
// memory instead of a [T, H] f32 round trip through global memory and a second launch. Same arithmetic and order.
__global__ void moe_combine_ffn_k(const void* y, bool y_bf16, const int32_t* idx, const float* w,
                                  const int32_t* sorted_pos, int k, float* h, const bf16* m1, int H, const float* w1,
                                  const float* w2, const float* wn, float eps, float scalar) {
  extern __shared__ float row[];  // [H]: m2, then the pre-norm sum
  __shared__ int src_row[kMaxTopK];
  __shared__ float src_w[kMaxTopK];
  const int t = blockIdx.x;
  if (threadIdx.x == 0) combine_sources(idx, w, sorted_pos, t, k, src_row, src_w);
  __syncthreads();
  const size_t off = size_t(t) * H;
  float s1 = 0, s2 = 0;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    float acc = 0;
    for (int j = 0; j < k; ++j) acc += src_w[j] * load_expert_row(y, y_bf16, size_t(src_row[j]) * H + i);
    row[i] = acc;
    const float a = __bfloat162float(m1[off + i]);
    s1 += a * a;
    s2 += acc * acc;
  }
  const float inv1 = rsqrtf(block_sum(s1) / float(H) + eps);
  const float inv2 = rsqrtf(block_sum(s2) / float(H) + eps);
  float s3 = 0;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    const float v = __bfloat162float(m1[off + i]) * inv1 * w1[i] + row[i] * inv2 * w2[i];
    row[i] = v;
    s3 += v * v;
  }
  const float inv3 = rsqrtf(block_sum(s3) / float(H) + eps);
  for (int i = threadIdx.x; i < H; i += blockDim.x) h[off + i] = (h[off + i] + row[i] * inv3 * wn[i]) * scalar;
}

// The same with the row in registers and the k expert rows of one 16-byte chunk loaded before they are summed
// (the scalar loop above waits on one 4-byte load per expert and element: ~30 us per layer at T = 256).
// kCombineThreads threads cover NV chunks each; moe_combine_ffn runs rows of up to 1024 chunks (H <= 4096) with 768 or
// 1024 threads and one chunk each, so a thread's k expert loads are its only round trip (256 threads x 3 chunks took
// 15 us a layer at the 4K step, H200 profile). Warp 0 loads the token's k (expert, weight, row) triples a lane each
// and ranks them with shuffles (thread 0 loading and sorting them alone took two dependent round trips). Holding the
// norm weights in registers from before griddepcontrol.wait (13.1 us: 76 registers, one block an SM) or staging them
// and h / m1 in shared memory by cp.async (14-15 us in the step, 20.2 alone) were slower (session 11).
// YB: the experts' rows in bf16 (ExpertRows), four of them an 8-byte load.
template <int NV, int KMAX, int kCombineThreads, bool YB>
__global__ void __launch_bounds__(kCombineThreads) moe_combine_ffn_vec_k(
    const void* y, const int32_t* idx, const float* w, const int32_t* sorted_pos, int k, float* h, const bf16* m1,
    int H, const float* w1, const float* w2, const float* wn, float eps, float scalar, const float* w_next,
    bf16* x_next, bool discard_y) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  static_assert(KMAX <= 32, "one lane a source");
  __shared__ int src_row[KMAX];
  __shared__ float src_w[KMAX];
  const int t = blockIdx.x, H4 = H / 4;
  if (threadIdx.x < 32) {  // a lane a source, ranked by expert id: combine_sources' order in one round trip
    const int lane = int(threadIdx.x);
    const bool mine = lane < k;
    const int e = mine ? idx[t * k + lane] : 0;
    const float wt = mine ? w[t * k + lane] : 0.0f;
    const int row = mine ? sorted_pos[t * k + lane] : 0;
    int rank = 0;  // sources before this one: a lower expert id, or the same id earlier in pair order
    for (int j = 0; j < k; ++j) {
      const int ej = __shfl_sync(0xffffffffu, e, j);
      rank += (ej < e || (ej == e && j < lane)) ? 1 : 0;
    }
    if (mine) src_row[rank] = row, src_w[rank] = wt;
  }
  __syncthreads();
  const size_t off = size_t(t) * H;
  float4 m2[NV], a1[NV];
  float s1 = 0, s2 = 0;
#pragma unroll
  for (int q = 0; q < NV; ++q) {
    const int c = threadIdx.x + q * kCombineThreads;
    float4 acc = make_float4(0, 0, 0, 0), a = acc;
    if (c < H4) {
      float4 ys[KMAX];
      if constexpr (YB) {  // every load of the token in flight before any conversion
        uint2 yb[KMAX];
#pragma unroll
        for (int j = 0; j < KMAX; ++j)
          if (j < k) yb[j] = reinterpret_cast<const uint2*>(static_cast<const bf16*>(y) + size_t(src_row[j]) * H)[c];
#pragma unroll
        for (int j = 0; j < KMAX; ++j)
          if (j < k) {
            const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&yb[j].x));
            const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&yb[j].y));
            ys[j] = make_float4(lo.x, lo.y, hi.x, hi.y);
          }
      } else {
#pragma unroll
        for (int j = 0; j < KMAX; ++j)
          if (j < k)
            ys[j] = reinterpret_cast<const float4*>(static_cast<const float*>(y) + size_t(src_row[j]) * H)[c];
      }
#pragma unroll
      for (int j = 0; j < KMAX; ++j)
        if (j < k) {
          acc.x += src_w[j] * ys[j].x;
          acc.y += src_w[j] * ys[j].y;
          acc.z += src_w[j] * ys[j].z;
          acc.w += src_w[j] * ys[j].w;
        }
      const uint2 u = reinterpret_cast<const uint2*>(m1 + off)[c];
      const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
      const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
      a = make_float4(lo.x, lo.y, hi.x, hi.y);
    }
    m2[q] = acc, a1[q] = a;
    s1 += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
    s2 += acc.x * acc.x + acc.y * acc.y + acc.z * acc.z + acc.w * acc.w;
  }
  const float inv1 = rsqrtf(block_sum(s1) / float(H) + eps);
  const float inv2 = rsqrtf(block_sum(s2) / float(H) + eps);
  if constexpr (YB) {
    // discard_y: every y line this token read (block_sum's barrier: all of them consumed) leaves L2 without a
    // write-back. A line is 16 chunks of one source row (the host checks H % 64 == 0 and the alignment).
    if (discard_y)
#pragma unroll
      for (int q = 0; q < NV; ++q) {
        const int c = threadIdx.x + q * kCombineThreads;
        if (c < H4 && (c & 15) == 0)
          for (int j = 0; j < k; ++j) discard_l2_line(static_cast<const bf16*>(y) + size_t(src_row[j]) * H + 4 * c);
      }
  }
  float s3 = 0;
#pragma unroll
  for (int q = 0; q < NV; ++q) {
    const int c = threadIdx.x + q * kCombineThreads;
    if (c < H4) {
      const float4 p = reinterpret_cast<const float4*>(w1)[c], r = reinterpret_cast<const float4*>(w2)[c];
      m2[q] = make_float4(a1[q].x * inv1 * p.x + m2[q].x * inv2 * r.x, a1[q].y * inv1 * p.y + m2[q].y * inv2 * r.y,
                          a1[q].z * inv1 * p.z + m2[q].z * inv2 * r.z, a1[q].w * inv1 * p.w + m2[q].w * inv2 * r.w);
      s3 += m2[q].x * m2[q].x + m2[q].y * m2[q].y + m2[q].z * m2[q].z + m2[q].w * m2[q].w;
    }
  }
  const float inv3 = rsqrtf(block_sum(s3) / float(H) + eps);
  float s4 = 0;
#pragma unroll
  for (int q = 0; q < NV; ++q) {
    const int c = threadIdx.x + q * kCombineThreads;
    float4 hv = make_float4(0, 0, 0, 0);
    if (c < H4) {
      const float4 p = reinterpret_cast<const float4*>(wn)[c];
      hv = reinterpret_cast<float4*>(h + off)[c];
      hv.x = (hv.x + m2[q].x * inv3 * p.x) * scalar;
      hv.y = (hv.y + m2[q].y * inv3 * p.y) * scalar;
      hv.z = (hv.z + m2[q].z * inv3 * p.z) * scalar;
      hv.w = (hv.w + m2[q].w * inv3 * p.w) * scalar;
      reinterpret_cast<float4*>(h + off)[c] = hv;
    }
    m2[q] = hv;  // the new residual row, for the next layer's input norm
    s4 += hv.x * hv.x + hv.y * hv.y + hv.z * hv.z + hv.w * hv.w;
  }
  if (!x_next) return;
  // x_next = rms(h; w_next) in bf16: rms_norm_f32_to_bf16's formula, not its bits (its blocks split the row and
  // sum the squares differently; the test holds the two to bf16 rounding).
  const float inv4 = rsqrtf(block_sum(s4) / float(H) + eps);
#pragma unroll
  for (int q = 0; q < NV; ++q) {
    const int c = threadIdx.x + q * kCombineThreads;
    if (c < H4) {
      const float4 p = reinterpret_cast<const float4*>(w_next)[c];
      const __nv_bfloat162 lo = __floats2bfloat162_rn(m2[q].x * inv4 * p.x, m2[q].y * inv4 * p.y);
      const __nv_bfloat162 hi = __floats2bfloat162_rn(m2[q].z * inv4 * p.z, m2[q].w * inv4 * p.w);
      uint2 u;
      u.x = *reinterpret_cast<const uint32_t*>(&lo);
      u.y = *reinterpret_cast<const uint32_t*>(&hi);
      reinterpret_cast<uint2*>(x_next + off)[c] = u;
    }
  }
}

}  // namespace

void route_top_k(const float* logits, int T, int E, int k, const float* per_expert_scale, int32_t* idx, float* w,
                 cudaStream_t s) {
  if (T == 0) return;
  if (k > kMaxTopK || k > E || E > 4096)
    throw_cuda_error("route_top_k", "unsupported expert count / top-k", 0, __FILE__, __LINE__);
  if (E <= 32 * kPerLane && k <= 32) {
    constexpr int kWarps = 8;
    launch_pdl(route_top_k_warp_k, dim3((T + kWarps - 1) / kWarps), dim3(32 * kWarps), 0, s, logits, T, E, k,
               per_expert_scale, idx, w);
  } else {
    int threads = E >= 1024 ? 1024 : (E + 31) / 32 * 32;
    route_top_k_k<<<T, threads, size_t(E) * sizeof(float), s>>>(logits, E, k, per_expert_scale, idx, w);
  }
  CUDA_CHECK_LAUNCH();
}

void moe_assign_padded(const int32_t* idx, int T, int k, int E, int M, int32_t* ovf_offsets, int32_t* sorted_pos,
                       int32_t* meta, int32_t* slot_token, cudaStream_t s, int threads, int heavy_rows,
                       int32_t* heavy_experts) {
  if (threads < 32 || threads > 1024 || threads % 32 != 0)
    throw_cuda_error("moe_assign_padded", "threads must be a multiple of 32 in [32, 1024]", 0, __FILE__, __LINE__);
  const AssignLayout al = assign_layout(T, k, E);
  launch_pdl(moe_assign_k, dim3(1), dim3(unsigned(threads)), al.bytes, s, idx, T, k, E, M, ovf_offsets, sorted_pos,
             M > 0 ? meta : nullptr, M > 0 ? slot_token : nullptr, al.ordered, al.staged, heavy_rows, heavy_experts);
  CUDA_CHECK_LAUNCH();
}

void moe_group_padded(const int32_t* idx, int T, int k, int E, const bf16* x, int H, int M, int32_t* ovf_offsets,
                      int32_t* sorted_pos, bf16* xs, cudaStream_t s, int32_t* meta) {
  moe_assign_padded(idx, T, k, E, M, ovf_offsets, sorted_pos, meta, nullptr, s);
  moe_gather(sorted_pos, T, k, x, H, xs, s);
}

void moe_gather(const int32_t* sorted_pos, int T, int k, const bf16* x, int H, bf16* xs, cudaStream_t s,
                int min_row) {
  if (T * k == 0) return;
  launch_pdl(moe_gather_k, dim3(T * k), dim3(128), 0, s, sorted_pos, k, reinterpret_cast<const uint4*>(x), H / 8,
             reinterpret_cast<uint4*>(xs), min_row);
  CUDA_CHECK_LAUNCH();
}

namespace {
bool g_router_tc = false;  // set_router_tensor_cores (off until a GPU A/B says it pays)
}  // namespace

void set_router_tensor_cores(bool on) { g_router_tc = on; }

bool router_tensor_cores() { return g_router_tc && compute_major() >= 8; }
int g_route_tokens = 2;  // set_route_tokens_per_block
void set_route_tokens_per_block(int tokens) {
  if (tokens != 2 && tokens != 8)
    throw_cuda_error("set_route_tokens_per_block", "tokens a block must be 2 or 8", 0, __FILE__, __LINE__);
  g_route_tokens = tokens;
}
int route_tokens_per_block() { return g_route_tokens; }

size_t router_partial_floats(int T, int H) { return size_t(router_split(T, H).splits) * size_t(T) * kRtExp; }

size_t expert_mask_words(int T, int E) { return size_t(E) * size_t((T + 31) / 32); }

bool router_fused_supported(int E, int H, int k) { return E >= 1 && E <= kRtExp && H % 4 == 0 && k <= 32 && k <= E; }

void router_top_k(const float* x, int T, int H, const float* W, int E, int k, const float* per_expert_scale,
                  float* partial, float* logits, int32_t* idx, float* w, unsigned* expert_masks, cudaStream_t s) {
  router_top_k_stage(RouterStage::Partials, x, T, H, W, E, k, per_expert_scale, partial, logits, idx, w, expert_masks,
                     s);
  router_top_k_stage(RouterStage::Route, x, T, H, W, E, k, per_expert_scale, partial, logits, idx, w, expert_masks, s);
}

void router_top_k_stage(RouterStage stage, const float* x, int T, int H, const float* W, int E, int k,
                        const float* per_expert_scale, float* partial, float* logits, int32_t* idx, float* w,
                        unsigned* expert_masks, cudaStream_t s) {
  if (T == 0) return;
  if (!router_fused_supported(E, H, k))
    throw_cuda_error("router_top_k", "needs E <= 128, H % 4 == 0 and k <= min(32, E)", 0, __FILE__, __LINE__);
  const RouterSplit sp = router_split(T, H);
  const RouterArgs a{x, W, per_expert_scale, T, H, E, k, partial, logits, idx, w, expert_masks};
  if (stage == RouterStage::Partials) {
    launch_pdl(router_tensor_cores() ? router_partials_k<true> : router_partials_k<false>,
               dim3(unsigned(sp.tiles), unsigned(sp.splits)), dim3(kRtThreads), 0, s, a);
  } else {
    const int tok = route_tokens_per_block();
    launch_pdl(tok == 8 ? router_route_k<8> : router_route_k<2>, dim3(unsigned((T + tok - 1) / tok)),
               dim3(unsigned(32 * tok * kRouteWarpsPerToken)), 0, s, a, sp.splits);
  }
  CUDA_CHECK_LAUNCH();
}

void moe_group(const int32_t* idx, int T, int k, int E, const bf16* x, int H, int32_t* offsets, int32_t* sorted_pos,
               bf16* xs, cudaStream_t s) {
  moe_group_padded(idx, T, k, E, x, H, /*M=*/0, offsets, sorted_pos, xs, s, nullptr);
}

void moe_gelu_mul_padded(const float* gu, int E, int M, int I, const int32_t* meta, bf16* act, cudaStream_t s) {
  if (E == 0 || M == 0) return;
  if (I % 4 == 0 && E <= 65535) {
    launch_pdl(moe_gelu_mul_padded_quad_k, dim3(dim3(unsigned(E), kGeluRowSplit)), dim3(kGeluQuadThreads), 0, s, gu, M,
               I, meta + 1 + E, act);
    CUDA_CHECK_LAUNCH();
    return;
  }
  const dim3 grid(unsigned((I + 255) / 256), unsigned(std::min(E * M, 65535)));
  moe_gelu_mul_padded_k<<<grid, 256, 0, s>>>(gu, E, M, I, meta + 1 + E, act);
  CUDA_CHECK_LAUNCH();
}

void moe_combine(ExpertRowsIn y, const int32_t* idx, const float* w, const int32_t* sorted_pos, int T, int k, int H,
                 float* out, cudaStream_t s) {
  if (T == 0) return;
  moe_combine_k<<<T, 256, 0, s>>>(y.p, y.is_bf16, idx, w, sorted_pos, k, H, out);
  CUDA_CHECK_LAUNCH();
}

void moe_combine_ffn(ExpertRowsIn y, const int32_t* idx, const float* w, const int32_t* sorted_pos, int T, int k,
                     float* h, const bf16* m1, int H, const float* w1, const float* w2, const float* w_post, float eps,
                     float scalar, cudaStream_t s, const float* w_next, bf16* x_next, bool discard_y) {
  if (T == 0) return;
  if (k > kMaxTopK) throw_cuda_error("moe_combine_ffn", "top-k above 32", 0, __FILE__, __LINE__);
  if (x_next && !w_next) throw_cuda_error("moe_combine_ffn", "x_next needs w_next", 0, __FILE__, __LINE__);
  if (k <= 8 && H % 4 == 0 && H / 4 <= 1024) {
    const bool narrow = H / 4 <= 768;
    auto* kern = y.is_bf16 ? (narrow ? moe_combine_ffn_vec_k<1, 8, 768, true> : moe_combine_ffn_vec_k<1, 8, 1024, true>)
                 : narrow  ? moe_combine_ffn_vec_k<1, 8, 768, false>
                           : moe_combine_ffn_vec_k<1, 8, 1024, false>;
    discard_y = discard_y && y.is_bf16 && H % 64 == 0 && (reinterpret_cast<uintptr_t>(y.p) & 127) == 0;
    launch_pdl(kern, dim3(T), dim3(narrow ? 768 : 1024), 0, s, y.p, idx, w, sorted_pos, k, h, m1, H, w1, w2, w_post,
               eps, scalar, w_next, x_next, discard_y);
    CUDA_CHECK_LAUNCH();
    return;
  }
  moe_combine_ffn_k<<<T, 256, size_t(H) * sizeof(float), s>>>(y.p, y.is_bf16, idx, w, sorted_pos, k, h, m1, H, w1,
                                                               w2, w_post, eps, scalar);
  CUDA_CHECK_LAUNCH();
  if (x_next) rms_norm_f32_to_bf16(h, T, H, w_next, eps, x_next, s);
}

}  // namespace dg::cuda
