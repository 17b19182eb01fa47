// Denoise attention as cuBLASLt GEMMs around one softmax kernel (gemm_attention in cuda_kernels.h).
//
// Why: in a denoise pass every canvas query sees the same keys (model-reference §3.5: the cache window and the whole
// canvas, no mask), so per query head h the attention is three dense steps, S_h = Q_h K_{h/g}^T, P_h = softmax(S_h),
// O_h = P_h V_{h/g}, and the two products run at cuBLASLt's tensor rate instead of the fused kernels' per-tile
// online softmax. H200 (tools/gpu/microbench/attention_gemm_bench.cu, session 9): a full layer at kv 4096 (4352 keys,
// D 512) 89.6 us (S 37.0, softmax 29.0, PV 26.7) against 138.9 us for attention_wgx_k; at kv 512 24.1 against 39.9.
// In the step (kv 4096, same call): 17.06 vs 17.27 ms (bench --no-gemm-attention). Sliding layers (D 256, 1279 keys)
// gain less alone, 25.9 against 31.1 us with the keys padded to 1280 (at 1279 keys cuBLASLt's kernels ran 5x slower,
// hence kGemmAttentionKeyAlign), and nothing in the step: tried with the ring stored twice (every slot at rows s and
// cap + s, canvas_length reserve slots) so that a wrapped window plus the canvas is one run of rows, 4K step
// 17.20 / 17.18 ms with and 17.20 / 17.18 without (session 9); its S GEMM at K = 256 runs at ~245 TFLOP/s and the
// cuBLASLt launches are not programmatic. So they keep the fused kernel.
//
// Numerics: S in f32, the row max and sum over the whole row in f32, P = bf16(exp(s - max) / sum) (normalized before
// the rounding, as HF's eager path rounds its f32 softmax), O = P V accumulated in f32 and rounded to bf16 once.
// Deterministic: fixed reduction trees, cuBLASLt plans without atomics (no split-K reduced in bf16, gemm.cpp).
#include <cstring>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/cuda_util.cuh"
#include "backend/cuda/launch.cuh"

namespace dg::cuda {
namespace {

// Block-wide max / sum of one value per thread (every thread gets the result); kW warps.
template <int kW>
__device__ __forceinline__ float block_max_all(float v, float* red) {
  for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(~0u, v, o));
  if constexpr (kW > 1) {
    __syncthreads();  // red may still be read by a previous reduction
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = red[0];
#pragma unroll
    for (int w = 1; w < kW; ++w) v = fmaxf(v, red[w]);
  }
  return v;
}
template <int kW>
__device__ __forceinline__ float block_sum_all(float v, float* red) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(~0u, v, o);
  if constexpr (kW > 1) {
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = red[0];
#pragma unroll
    for (int w = 1; w < kW; ++w) v += red[w];
  }
  return v;
}

__device__ __forceinline__ void store_bf16x4(bf16* p, float a, float b, float c, float d) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(a, b), hi = __floats2bfloat162_rn(c, d);
  uint2 u;
  std::memcpy(&u.x, &lo, 4);
  std::memcpy(&u.y, &hi, 4);
  *reinterpret_cast<uint2*>(p) = u;
}

// The group (head) of a softmax block: blockIdx.y, or the last group first (reverse). Blocks start in grid order and the
// S GEMM's batch writes its heads in order, so in reverse the first rows read are the ones written last, most likely
// still in L2 (a full layer's S is 71 MB at kv 4096); and the P rows written last are the first heads, which the PV
// GEMM reads first. Each row's result is the same either way.
__device__ __forceinline__ unsigned softmax_group(bool reverse) {
  return reverse ? gridDim.y - 1 - blockIdx.y : blockIdx.y;
}

// The 128-byte lines of a score row's n_cols columns dropped from L2 without their write-back (discard.global.L2),
// split over the block's threads: the row is dead once read, and a full layer's S (71 MB at kv 4096) is more than
// L2 holds, so its dirty lines would otherwise be written back in the middle of the PV GEMM and the expert stream.
// The caller guarantees 128-byte aligned rows and n_cols % 32 == 0.
__device__ __forceinline__ void discard_row_lines(const float* row, int n_cols, int threads) {
  for (int l = int(threadIdx.x); l < n_cols / 32; l += threads) discard_l2_line(row + 32 * l);
}

