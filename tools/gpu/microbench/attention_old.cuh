// Flash-style attention on tensor cores (mma.sync m16n8k16 bf16, f32 accumulate): one block per (32 query rows,
// kv head), where the rows are (query, head-of-the-group) pairs so that the K/V tiles of one kv head serve all its
// query heads. Scores stay f32 through an online softmax; P is rounded to bf16 for the P.V product (as HF's eager
// path does). The O accumulator lives in registers (FlashAttention-2 style): warp w owns row group w/4 and a quarter
// of the head dim, so the online-softmax rescale is a register multiply (a 32 x 512 f32 O tile in shared memory
// cost a load + rescale + store pass of 64 KB per key tile and 66 KB of smem). A whole row's O does not fit one
// warp at D = 512 (256 f32 per lane), hence the head-dim split; S/P (32 x 64) still go through shared memory.
// K and V have separate buffers, each filled by cp.async one tile ahead: K(j+1) streams in during softmax + P.V of
// tile j, V(j+1) during Q.K^T of tile j+1 (before, every K tile's load latency was exposed).
#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/cuda_util.cuh"

namespace dg::cuda {
namespace {

constexpr int BM = 32, BN = 64, kThreads = 256, kWarpsPerRowGroup = 4;

struct Smem {
  size_t q, k, v, s, p, stats, total;
  __host__ __device__ explicit Smem(int D) {
    auto up = [](size_t x) { return (x + 127) / 128 * 128; };
    q = 0;
    k = q + up(size_t(BM) * (D + 8) * 2);
    v = k + up(size_t(BN) * (D + 8) * 2);
    s = v + up(size_t(BN) * (D + 8) * 2);
    p = s + up(size_t(BM) * (BN + 4) * 4);
    stats = p + up(size_t(BM) * (BN + 8) * 2);
    total = stats + up(size_t(BM) * 4 * 3 + size_t(BM) * 8);
  }
};

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t lds32(const bf16* p) { return *reinterpret_cast<const uint32_t*>(p); }

// DT: the head dim as a compile-time constant for the model's 256 / 512 (index math by shifts, unrolled loops),
// 0 = run-time a.D <= 128 (the small test dims). NTW: n8 tiles of O per warp (D / 8 / 4, rounded up).
template <int DT, int NTW>
__global__ void __launch_bounds__(kThreads) attention_k(AttentionArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int D = DT ? DT : a.D, g = a.nh / a.nkv, kvh = blockIdx.y;
  const Smem L(D);
  bf16* Qs = reinterpret_cast<bf16*>(smem + L.q);
  bf16* Ks = reinterpret_cast<bf16*>(smem + L.k);
  bf16* Vs = reinterpret_cast<bf16*>(smem + L.v);
  float* Ss = reinterpret_cast<float*>(smem + L.s);
  bf16* Ps = reinterpret_cast<bf16*>(smem + L.p);
  float* row_m = reinterpret_cast<float*>(smem + L.stats);
  float* row_l = row_m + BM;
  float* row_alpha = row_l + BM;
  int64_t* row_pos = reinterpret_cast<int64_t*>(row_alpha + BM);
  const int ldq = D + 8, lds = BN + 4, ldp = BN + 8;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, grp = lane >> 2, tig = lane & 3;
  const int rows_total = a.T * g, m0 = blockIdx.x * BM;
  const int dvec = D / 8;

  for (int i = tid; i < BM * dvec; i += kThreads) {
    const int r = i / dvec, c = i % dvec, gr = m0 + r;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (gr < rows_total) {
      const int t = gr / g, h = kvh * g + gr % g;
      v = reinterpret_cast<const uint4*>(a.q + (size_t(t) * a.nh + h) * D)[c];
    }
    reinterpret_cast<uint4*>(Qs + r * ldq)[c] = v;
  }
  if (tid < BM) {
    const int gr = m0 + tid;
    row_m[tid] = -INFINITY;
    row_l[tid] = 0.0f;
    row_pos[tid] = gr < rows_total ? a.q_pos0 + gr / g : INT64_MIN;
  }
  const int last_row = min(rows_total, m0 + BM) - 1;
  const int64_t q_min = a.q_pos0 + m0 / g, q_max = a.q_pos0 + last_row / g;
  const int64_t nk = a.n_old + a.T_new;
  int64_t j_begin = 0, j_end = nk;
  if (a.causal) {
    j_end = min(nk, q_max - a.first_pos + 1);
    if (a.window > 0) j_begin = max(int64_t(0), q_min - a.window + 1 - a.first_pos);
  }

  // This warp's share of O: rows og*16 + {grp, grp + 8}, n8 tiles [ot0, ot0 + NTW) of the head dim.
  const int og = warp / kWarpsPerRowGroup, ot0 = (warp % kWarpsPerRowGroup) * NTW;
  float o[NTW][4];
#pragma unroll
  for (int t = 0; t < NTW; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.0f;
  __syncthreads();

  // Issues the tile's copies (rows past j_end zero-filled) as one cp.async group; the caller waits.
  auto load_tile = [&](bf16* dst, const bf16* cache, const bf16* fresh, int64_t j0) {
    const int64_t slot0 = (a.first_pos + j0) % a.cap;  // one 64-bit modulo per tile, not per 16-byte copy
    for (int i = tid; i < BN * dvec; i += kThreads) {
      const int r = i / dvec, c = i % dvec;
      const int64_t j = j0 + r;
      const bool ok = j < j_end;
      int64_t slot = slot0 + r;
      while (slot >= a.cap) slot -= a.cap;  // at most once unless the ring is shorter than a tile
      const bf16* src = !ok ? fresh
                        : j < a.n_old ? cache + (slot * a.nkv + kvh) * size_t(D)
                                      : fresh + ((j - a.n_old) * a.nkv + kvh) * size_t(D);
      cp_async16(dst + r * ldq + c * 8, src + (ok ? c * 8 : 0), ok);
    }
    cp_async_commit();
  };

  if (j_begin < j_end) {
    load_tile(Ks, a.k_cache, a.k_new, j_begin);
    load_tile(Vs, a.v_cache, a.v_new, j_begin);
  }
  for (int64_t j0 = j_begin; j0 < j_end; j0 += BN) {
    const bool has_next = j0 + BN < j_end;
    cp_async_wait<1>();  // in flight: K(j0), V(j0) in this order; K is the older group
    __syncthreads();
    {  // S = Q K^T: warp (mi, ni) computes rows mi*16.., keys ni*16.. as two n8 tiles
      const int mi = warp / (BN / 16), ni = warp % (BN / 16);
      float c[2][4] = {};
      const bf16* qa = Qs + (mi * 16 + grp) * ldq + tig * 2;
      const bf16* kb = Ks + (ni * 16 + grp) * ldq + tig * 2;
#pragma unroll 8
      for (int kk = 0; kk < D; kk += 16) {
        const uint32_t a0 = lds32(qa + kk), a1 = lds32(qa + 8 * ldq + kk);
        const uint32_t a2 = lds32(qa + kk + 8), a3 = lds32(qa + 8 * ldq + kk + 8);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const bf16* kr = kb + nt * 8 * ldq + kk;
          mma_bf16(c[nt], a0, a1, a2, a3, lds32(kr), lds32(kr + 8));
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        float* s0 = Ss + (mi * 16 + grp) * lds + ni * 16 + nt * 8 + tig * 2;
        s0[0] = c[nt][0];
        s0[1] = c[nt][1];
        s0[8 * lds] = c[nt][2];
        s0[8 * lds + 1] = c[nt][3];
      }
    }
    __syncthreads();  // every warp is done with the K tile: the next one may replace it
    if (has_next) load_tile(Ks, a.k_cache, a.k_new, j0 + BN);
    {  // online softmax: 8 threads per row, 8 columns each
      const int r = tid >> 3, c0 = (tid & 7) * 8;
      const int64_t qp = row_pos[r];
      float sv[8], tmax = -INFINITY;
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const int64_t j = j0 + c0 + c, kp = a.first_pos + j;
        bool ok = j < j_end && qp != INT64_MIN;
        if (a.causal) ok = ok && kp <= qp && (a.window == 0 || qp - kp < a.window);
        sv[c] = ok ? Ss[r * lds + c0 + c] : -INFINITY;
        tmax = fmaxf(tmax, sv[c]);
      }
      for (int o = 4; o > 0; o >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, o));
      const float m_old = row_m[r], m_new = fmaxf(m_old, tmax);
      float alpha = 1.0f, sum = 0.0f;
      if (m_new != -INFINITY) alpha = m_old == -INFINITY ? 0.0f : __expf(m_old - m_new);
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const float p = sv[c] == -INFINITY ? 0.0f : __expf(sv[c] - m_new);
        sum += p;
        Ps[r * ldp + c0 + c] = __float2bfloat16(p);
      }
      for (int o = 4; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      __syncwarp();
      if ((tid & 7) == 0) {
        row_alpha[r] = alpha;
        row_l[r] = row_l[r] * alpha + sum;
        row_m[r] = m_new;
      }
    }
    if (has_next) {
      cp_async_wait<1>();  // V(j0) landed; K(j0 + BN) may still be in flight
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    {  // O = O * alpha + P V, in registers
      const float al0 = row_alpha[og * 16 + grp], al1 = row_alpha[og * 16 + grp + 8];
#pragma unroll
      for (int t = 0; t < NTW; ++t) {
        o[t][0] *= al0;
        o[t][1] *= al0;
        o[t][2] *= al1;
        o[t][3] *= al1;
      }
      const bf16* pa = Ps + (og * 16 + grp) * ldp + tig * 2;
#pragma unroll
      for (int kk = 0; kk < BN; kk += 16) {
        const uint32_t a0 = lds32(pa + kk), a1 = lds32(pa + 8 * ldp + kk);
        const uint32_t a2 = lds32(pa + kk + 8), a3 = lds32(pa + 8 * ldp + kk + 8);
        // ldmatrix .trans: lanes 0-15 address V rows kk..kk+15 (lanes 16-31 repeat them); the two 8x8 transposed
        // matrices are exactly the B fragment (k = 2*tig.., n = grp) of the n8 tile.
        const uint32_t vrow = static_cast<uint32_t>(__cvta_generic_to_shared(Vs + (kk + (lane & 15)) * ldq));
#pragma unroll
        for (int t = 0; t < NTW; ++t) {
          const int nt = ot0 + t;
          if (DT == 0 && nt * 8 >= D) break;
          uint32_t b0, b1;
          asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                       : "=r"(b0), "=r"(b1)
                       : "r"(vrow + nt * 16));
          mma_bf16(o[t], a0, a1, a2, a3, b0, b1);
        }
      }
    }
    __syncthreads();  // the V tile and P are consumed: the next V may replace it
    if (has_next) load_tile(Vs, a.v_cache, a.v_new, j0 + BN);
  }

