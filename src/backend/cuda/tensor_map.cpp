// Hopper TMA descriptors (CUtensorMap, opaque to the rest of the engine as TmaMap) for bf16 tensors, 128-byte
// swizzled boxes 64 elements wide: what the TMA expert kernels and the attention kernels' K / V loads read.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <cstring>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_kernels.h"

namespace dg::cuda {

static_assert(sizeof(TmaMap) == sizeof(CUtensorMap) && alignof(TmaMap) >= alignof(CUtensorMap),
              "TmaMap must hold a CUtensorMap");

namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    cudaDriverEntryPointQueryResult q{};
    void* p = nullptr;
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || p == nullptr)
      throw_cuda_error("cuTensorMapEncodeTiled", "driver entry point not found", int(q), __FILE__, __LINE__);
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

CUtensorMapL2promotion promotion_of(int bytes, const char* who) {
  if (bytes != 0 && bytes != 128 && bytes != 256)
    throw_cuda_error(who, "l2_promotion must be 0, 128 or 256 bytes", bytes, __FILE__, __LINE__);
  return bytes == 0 ? CU_TENSOR_MAP_L2_PROMOTION_NONE
                    : bytes == 128 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B : CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
}

// dims / box innermost first; strides (bytes) of dims 1 .. rank - 1.
TmaMap encode(const bf16* p, int rank, const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
              CUtensorMapL2promotion promotion) {
  CUtensorMap m;
  std::memset(&m, 0, sizeof m);
  const cuuint32_t estr[3] = {1, 1, 1};
  const CUresult r = encode_fn()(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, cuuint32_t(rank), const_cast<bf16*>(p), dims,
                                 strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                 promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) throw_cuda_error("cuTensorMapEncodeTiled", "tensor map rejected", int(r), __FILE__, __LINE__);
  TmaMap out;
  std::memcpy(&out, &m, sizeof m);
  return out;
}

}  // namespace

TmaMap tma_map_bf16_rows(const bf16* p, int64_t rows, int64_t cols, int box_rows, int l2_promotion) {
  if (cols % 64 != 0 || (reinterpret_cast<uintptr_t>(p) & 15) != 0 || box_rows < 1 || box_rows > 256 || rows < 1)
    throw_cuda_error("tma_map_bf16_rows", "cols must be a multiple of 64, the base 16-byte aligned, box rows 1..256",
                     0, __FILE__, __LINE__);
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(cols) * sizeof(bf16)};
  const cuuint32_t box[2] = {64, cuuint32_t(box_rows)};
  return encode(p, 2, dims, strides, box, promotion_of(l2_promotion, "tma_map_bf16_rows"));
}

TmaMap tma_map_bf16_heads(const bf16* p, int64_t rows, int heads, int D, int box_rows, int box_heads) {
  if (D % 64 != 0 || (reinterpret_cast<uintptr_t>(p) & 15) != 0 || box_rows < 1 || box_rows > 256 || rows < 1 ||
      heads < 1 || box_heads < 1 || box_heads > heads || box_heads > 256)
    throw_cuda_error("tma_map_bf16_heads",
                     "D must be a multiple of 64, the base 16-byte aligned, box rows 1..256, box heads 1..heads", 0,
                     __FILE__, __LINE__);
  const cuuint64_t dims[3] = {cuuint64_t(D), cuuint64_t(heads), cuuint64_t(rows)};
  const cuuint64_t strides[2] = {cuuint64_t(D) * sizeof(bf16), cuuint64_t(heads) * D * sizeof(bf16)};
  const cuuint32_t box[3] = {64, cuuint32_t(box_heads), cuuint32_t(box_rows)};
  return encode(p, 3, dims, strides, box, CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
}

}  // namespace dg::cuda
