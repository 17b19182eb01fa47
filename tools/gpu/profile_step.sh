#!/usr/bin/env bash
# Kernel-level profile of denoise steps on the GPU machine (Nsight Systems from the image's Nsight Compute install),
# summarized by tools/gpu/profile_step.py into $OUT/profile.txt. The image's QdstrmImporter lacks libdw/libelf: carry
# them from here (build-prof/lib: libdw.so.1 libelf.so.1 liblzma.so.5 libbz2.so.1.0 libz.so.1):
#   run(command="bash tools/gpu/profile_step.sh", carry=["build-gpu-dist", "build-prof"])
# BENCH_ARGS: the bench run to profile (default: 12 steps at kv 4096).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/diffgemma-out}
mkdir -p "$OUT"
rm -f /tmp/step.* /tmp/step_*  # a warm machine keeps the last call's files: nsys stats would report the stale export
base=$(dirname "$(find /opt/nvidia -name QdstrmImporter -path '*x64*' 2>/dev/null | head -1)")
NSYS=$(find /opt/nvidia -name nsys -path '*target-linux-x64*' 2>/dev/null | head -1)
cublas=$(find /usr/local/cuda*/ /opt /usr/lib -name 'libcublasLt.so.13*' 2>/dev/null | head -1)
LD_LIBRARY_PATH="$PWD/build-gpu-dist/lib:$(dirname "$cublas")" timeout 300 "$NSYS" profile --cuda-graph-trace=node \
  -o /tmp/step build-gpu-dist/diffgemma bench ${BENCH_ARGS:---contexts 4096 --prefill 512 --fixed-steps 0 --reps 12} \
  >"$OUT/nsys.log" 2>&1
LD_LIBRARY_PATH="$PWD/build-prof/lib" timeout 300 "$base/QdstrmImporter" -i /tmp/step.qdstrm >>"$OUT/nsys.log" 2>&1
timeout 300 "$NSYS" stats --report cuda_gpu_trace,cuda_api_trace --format csv -o /tmp/step /tmp/step.nsys-rep \
  >>"$OUT/nsys.log" 2>&1
gzip -c /tmp/step_cuda_gpu_trace.csv >"$OUT/step_cuda_gpu_trace.csv.gz"
# The host's side (launch and synchronize calls), to line up with the GPU trace by correlation id.
[ -f /tmp/step_cuda_api_trace.csv ] && gzip -c /tmp/step_cuda_api_trace.csv >"$OUT/step_cuda_api_trace.csv.gz"
python3 tools/gpu/profile_step.py /tmp/step_cuda_gpu_trace.csv --steps 10 >"$OUT/profile.txt" 2>&1
tail -5 "$OUT/nsys.log"
cat "$OUT/profile.txt"
