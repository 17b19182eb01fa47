#!/usr/bin/env bash
# Nsight Compute on the kernels of a 4K denoise step (GPU machine), one kernel family at a time: where the expert
# GEMMs, attention and the small kernels between them lose time (DRAM / L2 / SM throughput, the warp stall reasons).
# Build and pack here first (tools/gpu/package.sh), then:
#   run(command="bash tools/gpu/ncu_step.sh", carry=["build-gpu-dist"])
# KERNELS: ';'-separated kernel-name regexes (default below); NCU_SKIP / NCU_COUNT: matching launches skipped (the
# prefill's and the warm-up's) and then profiled per family. The step runs without CUDA graphs (bench --no-graphs:
# ncu serializes the kernels anyway). Clocks are left to the GPU (--clock-control none: ncu's default locks the base
# clock, which slows the SM side); caches are flushed before each kernel (ncu's default), so L2 hits between kernels
# (the combine reading the down GEMM's output, for one) are not seen here.
# Output under $OUT: ncu_<i>.csv (raw metrics per launch), ncu_summary.txt (a few metrics per launch), ncu.log.
# NCU_DETAILS=1: instead, ncu's full section set as text, ncu_details_<i>.txt per family (NCU_COUNT default 1).
# First run in session 6 (docs/BENCHMARKS.md): four families with NCU_COUNT=6 took well under a minute.
set -uo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=tools/gpu/ncu_env.sh
source tools/gpu/ncu_env.sh
KERNELS=${KERNELS:-"experts_tma_k;nvjet_sm90_tss_128x32;attention_ws_k|attention_combine_k;attention_wgx_k;router_partials_k|router_route_k|moe_combine_ffn|add_rms_norm_pre_ffn"}
BENCH=${BENCH:-"bench --contexts 4096 --prefill 256 --fixed-steps 0 --reps 1 --no-graphs"}
METRICS=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,\
dram__bytes_write.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,\
sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__registers_per_thread,\
smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio
: >"$OUT/ncu.log"
: >"$OUT/ncu_summary.txt"
i=0
IFS=';' read -ra families <<<"$KERNELS"
for k in "${families[@]}"; do
  i=$((i + 1))
  echo "== $k" >>"$OUT/ncu.log"
  if [ "${NCU_DETAILS:-0}" = 1 ]; then  # every section of ncu's full set, as text (one file per family)
    # shellcheck disable=SC2086
    LD_LIBRARY_PATH="$LIBS" timeout 240 "$NCU" --clock-control none --kernel-name "regex:$k" \
      --launch-skip "${NCU_SKIP:-40}" --launch-count "${NCU_COUNT:-1}" --set full --page details \
      "$DIST/diffgemma" $BENCH >"$OUT/ncu_details_$i.txt" 2>>"$OUT/ncu.log"
    echo "rc $? for $k (details)" >>"$OUT/ncu.log"
    continue
  fi
  # shellcheck disable=SC2086
  LD_LIBRARY_PATH="$LIBS" timeout 240 "$NCU" --clock-control none --kernel-name "regex:$k" \
    --launch-skip "${NCU_SKIP:-40}" --launch-count "${NCU_COUNT:-4}" --metrics "$METRICS" --csv --page raw \
    "$DIST/diffgemma" $BENCH >"$OUT/ncu_$i.csv" 2>>"$OUT/ncu.log"
  echo "rc $? for $k" >>"$OUT/ncu.log"
  # A few columns per profiled launch: kernel, duration, DRAM %, bytes, L2 %, SM %, tensor %.
  python3 - "$OUT/ncu_$i.csv" "$k" >>"$OUT/ncu_summary.txt" <<'EOF'
import csv, sys
path, family = sys.argv[1], sys.argv[2]
rows = [r for r in csv.reader(l for l in open(path, errors="replace") if l.startswith('"'))]
print(f"== {family}: {max(0, len(rows) - 2)} launches profiled")
if len(rows) < 3:
    sys.exit(0)
head = rows[0]
col = {name: i for i, name in enumerate(head)}
want = ["Kernel Name", "gpu__time_duration.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        "dram__bytes_read.sum", "dram__bytes_write.sum", "lts__throughput.avg.pct_of_peak_sustained_elapsed",
        "sm__throughput.avg.pct_of_peak_sustained_elapsed",
        "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
        "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
        "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
        "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"]
units = rows[1]
print("  " + " | ".join(f"{w.split('.')[0]} [{units[col[w]]}]" if w in col else w for w in want))
for r in rows[2:]:
    print("  " + " | ".join((r[col[w]][:40] if w in col else "?") for w in want))
EOF
done
cat "$OUT/ncu_summary.txt"
