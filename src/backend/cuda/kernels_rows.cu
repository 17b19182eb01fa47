// Row-wise and elementwise kernels: embedding, RMSNorm variants, q/k/v norm + RoPE, GELU gate, KV writes,
// softcap + sampler row statistics, softmax for the SC soft embedding, synthetic weight fill.
#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <type_traits>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/cuda_util.cuh"

namespace dg::cuda {
namespace {

constexpr int kRowThreads = 256;

// VEC (H % 8 == 0, 16-byte aligned rows): 8 bf16 a 16-byte load, two float4 stores (the scalar loop of 2-byte loads
// took 9.2 us for the canvas in the session-15 profile). PDL-launched: the ids may come from the previous kernel.
template <bool VEC>
__global__ void embed_scale_k(const int32_t* ids, const bf16* E, int H, float scale, float* out) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  const int t = blockIdx.x;
  const bf16* row = E + size_t(ids[t]) * H;
  float* o = out + size_t(t) * H;
  if constexpr (VEC) {
    for (int c = threadIdx.x; c < H / 8; c += blockDim.x) {
      const uint4 u = reinterpret_cast<const uint4*>(row)[c];
      const uint32_t w[4] = {u.x, u.y, u.z, u.w};
      float f[8];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 p = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[j]));
        f[2 * j] = p.x * scale, f[2 * j + 1] = p.y * scale;
      }
      reinterpret_cast<float4*>(o)[2 * c] = make_float4(f[0], f[1], f[2], f[3]);
      reinterpret_cast<float4*>(o)[2 * c + 1] = make_float4(f[4], f[5], f[6], f[7]);
    }
  } else {
    for (int i = threadIdx.x; i < H; i += blockDim.x) o[i] = __bfloat162float(row[i]) * scale;
  }
}

// A plain copy of 32-bit words, PDL-launched: the whole-step graph's row statistics into mapped pinned host memory
// (a kernel node instead of a memcpy node; see copy_words).
__global__ void copy_words_k(const uint32_t* src, size_t n, uint32_t* dst) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

// A graph memset node's work as a kernel (memset_nodes_as_kernels): height rows of width elements of elem bytes.
__global__ void fill_pattern_k(unsigned char* dst, size_t pitch, unsigned value, unsigned elem, size_t width,
                               size_t height) {
  const size_t n = width * height;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned char* p = dst + (i / width) * pitch + (i % width) * elem;
    if (elem == 4)
      *reinterpret_cast<uint32_t*>(p) = value;
    else if (elem == 2)
      *reinterpret_cast<uint16_t*>(p) = uint16_t(value);
    else
      *p = uint8_t(value);
  }
}

template <class Out>
__global__ void rms_norm_k(const float* x, int n, const float* w, float eps, Out* y) {
  const float* xr = x + size_t(blockIdx.x) * n;
  float ss = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
  const float inv = rsqrtf(block_sum(ss) / float(n) + eps);
  Out* yr = y + size_t(blockIdx.x) * n;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    float v = xr[i] * inv;
    if (w) v *= w[i];
    yr[i] = Out(v);
  }
}

__global__ void add_rms_norm_k(float* h, const bf16* a, int n, const float* w, float eps) {
  const bf16* ar = a + size_t(blockIdx.x) * n;
  float ss = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    float v = __bfloat162float(ar[i]);
    ss += v * v;
  }
  const float inv = rsqrtf(block_sum(ss) / float(n) + eps);
  float* hr = h + size_t(blockIdx.x) * n;
  for (int i = threadIdx.x; i < n; i += blockDim.x) hr[i] += __bfloat162float(ar[i]) * inv * w[i];
}

__global__ void pre_ffn_k(const float* h, int n, const float* w_pre, const float* w_pre2, const float* rs, float eps,
                          bf16* x1, bf16* xe, float* xr) {
  const size_t off = size_t(blockIdx.x) * n;
  float ss = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) ss += h[off + i] * h[off + i];
  const float inv = rsqrtf(block_sum(ss) / float(n) + eps);
  const float inv_sqrt_n = 1.0f / sqrtf(float(n));
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = h[off + i] * inv;
    x1[off + i] = __float2bfloat16(v * w_pre[i]);
    xe[off + i] = __float2bfloat16(v * w_pre2[i]);
    xr[off + i] = v * rs[i] * inv_sqrt_n;
  }
}

__global__ void ffn_combine_k(float* h, const bf16* m1, const float* m2, int n, const float* w1, const float* w2,
                              const float* w, float eps, float scalar) {
  extern __shared__ float row[];
  const size_t off = size_t(blockIdx.x) * n;
  float s1 = 0, s2 = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    float a = __bfloat162float(m1[off + i]), b = m2[off + i];
    s1 += a * a;
    s2 += b * b;
  }
  const float inv1 = rsqrtf(block_sum(s1) / float(n) + eps);
  const float inv2 = rsqrtf(block_sum(s2) / float(n) + eps);
  float s3 = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    float v = __bfloat162float(m1[off + i]) * inv1 * w1[i] + m2[off + i] * inv2 * w2[i];
    row[i] = v;
    s3 += v * v;
  }
  const float inv3 = rsqrtf(block_sum(s3) / float(n) + eps);
  for (int i = threadIdx.x; i < n; i += blockDim.x) h[off + i] = (h[off + i] + row[i] * inv3 * w[i]) * scalar;
}

// Fast paths of the row kernels above for n % 4 == 0 and n <= 4 * 256 * NV (the model's H = 2816: NV = 3): the row
// is read once with 16-byte loads into registers, reduced, and written from registers. The scalar kernels issue one
// 4-byte load per loop trip and re-read the row for the output pass; at 256 rows they were latency-bound
// (~10-15 us each instead of ~3). Same arithmetic per element, so results match the scalar kernels to rounding of
// the sum of squares (which is a block reduction in a different order).
constexpr int kVecThreads = 256;

template <int NV>
struct RowVec {
  float4 v[NV];
};
template <int NV>
__device__ __forceinline__ RowVec<NV> load_f32(const float* row, int n4) {
  RowVec<NV> r;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = threadIdx.x + j * kVecThreads;
    r.v[j] = c < n4 ? reinterpret_cast<const float4*>(row)[c] : make_float4(0, 0, 0, 0);
  }
  return r;
}
// bf16(x) as a float: what a bf16 store then load of x gives.
__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }
// A row given as `splits` split-K partials (the first at row, the next ones split_stride floats apart): their in-order
// sum, rounded to bf16 (dense_tma_splitk's readers: the same values its bf16 output would have).
template <int NV>
__device__ __forceinline__ RowVec<NV> load_splits_bf16(const float* row, int n4, int splits, size_t split_stride) {
  RowVec<NV> r = load_f32<NV>(row, n4);
  for (int sp = 1; sp < splits; ++sp) {
    const RowVec<NV> o = load_f32<NV>(row + size_t(sp) * split_stride, n4);
#pragma unroll
    for (int j = 0; j < NV; ++j) r.v[j].x += o.v[j].x, r.v[j].y += o.v[j].y, r.v[j].z += o.v[j].z, r.v[j].w += o.v[j].w;
  }
#pragma unroll
  for (int j = 0; j < NV; ++j)
    r.v[j] = make_float4(round_bf16(r.v[j].x), round_bf16(r.v[j].y), round_bf16(r.v[j].z), round_bf16(r.v[j].w));
  return r;
}
template <int NV>
__device__ __forceinline__ RowVec<NV> load_bf16(const bf16* row, int n4) {
  RowVec<NV> r;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = threadIdx.x + j * kVecThreads;
    if (c < n4) {
      const uint2 u = reinterpret_cast<const uint2*>(row)[c];
      const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
      const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
      r.v[j] = make_float4(a.x, a.y, b.x, b.y);
    } else {
      r.v[j] = make_float4(0, 0, 0, 0);
    }
  }
  return r;
}
template <int NV>
__device__ __forceinline__ float sum_sq(const RowVec<NV>& r) {
  // Explicit fmas: left to itself the compiler contracts this sum differently per kernel, and the fused norms
  // (add_then_rms_norm, scaled_rms_norm) must match their unfused pairs bit for bit.
  float s = 0;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    s = __fmaf_rn(r.v[j].x, r.v[j].x, s);
    s = __fmaf_rn(r.v[j].y, r.v[j].y, s);
    s = __fmaf_rn(r.v[j].z, r.v[j].z, s);
    s = __fmaf_rn(r.v[j].w, r.v[j].w, s);
  }
  return s;
}
__device__ __forceinline__ float4 ld4(const float* p, int c) { return reinterpret_cast<const float4*>(p)[c]; }
__device__ __forceinline__ void st4(float* p, int c, float4 v) { reinterpret_cast<float4*>(p)[c] = v; }
__device__ __forceinline__ void st4(bf16* p, int c, float4 v) {
  __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
  uint2 u;
  u.x = *reinterpret_cast<uint32_t*>(&a);
  u.y = *reinterpret_cast<uint32_t*>(&b);
  reinterpret_cast<uint2*>(p)[c] = u;
}
__device__ __forceinline__ float4 mul4(float4 a, float s, float4 w) {
  return make_float4(a.x * s * w.x, a.y * s * w.y, a.z * s * w.z, a.w * s * w.w);
}

// y = r * inv * w (w null: no scale), the row's n4 float4 chunks of this thread
template <int NV, class Out>
__device__ __forceinline__ void store_normed(Out* y, const RowVec<NV>& r, float inv, const float* w, int n4) {
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = threadIdx.x + j * kVecThreads;
    if (c < n4) st4(y, c, w ? mul4(r.v[j], inv, ld4(w, c)) : mul4(r.v[j], inv, make_float4(1, 1, 1, 1)));
  }
}

