// The single main() of diffgemma_bench (CMake links benchmark::benchmark, not benchmark_main); every other
// bench/*.cpp only registers benchmarks.
#include <benchmark/benchmark.h>

BENCHMARK_MAIN();
