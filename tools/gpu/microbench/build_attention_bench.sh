#!/bin/sh
# Builds build-attn/attention_bench (or $1/attention_bench) for sm_90a from src/backend/cuda/kernels_attention.cu and
# an older kernel (tools/gpu/microbench/attention_old.cuh); the binary needs no other libraries on the GPU
# machine. VARIANT_SED='sed expression' adds a third build of the file with that edit applied (printed as "var"),
# e.g. VARIANT_SED='s/^#pragma unroll 4$/#pragma unroll/' to try the Q.K^T loop fully unrolled; VARIANT_SED2 likewise
# adds a fourth ("var2"). VARIANT_SRC / VARIANT_SRC2=file: build the variant from that file instead (e.g. the committed
# kernel, `git show main:src/backend/cuda/kernels_attention.cu > f`, as the "before" column); VARIANT_SED may then
# be 's/^$//' (no edit).
set -e
cd "$(dirname "$0")/../../.."
out=${1:-build-attn}
mkdir -p "$out"
# TIMELINE=1: per-block phase timestamps of the wgmma kernels, printed per timed case (-DDG_ATTN_TIMELINE).
NVCC="${NVCC:-/usr/local/cuda/bin/nvcc} -std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a -I src --expt-relaxed-constexpr"
[ "${TIMELINE:-0}" = 1 ] && NVCC="$NVCC -DDG_ATTN_TIMELINE"
src=${ATTN_SRC:-src/backend/cuda/kernels_attention.cu}  # ATTN_SRC: build another copy of the file as "new"
extra=""
# The other functions the file exports get a suffix in a variant's copy (one definition each at link time).
exports='s/void set_attention_splits(/void set_attention_splits_VAR(/; s/void set_attention_tma(/void set_attention_tma_VAR(/; s/void set_attention_key_runs(/void set_attention_key_runs_VAR(/; s/void set_attention_q_tma(/void set_attention_q_tma_VAR(/; s/void set_attention_ws512(/void set_attention_ws512_VAR(/; s/int attention_timeline_slots(/int attention_timeline_slots_VAR(/; s/void attention_timeline(/void attention_timeline_VAR(/; s/void clear_attention_timeline(/void clear_attention_timeline_VAR(/'
if [ -n "$VARIANT_SED" ]; then
  decl='^void attention(const AttentionArgs& a, cudaStream_t s) {'
  sed "$VARIANT_SED; $(echo "$exports" | sed 's/VAR/v3/g'); s/$decl/void attention_v3(const AttentionArgs\& a, cudaStream_t s) {/" \
    "${VARIANT_SRC:-$src}" >"$out/attn_var.cu"
  grep -q attention_v3 "$out/attn_var.cu"
  $NVCC -c "$out/attn_var.cu" -o "$out/attn_var.o"
  extra="-DWITH_V3 $out/attn_var.o"
fi
if [ -n "$VARIANT_SED2" ]; then  # a second variant, "var2"
  decl='^void attention(const AttentionArgs& a, cudaStream_t s) {'
  sed "$VARIANT_SED2; $(echo "$exports" | sed 's/VAR/v4/g'); s/$decl/void attention_v4(const AttentionArgs\& a, cudaStream_t s) {/" \
    "${VARIANT_SRC2:-$src}" >"$out/attn_var2.cu"
  grep -q attention_v4 "$out/attn_var2.cu"
  $NVCC -c "$out/attn_var2.cu" -o "$out/attn_var2.o"
  extra="$extra -DWITH_V4 $out/attn_var2.o"
fi
$NVCC -cudart static tools/gpu/microbench/attention_bench.cu $src src/backend/cuda/tensor_map.cpp $extra \
  -o "$out/attention_bench"