// y = rms_norm(x * f; w), f = (row_scale ? row_scale[row] : 1) * scale: with f = 1 the plain norm (x * 1 is x, so
// no multiply then), otherwise scale_rows_f32 / scale_f32 then the plain norm in one pass, the same bits.
template <int NV, class Out>
__global__ void __launch_bounds__(kVecThreads) rms_norm_vec_k(const float* x, int n, const float* row_scale, float scale,
                                                              const float* w, float eps, Out* y) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  const int n4 = n / 4;
  RowVec<NV> r = load_f32<NV>(x + size_t(blockIdx.x) * n, n4);
  if (row_scale || scale != 1.0f) {
    const float f = row_scale ? row_scale[blockIdx.x] * scale : scale;
#pragma unroll
    for (int j = 0; j < NV; ++j) r.v[j].x *= f, r.v[j].y *= f, r.v[j].z *= f, r.v[j].w *= f;
  }
  const float inv = rsqrtf(block_sum(sum_sq(r)) / float(n) + eps);
  store_normed(y + size_t(blockIdx.x) * n, r, inv, w, n4);
}

template <int NV>
__global__ void __launch_bounds__(kVecThreads) add_rms_norm_vec_k(float* h, const bf16* a, int n, const float* w,
                                                                  float eps) {
  const int n4 = n / 4;
  const RowVec<NV> r = load_bf16<NV>(a + size_t(blockIdx.x) * n, n4);
  const float inv = rsqrtf(block_sum(sum_sq(r)) / float(n) + eps);
  float* hr = h + size_t(blockIdx.x) * n;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = threadIdx.x + j * kVecThreads;
    if (c < n4) {
      float4 hv = ld4(hr, c);
      const float4 d = mul4(r.v[j], inv, ld4(w, c));
      hv.x += d.x, hv.y += d.y, hv.z += d.z, hv.w += d.w;
      st4(hr, c, hv);
    }
  }
}

// The pre-FFN norms' weights of this thread's quads, loaded up front (constants: add_rms_norm_pre_ffn_vec_k reads
// them before its griddepcontrol.wait, off the critical path).
template <int NV>
struct FfnWeights {
  float4 pre[NV], pre2[NV], rs[NV];
};
template <int NV>
__device__ __forceinline__ FfnWeights<NV> load_ffn_weights(const float* w_pre, const float* w_pre2, const float* rs,
                                                           int n4) {
  FfnWeights<NV> f;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = threadIdx.x + j * kVecThreads;
    const bool in = c < n4;
    f.pre[j] = in ? ld4(w_pre, c) : make_float4(0, 0, 0, 0);
    f.pre2[j] = in ? ld4(w_pre2, c) : make_float4(0, 0, 0, 0);
    f.rs[j] = in ? ld4(rs, c) : make_float4(0, 0, 0, 0);
  }
  return f;
}

// From the residual row r (in registers): x1 = rms(r; w_pre), xe = rms(r; w_pre2), xr = rms_noscale(r) * rs / sqrt(n).
template <int NV>
__device__ __forceinline__ void store_ffn_inputs(const RowVec<NV>& r, int n, size_t off, const FfnWeights<NV>& f,
                                                 float eps, bf16* x1, bf16* xe, float* xr) {
  const int n4 = n / 4;
  const float inv = rsqrtf(block_sum(sum_sq(r)) / float(n) + eps);
  const float inv_sqrt_n = 1.0f / sqrtf(float(n));
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = threadIdx.x + j * kVecThreads;
    if (c < n4) {
      const float4 v = mul4(r.v[j], inv, make_float4(1, 1, 1, 1));
      st4(x1 + off, c, mul4(v, 1.0f, f.pre[j]));
      st4(xe + off, c, mul4(v, 1.0f, f.pre2[j]));
      const float4 q = f.rs[j];
      st4(xr + off, c, make_float4(v.x * q.x * inv_sqrt_n, v.y * q.y * inv_sqrt_n, v.z * q.z * inv_sqrt_n,
                                   v.w * q.w * inv_sqrt_n));
    }
  }
}

template <int NV>
__global__ void __launch_bounds__(kVecThreads) pre_ffn_vec_k(const float* h, int n, const float* w_pre,
                                                             const float* w_pre2, const float* rs, float eps, bf16* x1,
                                                             bf16* xe, float* xr) {
  const int n4 = n / 4;
  const size_t off = size_t(blockIdx.x) * n;
  const FfnWeights<NV> f = load_ffn_weights<NV>(w_pre, w_pre2, rs, n4);
  const RowVec<NV> r = load_f32<NV>(h + off, n4);
  store_ffn_inputs(r, n, off, f, eps, x1, xe, xr);
}

// add_rms_norm_vec_k then pre_ffn_vec_k in one pass: the updated residual row stays in registers (the same arithmetic
// in the same order as the two kernels). The norm weights are constants, so they are loaded before
// griddepcontrol.wait; after it, the attention output and the residual rows in one round trip. (It waited for three
// dependent round trips before: 7.9-8.9 us a layer at T = 256 in the H200 profile, session 11.)
// a_part: a as split-K partials (load_splits_bf16), a_splits of them [a_splits][rows][n].
template <int NV>
__global__ void __launch_bounds__(kVecThreads) add_rms_norm_pre_ffn_vec_k(float* h, const bf16* a, int n,
                                                                          const float* w_post, const float* w_pre,
                                                                          const float* w_pre2, const float* rs,
                                                                          float eps, bf16* x1, bf16* xe, float* xr,
                                                                          const float* a_part, int a_splits) {
  const int n4 = n / 4;
  const FfnWeights<NV> f = load_ffn_weights<NV>(w_pre, w_pre2, rs, n4);
  float4 wp[NV];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = threadIdx.x + j * kVecThreads;
    wp[j] = c < n4 ? ld4(w_post, c) : make_float4(0, 0, 0, 0);
  }
  pdl_wait();  // launch.cuh: only the constant weights above were read before it
  pdl_trigger();
  const size_t off = size_t(blockIdx.x) * n;
  const RowVec<NV> ra = a_part ? load_splits_bf16<NV>(a_part + off, n4, a_splits, size_t(gridDim.x) * n)
                               : load_bf16<NV>(a + off, n4);
  RowVec<NV> r = load_f32<NV>(h + off, n4);
  const float inv_a = rsqrtf(block_sum(sum_sq(ra)) / float(n) + eps);
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = threadIdx.x + j * kVecThreads;
    if (c < n4) {
      float4 hv = r.v[j];
      const float4 d = mul4(ra.v[j], inv_a, wp[j]);
      hv.x += d.x, hv.y += d.y, hv.z += d.z, hv.w += d.w;
      st4(h + off, c, hv);
      r.v[j] = hv;
    }
  }
  store_ffn_inputs(r, n, off, f, eps, x1, xe, xr);
}

// NV for a row of n floats, 0 when the vector path does not apply.
int row_vec_nv(int n) {
  if (n % 4 != 0) return 0;
  const int nv = (n / 4 + kVecThreads - 1) / kVecThreads;
  return nv <= 4 ? nv : 0;
}

// h = rms_norm(h + a; w): add_bf16_to_f32 then rms_norm_vec_k in place, in one pass, the same bits. y2 != null: also
// y2 = bf16(rms_norm(h; w2)) of the new h, from the values just stored (rms_norm_vec_k after it, the same bits).
// ids != null: h's rows are not read but embedded here, E[ids[row]] * escale (embed_scale's products, the same bits).
template <int NV>
__global__ void __launch_bounds__(kVecThreads) add_then_rms_norm_vec_k(float* h, const bf16* a, int n, const float* w,
                                                                       float eps, const float* w2, bf16* y2,
                                                                       const int32_t* ids, const bf16* E,
                                                                       float escale) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  const int n4 = n / 4;
  float* hr = h + size_t(blockIdx.x) * n;
  RowVec<NV> r;
  if (ids) {
    r = load_bf16<NV>(E + size_t(ids[blockIdx.x]) * n, n4);
#pragma unroll
    for (int j = 0; j < NV; ++j) r.v[j].x *= escale, r.v[j].y *= escale, r.v[j].z *= escale, r.v[j].w *= escale;
  } else {
    r = load_f32<NV>(hr, n4);
  }
  const RowVec<NV> d = load_bf16<NV>(a + size_t(blockIdx.x) * n, n4);
#pragma unroll
  for (int j = 0; j < NV; ++j) r.v[j].x += d.v[j].x, r.v[j].y += d.v[j].y, r.v[j].z += d.v[j].z, r.v[j].w += d.v[j].w;
  const float inv = rsqrtf(block_sum(sum_sq(r)) / float(n) + eps);
  store_normed(hr, r, inv, w, n4);
  if (!y2) return;
  RowVec<NV> s = r;  // what store_normed wrote (chunks past n4 are never stored nor summed: zero, as load_f32 leaves them)
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int c = threadIdx.x + j * kVecThreads;
    s.v[j] = c < n4 ? mul4(r.v[j], inv, w ? ld4(w, c) : make_float4(1, 1, 1, 1)) : make_float4(0, 0, 0, 0);
  }
  const float inv2 = rsqrtf(block_sum(sum_sq(s)) / float(n) + eps);
  store_normed(y2 + size_t(blockIdx.x) * n, s, inv2, w2, n4);
}

// act = bf16(gelu_tanh(gate) * up), gate/up as bf16 (dense MLP; the padded experts' f32 variant is
// moe_gelu_mul_padded in kernels_moe.cu)
__global__ void gelu_mul_k(const bf16* gu, int rows, int I, bf16* act) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  for (int r = blockIdx.y; r < rows; r += gridDim.y)
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < I; i += gridDim.x * blockDim.x) {
      const float g = __bfloat162float(gu[size_t(r) * 2 * I + i]), u = __bfloat162float(gu[size_t(r) * 2 * I + I + i]);
      act[size_t(r) * I + i] = __float2bfloat16(gelu_tanh(g) * u);
    }
}

