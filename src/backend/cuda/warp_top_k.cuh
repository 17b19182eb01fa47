#pragma once
// warp_top_k: one token's router top-k on one warp, shared by the route kernels (kernels_moe.cu) and the pre-FFN
// norm kernel that routes in place (add_rms_norm_pre_ffn_route, kernels_rows.cu).
#include <cstdint>

#include "backend/cuda/cuda_util.cuh"

namespace dg::cuda {

// One warp per token, the token's expert probabilities in registers (PL per lane, expert of slot j: eid(j), E <= 32 *
// PL): no shared memory and no block barriers, where route_top_k_k spends two barriers per selected expert. Same
// rules: float exp, double sum, p = float(e / sum), ties to the lower index. l[j]: the logit of expert eid(j) (any
// value where eid(j) >= E). eid must be ascending in j within a lane (the lane's first maximum is its lowest id).
// Returns the expert of slot `lane` (lanes < k).
template <int PL, class ExpertOf>
__device__ __forceinline__ int warp_top_k(float (&l)[PL], ExpertOf eid, int E, int k, const float* pes, int32_t* idx,
                                          float* w) {
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

}  // namespace dg::cuda
