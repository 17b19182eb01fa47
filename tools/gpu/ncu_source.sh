#!/usr/bin/env bash
# Nsight Compute source view of one kernel of a 4K denoise step (GPU machine): per-SASS-instruction stall samples and
# executed instructions, with the CUDA source line of each (the CUDA code is built with -lineinfo), so that a kernel's
# time can be placed on its instructions. Build and pack here first (tools/gpu/package.sh), then:
#   run(command="bash tools/gpu/unpack_slim.sh && KERNEL=attention_ws_k bash tools/gpu/ncu_source.sh",
#       carry=["build-gpu-slim"])
# KERNEL: kernel-name regex; NCU_SKIP: matching launches skipped first (the prefill's and the warm-up's); BENCH: the
# bench run. Output under $OUT: ncu_source_sass.csv (per instruction), ncu_source_top.txt (the instructions and source
# lines with the most stall samples), ncu_source.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=tools/gpu/ncu_env.sh
source tools/gpu/ncu_env.sh
BENCH=${BENCH:-"bench --contexts 4096 --prefill 256 --fixed-steps 0 --reps 1 --no-graphs"}
rm -f /tmp/ncu_source.ncu-rep
# shellcheck disable=SC2086
LD_LIBRARY_PATH="$LIBS" timeout 300 "$NCU" --clock-control none --kernel-name "regex:${KERNEL:-attention_ws_k}" \
  --launch-skip "${NCU_SKIP:-200}" --launch-count 1 --set full --import-source yes -o /tmp/ncu_source \
  "$DIST/diffgemma" $BENCH >"$OUT/ncu_source.log" 2>&1
timeout 120 "$NCU" -i /tmp/ncu_source.ncu-rep --page source --csv --print-source sass \
  >"$OUT/ncu_source_sass.csv" 2>>"$OUT/ncu_source.log"
timeout 120 "$NCU" -i /tmp/ncu_source.ncu-rep --page details >>"$OUT/ncu_source.log" 2>&1
python3 - "$OUT/ncu_source_sass.csv" >"$OUT/ncu_source_top.txt" 2>&1 <<'PY'
import csv, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1], errors="replace") if l.startswith('"'))]
if len(rows) < 2:
    print("no source rows"); sys.exit(0)
head = rows[0]
print("columns:", head)
def col(*names):
    for n in names:
        for i, h in enumerate(head):
            if h.lower().startswith(n.lower()):
                return i
    return None
ci_src = col("Source")
ci_samp = col("Warp Stall Sampling (All", "Warp Stall Sampling")
ci_exec = col("Instructions Executed")
data = rows[1:]
def num(r, i):
    try:
        return float(r[i].replace(',', ''))
    except Exception:
        return 0.0
if ci_samp is None:
    print("no stall-sampling column"); sys.exit(0)
tot = sum(num(r, ci_samp) for r in data) or 1
print(f"total stall samples {tot:.0f}")
for r in sorted(data, key=lambda r: -num(r, ci_samp))[:60]:
    print(f"{100 * num(r, ci_samp) / tot:6.2f}%  exec {num(r, ci_exec) if ci_exec is not None else 0:10.0f}  {r[ci_src][:110]}")
PY
cat "$OUT/ncu_source_top.txt" | head -80
