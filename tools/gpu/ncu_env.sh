# Sourced by the Nsight Compute scripts (ncu_step.sh, ncu_source.sh) from the repository root: DIST, OUT (created),
# NCU (the ncu binary; the script exits with a message when there is none) and LIBS (our libraries, then cuBLASLt's).
DIST=${DIST:-build-gpu-dist}
OUT=${OUT:-/tmp/diffgemma-out}
mkdir -p "$OUT"
NCU=$(find /opt/nvidia /usr/local/cuda*/ -name ncu -type f -path '*x64*' 2>/dev/null | head -1)
[ -z "$NCU" ] && NCU=$(find /opt/nvidia /usr/local/cuda*/ -name ncu -type f 2>/dev/null | head -1)
if [ -z "$NCU" ]; then
  echo "$(basename "$0"): no ncu binary under /opt/nvidia or /usr/local/cuda*" | tee "$OUT/ncu_summary.txt"
  exit 1
fi
cublas=$(find /usr/local/cuda*/ /opt /usr/lib -name 'libcublasLt.so.13*' 2>/dev/null | head -1)
LIBS="$PWD/$DIST/lib:$(dirname "${cublas:-/nonexistent/x}")"
