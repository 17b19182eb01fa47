#pragma once
// The packed layouts of the expert weights (CudaOptions::pack_expert_gate_up / pack_expert_down): each 16 KB stage
// the TMA expert kernel (kernels_experts_tma.cu) consumes is stored contiguously, already in the 128-byte-swizzled
// order its shared-memory ring holds, so one 1D bulk copy (cp.async.bulk) fills a stage instead of two 2D
// tensor-map boxes of 64 rows x 128 B. On the H200 a bare ring of such copies streams one layer's gate_up bytes at
// 4.46-4.49 TB/s against 4.18-4.27 for the 2D boxes, the rate of a plain read (tools/gpu/microbench/stream_bench.cu,
// docs/BENCHMARKS.md, session 10).
//
// A tile is 128 weight rows of one expert as two 64-row halves: gate_up tile nt = gate rows nt 64 .. nt 64 + 63, then
// the matching up rows I + nt 64 ..; down tile nt = rows nt 128 .. nt 128 + 127. Stage (e, nt, kt) = tile nt of
// expert e at k slice kt (columns kt 64 .. kt 64 + 63); stages in the kernel's order (expert, tile, slice). Within a
// stage, tile row r (0..127) is 128 B at r 128, its 16-byte chunk c at chunk c ^ (r % 8) (what
// CU_TENSOR_MAP_SWIZZLE_128B writes). A 16-byte chunk (8 consecutive k of one row) stays contiguous, so the grouped
// kernels (kernels_experts.cu) read the packed weights chunk by chunk (expert_packed_in_stage).
// gate_up [E, 2I, H] needs H % 64 == 0 and I % 64 == 0; down [E, H, I] needs H % 128 == 0 and I % 64 == 0.
#include <cstddef>

#if defined(__CUDACC__)
#define DG_EXPERT_LAYOUT_FN __host__ __device__ __forceinline__
#else
#define DG_EXPERT_LAYOUT_FN inline
#endif

namespace dg::cuda {

// Elements of one packed stage (16 KB).
constexpr int kExpertPackedStageElems = 8192;

// Element offset of stage kt of tile `tile` (tiles numbered expert by expert, `slices` k slices a tile).
DG_EXPERT_LAYOUT_FN size_t expert_packed_stage(size_t tile, int slices, int kt) {
  return (tile * size_t(slices) + size_t(kt)) * kExpertPackedStageElems;
}

// Element offset, inside its stage, of element k % 64 of tile row r (0..127).
DG_EXPERT_LAYOUT_FN int expert_packed_in_stage(int r, int k) {
  return r * 64 + ((((k & 63) >> 3) ^ (r & 7)) << 3) + (k & 7);
}

// Element offset of gate_up weight (expert e, row r in [0, 2I), column k in [0, H)).
DG_EXPERT_LAYOUT_FN size_t expert_gate_up_packed_offset(int e, int r, int k, int H, int I) {
  const int up = r >= I ? 1 : 0, rr = r - up * I;
  return expert_packed_stage(size_t(e) * size_t(I >> 6) + size_t(rr >> 6), H >> 6, k >> 6) +
         size_t(expert_packed_in_stage(up * 64 + (rr & 63), k));
}

// Element offset of down weight (expert e, row r in [0, H), column k in [0, I)).
DG_EXPERT_LAYOUT_FN size_t expert_down_packed_offset(int e, int r, int k, int H, int I) {
  return expert_packed_stage(size_t(e) * size_t(H >> 7) + size_t(r >> 7), I >> 6, k >> 6) +
         size_t(expert_packed_in_stage(r & 127, k));
}

}  // namespace dg::cuda

#undef DG_EXPERT_LAYOUT_FN
