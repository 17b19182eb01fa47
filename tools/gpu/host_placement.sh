#!/usr/bin/env bash
# On the GPU machine: does the host CPU that runs the engine move the denoise step? The bench's step time includes
# the host's part between steps (the synchronize's return, the graph launch calls); in session 33 the same binaries
# ran the 4K step at 19.78 ms in processes whose launch calls took 4-5 us and 19.84-19.86 in ones where they took
# 14-21 us. This prints the host's CPU / NUMA layout and the GPU's local CPUs, then runs the same bench pinned to each
# CPU of PLACES ("-" = unpinned), printing the step and the launch-call times of each run.
#   run(command="bash tools/gpu/unpack_slim.sh >/dev/null && OUT=$OUT bash tools/gpu/host_placement.sh",
#       carry=["build-gpu-slim"])
set -uo pipefail
cd "$(dirname "$0")/../.."
DIST=${DIST:-build-gpu-dist}
OUT=${OUT:-/tmp/diffgemma-out}
mkdir -p "$OUT"
cublas=$(find /usr/local/cuda*/ /opt /usr/lib -name 'libcublasLt.so.13*' 2>/dev/null | head -1)
LIBS="$PWD/$DIST/lib:$(dirname "${cublas:-/nonexistent/x}"):${LD_LIBRARY_PATH:-}"
{
  echo "binaries built from $(cat "$DIST/BUILT_FROM" 2>/dev/null || echo '?')"
  nvidia-smi --query-gpu=name,pci.bus_id,clocks.max.sm,clocks.max.mem --format=csv
  echo "nproc $(nproc); allowed CPUs $(grep Cpus_allowed_list /proc/self/status | cut -f2)"
  lscpu | grep -Ei 'model name|socket|numa|thread|mhz' || true
  bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | head -1 | tr 'A-F' 'a-f')
  dev=/sys/bus/pci/devices/${bus: -12}  # nvidia-smi's 00000000:19:00.0 is sysfs's 0000:19:00.0
  echo "GPU PCI device ${dev:-not found}: local_cpulist $(cat "$dev/local_cpulist" 2>/dev/null || echo '?'), numa_node $(cat "$dev/numa_node" 2>/dev/null || echo '?')"
  nvidia-smi topo -m 2>/dev/null | head -4 || true
} | tee "$OUT/host_placement.txt"
for place in ${PLACES:-- 0 7 15 - 0 7 15}; do
  pin=()
  [ "$place" != "-" ] && pin=(taskset -c "$place")
  line=$(LD_LIBRARY_PATH="$LIBS" timeout 120 "${pin[@]}" "$DIST/diffgemma" bench ${BENCH_ARGS:---contexts 4096 --prefill 0 --fixed-steps 0} 2>&1 |
    grep 'denoise step' | head -1)
  echo "cpu $place: $line" | tee -a "$OUT/host_placement.txt"
done