__global__ void add_bf16_to_f32_k(float* h, const bf16* a, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    h[i] += __bfloat162float(a[i]);
}

// cos_t[slot(i)], sin_t[slot(i)] = cos, sin of the token's angle pos * inv_freq[i] (i < half; an inv_freq of 0 is no
// rotation), once per block instead of once per head row. No barrier: the caller syncs before reading them.
template <class Slot>
__device__ __forceinline__ void fill_rope_trig(float* cos_t, float* sin_t, int half, float pos, const float* inv_freq,
                                               Slot slot) {
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    float sn = 0.0f, cs = 1.0f;
    if (inv_freq[i] != 0.0f) sincosf(pos * inv_freq[i], &sn, &cs);
    cos_t[slot(i)] = cs, sin_t[slot(i)] = sn;
  }
}

// Head row r of token t in qkv_norm_rope: q heads, then k heads, then v heads (v from the k projection when
// v_from_k): where it is read and written, its norm weight (v: none) and whether it is rotated.
struct QkvRow {
  int col;  // the head's first column in a qkv row
  bf16* dst;
  const float* w;
  bool rotate;
};
__device__ __forceinline__ QkvRow qkv_row(int r, int t, int nh, int nkv, int D, bool v_from_k, const float* qw,
                                          const float* kw, bf16* q, bf16* k, bf16* v) {
  if (r < nh) return {r * D, q + (size_t(t) * nh + r) * D, qw, true};
  if (r < nh + nkv) return {r * D, k + (size_t(t) * nkv + (r - nh)) * D, kw, true};
  const int hv = r - nh - nkv;
  return {(v_from_k ? nh + hv : nh + nkv + hv) * D, v + (size_t(t) * nkv + hv) * D, nullptr, false};
}

// One warp per (token, head) row: norm over D, then split-half rotation of the pairs (i, i + D/2).
__global__ void qkv_norm_rope_k(const bf16* qkv, int nh, int nkv, int D, bool v_from_k, const float* qw,
                                const float* kw, const float* inv_freq, int64_t pos0, float eps, bf16* q, bf16* k,
                                bf16* v) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  const int t = blockIdx.x, lane = threadIdx.x & 31;
  const int n_rows = nh + 2 * nkv;
  const int width = (nh + (v_from_k ? 1 : 2) * nkv) * D;
  const bf16* src_row = qkv + size_t(t) * width;
  const float pos = float(pos0 + t);
  const int half = D / 2;
  extern __shared__ float trig[];  // [half] cos, then [half] sin
  fill_rope_trig(trig, trig + half, half, pos, inv_freq, [](int i) { return i; });
  __syncthreads();
  for (int r = threadIdx.x >> 5; r < n_rows; r += blockDim.x >> 5) {
    const auto [col, dst, w, rotate] = qkv_row(r, t, nh, nkv, D, v_from_k, qw, kw, q, k, v);
    const bf16* src = src_row + col;
    float ss = 0;
    for (int i = lane; i < D; i += 32) {
      float x = __bfloat162float(src[i]);
      ss += x * x;
    }
    const float inv = rsqrtf(warp_sum(ss) / float(D) + eps);
    for (int i = lane; i < half; i += 32) {
      float a = __bfloat162float(src[i]) * inv, b = __bfloat162float(src[i + half]) * inv;
      if (w) a *= w[i], b *= w[i + half];
      if (rotate && inv_freq[i] != 0.0f) {
        const float cs = trig[i], sn = trig[half + i];
        const float a2 = a * cs - b * sn, b2 = b * cs + a * sn;
        a = a2, b = b2;
      }
      dst[i] = __float2bfloat16(a);
      dst[i + half] = __float2bfloat16(b);
    }
  }
}

// The same for D = 32 EPL (EPL a multiple of 8): lane l holds elements [l EPL, l EPL + EPL) of its row as 16-byte
// loads and stores, and the rotation partner i + D/2 of element i sits in lane l ^ 16 (one shuffle per element).
// The scalar kernel above (2-byte loads, the row read twice) took ~9 us a layer at T = 256 (H200 profile).
// A warp takes R rows of its token (rows w, w + warps, ...) with all their loads in flight before any arithmetic: at
// one row a warp the block of 1024 (sliding) or 640 (full) threads left room for one block an SM (40-56 registers),
// so the 256 tokens ran in two waves (H200, alone: sliding 9.5 -> 6.3 us, full 14.0 -> 7.6 us with what follows; 4K step
// -0.1 to -0.15 ms in four same-call A/Bs, session 20).
// Everything that does not depend on the qkv rows is set up before griddepcontrol.wait: the token's angles and both
// norm weights go to shared memory transposed to [j][lane] (lane l reads element l EPL + j at bank l: with the natural
// layout the 16 lanes' reads of a step j hit 4-16 ways on one bank), and each lane's rotation flags to a bit mask.
// part (splits >= 1): the qkv rows as split-K partials [splits][T][width] (load_splits_bf16's values), qkv unread.
template <int EPL, int R>
__global__ void qkv_norm_rope_vec_k(const bf16* qkv, int nh, int nkv, bool v_from_k, const float* qw,
                                    const float* kw, const float* inv_freq, int64_t pos0, float eps, bf16* q, bf16* k,
                                    bf16* v, const float* part, int splits) {
  constexpr int D = 32 * EPL, half = D / 2;
  const int t = blockIdx.x, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int n_rows = nh + 2 * nkv;
  const int width = (nh + (v_from_k ? 1 : 2) * nkv) * D;
  const float pos = float(pos0 + t);
  __shared__ float cos_t[half], sin_t[half];  // [j][16]: frequency i = l16 EPL + j at j * 16 + l16
  __shared__ float qw_t[D], kw_t[D];           // [j][32]: element e = l EPL + j at j * 32 + l
  fill_rope_trig(cos_t, sin_t, half, pos, inv_freq, [](int i) { return (i % EPL) * 16 + i / EPL; });
  for (int e = threadIdx.x; e < D; e += blockDim.x) {
    const int slot = (e % EPL) * 32 + e / EPL;
    qw_t[slot] = qw ? qw[e] : 1.0f, kw_t[slot] = kw ? kw[e] : 1.0f;  // a row without weights never reads them
  }
  const bool first = lane < 16;
  const int e0 = lane * EPL, l16 = lane & 15, i0 = l16 * EPL;  // element, and its rotation frequency index
  uint32_t rotates = 0;  // bit j: frequency i0 + j rotates (an inv_freq of 0 is no rotation)
#pragma unroll
  for (int j = 0; j < EPL; ++j) rotates |= inv_freq[i0 + j] != 0.0f ? 1u << j : 0u;
  __syncthreads();
  pdl_wait();  // launch.cuh: only the constant weights and frequencies above were read before it
  pdl_trigger();
  const bf16* src_row = qkv + size_t(t) * width;
  for (int r0 = threadIdx.x >> 5; r0 < n_rows; r0 += warps * R) {
    float x[R][EPL];
#pragma unroll
    for (int u = 0; u < R; ++u) {
      const int r = r0 + u * warps;
      if (r >= n_rows) continue;  // warp-uniform
      const int col = qkv_row(r, t, nh, nkv, D, v_from_k, qw, kw, q, k, v).col;
      if (part) {
        const float* p = part + size_t(t) * width + col + e0;
        const size_t stride = size_t(gridDim.x) * width;
#pragma unroll
        for (int c = 0; c < EPL / 4; ++c) {
          float4 a = reinterpret_cast<const float4*>(p)[c];
          for (int sp = 1; sp < splits; ++sp) {
            const float4 o = reinterpret_cast<const float4*>(p + size_t(sp) * stride)[c];
            a.x += o.x, a.y += o.y, a.z += o.z, a.w += o.w;
          }
          x[u][4 * c] = round_bf16(a.x), x[u][4 * c + 1] = round_bf16(a.y);
          x[u][4 * c + 2] = round_bf16(a.z), x[u][4 * c + 3] = round_bf16(a.w);
        }
      } else {
        const bf16* src = src_row + col;
#pragma unroll
        for (int c = 0; c < EPL / 8; ++c) {
          const uint4 w4 = reinterpret_cast<const uint4*>(src + e0)[c];
          const uint32_t wd[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wd[j]));
            x[u][8 * c + 2 * j] = f.x, x[u][8 * c + 2 * j + 1] = f.y;
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < R; ++u) {
      const int r = r0 + u * warps;
      if (r >= n_rows) continue;  // warp-uniform
      const auto [col, dst, w, rotate] = qkv_row(r, t, nh, nkv, D, v_from_k, qw, kw, q, k, v);
      float ss = 0;
#pragma unroll
      for (int j = 0; j < EPL; ++j) ss += x[u][j] * x[u][j];
      const float inv = rsqrtf(warp_sum(ss) / float(D) + eps);
      const float* wt = w == qw ? qw_t : kw_t;
#pragma unroll
      for (int j = 0; j < EPL; ++j) {
        x[u][j] *= inv;
        if (w) x[u][j] *= wt[j * 32 + lane];
      }
      if (rotate) {
#pragma unroll
        for (int j = 0; j < EPL; ++j) {
          const float other = __shfl_xor_sync(0xffffffffu, x[u][j], 16);
          if (rotates >> j & 1u) {
            const float cs = cos_t[j * 16 + l16], sn = sin_t[j * 16 + l16];
            x[u][j] = first ? x[u][j] * cs - other * sn : x[u][j] * cs + other * sn;
          }
        }
      }
#pragma unroll
      for (int c = 0; c < EPL / 8; ++c) {
        uint32_t wd[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const __nv_bfloat162 b = __floats2bfloat162_rn(x[u][8 * c + 2 * j], x[u][8 * c + 2 * j + 1]);
          wd[j] = *reinterpret_cast<const uint32_t*>(&b);
        }
        reinterpret_cast<uint4*>(dst + e0)[c] = make_uint4(wd[0], wd[1], wd[2], wd[3]);
      }
    }
  }
}

__global__ void kv_write_k(const uint4* k_new, const uint4* v_new, int T, int row_vec, int64_t pos0, uint4* kc,
                           uint4* vc, int64_t cap, int t_first) {
  const int t = t_first + blockIdx.x;
  const int64_t slot = (pos0 + t) % cap;
  for (int i = threadIdx.x; i < row_vec; i += blockDim.x) {
    kc[slot * row_vec + i] = k_new[size_t(t) * row_vec + i];
    vc[slot * row_vec + i] = v_new[size_t(t) * row_vec + i];
  }
}

// Ties: the lowest index wins, as in dg::compute_row_stats.
__device__ __forceinline__ void better(float& bv, int& bi, float v, int i) {
  if (v > bv || (v == bv && i < bi)) bv = v, bi = i;
}

// dense_splits_to_bf16: split-K partials (kernels_dense_tma.cu) summed in order, rounded to bf16.
__global__ void dense_splits_to_bf16_k(const float* __restrict__ part, int splits, size_t n, bf16* __restrict__ out) {
  pdl_wait();
  pdl_trigger();
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    float v = part[i];
    for (int s = 1; s < splits; ++s) v += part[size_t(s) * n + i];
    out[i] = __float2bfloat16(v);
  }
}

