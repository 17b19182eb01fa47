#pragma once
// Whether kernels are launched with programmatic dependent launch (launch.cuh); process-wide, on by default.
// Off only for A/B timing (bench --no-pdl): the kernels compute the same either way.
namespace dg::cuda {

inline bool& pdl_flag() {
  static bool on = true;
  return on;
}
inline void set_pdl(bool on) { pdl_flag() = on; }
inline bool pdl_enabled() { return pdl_flag(); }

}  // namespace dg::cuda
