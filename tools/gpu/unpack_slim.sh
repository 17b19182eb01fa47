#!/usr/bin/env bash
# On the GPU machine: rebuilds build-gpu-dist (and build-prof, for profile_step.sh) from build-gpu-slim, the
# compressed copy package.sh also writes. Carry build-gpu-slim instead of build-gpu-dist + build-prof when the
# working tree and those would pass a device call's 64 MiB carry limit:
#   run(command="bash tools/gpu/unpack_slim.sh && bash tools/gpu/run_all.sh", carry=["build-gpu-slim"])
set -euo pipefail
cd "$(dirname "$0")/../.."
SLIM=${SLIM:-build-gpu-slim}  # another packed copy (e.g. an older build kept for a comparison), carried under its name
rm -rf build-gpu-dist build-prof
mkdir -p build-gpu-dist build-prof
cp -r "$SLIM/lib" "$SLIM/BUILT_FROM" build-gpu-dist/
cp -r "$SLIM/prof" build-prof/lib
for bin in diffgemma diffgemma_tests; do
  gunzip -c "$SLIM/$bin.gz" >"build-gpu-dist/$bin"
  chmod +x "build-gpu-dist/$bin"
done