// ---- softcap + row statistics (+ SC probs) ----
// Three launches over [rows, V] (was one 1024-thread block per row with three passes over the row, exp in double:
// 0.556 ms at 256 x 262144 on the H200, 0.339 with probs for the first tiled version of this, which
// tools/gpu/microbench/rowstats_bench.cu keeps as `prev` to time and check this one against):
//  1. rowstats_tile_k: grid (tiles of kRsTile tokens, rows). Each block reads its tile once into registers (16-byte
//     loads when V % 4 == 0, a full tile's eight issued before any arithmetic), softcaps it in place, and each warp
//     takes the max / argmax of z = c / T over its 1024 tokens, then s = sum exp(z - m), w = sum exp(z - m) (z - m)
//     with m the warp's max (each thread sums its 32 same-signed terms in f32, relative error <= 2e-6, then double
//     across the warp in a fixed tree) -> one RowPartial per warp: no barrier, no shared memory. The first tiled
//     version (one partial per block, four barriers) was bound by its arithmetic, not its traffic (0.238 ms
//     stats-only where a copy moves the same 537 MB in 0.133): per token two IEEE divisions of ~10 instructions
//     each with a slow-path branch (x / cap, c / T), tanhf and an expf. The divisions are now div_rcp (3
//     instructions, the same bits for the operands that occur; the exp could be ex2.approx, kRsFastExp): a full
//     tile's SASS (nvcc 13.0, sm_90a, with kRsFastExp) is 1159 instructions per thread for its 32 tokens, 96 of them
//     MUFU, where it was 2405 and 160 (the division slow paths not counted). H200 (rowstats_bench, session 9):
//     stats + probs 0.338 -> 0.237 ms, stats only 0.240 -> 0.144, now ~4 TB/s (a copy: 4.02).
//  2. rowstats_merge_k: one block per row merges the row's warp partials in a fixed order: M = max m, argmax =
//     lowest index among equal maxima, S = sum s_k e^(m_k - M), W = sum e^(m_k - M) (w_k + (m_k - M) s_k) in
//     double -> DeviceRowStats (H = log S - W / S, as compute_row_stats).
//  3. rowstats_probs_k (probs != nullptr): probs = bf16(expf(z - M) * inv_sum), tiles in reverse order so that the
//     first blocks read the capped logits that pass 1 wrote last (still in L2).
// No atomics, fixed reduction orders: bitwise deterministic.
constexpr int kRsThreads = 256, kRsVec = 8;               // float4 loads per thread
constexpr int kRsTile = kRsThreads * kRsVec * 4;          // 8192 tokens per block
constexpr int kRsWarps = kRsThreads / 32;                 // partials per tile
// true: the terms of s and w as ex2.approx.ftz(d log2(e)) (2 instructions; __expf's bound, 2 + 1.17 |d| ulp, with
// results below 2^-126 flushed) rather than expf (8 instructions, 2 ulp). Off: with the divisions gone the pass moves
// its bytes at ~4 TB/s either way (H200, rowstats_bench: stats + probs 0.2370 ms with it, 0.2368 without; stats only
// 0.1439 / 0.1443), and expf keeps the entropy bitwise the previous kernel's.
constexpr bool kRsFastExp = false;
struct RowPartial {
  double s, w;
  float m;
  int32_t idx;
};

// a / b rounded to nearest like div.rn, from r = RN(1 / b): q = RN(a r) is within an ulp of a / b, the residual
// b q - a is exact in one FMA, and one correction step then rounds correctly (Markstein's theorem); negating r
// rather than the residual keeps the sign of a zero quotient. Exact only while the residual does not underflow:
// host-checked bitwise against a / b for every float a with b = 30 (1 bit apart only for |a| < 2.4e-38, 559240 of
// 4.28e9) and for every |a| <= 1e4 with 101 values of b spread over [0.3, 1] (8.9e8 of 2.4e11 one bit apart, every
// one with |a| < 2^-102 ~ 2e-31), plus 4e9 random (a, b) with 2^-102 <= |a| <= 1e4, b in [0.3, 1]: none apart.
// Infinite a gives NaN (the residual is inf - inf): softcap_rs clamps.
__device__ __forceinline__ float div_rcp(float a, float b, float r) {
  const float q = __fmul_rn(a, r);
  return __fmaf_rn(__fmaf_rn(b, q, -a), -r, q);
}
template <bool kRcp>
__device__ __forceinline__ float rs_div(float a, float b, float r) {
  return kRcp ? div_rcp(a, b, r) : a / b;
}
// cap * tanh(x / cap) as cap - 2 cap / (2^(|x| k) + 1) with the sign of x, k = RN(2 log2(e) / cap): one ex2 and one
// rcp on the MUFU unit and four ALU operations, where cap * tanhf(x / cap) took ~25 (the division, tanhf's branch
// between a small-|x| polynomial and this same form), half of the statistics pass's instruction issue (session 22).
// The absolute error stays below ~1e-6 cap (ex2.approx's and rcp.approx's 2^-22 / 2^-23 relative errors carried
// through the cancellation near x = 0; CudaKernels.SoftcapRowStats checks it against std::tanh), far below the half
// ulp of a bf16 logit (|x| 2^-9, the rounding HF's lm_head output has). +-inf gives +-cap, NaN stays NaN, +-0 stays.
__device__ __forceinline__ float softcap_rs(float x, float cap, float k) {
  float t, r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(t) : "f"(fabsf(x) * k));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(t + 1.0f));
  return copysignf(__fmaf_rn(-2.0f * cap, r, cap), x);
}
// k of softcap_rs for a cap, rounded once on the host.
inline float softcap_k(float cap) { return float(2.0 * 1.4426950408889634 / double(cap)); }
// 2^x rounded to zero below 2^-126 (ex2.approx.ftz; __expf's ex2.approx without .ftz adds a compare and two
// multiplies to keep subnormal results, which are nothing next to the sums' largest term, 1).
__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The temperature from device memory (softcap_row_stats' temperature_dev): 1 / T (and cap / T where a kernel needs
// it, __fdiv_rn) rounded as the host rounds them (IEEE, round to nearest), so a step captured once serves every
// temperature with the same bits.
__device__ __forceinline__ void rs_device_temperature(float t, float& T, float& rT) { T = t, rT = __frcp_rn(t); }

// Four tokens of a row from index 4 c on, as f32 (16-byte loads of f32 logits, 8-byte loads of bf16 ones: the same
// tokens a thread, so the bf16 logits give the same statistics bits as f32 logits holding the same values).
__device__ __forceinline__ float4 rs_ld4(const float* p, int c) { return reinterpret_cast<const float4*>(p)[c]; }
__device__ __forceinline__ float4 rs_ld4(const bf16* p, int c) {
  const uint2 u = reinterpret_cast<const uint2*>(p)[c];
  return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                     __uint_as_float(u.y & 0xffff0000u));
}
__device__ __forceinline__ float rs_ld1(const float* p, int i) { return p[i]; }
__device__ __forceinline__ float rs_ld1(const bf16* p, int i) { return __bfloat162float(p[i]); }

// z[4 k + q] = softcapped token base + 4 (threadIdx.x + k kRsThreads) + q of the row `in`, / T; -inf past V. The
// capped values are written to `capped` (f32; the same row as `in` when the logits are f32) when `write`. kVec:
// V % 4 == 0 (aligned rows); kFull: the whole tile is inside the row.
template <bool kVec, bool kFull, bool kRcp, class In>
__device__ __forceinline__ void rs_tile_z(const In* in, float* capped, int V, int base, float cap, float ck, float T,
                                          float rT, float (&z)[kRsVec * 4], bool write) {
  if constexpr (kVec && kFull) {
    float4 x[kRsVec];
#pragma unroll
    for (int k = 0; k < kRsVec; ++k) x[k] = rs_ld4(in, base / 4 + threadIdx.x + k * kRsThreads);
#pragma unroll
    for (int k = 0; k < kRsVec; ++k) {
      float4 c = x[k];
      c.x = softcap_rs(c.x, cap, ck), c.y = softcap_rs(c.y, cap, ck);
      c.z = softcap_rs(c.z, cap, ck), c.w = softcap_rs(c.w, cap, ck);
      if (write) reinterpret_cast<float4*>(capped)[base / 4 + threadIdx.x + k * kRsThreads] = c;
      z[4 * k] = rs_div<kRcp>(c.x, T, rT), z[4 * k + 1] = rs_div<kRcp>(c.y, T, rT);  // division, as compute_row_stats
      z[4 * k + 2] = rs_div<kRcp>(c.z, T, rT), z[4 * k + 3] = rs_div<kRcp>(c.w, T, rT);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kRsVec; ++k) {
      const int i0 = base + 4 * (threadIdx.x + k * kRsThreads);
      float c[4];
      if (kVec) {
        if (i0 < V) {
          float4 x = rs_ld4(in, i0 / 4);
          x.x = softcap_rs(x.x, cap, ck), x.y = softcap_rs(x.y, cap, ck);
          x.z = softcap_rs(x.z, cap, ck), x.w = softcap_rs(x.w, cap, ck);
          if (write) reinterpret_cast<float4*>(capped)[i0 / 4] = x;
          c[0] = x.x, c[1] = x.y, c[2] = x.z, c[3] = x.w;
        }
      } else {
#pragma unroll
        for (int q = 0; q < 4; ++q)
          if (i0 + q < V) {
            c[q] = softcap_rs(rs_ld1(in, i0 + q), cap, ck);
            if (write) capped[i0 + q] = c[q];
          }
      }
#pragma unroll
      for (int q = 0; q < 4; ++q) z[4 * k + q] = i0 + q < V ? rs_div<kRcp>(c[q], T, rT) : -INFINITY;
    }
  }
}