// One row a block (grid: rows x groups; row r of group g at S + (g group_rows + r) ld), the row held in registers:
// kThreads threads of kPer4 float4 chunks (chunk c4 = thread + kThreads i), so n_cols <= 4 kThreads kPer4.
template <int kThreads, int kPer4>
__global__ void __launch_bounds__(kThreads) softmax_rows_regs_k(const float* S, int ld, int group_rows, int n,
                                                                int n_cols, bf16* P, bool reverse, bool discard) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  constexpr int kW = kThreads / 32;
  __shared__ float red[kW];
  const size_t row = size_t(softmax_group(reverse)) * group_rows + blockIdx.x;
  const float4* s = reinterpret_cast<const float4*>(S + row * ld);
  bf16* p = P + row * ld;
  float v[4 * kPer4];
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPer4; ++i) {
    const int c = 4 * (int(threadIdx.x) + kThreads * i);
    float4 x = make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
    if (c < n_cols) x = s[c / 4];
    v[4 * i] = c < n ? x.x : -INFINITY;
    v[4 * i + 1] = c + 1 < n ? x.y : -INFINITY;
    v[4 * i + 2] = c + 2 < n ? x.z : -INFINITY;
    v[4 * i + 3] = c + 3 < n ? x.w : -INFINITY;
    m = fmaxf(m, fmaxf(fmaxf(v[4 * i], v[4 * i + 1]), fmaxf(v[4 * i + 2], v[4 * i + 3])));
  }
  m = block_max_all<kW>(m, red);
  if (discard) discard_row_lines(S + row * ld, n_cols, kThreads);  // the barrier above: every load of the row is done
  float sum = 0;
#pragma unroll
  for (int i = 0; i < 4 * kPer4; ++i) {
    v[i] = expf(v[i] - m);  // exp(-inf) = 0 for the columns past n
    sum += v[i];
  }
  const float inv = 1.0f / block_sum_all<kW>(sum, red);
#pragma unroll
  for (int i = 0; i < kPer4; ++i) {
    const int c = 4 * (int(threadIdx.x) + kThreads * i);
    if (c < n_cols) store_bf16x4(p + c, v[4 * i] * inv, v[4 * i + 1] * inv, v[4 * i + 2] * inv, v[4 * i + 3] * inv);
  }
}

// Rows too long for registers: per-thread online (max, sum) over its columns, merged across the block in a fixed
// order, then a second pass that writes P.
constexpr int kLongThreads = 512;
__global__ void __launch_bounds__(kLongThreads) softmax_rows_long_k(const float* S, int ld, int group_rows, int n,
                                                                    int n_cols, bf16* P, bool reverse, bool discard) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  constexpr int kW = kLongThreads / 32;
  __shared__ float red[kW];
  const size_t row = size_t(softmax_group(reverse)) * group_rows + blockIdx.x;
  const float4* s = reinterpret_cast<const float4*>(S + row * ld);
  bf16* p = P + row * ld;
  float m = -INFINITY, sum = 0;
  for (int c = 4 * int(threadIdx.x); c < n; c += 4 * kLongThreads) {
    const float4 x = s[c / 4];
    const float a[4] = {x.x, c + 1 < n ? x.y : -INFINITY, c + 2 < n ? x.z : -INFINITY, c + 3 < n ? x.w : -INFINITY};
    const float mx = fmaxf(fmaxf(a[0], a[1]), fmaxf(a[2], a[3]));
    if (mx > m) sum *= expf(m - mx), m = mx;
    sum += expf(a[0] - m) + expf(a[1] - m) + expf(a[2] - m) + expf(a[3] - m);
  }
  const float M = block_max_all<kW>(m, red);
  const float inv = 1.0f / block_sum_all<kW>(m == -INFINITY ? 0.0f : sum * expf(m - M), red);
  for (int c = 4 * int(threadIdx.x); c < n_cols; c += 4 * kLongThreads) {
    const float4 x = s[c / 4];
    store_bf16x4(p + c, c < n ? expf(x.x - M) * inv : 0.0f, c + 1 < n ? expf(x.y - M) * inv : 0.0f,
                 c + 2 < n ? expf(x.z - M) * inv : 0.0f, c + 3 < n ? expf(x.w - M) * inv : 0.0f);
  }
  if (discard) {
    __syncthreads();  // every thread's second pass over the row has read its chunks
    discard_row_lines(S + row * ld, n_cols, kLongThreads);
  }
}

bool g_softmax_reverse = true;  // set_softmax_rows_reverse

}  // namespace

