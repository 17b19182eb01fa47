#pragma once
// Programmatic dependent launch (PDL, sm_90+): a kernel launched with launch_pdl may be scheduled while the kernel
// before it in the stream is still finishing, and waits in pdl_wait() until that kernel has completed and its writes
// are visible. Every kernel launched this way calls pdl_wait() before it touches global memory (so it can neither
// read an input early nor overwrite one its predecessor still reads), then pdl_trigger(), which lets its own
// successor be scheduled once all of its blocks have started. Both are no-ops below sm_90 and for a kernel launched
// without the attribute; the attribute is also dropped while pdl_enabled() is false (A/B: bench --no-pdl).
#include <cuda_runtime.h>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/pdl.h"

namespace dg::cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Attribute A of the current device (read once).
template <cudaDeviceAttr A>
inline int device_attribute() {
  static const int v = [] {
    int dev = 0, x = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&x, A, dev));
    return x;
  }();
  return v;
}
// Streaming multiprocessors / compute capability major of the current device.
inline int sm_count() { return device_attribute<cudaDevAttrMultiProcessorCount>(); }
inline int compute_major() { return device_attribute<cudaDevAttrComputeCapabilityMajor>(); }

// Whether `kernel` runs from its sm_90a image here (an sm_90 device, and the binary carries that image): the
// wgmma / TMA kernels are compiled out of every other image.
template <class Kernel>
bool sm90a_image_of(Kernel kernel) {
  cudaFuncAttributes fa{};
  CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel));
  return compute_major() == 9 && fa.binaryVersion == 90;
}

// kernel<<<grid, block, smem, s>>>(args...) with the PDL attribute. (Clustered launches set their own attributes:
// kernels_dense_tma.cu.)
template <class... KArgs, class... Args>
void launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, Args... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  if (pdl_enabled()) cfg.attrs = at, cfg.numAttrs = 1;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...));
}

}  // namespace dg::cuda