// Partial (tile, warp) of row r at part[(r * tiles + tile) * kRsWarps + warp]. ck: softcap_k(cap); rT: RN(1 / T).
// probs != nullptr: also probs = bf16(exp(z - ref)) for a ref fixed before the pass (the fused SC probs, below).
template <bool kVec, bool kRcp, bool kFastExp, class In>
__global__ void __launch_bounds__(kRsThreads) rowstats_tile_k(const In* logits, float* capped, int V, float cap,
                                                              float ck, float temperature, float rT,
                                                              RowPartial* part, bool write_capped, bf16* probs,
                                                              float ref, const float* t_dev) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  if (t_dev) rs_device_temperature(*t_dev, temperature, rT), ref = __fdiv_rn(cap, temperature);
  const int tile = blockIdx.x, r = blockIdx.y;
  const In* row = logits + size_t(r) * V;
  float* capped_row = capped ? capped + size_t(r) * V : nullptr;  // null: bf16 logits, nothing written
  const int base = tile * kRsTile;
  float z[kRsVec * 4];
  if (base + kRsTile <= V)
    rs_tile_z<kVec, true, kRcp>(row, capped_row, V, base, cap, ck, temperature, rT, z, write_capped);
  else
    rs_tile_z<kVec, false, kRcp>(row, capped_row, V, base, cap, ck, temperature, rT, z, write_capped);
  // a thread's tokens come in ascending index: strict > keeps the lowest index of equal maxima; -inf (past V) and
  // NaN never win
  float bv = -INFINITY;
  int bi = INT32_MAX;
#pragma unroll
  for (int j = 0; j < kRsVec * 4; ++j)
    if (z[j] > bv) bv = z[j], bi = base + 4 * (threadIdx.x + (j / 4) * kRsThreads) + j % 4;
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    better(bv, bi, ov, oi);
  }
  float sf = 0, wf = 0;
#pragma unroll
  for (int j = 0; j < kRsVec * 4; ++j) {
    // the f32 difference, as compute_row_stats; -inf (past V, or a warp without a finite value) and NaN become a
    // zero term, as they were left out before
    const float d = fmaxf(z[j] - bv, -FLT_MAX);
    const float e = kFastExp ? ex2_ftz(d * 1.44269502f) : expf(d);  // RN(log2 e)
    sf += e;
    wf = fmaf(e, d, wf);
    z[j] = e;
  }
  const double s = warp_sum_d(sf), w = warp_sum_d(wf);
  if ((threadIdx.x & 31) == 0)
    part[(size_t(r) * gridDim.x + tile) * kRsWarps + (threadIdx.x >> 5)] = RowPartial{s, w, bv, bi};
  if (!probs) return;
  // exp(z - ref) = exp(z - m) exp(m - ref): one multiply a token on the term already summed (z - m is the same f32
  // difference). A warp without a finite value has e = 0 throughout.
  const float f = expf(fmaxf(bv - ref, -FLT_MAX));
  bf16* out = probs + size_t(r) * V;
#pragma unroll
  for (int k = 0; k < kRsVec; ++k) {
    const int i0 = base + 4 * (threadIdx.x + k * kRsThreads);
    const float4 u = make_float4(z[4 * k] * f, z[4 * k + 1] * f, z[4 * k + 2] * f, z[4 * k + 3] * f);
    if (kVec && i0 + 4 <= V) {
      st4(out, i0 / 4, u);
    } else {
      const float uq[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int q = 0; q < 4; ++q)
        if (i0 + q < V) out[i0 + q] = __float2bfloat16(uq[q]);
    }
  }
}

// Block-wide (max, lowest index) of (bv, bi); every thread gets the result.
__device__ __forceinline__ void block_argmax(float& bv, int& bi) {
  __shared__ float sv[32];
  __shared__ int si[32];
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    better(bv, bi, ov, oi);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) sv[warp] = bv, si[warp] = bi;
  __syncthreads();
  bv = lane < nw ? sv[lane] : -INFINITY;
  bi = lane < nw ? si[lane] : INT32_MAX;
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    better(bv, bi, ov, oi);
  }
}

// Block-wide sums of a and b in double (fixed tree); every thread gets the results.
__device__ __forceinline__ void block_sum2(double& a, double& b) {
  __shared__ double pa[32], pb[32];
  for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o), b += __shfl_xor_sync(0xffffffffu, b, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) pa[warp] = a, pb[warp] = b;
  __syncthreads();
  a = lane < nw ? pa[lane] : 0.0;
  b = lane < nw ? pb[lane] : 0.0;
  for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o), b += __shfl_xor_sync(0xffffffffu, b, o);
}

// probs[i] = bf16(expf(z - M) * inv) of token i of a row, z = softcap(x) / T (x already capped unless raw): the
// normalized SC probs of the unfused path, bitwise.
template <bool kRcp>
__device__ __forceinline__ float exact_prob(float x, bool raw, float cap, float ck, float T, float rT, float M,
                                            float inv) {
  if (raw) x = softcap_rs(x, cap, ck);
  return expf(rs_div<kRcp>(x, T, rT) - M) * inv;
}

// out[i] = bf16(p1(row[i])) over the kRsTile tokens from base: a full tile with all eight loads of a thread in flight
// before the arithmetic (kVec), a ragged one token by token. Row: f32 or bf16 logits.
template <bool kVec, class Row, class P>
__device__ __forceinline__ void write_probs_tile(const Row* row, bf16* out, int V, int base, P p1) {
  if (kVec && base + kRsTile <= V) {
    float4 x[kRsVec];
#pragma unroll
    for (int k = 0; k < kRsVec; ++k) x[k] = rs_ld4(row, base / 4 + threadIdx.x + k * kRsThreads);
#pragma unroll
    for (int k = 0; k < kRsVec; ++k)
      st4(out, base / 4 + threadIdx.x + k * kRsThreads, make_float4(p1(x[k].x), p1(x[k].y), p1(x[k].z), p1(x[k].w)));
    return;
  }
#pragma unroll
  for (int k = 0; k < kRsVec; ++k) {
    const int i0 = base + 4 * (threadIdx.x + k * kRsThreads);
    if (kVec) {
      if (i0 < V) {
        const float4 x = rs_ld4(row, i0 / 4);
        st4(out, i0 / 4, make_float4(p1(x.x), p1(x.y), p1(x.z), p1(x.w)));
      }
    } else {
#pragma unroll
      for (int q = 0; q < 4; ++q)
        if (i0 + q < V) out[i0 + q] = __float2bfloat16(p1(rs_ld1(row, i0 + q)));
    }
  }
}

// The fused SC probs (softcap_row_stats with probs_row_scale): the tile pass writes u = bf16(exp(z - ref)) with ref =
// cap / T, an upper bound of z known before the pass, and the merge sets scale = exp(ref - M) / sum, so that
// probs @ E = scale * (u @ E) without a second pass over the logits. Where ref - M <= kFusedProbsMaxGap, the row's
// largest term exp(M - ref) >= e^-60 and every token within 27 nats of the max stays a normal f32 / bf16 (>= 2^-126
// ~ e^-87.3); those further down weigh < e^-27 each against the max, all together < 262144 e^-27 ~ 5e-7 of the row's
// mass, far below bf16's half ulp (2^-9). Rows past the gap (softcapped max < cap - 60 T: only at T < 1, e.g. a max
// logit below 6 at T 0.4) are rewritten by the merge block with the unfused path's normalized probs, scale 1.
constexpr double kFusedProbsMaxGap = 60.0;
struct FusedProbs {
  bf16* probs;  // null: no fused probs
  float* scale;
  const float* logits;   // f32 logits: capped unless raw
  const bf16* logits16;  // non-null: the raw logits are these bf16 values (raw is then true)
  int V;
  float T, rT, cap, ck, ref;
  bool raw, rcp;
  const float* t_dev;  // non-null: T, rT and ref from *t_dev (rs_device_temperature)
  bool vec;            // V % 4 == 0 with 16-byte aligned logits and 8-byte aligned probs rows
};

