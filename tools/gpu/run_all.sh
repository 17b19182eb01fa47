#!/usr/bin/env bash
# The one script for the GPU machine: CUDA kernel tests, CUDA-vs-CPU parity on the tiny fixtures, the bench at full
# size (synthetic weights), optionally HF transformers on the same shapes. Logs go under $OUT; a short table last.
# Build and pack here first (tools/gpu/package.sh), then run with build-gpu-dist carried:
#   run(command="bash tools/gpu/run_all.sh", carry=["build-gpu-dist"])
# HF=1 also times transformers (tools/reference/bench_hf.py, ~5 minutes; HF_ARGS, default --skip-32k). FULLSHAPE=0 skips the full-shape CUDA-vs-HF
# check (tools/reference/make_fullshape_fixture.py builds its ~5 GB checkpoint under /tmp in ~2 minutes, in the
# background while the kernel and parity tests run; never commit it).
set -uo pipefail
cd "$(dirname "$0")/../.."
DIST=${DIST:-build-gpu-dist}
OUT=${OUT:-/tmp/diffgemma-out}
mkdir -p "$OUT"
# The test binary has the fixtures' absolute path of the build machine compiled in.
if [ ! -e /work/main/tests/fixtures ]; then mkdir -p /work && ln -sfn "$PWD" /work/main; fi
cublas=$(find /usr/local/cuda*/ /opt /usr/lib -name 'libcublasLt.so.13*' 2>/dev/null | head -1)
# Only for our binaries: the carried libstdc++ must not shadow the image's for python3.
LIBS="$PWD/$DIST/lib:$(dirname "${cublas:-/nonexistent/x}"):${LD_LIBRARY_PATH:-}"
echo "binaries built from $(cat "$DIST/BUILT_FROM" 2>/dev/null || echo '? (no BUILT_FROM: rebuild with package.sh)') $(date -u +%FT%TZ)" |
  tee "$OUT/summary.txt"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv | tee -a "$OUT/summary.txt"
# Why one machine's step runs ~2-3% slower than another's with the same binaries is still open (docs/PERFORMANCE.md):
# each bench is bracketed by the board's limits and state (memory temperature included: HBM refreshes more often
# when hot), and sampled every 250 ms while the benches run (gpu_samples.csv in logs.tgz).
nvidia-smi --query-gpu=clocks.max.sm,clocks.max.mem,power.limit,power.max_limit,pci.bus_id --format=csv |
  sed 's/^/[gpu] /' | tee -a "$OUT/summary.txt"
GPU_STATE=timestamp,temperature.gpu,temperature.memory,clocks.sm,clocks.mem,power.draw
for reasons in clocks_event_reasons.active clocks_throttle_reasons.active; do  # the field's name by driver age
  if nvidia-smi --query-gpu=$GPU_STATE,$reasons --format=csv,noheader >/dev/null 2>&1; then
    GPU_STATE=$GPU_STATE,$reasons
    break
  fi
done
gpu_state() {
  echo "[gpu] $1: $(nvidia-smi --query-gpu=$GPU_STATE --format=csv,noheader 2>&1 | head -1)" | tee -a "$OUT/summary.txt"
}

FS_DIR=${FS_DIR:-/tmp/fullshape}
if [ "${FULLSHAPE:-1}" = 1 ]; then
  # FS_ARGS: fixture flags, e.g. "--gaussian" (the old i.i.d. weights; default: the well-conditioned mode)
  HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 timeout 300 python3 tools/reference/make_fullshape_fixture.py ${FS_ARGS:-} \
    --out "$FS_DIR" \
    >"$OUT/fullshape_fixture.log" 2>&1 &
  fs_pid=$!
fi
LD_LIBRARY_PATH="$LIBS" timeout 300 "$DIST/diffgemma_tests" --gtest_filter='CudaKernels.*' >"$OUT/kernels.log" 2>&1
k_rc=$?
LD_LIBRARY_PATH="$LIBS" "$DIST/diffgemma_tests" --gtest_filter='*CudaParity*' >"$OUT/parity.log" 2>&1
p_rc=$?
f_rc=skipped
if [ "${FULLSHAPE:-1}" = 1 ]; then
  wait "$fs_pid"
  g_rc=$?
  cp "$FS_DIR/reference/case.json" "$OUT/fullshape_case.json" 2>/dev/null
  DIFFGEMMA_FULLSHAPE_DIR="$FS_DIR" LD_LIBRARY_PATH="$LIBS" timeout 300 "$DIST/diffgemma_tests" \
    --gtest_filter='CudaFullShape.*' >"$OUT/fullshape.log" 2>&1
  f_rc="$? (fixture script rc $g_rc)"
