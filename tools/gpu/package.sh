#!/usr/bin/env bash
# Run HERE (the build machine): builds the CUDA binaries and packs them with the non-system shared libraries they
# need into build-gpu-dist/, the folder to carry to the GPU machine (which has CUDA but no Debian packages).
set -euo pipefail
cd "$(dirname "$0")/../.."
# Only the H200's architecture (CI builds them all): with sm_80/89 + PTX the binaries outgrow what a device call carries.
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DDIFFGEMMA_STATIC=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${DIFFGEMMA_GPU_ARCHS:-90a-real}" >/dev/null
cmake --build build-gpu -j"${JOBS:-2}" --target diffgemma diffgemma_tests
rm -rf build-gpu-dist && mkdir -p build-gpu-dist/lib
cp build-gpu/diffgemma build-gpu/diffgemma_tests build-gpu-dist/
# What the binaries were built from (the device copy of the tree carries a stale .git: run_all.sh reads this instead).
echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src tests CMakeLists.txt || echo '+uncommitted changes')" \
  >build-gpu-dist/BUILT_FROM
strip build-gpu-dist/diffgemma build-gpu-dist/diffgemma_tests
# cuBLASLt (540 MB) is not carried: the GPU image has its own; everything else outside glibc travels.
for bin in build-gpu-dist/diffgemma build-gpu-dist/diffgemma_tests; do
  ldd "$bin" | awk '/=> \//{print $3}' | grep -v -E 'libc\.so|libm\.so|libpthread|libdl\.so|librt\.so|ld-linux|cublas' |
    xargs -r -I{} cp -Ln {} build-gpu-dist/lib/
done
du -sh build-gpu-dist
# The same, compressed, with build-prof's libraries (profile_step.sh) beside: tools/gpu/unpack_slim.sh restores both on
# the GPU machine (for when the tree plus build-gpu-dist would pass the 64 MiB a device call carries).
rm -rf build-gpu-slim && mkdir -p build-gpu-slim
cp -r build-gpu-dist/lib build-gpu-dist/BUILT_FROM build-gpu-slim/
if [ -d build-prof/lib ]; then cp -r build-prof/lib build-gpu-slim/prof; else mkdir -p build-gpu-slim/prof; fi
for bin in diffgemma diffgemma_tests; do gzip -c "build-gpu-dist/$bin" >"build-gpu-slim/$bin.gz"; done
du -sh build-gpu-slim