// One block per row (the 256 partials of a 262144-token row: one per thread, where a warp per row took 8 rounds of a
// load and a double exp); stats[r] from the row's `parts` partials in a fixed order.
__global__ void __launch_bounds__(kRsThreads) rowstats_merge_k(const RowPartial* part, int parts,
                                                               DeviceRowStats* stats, FusedProbs fp,
                                                               DeviceRowStats* stats_mirror) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  if (fp.t_dev) rs_device_temperature(*fp.t_dev, fp.T, fp.rT), fp.ref = __fdiv_rn(fp.cap, fp.T);
  const int r = blockIdx.x;
  const RowPartial* p = part + size_t(r) * parts;
  float bv = -INFINITY;
  int bi = INT32_MAX;
  for (int t = threadIdx.x; t < parts; t += kRsThreads) better(bv, bi, p[t].m, p[t].idx);
  block_argmax(bv, bi);
  double S = 0, W = 0;
  for (int t = threadIdx.x; t < parts; t += kRsThreads) {
    if (!(p[t].m > -INFINITY)) continue;  // a part without a finite value contributes nothing
    const double dm = double(p[t].m) - double(bv), f = exp(dm);
    S += p[t].s * f;
    W += f * (p[t].w + dm * p[t].s);
  }
  block_sum2(S, W);
  if (threadIdx.x == 0) {
    DeviceRowStats o;
    o.argmax = bi == INT32_MAX ? 0 : bi;
    o.max_z = bv;
    o.logsumexp = float(double(bv) + log(S));
    o.entropy = float(fmax(0.0, log(S) - W / S));
    o.inv_sum = float(1.0 / S);
    o.survivors = -1, o.tail_mass = 0.0f, o.tile_overflow = 0;
    stats[r] = o;
    if (stats_mirror) stats_mirror[r] = o;
  }
  if (!fp.probs) return;
  const double gap = double(fp.ref) - double(bv);
  if (gap <= kFusedProbsMaxGap) {  // false for a row without a finite value too (gap +inf, or NaN)
    if (threadIdx.x == 0) fp.scale[r] = float(exp(gap) / S);
    return;
  }
  const float M = bv, inv = float(1.0 / S);
  bf16* out = fp.probs + size_t(r) * fp.V;
  auto p1 = [&](float x) {
    return fp.rcp ? exact_prob<true>(x, fp.raw, fp.cap, fp.ck, fp.T, fp.rT, M, inv)
                  : exact_prob<false>(x, fp.raw, fp.cap, fp.ck, fp.T, fp.rT, M, inv);
  };
  // One block streams the whole row (1 MB of logits at the full vocabulary) tile by tile, as rowstats_probs_k does:
  // one load at a time a thread, the rewrite was bound by its latency (~270 us a row on the H200).
  auto rewrite = [&](auto row) {
    for (int base = 0; base < fp.V; base += kRsTile) {
      if (fp.vec)
        write_probs_tile<true>(row, out, fp.V, base, p1);
      else
        write_probs_tile<false>(row, out, fp.V, base, p1);
    }
  };
  if (fp.logits16)
    rewrite(fp.logits16 + size_t(r) * fp.V);
  else
    rewrite(fp.logits + size_t(r) * fp.V);
  if (threadIdx.x == 0) fp.scale[r] = 1.0f;
}

template <bool kVec, bool kRcp, class Row>
__global__ void __launch_bounds__(kRsThreads) rowstats_probs_k(const Row* logits, int rows, int V, int tiles,
                                                               float temperature, float rT,
                                                               const DeviceRowStats* stats, bf16* probs,
                                                               bool raw, float cap, float ck,
                                                               const float* t_dev) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  if (t_dev) rs_device_temperature(*t_dev, temperature, rT);
  const int tile = tiles - 1 - int(blockIdx.x), r = rows - 1 - int(blockIdx.y);  // reverse: L2-resident tiles first
  const Row* row = logits + size_t(r) * V;
  bf16* out = probs + size_t(r) * V;
  const float M = stats[r].max_z, inv = stats[r].inv_sum;
  const int base = tile * kRsTile;
  // raw: the logits were left uncapped (write_capped false): the same softcap_rs as the stats pass, so the same bits
  write_probs_tile<kVec>(row, out, V, base,
                         [&](float x) { return exact_prob<kRcp>(x, raw, cap, ck, temperature, rT, M, inv); });
}

// Whether div_rcp may stand in for the divisions by cap and T: no reciprocal, quotient or residual overflows, and
// only |c| < 2^-102 can underflow (the host checks above also ran with T from 6e-8 to 1.6e7, every |c| <= 30:
// nothing apart above 2^-102). cap >= 1 keeps x / cap from overflowing for a finite x (softcap_rs).
inline bool rs_rcp_ok(float cap, float T) { return cap >= 1.0f && cap <= 0x1p24f && T >= 0x1p-24f && T <= 0x1p24f; }

__global__ void softmax_rows_bf16_k(const float* logits, int V, float temperature, bf16* probs) {
  const float* row = logits + size_t(blockIdx.x) * V;
  __shared__ float part[32];
  __shared__ float mx_s;
  float mx = -INFINITY;
  for (int i = threadIdx.x; i < V; i += blockDim.x) mx = fmaxf(mx, row[i] / temperature);
  mx = warp_max(mx);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = mx;
  __syncthreads();
  if (threadIdx.x < 32) {
    float x = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : -INFINITY;
    x = warp_max(x);
    if (threadIdx.x == 0) mx_s = x;
  }
  __syncthreads();
  mx = mx_s;
  float s = 0;
  for (int i = threadIdx.x; i < V; i += blockDim.x) s += __expf(row[i] / temperature - mx);
  const float inv = 1.0f / block_sum(s);
  bf16* out = probs + size_t(blockIdx.x) * V;
  for (int i = threadIdx.x; i < V; i += blockDim.x) out[i] = __float2bfloat16(__expf(row[i] / temperature - mx) * inv);
}

__global__ void scale_rows_f32_k(const float* in, int n, const float* row_scale, float scale, float* out) {
  pdl_wait();  // launch.cuh: nothing before this touches global memory
  pdl_trigger();
  const size_t off = size_t(blockIdx.x) * n;
  const float f = row_scale[blockIdx.x] * scale;
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[off + i] = in[off + i] * f;
}

__global__ void scale_f32_k(const float* in, size_t n, float scale, float* out) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = in[i] * scale;
}

__device__ __forceinline__ float hash_uniform(uint64_t seed, uint64_t i) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * (i + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return float(z >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;  // [-1, 1)
}

__global__ void fill_bf16_k(bf16* p, size_t n, uint64_t seed, float scale, float offset) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(offset + scale * hash_uniform(seed, i));
}
__global__ void fill_f32_k(float* p, size_t n, uint64_t seed, float scale, float offset) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = offset + scale * hash_uniform(seed, i);
}

unsigned grid_for(size_t n) {
  size_t g = (n + 255) / 256;
  return unsigned(g < 1 ? 1 : (g > 65536 ? 65536 : g));
}

}  // namespace