fi
# CUBLAS_ROUTER=1: the parity tests again with CudaOptions::fused_router off (cuBLASLt's router GEMM + top-k + assign).
cr_rc=skipped
if [ "${CUBLAS_ROUTER:-0}" = 1 ]; then
  DIFFGEMMA_TEST_CUBLAS_ROUTER=1 LD_LIBRARY_PATH="$LIBS" timeout 300 "$DIST/diffgemma_tests" --gtest_filter='*CudaParity*' \
    >"$OUT/parity_fused_router.log" 2>&1
  cr_rc=$?
fi
# CUBLAS_EXPERTS=1: the parity and full-shape tests again with CudaOptions::tma_experts off (cuBLASLt gate_up + the
# GELU pass, the path of non-Hopper GPUs); TMA_EXPERTS_DOWN=1: with the TMA down kernel on as well; NO_TMA_GATHER=1:
# with the gate_up kernel reading a gathered copy of the token rows (CudaOptions::tma_gather_rows off);
# STATIC_EXPERT_TILES=1: with gate_up's blocks striding over its tiles; ROUTER_TC=1: with the router's partials on
# the tensor cores; UNFUSED_EXPERTS=1: gate_up and down in two launches; UNPACKED_EXPERTS=1: the expert weights in
# the checkpoint layout (2D tensor-map boxes); LAYER_GRAPH=1: only the layers of a denoise step as one
# CUDA graph (CudaOptions::whole_step_graph off); DENSE_TMA=1 (or 2: clusters of 2): qkv / o_proj on the split-K
# Hopper GEMM (CudaOptions::dense_tma); TWO_TOKEN_TILES=1: up to 64 rows an expert in the fused expert launch
# (CudaOptions::expert_two_token_tiles); BF16_LOGITS=1: the lm_head's logits in bf16 (CudaOptions::bf16_logits).
# CUBLAS_ROUTER=1 applies to this run too.
te_rc=skipped
if [ "${CUBLAS_EXPERTS:-0}" = 1 ] || [ "${TMA_EXPERTS_DOWN:-0}" = 1 ] || [ "${NO_TMA_GATHER:-0}" = 1 ] ||
  [ "${STATIC_EXPERT_TILES:-0}" = 1 ] || [ "${ROUTER_TC:-0}" = 1 ] ||
  [ "${UNFUSED_EXPERTS:-0}" = 1 ] || [ "${UNPACKED_EXPERTS:-0}" = 1 ] || [ "${LAYER_GRAPH:-0}" = 1 ] ||
  [ "${DENSE_TMA:-0}" != 0 ] || [ "${TWO_TOKEN_TILES:-0}" = 1 ] || [ "${BF16_LOGITS:-0}" = 1 ]; then
  DIFFGEMMA_TEST_CUBLAS_EXPERTS=${CUBLAS_EXPERTS:-0} DIFFGEMMA_TEST_TMA_EXPERTS_DOWN=${TMA_EXPERTS_DOWN:-0} \
    DIFFGEMMA_TEST_NO_TMA_GATHER=${NO_TMA_GATHER:-0} DIFFGEMMA_TEST_STATIC_EXPERT_TILES=${STATIC_EXPERT_TILES:-0} \
    DIFFGEMMA_TEST_CUBLAS_ROUTER=${CUBLAS_ROUTER:-0} \
    DIFFGEMMA_TEST_ROUTER_TC=${ROUTER_TC:-0} DIFFGEMMA_TEST_UNFUSED_EXPERTS=${UNFUSED_EXPERTS:-0} \
    DIFFGEMMA_TEST_UNPACKED_EXPERTS=${UNPACKED_EXPERTS:-0} DIFFGEMMA_TEST_LAYER_GRAPH=${LAYER_GRAPH:-0} \
    DIFFGEMMA_TEST_DENSE_TMA=${DENSE_TMA:-0} DIFFGEMMA_TEST_TWO_TOKEN_TILES=${TWO_TOKEN_TILES:-0} \
    DIFFGEMMA_TEST_BF16_LOGITS=${BF16_LOGITS:-0} \
    DIFFGEMMA_FULLSHAPE_DIR="$FS_DIR" LD_LIBRARY_PATH="$LIBS" timeout 300 \
    "$DIST/diffgemma_tests" --gtest_filter='*CudaParity*:CudaFullShape.*' >"$OUT/parity_experts_path.log" 2>&1
  te_rc=$?
