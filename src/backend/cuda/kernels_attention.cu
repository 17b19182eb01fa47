// Flash-style attention on tensor cores (WMMA bf16, f32 accumulate): one block per (32 query rows, kv head), where
// the rows are (query, head-of-the-group) pairs so that the K/V tiles of one kv head serve all its query heads.
// Scores stay f32 through an online softmax; P is rounded to bf16 for the P.V product (as HF's eager path does).
// K/V tiles arrive by cp.async: every 16-byte copy of a tile is in flight at once (a per-thread load loop costed one
// memory round trip per iteration, ~16 per D=512 tile), and the V tile streams in while the softmax runs.
#include <mma.h>

#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/cuda_util.cuh"

namespace dg::cuda {
namespace {

using namespace nvcuda;

constexpr int BM = 32, BN = 64, kThreads = 256;

struct Smem {
  size_t q, kv, o, s, p, stats, total;
  __host__ __device__ explicit Smem(int D) {
    auto up = [](size_t x) { return (x + 127) / 128 * 128; };
    q = 0;
    kv = q + up(size_t(BM) * (D + 8) * 2);
    o = kv + up(size_t(BN) * (D + 8) * 2);
    s = o + up(size_t(BM) * (D + 4) * 4);
    p = s + up(size_t(BM) * (BN + 4) * 4);
    stats = p + up(size_t(BM) * (BN + 8) * 2);
    total = stats + up(size_t(BM) * 4 * 3 + size_t(BM) * 8);
  }
};

// DT: the head dim as a compile-time constant for the model's 256 / 512 (index math by shifts, unrolled loops; at
// one block per SM this kernel is latency-bound, so integer divisions showed up), 0 = run-time a.D.
template <int DT>
__global__ void __launch_bounds__(kThreads) attention_k(AttentionArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int D = DT ? DT : a.D, g = a.nh / a.nkv, kvh = blockIdx.y;
  const Smem L(D);
  bf16* Qs = reinterpret_cast<bf16*>(smem + L.q);
  bf16* KVs = reinterpret_cast<bf16*>(smem + L.kv);
  float* Os = reinterpret_cast<float*>(smem + L.o);
  float* Ss = reinterpret_cast<float*>(smem + L.s);
  bf16* Ps = reinterpret_cast<bf16*>(smem + L.p);
  float* row_m = reinterpret_cast<float*>(smem + L.stats);
  float* row_l = row_m + BM;
  float* row_alpha = row_l + BM;
  int64_t* row_pos = reinterpret_cast<int64_t*>(row_alpha + BM);
  const int ldq = D + 8, ldo = D + 4, lds = BN + 4, ldp = BN + 8;
  const int tid = threadIdx.x, warp = tid >> 5;
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
  for (int i = tid; i < BM * D; i += kThreads) Os[(i / D) * ldo + i % D] = 0.0f;
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
  __syncthreads();

  // Issues the tile's copies (rows past j_end zero-filled) as one cp.async group; the caller waits.
  auto load_tile = [&](const bf16* cache, const bf16* fresh, int64_t j0) {
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
      cp_async16(KVs + r * ldq + c * 8, src + (ok ? c * 8 : 0), ok);
    }
    cp_async_commit();
  };

  if (j_begin < j_end) load_tile(a.k_cache, a.k_new, j_begin);
  for (int64_t j0 = j_begin; j0 < j_end; j0 += BN) {
    cp_async_wait<0>();
    __syncthreads();
    {  // S = Q K^T: 2 x 4 fragments, one per warp
      const int mi = warp / (BN / 16), ni = warp % (BN / 16);
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
      for (int kk = 0; kk < D; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fb;
        wmma::load_matrix_sync(fa, Qs + mi * 16 * ldq + kk, ldq);
        wmma::load_matrix_sync(fb, KVs + ni * 16 * ldq + kk, ldq);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(Ss + mi * 16 * lds + ni * 16, acc, lds, wmma::mem_row_major);
    }
    __syncthreads();  // every warp is done with the K tile: V may overwrite it while the softmax runs
    load_tile(a.v_cache, a.v_new, j0);
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
    __syncthreads();
    for (int i = tid; i < BM * D; i += kThreads) Os[(i / D) * ldo + i % D] *= row_alpha[i / D];
    cp_async_wait<0>();
    __syncthreads();
    for (int f = warp; f < (BM / 16) * (D / 16); f += kThreads / 32) {  // O += P V
      const int mi = f / (D / 16), di = f % (D / 16);
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::load_matrix_sync(acc, Os + mi * 16 * ldo + di * 16, ldo, wmma::mem_row_major);
#pragma unroll
      for (int kk = 0; kk < BN; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fb;
        wmma::load_matrix_sync(fa, Ps + mi * 16 * ldp + kk, ldp);
        wmma::load_matrix_sync(fb, KVs + kk * ldq + di * 16, ldq);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(Os + mi * 16 * ldo + di * 16, acc, ldo, wmma::mem_row_major);
    }
    __syncthreads();  // the V tile is consumed: the next K tile may replace it
    if (j0 + BN < j_end) load_tile(a.k_cache, a.k_new, j0 + BN);
  }

  for (int i = tid; i < BM * D; i += kThreads) {
    const int r = i / D, d = i % D, gr = m0 + r;
    if (gr >= rows_total) continue;
    const int t = gr / g, h = kvh * g + gr % g;
    const float l = row_l[r];
    a.out[(size_t(t) * a.nh + h) * D + d] = __float2bfloat16(l > 0 ? Os[r * ldo + d] / l : 0.0f);
  }
}

}  // namespace

void attention(const AttentionArgs& a, cudaStream_t s) {
  if (a.T == 0) return;
  if (a.D % 16 != 0 || a.nh % a.nkv != 0) throw_cuda_error("attention", "head_dim must be a multiple of 16 and nh of nkv", 0, __FILE__, __LINE__);
  const Smem L(a.D);
  const int which = a.D == 256 ? 0 : a.D == 512 ? 1 : 2;
  void (*const kernels[3])(AttentionArgs) = {attention_k<256>, attention_k<512>, attention_k<0>};
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
