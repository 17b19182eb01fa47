// The GPU bench commands' argument checks and their answer on a machine without a GPU (the CI machine): a clear
// error and a non-zero exit, never a crash. Their timings themselves need the GPU machine (tools/gpu/run_all.sh).
#include <gtest/gtest.h>

#include <string>

#include "cli_command.h"
#ifdef DIFFGEMMA_WITH_CUDA
#include "backend/cuda/cuda_device.h"
#endif

namespace {

#ifdef DIFFGEMMA_BINARY
bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(BenchKernelsCli, RejectsBadArgumentsByName) {
  CommandResult r = run_command(std::string(DIFFGEMMA_BINARY) + " bench-kernels --kv 100");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "--kv must be >= 1024")) << r.output;
  r = run_command(std::string(DIFFGEMMA_BINARY) + " bench-kernels --reps 0");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "--reps")) << r.output;
}

// bench's A/B options with a range: a value outside it is named with the option, before any GPU work.
TEST(BenchCli, RejectsOutOfRangeOptionsByName) {
  for (const char* arg : {"--gemm-attention-max-keys 0", "--attn-splits 17"}) {
    const CommandResult r = run_command(std::string(DIFFGEMMA_BINARY) + " bench " + arg);
    EXPECT_NE(r.status, 0) << arg << ": " << r.output;
    EXPECT_TRUE(contains(r.output, std::string(arg).substr(0, std::string(arg).find(' ')))) << r.output;
    EXPECT_TRUE(contains(r.output, "not in range")) << r.output;
  }
}

TEST(BenchKernelsCli, SaysWhyWithoutAGpu) {
#ifdef DIFFGEMMA_WITH_CUDA
  if (dg::cuda::query_device(0).available) GTEST_SKIP() << "a GPU is present: the no-GPU answer cannot be seen here";
#endif
  const CommandResult r = run_command(std::string(DIFFGEMMA_BINARY) + " bench-kernels --reps 1");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "bench-kernels needs")) << r.output;
}
#endif

}  // namespace