fi
# GROUPED=1: the parity and full-shape tests again with CudaOptions::padded_experts off (the grouped expert kernels
# on canvas passes too), and a second bench with --grouped-experts.
pd_rc=skipped
if [ "${GROUPED:-0}" = 1 ]; then
  DIFFGEMMA_TEST_GROUPED_EXPERTS=1 DIFFGEMMA_FULLSHAPE_DIR="$FS_DIR" LD_LIBRARY_PATH="$LIBS" timeout 300 \
    "$DIST/diffgemma_tests" --gtest_filter='*CudaParity*:CudaFullShape.*:CudaKernels.MoePadded*' >"$OUT/grouped.log" 2>&1
  pd_rc=$?
  LD_LIBRARY_PATH="$LIBS" timeout 300 "$DIST/diffgemma" bench --grouped-experts --json ${BENCH_ARGS:-} \
    >"$OUT/bench_grouped.json" 2>"$OUT/bench_grouped.log"
fi
# TUNE=1 (TUNE_CONTEXTS, default 512: the denoise contexts whose shapes are tuned; TUNE_ARGS: more bench flags): time every cuBLASLt candidate of each GEMM shape first (bench --tune-gemm, graphs off); the summary lists
# the fastest configurations as lines for src/backend/cuda/gemm_tuned.inc.
t_rc=skipped
if [ "${TUNE:-0}" = 1 ]; then
  LD_LIBRARY_PATH="$LIBS" timeout 300 "$DIST/diffgemma" bench --tune-gemm --contexts ${TUNE_CONTEXTS:-512} --prefill 4096 ${TUNE_ARGS:-} \
    --fixed-steps 0 --reps 2 --json >"$OUT/gemm_tune.json" 2>"$OUT/gemm_tune.log"
  t_rc=$?
fi
nvidia-smi --query-gpu=$GPU_STATE --format=csv -lms 250 >"$OUT/gpu_samples.csv" 2>&1 &
smi_pid=$!
gpu_state "before bench"
# BENCH_ARGS: extra bench flags, e.g. "--breakdown --prefill 4096" (per-stage CUDA-event times of a denoise step).
LD_LIBRARY_PATH="$LIBS" timeout 400 "$DIST/diffgemma" bench --json ${BENCH_ARGS:-} >"$OUT/bench.json" 2>"$OUT/bench.log"
b_rc=$?
gpu_state "after bench"
# KERNEL_BENCH=0 skips `diffgemma bench-kernels` (every kernel launcher timed alone at the full-size shapes).
kb_rc=skipped
if [ "${KERNEL_BENCH:-1}" = 1 ]; then
  LD_LIBRARY_PATH="$LIBS" timeout 300 "$DIST/diffgemma" bench-kernels ${KERNEL_BENCH_ARGS:-} >"$OUT/bench_kernels.md" \
    2>"$OUT/bench_kernels.log"
  kb_rc=$?
fi
# AB_ARGS: A/B benches after the main one, ';'-separated flag sets, each with AB_COMMON (default: the 4K step and
# prefill only), e.g. AB_ARGS="--cublas-router;--no-overlap" -> bench_ab1.json, bench_ab2.json, in the summary.
# An empty set is the defaults, also as the last one ("--no-overlap;": read -a drops a trailing empty field).
ab_i=0
IFS=';' read -ra ab_sets <<<"${AB_ARGS:-}"
if [[ "${AB_ARGS:-}" == *';' ]]; then ab_sets+=(""); fi
for ab in "${ab_sets[@]}"; do
  ab_i=$((ab_i + 1))
  echo "A/B $ab_i: $ab" >"$OUT/bench_ab$ab_i.log"
  LD_LIBRARY_PATH="$LIBS" timeout 300 "$DIST/diffgemma" bench --json ${AB_COMMON:---contexts 4096 --prefill 4096 --fixed-steps 0} $ab \
    >"$OUT/bench_ab$ab_i.json" 2>>"$OUT/bench_ab$ab_i.log"
  gpu_state "after A/B $ab_i"
done
kill "$smi_pid" 2>/dev/null
wait "$smi_pid" 2>/dev/null
h_rc=skipped
if [ "${HF:-0}" = 1 ]; then
  PYTHONUNBUFFERED=1 timeout "${HF_TIMEOUT:-300}" python3 tools/reference/bench_hf.py --json "$OUT/hf_bench.json" ${HF_ARGS:---skip-32k} \
    >"$OUT/hf.log" 2>&1
  h_rc=$?
fi

