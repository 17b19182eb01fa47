#include <cuda_runtime.h>

#include "backend/cuda/cuda_device.h"

namespace dg::cuda {

DeviceInfo query_device(int ordinal) {
  DeviceInfo info;
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    info.reason = std::string("no usable CUDA device: ") + cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky error so later calls are not poisoned
    return info;
  }
  if (ordinal < 0 || ordinal >= count) {
    info.reason = "CUDA device " + std::to_string(ordinal) + " not present (" + std::to_string(count) + " found)";
    return info;
  }
  cudaDeviceProp prop{};
  if ((err = cudaGetDeviceProperties(&prop, ordinal)) != cudaSuccess) {
    info.reason = std::string("cudaGetDeviceProperties failed: ") + cudaGetErrorString(err);
    return info;
  }
  info.name = prop.name;
  info.compute_major = prop.major;
  info.compute_minor = prop.minor;
  info.multiprocessors = prop.multiProcessorCount;
  info.total_memory = prop.totalGlobalMem;
  if (cudaSetDevice(ordinal) == cudaSuccess) cudaMemGetInfo(&info.free_memory, &info.total_memory);
  info.available = true;
  return info;
}

}  // namespace dg::cuda