void embed_scale(const int32_t* ids, int T, const bf16* E, int H, float scale, float* out, cudaStream_t s) {
  if (T == 0) return;
  const bool vec = H % 8 == 0 && ((reinterpret_cast<uintptr_t>(E) | reinterpret_cast<uintptr_t>(out)) & 15) == 0;
  launch_pdl(vec ? embed_scale_k<true> : embed_scale_k<false>, dim3(T), dim3(kRowThreads), 0, s, ids, E, H, scale,
             out);
  CUDA_CHECK_LAUNCH();
}
int memset_nodes_as_kernels(cudaGraph_t graph) {
  size_t n = 0;
  CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &n));
  int replaced = 0;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type{};
    CUDA_CHECK(cudaGraphNodeGetType(node, &type));
    if (type != cudaGraphNodeTypeMemset) continue;
    cudaMemsetParams mp{};
    CUDA_CHECK(cudaGraphMemsetNodeGetParams(node, &mp));
    size_t nd = 0, nu = 0;
    CUDA_CHECK(cudaGraphNodeGetDependencies(node, nullptr, nullptr, &nd));
    CUDA_CHECK(cudaGraphNodeGetDependentNodes(node, nullptr, nullptr, &nu));
    std::vector<cudaGraphNode_t> deps(nd), users(nu);
    std::vector<cudaGraphEdgeData> dep_edges(nd), user_edges(nu);
    CUDA_CHECK(cudaGraphNodeGetDependencies(node, deps.data(), dep_edges.data(), &nd));
    CUDA_CHECK(cudaGraphNodeGetDependentNodes(node, users.data(), user_edges.data(), &nu));
    // fill_pattern_k's arguments, by address as a kernel node takes them
    unsigned char* dst = static_cast<unsigned char*>(mp.dst);
    unsigned value = mp.value, elem = mp.elementSize;
    size_t width = mp.width, height = mp.height ? mp.height : 1;
    size_t pitch = height > 1 ? mp.pitch : width * elem;
    const size_t count = width * height;
    void* args[] = {&dst, &pitch, &value, &elem, &width, &height};
    cudaKernelNodeParams kp{};
    kp.func = reinterpret_cast<void*>(fill_pattern_k);
    kp.gridDim = dim3(unsigned(std::clamp<size_t>((count + kRowThreads - 1) / kRowThreads, 1, 1024)));
    kp.blockDim = dim3(kRowThreads);
    kp.kernelParams = args;
    cudaGraphNode_t k = nullptr;
    CUDA_CHECK(cudaGraphAddKernelNode(&k, graph, nullptr, 0, &kp));
    // The memset's edges move to the kernel unchanged (a memset node has no ports: every edge is a full dependency).
    for (size_t i = 0; i < nd; ++i) CUDA_CHECK(cudaGraphAddDependencies(graph, &deps[i], &k, &dep_edges[i], 1));
    for (size_t i = 0; i < nu; ++i) CUDA_CHECK(cudaGraphAddDependencies(graph, &k, &users[i], &user_edges[i], 1));
    CUDA_CHECK(cudaGraphDestroyNode(node));
    ++replaced;
  }
  return replaced;
}
void copy_words(const void* src, size_t words, void* dst, cudaStream_t s) {
  if (words == 0) return;
  launch_pdl(copy_words_k, dim3(unsigned(std::min<size_t>((words + kRowThreads - 1) / kRowThreads, 1024))),
             dim3(kRowThreads), 0, s, static_cast<const uint32_t*>(src), words, static_cast<uint32_t*>(dst));
}
float graph_after_copies_ms(cudaStream_t s, uint32_t* word, int pairs, int rounds, const std::function<bool()>& call,
                            bool memset_kernels) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
  bool ok = true;
  try {
    for (int i = 0; i < pairs; ++i) {
      copy_words(word, 1, word + 1, s);
      if (call) ok = call() && ok;
    }
  } catch (const std::exception&) {
    ok = false;
  }
  ok = cudaStreamEndCapture(s, &graph) == cudaSuccess && ok;
  if (ok && memset_kernels) memset_nodes_as_kernels(graph);
  ok = ok && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
  float best = -1;
  if (ok) {
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    CUDA_CHECK(cudaGraphLaunch(exec, s));  // warm-up
    for (int r = 0; r < rounds; ++r) {
      CUDA_CHECK(cudaEventRecord(e0, s));
      CUDA_CHECK(cudaGraphLaunch(exec, s));
      CUDA_CHECK(cudaEventRecord(e1, s));
      CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      best = best < 0 ? ms : std::min(best, ms);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
  }
  if (exec) cudaGraphExecDestroy(exec);
  if (graph) cudaGraphDestroy(graph);
  (void)cudaGetLastError();
  return best;
}
// rms_norm_vec_k where the width allows (nv 1-4), else the scalar kernel, which has no row factor: a caller with
// one (scaled_rms_norm_f32_to_bf16) applies it first at those widths.
template <class Out>
void launch_rms_norm(const float* x, int rows, int n, const float* row_scale, float scale, const float* w, float eps,
                     Out* y, cudaStream_t s) {
  if (rows == 0) return;
  const int nv = row_vec_nv(n);
  if (nv == 0) {
    rms_norm_k<Out><<<rows, kRowThreads, 0, s>>>(x, n, w, eps, y);
  } else {
    auto* kern = nv == 1 ? rms_norm_vec_k<1, Out> : nv == 2 ? rms_norm_vec_k<2, Out>
               : nv == 3 ? rms_norm_vec_k<3, Out> : rms_norm_vec_k<4, Out>;
    launch_pdl(kern, dim3(rows), dim3(kVecThreads), 0, s, x, n, row_scale, scale, w, eps, y);
  }
  CUDA_CHECK_LAUNCH();
}
void rms_norm_f32_to_bf16(const float* x, int rows, int n, const float* w, float eps, bf16* y, cudaStream_t s) {
  launch_rms_norm(x, rows, n, nullptr, 1.0f, w, eps, y, s);
}
void rms_norm_f32_to_f32(const float* x, int rows, int n, const float* w, float eps, float* y, cudaStream_t s) {
  launch_rms_norm(x, rows, n, nullptr, 1.0f, w, eps, y, s);
}
void add_rms_norm(float* h, const bf16* a, int rows, int n, const float* w, float eps, cudaStream_t s) {
  if (rows == 0) return;
  switch (row_vec_nv(n)) {
    case 1: add_rms_norm_vec_k<1><<<rows, kVecThreads, 0, s>>>(h, a, n, w, eps); break;
    case 2: add_rms_norm_vec_k<2><<<rows, kVecThreads, 0, s>>>(h, a, n, w, eps); break;
    case 3: add_rms_norm_vec_k<3><<<rows, kVecThreads, 0, s>>>(h, a, n, w, eps); break;
    case 4: add_rms_norm_vec_k<4><<<rows, kVecThreads, 0, s>>>(h, a, n, w, eps); break;
    default: add_rms_norm_k<<<rows, kRowThreads, 0, s>>>(h, a, n, w, eps);
  }
  CUDA_CHECK_LAUNCH();
}
void pre_ffn(const float* h, int rows, int n, const float* w_pre, const float* w_pre2, const float* router_scale,
             float eps, bf16* x1, bf16* xe, float* xr, cudaStream_t s) {
  if (rows == 0) return;
  switch (row_vec_nv(n)) {
    case 1: pre_ffn_vec_k<1><<<rows, kVecThreads, 0, s>>>(h, n, w_pre, w_pre2, router_scale, eps, x1, xe, xr); break;
    case 2: pre_ffn_vec_k<2><<<rows, kVecThreads, 0, s>>>(h, n, w_pre, w_pre2, router_scale, eps, x1, xe, xr); break;
    case 3: pre_ffn_vec_k<3><<<rows, kVecThreads, 0, s>>>(h, n, w_pre, w_pre2, router_scale, eps, x1, xe, xr); break;
    case 4: pre_ffn_vec_k<4><<<rows, kVecThreads, 0, s>>>(h, n, w_pre, w_pre2, router_scale, eps, x1, xe, xr); break;
    default: pre_ffn_k<<<rows, kRowThreads, 0, s>>>(h, n, w_pre, w_pre2, router_scale, eps, x1, xe, xr);
  }
  CUDA_CHECK_LAUNCH();
}
void add_rms_norm_pre_ffn(float* h, const bf16* a, int rows, int n, const float* w_post, const float* w_pre,
                          const float* w_pre2, const float* router_scale, float eps, bf16* x1, bf16* xe, float* xr,
                          cudaStream_t s, const float* a_part, int a_splits) {
  if (rows == 0) return;
  if (a_part && a_splits < 1)
    throw_cuda_error("add_rms_norm_pre_ffn", "a_part needs a_splits >= 1", a_splits, __FILE__, __LINE__);
  const int nv = row_vec_nv(n);
  if (nv == 0) {
    if (a_part) dense_splits_to_bf16(a_part, a_splits, rows, n, const_cast<bf16*>(a), s);  // a is written then
    add_rms_norm(h, a, rows, n, w_post, eps, s);
    pre_ffn(h, rows, n, w_pre, w_pre2, router_scale, eps, x1, xe, xr, s);
    return;
  }
  auto* kern = nv == 1   ? add_rms_norm_pre_ffn_vec_k<1>
               : nv == 2 ? add_rms_norm_pre_ffn_vec_k<2>
               : nv == 3 ? add_rms_norm_pre_ffn_vec_k<3>
                         : add_rms_norm_pre_ffn_vec_k<4>;
  launch_pdl(kern, dim3(rows), dim3(kVecThreads), 0, s, h, a, n, w_post, w_pre, w_pre2, router_scale, eps, x1, xe, xr,
             a_part, a_splits);
  CUDA_CHECK_LAUNCH();
}
void ffn_combine(float* h, const bf16* m1, const float* m2, int rows, int n, const float* w1, const float* w2,
                 const float* w, float eps, float scalar, cudaStream_t s) {
  if (rows == 0) return;
  ffn_combine_k<<<rows, kRowThreads, size_t(n) * sizeof(float), s>>>(h, m1, m2, n, w1, w2, w, eps, scalar);
  CUDA_CHECK_LAUNCH();
}
void gelu_mul(const bf16* gu, int rows, int I, bf16* act, cudaStream_t s) {
  if (rows == 0) return;
  dim3 grid(unsigned((I + 255) / 256), unsigned(rows < 65535 ? rows : 65535));
  launch_pdl(gelu_mul_k, dim3(grid), dim3(256), 0, s, gu, rows, I, act);
  CUDA_CHECK_LAUNCH();
}
void scaled_rms_norm_f32_to_bf16(float* x, int rows, int n, const float* row_scale, float scale, const float* w,
                                 float eps, bf16* y, cudaStream_t s) {
  if (rows <= 0) return;
  if (row_vec_nv(n) == 0) {  // no vector kernel at this width: x scaled in place first, then the plain norm
    if (row_scale)
      scale_rows_f32(x, rows, n, row_scale, scale, x, s);
    else
      scale_f32(x, size_t(rows) * n, scale, x, s);
    row_scale = nullptr, scale = 1.0f;
  }
  launch_rms_norm(x, rows, n, row_scale, scale, w, eps, y, s);
}
namespace {
void launch_add_then_rms_norm(float* h, const bf16* a, int rows, int n, const float* w, float eps, cudaStream_t s,
                              const float* w2, bf16* y2, const int32_t* ids, const bf16* E, float escale) {
  if (rows <= 0) return;
  const int nv = row_vec_nv(n);
  if (nv == 0) {
    if (ids) embed_scale(ids, rows, E, n, escale, h, s);
    add_bf16_to_f32(h, a, size_t(rows) * n, s);
    rms_norm_f32_to_f32(h, rows, n, w, eps, h, s);
    if (y2) rms_norm_f32_to_bf16(h, rows, n, w2, eps, y2, s);
    return;
  }
  auto* kern = nv == 1 ? add_then_rms_norm_vec_k<1> : nv == 2 ? add_then_rms_norm_vec_k<2>
             : nv == 3 ? add_then_rms_norm_vec_k<3> : add_then_rms_norm_vec_k<4>;
  launch_pdl(kern, dim3(rows), dim3(kVecThreads), 0, s, h, a, n, w, eps, w2, y2, ids, E, escale);
  CUDA_CHECK_LAUNCH();
}
}  // namespace
void add_then_rms_norm(float* h, const bf16* a, int rows, int n, const float* w, float eps, cudaStream_t s,
                       const float* w2, bf16* y2) {
  launch_add_then_rms_norm(h, a, rows, n, w, eps, s, w2, y2, nullptr, nullptr, 1.0f);
}
void embed_add_then_rms_norm(const int32_t* ids, const bf16* E, float escale, float* h, const bf16* a, int rows,
                             int n, const float* w, float eps, cudaStream_t s, const float* w2, bf16* y2) {
  launch_add_then_rms_norm(h, a, rows, n, w, eps, s, w2, y2, ids, E, escale);
}
void add_bf16_to_f32(float* h, const bf16* a, size_t n, cudaStream_t s) {
  if (n == 0) return;
  add_bf16_to_f32_k<<<grid_for(n), 256, 0, s>>>(h, a, n);
  CUDA_CHECK_LAUNCH();
}
namespace {
int g_qkv_rope_max_warps = 32;  // set_qkv_rope_max_warps
}  // namespace
void set_qkv_rope_max_warps(int n) { g_qkv_rope_max_warps = std::clamp(n > 0 ? n : 32, 1, 32); }
void qkv_norm_rope(const bf16* qkv, int T, int nh, int nkv, int D, bool v_from_k, const float* qw, const float* kw,
                   const float* inv_freq, int64_t pos0, float eps, bf16* q, bf16* k, bf16* v, cudaStream_t s,
                   const float* qkv_part, int splits) {
  if (T == 0) return;
  const int rows = nh + 2 * nkv;
  if (qkv_part && splits < 1) throw_cuda_error("qkv_norm_rope", "qkv_part needs splits >= 1", splits, __FILE__, __LINE__);
  if (D == 256 || D == 512) {
    // R rows a warp (their loads in flight together), so a block's rows take one pass (each row is processed the same way
    // at any warp count).
    constexpr int kRowsPerWarp = 2;  // qkv_norm_rope_vec_k's R
    const int vwarps = std::min((rows + kRowsPerWarp - 1) / kRowsPerWarp, g_qkv_rope_max_warps);
    auto* kern = D == 256 ? qkv_norm_rope_vec_k<8, kRowsPerWarp> : qkv_norm_rope_vec_k<16, kRowsPerWarp>;
    launch_pdl(kern, dim3(T), dim3(32 * vwarps), 0, s, qkv, nh, nkv, v_from_k, qw, kw, inv_freq, pos0, eps, q, k, v,
               qkv_part, splits);
    return;
  }
  if (qkv_part) {  // other head dims: the partials summed into qkv first (qkv is then written, not just read)
    const int width = (nh + (v_from_k ? 1 : 2) * nkv) * D;
    dense_splits_to_bf16(qkv_part, splits, T, width, const_cast<bf16*>(qkv), s);
  }
  const int warps = rows < 8 ? rows : 8;
  launch_pdl(qkv_norm_rope_k, dim3(T), dim3(32 * warps), size_t(D) * sizeof(float), s, qkv, nh, nkv, D, v_from_k, qw, kw, inv_freq, pos0,
                                                                   eps, q, k, v);
  CUDA_CHECK_LAUNCH();
}
void kv_write(const bf16* k_new, const bf16* v_new, int T, int row, int64_t pos0, bf16* k_cache, bf16* v_cache,
              int64_t cap, cudaStream_t s) {
  if (T == 0) return;
  const int t_first = T > cap ? int(T - cap) : 0;
  kv_write_k<<<T - t_first, 128, 0, s>>>(reinterpret_cast<const uint4*>(k_new), reinterpret_cast<const uint4*>(v_new),
                                         T, row / 8, pos0, reinterpret_cast<uint4*>(k_cache),
                                         reinterpret_cast<uint4*>(v_cache), cap, t_first);
  CUDA_CHECK_LAUNCH();
}
size_t softcap_row_stats_scratch_bytes(int rows, int V) {
  return size_t(rows < 0 ? 0 : rows) * size_t((V + kRsTile - 1) / kRsTile) * kRsWarps * sizeof(RowPartial);
}
void softcap_row_stats(float* logits, int rows, int V, float softcap, float temperature, DeviceRowStats* stats,
                       void* scratch, cudaStream_t s, bf16* probs, bool write_capped, float* probs_row_scale,
                       DeviceRowStats* stats_mirror, const float* temperature_dev, const bf16* logits_bf16) {
  char msg[160];
  if (rows < 0 || rows > 65535 || V < 1) {
    std::snprintf(msg, sizeof msg, "rows %d must be in [0, 65535] and V %d >= 1", rows, V);
    throw_cuda_error("softcap_row_stats", msg, 0, __FILE__, __LINE__);
  }
  if (!(temperature > 0) || !(softcap > 0)) {
    std::snprintf(msg, sizeof msg, "temperature %g and softcap %g must be > 0", double(temperature), double(softcap));
    throw_cuda_error("softcap_row_stats", msg, 0, __FILE__, __LINE__);
  }
  if (rows == 0) return;
  if (!scratch) throw_cuda_error("softcap_row_stats", "no scratch (softcap_row_stats_scratch_bytes)", 0, __FILE__, __LINE__);
  if (!logits && (write_capped || !logits_bf16))
    throw_cuda_error("softcap_row_stats", "no f32 logits buffer (the input, or where the capped logits go)", 0,
                     __FILE__, __LINE__);
  const int tiles = (V + kRsTile - 1) / kRsTile;
  auto* part = static_cast<RowPartial*>(scratch);
  const dim3 grid{unsigned(tiles), unsigned(rows)};
  const bool bf16_in = logits_bf16 != nullptr;
  const bool vec = V % 4 == 0 && (!bf16_in || reinterpret_cast<uintptr_t>(logits_bf16) % 8 == 0) &&
                   ((bf16_in && !write_capped) || reinterpret_cast<uintptr_t>(logits) % 16 == 0) &&
                   (!probs || reinterpret_cast<uintptr_t>(probs) % 8 == 0);
  // IEEE divisions (the kernels' slow variant) outside the range where div_rcp was shown to give the same bits
  const bool rcp = rs_rcp_ok(softcap, temperature);
  const float ck = softcap_k(softcap), rT = 1.0f / temperature;  // host f32 division: RN(1 / x)
  const bool fused = probs && probs_row_scale;
  // Re-reads (the merge's exact fallback, the unfused probs pass) take the raw input where it is bf16: half the bytes,
  // the same softcap_rs bits as the capped f32 copy.
  const bool raw = bf16_in || !write_capped;
  const FusedProbs fp{fused ? probs : nullptr, probs_row_scale, logits, logits_bf16, V, temperature, rT, softcap, ck,
                      softcap / temperature, raw, rcp, temperature_dev, vec};
  // The tile pass and the unfused probs pass over logits of either type; `logits` takes the capped values.
  auto passes = [&](auto* in) {
    using In = std::remove_const_t<std::remove_pointer_t<decltype(in)>>;
    constexpr bool kFastExp = kRsFastExp;
    auto* tile_k = vec ? (rcp ? rowstats_tile_k<true, true, kFastExp, In>  //
                              : rowstats_tile_k<true, false, kFastExp, In>)
                       : (rcp ? rowstats_tile_k<false, true, kFastExp, In>  //
                              : rowstats_tile_k<false, false, kFastExp, In>);
    launch_pdl(tile_k, dim3(grid), dim3(kRsThreads), 0, s, in, logits, V, softcap, ck, temperature, rT, part,
               write_capped, fp.probs, fp.ref, temperature_dev);
    CUDA_CHECK_LAUNCH();
    launch_pdl(rowstats_merge_k, dim3(rows), dim3(kRsThreads), 0, s, part, tiles * kRsWarps, stats, fp, stats_mirror);
    CUDA_CHECK_LAUNCH();
    if (!probs || fused) return;
    auto* probs_k = vec ? (rcp ? rowstats_probs_k<true, true, In> : rowstats_probs_k<true, false, In>)
                        : (rcp ? rowstats_probs_k<false, true, In> : rowstats_probs_k<false, false, In>);
    launch_pdl(probs_k, dim3(grid), dim3(kRsThreads), 0, s, in, rows, V, tiles, temperature, rT, stats, probs, raw,
               softcap, ck, temperature_dev);
    CUDA_CHECK_LAUNCH();
  };
  if (bf16_in)
    passes(logits_bf16);
  else
    passes(static_cast<const float*>(logits));
}
int softcap_row_stats_variant(float softcap, float temperature) { return rs_rcp_ok(softcap, temperature) ? 1 : 0; }
void softmax_rows_bf16(const float* logits, int rows, int V, float temperature, bf16* probs, cudaStream_t s) {
  if (rows == 0) return;
  softmax_rows_bf16_k<<<rows, 1024, 0, s>>>(logits, V, temperature, probs);
  CUDA_CHECK_LAUNCH();
}
void scale_f32(const float* in, size_t n, float scale, float* out, cudaStream_t s) {
  if (n == 0) return;
  scale_f32_k<<<grid_for(n), 256, 0, s>>>(in, n, scale, out);
  CUDA_CHECK_LAUNCH();
}
void scale_rows_f32(const float* in, int rows, int n, const float* row_scale, float scale, float* out,
                    cudaStream_t s) {
  if (rows <= 0 || n <= 0) return;
  launch_pdl(scale_rows_f32_k, dim3(rows), dim3(256), 0, s, in, n, row_scale, scale, out);
  CUDA_CHECK_LAUNCH();
}
void fill_uniform_bf16(bf16* p, size_t n, uint64_t seed, float scale, float offset, cudaStream_t s) {
  if (n == 0) return;
  fill_bf16_k<<<grid_for(n), 256, 0, s>>>(p, n, seed, scale, offset);
  CUDA_CHECK_LAUNCH();
}
void fill_uniform_f32(float* p, size_t n, uint64_t seed, float scale, float offset, cudaStream_t s) {
  if (n == 0) return;
  fill_f32_k<<<grid_for(n), 256, 0, s>>>(p, n, seed, scale, offset);
  CUDA_CHECK_LAUNCH();
}

void dense_splits_to_bf16(const float* part, int splits, int T, int N, bf16* out, cudaStream_t s) {
  const size_t n = size_t(T) * size_t(N);
  if (n == 0) return;
  const unsigned grid = unsigned(std::min<size_t>((n + 255) / 256, size_t(sm_count()) * 8));
  launch_pdl(dense_splits_to_bf16_k, dim3(grid), dim3(256), 0, s, part, splits, n, out);
  CUDA_CHECK_LAUNCH();
}

}  // namespace dg::cuda