{
  echo "== kernel tests (rc $k_rc)"; grep -E '^\[  (FAILED|  OK|SKIPPED) \]|PASSED|FAILED  ' "$OUT/kernels.log" | tail -20
  grep -B2 -A6 'Failure' "$OUT/kernels.log" | head -60
  echo "== parity (rc $p_rc)"; grep -E '^\[parity\]|^\[  (FAILED|  OK|SKIPPED) \]' "$OUT/parity.log"
  grep -E '^\[trace\].*(logits|stage  0)' "$OUT/parity.log" | head -80
  grep -B2 -A6 'Failure' "$OUT/parity.log" | head -60
  echo "== parity with the cuBLASLt router (rc $cr_rc)"
  [ -f "$OUT/parity_fused_router.log" ] && grep -E '^\[parity\]|^\[  (FAILED|  OK) \]' "$OUT/parity_fused_router.log"
  echo "== parity + full shape, CUBLAS_EXPERTS=${CUBLAS_EXPERTS:-0} TMA_EXPERTS_DOWN=${TMA_EXPERTS_DOWN:-0}" \
    "NO_TMA_GATHER=${NO_TMA_GATHER:-0} STATIC_EXPERT_TILES=${STATIC_EXPERT_TILES:-0}" \
    "CUBLAS_ROUTER=${CUBLAS_ROUTER:-0} ROUTER_TC=${ROUTER_TC:-0}" \
    "UNFUSED_EXPERTS=${UNFUSED_EXPERTS:-0} UNPACKED_EXPERTS=${UNPACKED_EXPERTS:-0}" \
    "LAYER_GRAPH=${LAYER_GRAPH:-0} DENSE_TMA=${DENSE_TMA:-0} TWO_TOKEN_TILES=${TWO_TOKEN_TILES:-0}" \
    "BF16_LOGITS=${BF16_LOGITS:-0} (rc $te_rc)"
  [ -f "$OUT/parity_experts_path.log" ] && grep -E '^\[parity\]|^\[fullshape\] (nosc|sc|commit|two|auto) |^\[  (FAILED|  OK) \]' "$OUT/parity_experts_path.log"
  echo "== full shape vs HF (rc $f_rc)"
  [ -f "$OUT/fullshape_fixture.log" ] && grep -E 'FAIL|WARN|agree|cosine|Error' "$OUT/fullshape_fixture.log" | tail -12
  [ -f "$OUT/fullshape.log" ] && grep -E '^\[fullshape\]|^\[  (FAILED|  OK|SKIPPED) \]|Failure' "$OUT/fullshape.log"
  echo "== bench (rc $b_rc)"; grep -v uploading "$OUT/bench.log"
  for f in "$OUT"/bench_ab*.log; do [ -f "$f" ] && echo "== $(head -1 "$f")" && grep -v -E 'uploading|^A/B' "$f"; done
  echo "== kernels alone (rc $kb_rc)"; [ -f "$OUT/bench_kernels.md" ] && cat "$OUT/bench_kernels.md"
  [ -f "$OUT/bench_kernels.log" ] && grep -i error "$OUT/bench_kernels.log"
  echo "== grouped experts: tests rc $pd_rc"
  [ -f "$OUT/grouped.log" ] && grep -E '^\[parity\]|^\[fullshape\] (nosc|sc|commit) |^\[  (FAILED|  OK) \]|Failure' "$OUT/grouped.log" | head -60
  [ -f "$OUT/bench_grouped.log" ] && grep -v uploading "$OUT/bench_grouped.log"
  echo "== gemm tuning (rc $t_rc)"; [ -f "$OUT/gemm_tune.log" ] && grep -E '^\{|GEMM tuning' "$OUT/gemm_tune.log"
  echo "== hf (rc $h_rc)"; [ -f "$OUT/hf.log" ] && grep -E 'prefill_ms|step|fail|Error' "$OUT/hf.log" | tail -20
  # issue #5's acceptance from this call's numbers (tools/gpu/verdict.py; logged, not the script's exit code)
  echo "== acceptance"
  python3 tools/gpu/verdict.py --bench "$OUT/bench.json" --hf "$OUT/hf_bench.json" --kernels-rc "$k_rc" \
    --parity-rc "$p_rc" --fullshape-rc "$f_rc"
} | tee -a "$OUT/summary.txt"
# A device call returns at most 8 files: everything but the summary and the bench JSON goes into one archive.
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude=summary.txt --exclude=bench.json \
  --exclude=hf_bench.json ./* && \
  find . -maxdepth 1 -type f ! -name logs.tgz ! -name summary.txt ! -name bench.json ! -name hf_bench.json -delete)
