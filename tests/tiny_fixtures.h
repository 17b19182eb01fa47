#pragma once
// The randomized tiny checkpoints under tests/fixtures that the parity suites (CPU vs HF, CUDA vs CPU) run on, and
// their gtest parameter names ("tiny-a" -> "tiny_a": test names take no '-').
#include <string>

#include <gtest/gtest.h>

namespace dg {

inline const char* const kTinyFixtures[] = {"tiny-a", "tiny-b", "tiny-v", "tiny-g"};

inline std::string tiny_fixture_test_name(const ::testing::TestParamInfo<const char*>& info) {
  std::string name(info.param);
  for (char& ch : name)
    if (ch == '-') ch = '_';
  return name;
}

}  // namespace dg
