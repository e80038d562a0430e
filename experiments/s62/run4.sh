#!/usr/bin/env bash
# Session 62, run 4 (one lent GPU, one call, what device time was left): build, then the slope of the default (after
# the chunk kernel's restructure for `early`, which is off by default) against pja+early, alternating, a spacer
# variant first so that no compared variant is the process's first (on the H100 of runs 1-3 the first pass ran about
# 1.3 us per layer slower than the later passes of the same variant). Logs and summary.txt in $OUT.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PJOIN DS4_ATTN_EARLY
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
S="$OUT/summary.txt"
nvidia-smi -L | tee "$S"
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$? at +$(el)s" | tee -a "$S"
V=kernels+fused+graph+cap8192
left=$(( ${BUDGET:-330} - $(el) ))
if [ $left -gt 40 ]; then
  timeout $left python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
    --variants "$V+noride,$V,$V+pja+early,$V,$V+pja+early" --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "bench rc=$? at +$(el)s" | tee -a "$S"; grep -E "^per-layer|copy" "$OUT/bench.log" | tee -a "$S"
else echo "bench SKIPPED (${left}s left)" | tee -a "$S"; fi
echo "total $(el)s" | tee -a "$S"
