#!/usr/bin/env bash
# On the GPU machine: alternating same-call A/B of one binary under different environment settings (timing probes
# gated by environment variables, e.g. docs/experiments/timing-probes.patch). Usage:
#   ROUNDS=3 bash tools/gpu/ab_env.sh BIN "X=0;DG_SKIP_DENSE=1" bench --contexts 4096 --prefill 0 --fixed-steps 0
# Each round runs every setting once, in order; one line a run: the setting, the 4K step's median and minimum (ms).
set -uo pipefail
cd "$(dirname "$0")/../.."
bin=$1 sets=$2
shift 2
cublas=$(find /usr/local/cuda*/ /opt /usr/lib -name 'libcublasLt.so.13*' 2>/dev/null | head -1)
LIBS="$PWD/${DIST:-build-gpu-dist}/lib:$(dirname "${cublas:-/nonexistent/x}")"
IFS=';' read -ra envs <<<"$sets"
for ((r = 1; r <= ${ROUNDS:-3}; ++r)); do
  for e in "${envs[@]}"; do
    line=$(env $e LD_LIBRARY_PATH="$LIBS" timeout 200 "$bin" "$@" --json 2>/dev/null |
      python3 -c 'import json,sys; d=json.load(sys.stdin)["denoise"]; print(" ".join(f"kv{k} {v["step_ms"]:.3f} (min {v["step_ms_min"]:.3f})" for k,v in d.items()))' 2>&1)
    echo "round $r  $e  $line"
  done
done
