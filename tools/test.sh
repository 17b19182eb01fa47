#!/usr/bin/env bash
# The test suite: installs dependencies, builds everything (CUDA code included when nvcc exists), runs every CPU test
# (GPU tests skip themselves visibly without a GPU), then re-runs the input-validation and parser tests under
# AddressSanitizer + UBSan.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}
tools/install_deps.sh
tools/build.sh
(cd build && ctest --output-on-failure -j"$JOBS" --timeout 900)

# Sanitizer pass over everything that parses untrusted input (files, requests, model output) and the pure ops and
# sampler rules (the model-running suites are too slow under ASan on two cores).
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DDIFFGEMMA_SANITIZE=ON -DDIFFGEMMA_CUDA=OFF >/dev/null
cmake --build build-asan -j"$JOBS" --target diffgemma diffgemma_tests
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j"$JOBS" --timeout 900 \
  -R '^(Safetensors|Checkpoint|Config|OutputParser|Chat|Tokenizer|ServerProtocol|ServerTextStream|CpuOps|AcceptRule|StopRules|Rng|Options)'