  // Each lane writes its rows grp, grp + 8 of the row group, two adjacent columns per n8 tile.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = og * 16 + grp + half * 8, gr = m0 + r;
    if (gr >= rows_total) continue;
    const int t = gr / g, h = kvh * g + gr % g;
    const float l = row_l[r], inv = l > 0 ? 1.0f / l : 0.0f;
    bf16* dst = a.out + (size_t(t) * a.nh + h) * D;
#pragma unroll
    for (int u = 0; u < NTW; ++u) {
      const int nt = ot0 + u;
      if (DT == 0 && nt * 8 >= D) break;
      *reinterpret_cast<__nv_bfloat162*>(dst + nt * 8 + tig * 2) =
          __floats2bfloat162_rn(o[u][half * 2] * inv, o[u][half * 2 + 1] * inv);
    }
  }
}

}  // namespace

void attention_old(const AttentionArgs& a, cudaStream_t s) {
  if (a.T == 0) return;
  if (a.D % 16 != 0 || a.nh % a.nkv != 0) throw_cuda_error("attention", "head_dim must be a multiple of 16 and nh of nkv", 0, __FILE__, __LINE__);
  const Smem L(a.D);
  const int which = a.D == 256 ? 0 : a.D == 512 ? 1 : 2;
  if (which == 2 && a.D > 128) throw_cuda_error("attention", "head_dim must be 256, 512 or <= 128", 0, __FILE__, __LINE__);
  // O registers per lane: 4 * D / 32 (64 at D = 512); the run-time kernel reserves the D = 128 share.
  void (*const kernels[3])(AttentionArgs) = {attention_k<256, 8>, attention_k<512, 16>, attention_k<0, 4>};
  auto* kern = kernels[which];
  static size_t raised[3] = {0, 0, 0};  // dynamic shared memory opt-in, per kernel
  if (L.total > 48 * 1024 && L.total > raised[which]) {
    CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(L.total)));
    raised[which] = L.total;
  }
  const int rows = a.T * (a.nh / a.nkv);
  dim3 grid((rows + BM - 1) / BM, a.nkv);
  kern<<<grid, kThreads, L.total, s>>>(a);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dg::cuda
