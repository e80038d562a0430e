#!/usr/bin/env bash
# Session 60, run 1 (one lent GPU, one call): session 59's floor-relative end-to-end tests (never run), then the
# sampled-graph test at V4's vocabulary width, then the plain slope (4 -> 12 layers, two passes in one process) on
# whatever card came. Logs in $OUT.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
t0=$(date +%s)
ONLY="e2e_new" BUDGET=${BUDGET:-420} bash experiments/s59/gpu_tests.sh
left=$(( 470 - ($(date +%s) - t0) ))
[ $left -gt 30 ] && { timeout $left python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_gpu_e2e.py \
  -k sampled_generate > "$OUT/sampled.log" 2>&1; echo "sampled rc=$?: $(tail -1 "$OUT/sampled.log")"; \
  grep -E "^FAILED|Error" "$OUT/sampled.log" | head -5; }
V=kernels+fused+graph+cap8192
left=$(( 560 - ($(date +%s) - t0) ))
if [ $left -gt 40 ]; then
  timeout $left python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V,$V" \
    --out "$OUT/bench_run1.json" > "$OUT/bench_run1.log" 2>&1; echo "bench rc=$?"
  grep -E "^per-layer|copy|GB/s" "$OUT/bench_run1.log" | head -8
else echo "bench SKIPPED (${left}s left)"; fi
echo "total $(( $(date +%s) - t0 ))s"
