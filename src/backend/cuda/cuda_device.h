#pragma once
// CUDA device discovery. Absence of a usable GPU (no device, or a driver too old for this build) is a normal
// outcome, not an error: callers fall back to the CPU backend and GPU tests skip with `reason`.
#include <cstddef>
#include <string>

namespace dg::cuda {

struct DeviceInfo {
  bool available = false;
  std::string reason;  // why not available
  std::string name;
  int compute_major = 0, compute_minor = 0;
  int multiprocessors = 0;
  size_t total_memory = 0, free_memory = 0;
};

DeviceInfo query_device(int ordinal = 0);

}  // namespace dg::cuda