void softmax_rows_to_bf16(const float* S, int ld, int rows, int groups, int group_rows, int n, int n_cols, bf16* P,
                          cudaStream_t s, bool discard_scores) {
  if (rows <= 0 || groups <= 0) return;
  if (n < 1 || n_cols < n || n_cols % 4 || ld < n_cols || ld % 8 || rows > group_rows || groups > 65535)
    throw_cuda_error("softmax_rows_to_bf16", "bad shape (needs 1 <= n <= n_cols, n_cols % 4 == 0, ld >= n_cols, "
                                             "ld % 8 == 0, rows <= group_rows)", 0, __FILE__, __LINE__);
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(groups));
  const bool rev = g_softmax_reverse;
  const bool dis = discard_scores && (reinterpret_cast<uintptr_t>(S) & 127) == 0 && ld % 32 == 0 && n_cols % 32 == 0;
  if (n_cols <= 4 * 64 * 6)
    launch_pdl(softmax_rows_regs_k<64, 6>, grid, dim3(64), 0, s, S, ld, group_rows, n, n_cols, P, rev, dis);
  else if (n_cols <= 4 * 128 * 9)
    launch_pdl(softmax_rows_regs_k<128, 9>, grid, dim3(128), 0, s, S, ld, group_rows, n, n_cols, P, rev, dis);
  else if (n_cols <= 4 * 256 * 9)
    launch_pdl(softmax_rows_regs_k<256, 9>, grid, dim3(256), 0, s, S, ld, group_rows, n, n_cols, P, rev, dis);
  else
    launch_pdl(softmax_rows_long_k, grid, dim3(kLongThreads), 0, s, S, ld, group_rows, n, n_cols, P, rev, dis);
}

void set_softmax_rows_reverse(bool on) { g_softmax_reverse = on; }

size_t gemm_attention_pointer_count(int nh) { return size_t(6) * size_t(nh); }

namespace {
// a's batch pointers (they depend only on the buffers), into host memory out[gemm_attention_pointer_count(nh)].
void gemm_attention_pointers(const GemmAttentionArgs& a, void** out) {
  const int g = a.nh / a.nkv, nh = a.nh;
  for (int h = 0; h < nh; ++h) {
    out[h] = const_cast<bf16*>(a.k + size_t(h / g) * a.D);                     // S: A (keys)
    out[nh + h] = const_cast<bf16*>(a.q + size_t(h) * a.D);                    // S: B (queries)
    out[2 * nh + h] = a.S + size_t(h) * a.head_rows * a.ld;                     // S: C
    out[3 * nh + h] = const_cast<bf16*>(a.v + size_t(h / g) * a.D);             // PV: A (values)
    out[4 * nh + h] = a.P + size_t(h) * a.head_rows * a.ld;                     // PV: B
    out[5 * nh + h] = a.out + size_t(h) * a.D;                                  // PV: C
  }
}
}  // namespace

void set_gemm_attention_pointers(const GemmAttentionArgs& a, cudaStream_t s) {
  std::vector<void*> p(gemm_attention_pointer_count(a.nh));
  gemm_attention_pointers(a, p.data());
  CUDA_CHECK(cudaMemcpyAsync(a.ptrs, p.data(), p.size() * sizeof(void*), cudaMemcpyHostToDevice, s));
  CUDA_CHECK(cudaStreamSynchronize(s));  // p is pageable and about to go away
}

int gemm_attention_key_columns(int n) {
  return (n + kGemmAttentionKeyAlign - 1) / kGemmAttentionKeyAlign * kGemmAttentionKeyAlign;
}

void gemm_attention(Gemm& gemm, const GemmAttentionArgs& a, int T, int n, cudaStream_t s, bool discard_scores) {
  const int n_cols = gemm_attention_key_columns(n);
  if (T < 1 || T > a.head_rows || n < 1 || n_cols > a.ld || a.nh % a.nkv || a.ld % 8)
    throw_cuda_error("gemm_attention", "bad shape (needs 1 <= T <= head_rows, 1 <= n, n rounded up to 64 <= ld, "
                                       "nh % nkv == 0, ld % 8 == 0)", 0, __FILE__, __LINE__);
  void** p = a.ptrs;
  const int nh = a.nh, kv_ld = a.nkv * a.D, q_ld = nh * a.D;
  // column-major S_h^T [n_cols, T] = (K_h as [D, n_cols])^T . (Q_h as [D, T])
  gemm.batched_pointers(true, n_cols, T, a.D, p, Dt::BF16, kv_ld, p + nh, Dt::BF16, q_ld, p + 2 * nh, Dt::F32, a.ld,
                        nh, s);
  softmax_rows_to_bf16(a.S, a.ld, T, nh, a.head_rows, n, n_cols, a.P, s, discard_scores);
  // column-major O_h^T [D, T] = (V_h as [D, n_cols]) . (P_h as [n_cols, T])
  gemm.batched_pointers(false, a.D, T, n_cols, p + 3 * nh, Dt::BF16, kv_ld, p + 4 * nh, Dt::BF16, a.ld, p + 5 * nh,
                        Dt::BF16, q_ld, nh, s);
}

}  // namespace dg::cuda
