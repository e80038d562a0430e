#!/usr/bin/env bash
# Session 65, run 1 (one lent GPU, one call): the dp4a gate+up with its items claimed from a device counter
# (DS4_DP4A_CLAIM=1) against the fixed shares of session 64. Build; the dp4a GPU tests (with the claimed form's and
# the counter's reset across launches and graph replays); the kernels alone; the slope of V, V+dp4a, V+dp4a+claim,
# twice, alternating; each variant's 4-layer step timeline (profile_step.py --timeline, JSON under $OUT).
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PJOIN DS4_ATTN_EARLY DS4_DP4A_CLAIM
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( ${BUDGET:-540} - $(el) )); }
nvidia-smi -L
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_moe_dp4a_gpu.py > "$OUT/dp4a_tests.log" 2>&1
echo "dp4a tests rc=$?: $(tail -1 "$OUT/dp4a_tests.log") at +$(el)s"
grep -E "FAILED|Error|assert" "$OUT/dp4a_tests.log" | head -8
timeout 90 python3 scripts/bench_kernels.py --quick > "$OUT/kernels.log" 2>&1
echo "bench_kernels rc=$? at +$(el)s"; grep -iE "copy|moe fp4 (gate|routed)" "$OUT/kernels.log" | head -8
V=kernels+fused+graph+cap8192
timeout 150 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
  --variants "$V,$V+dp4a,$V+dp4a+claim,$V,$V+dp4a,$V+dp4a+claim" --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "^per-layer|copy" "$OUT/bench.log"
for v in base dp4a claim; do
  l=$(left); [ $l -lt 45 ] && { echo "profile $v SKIPPED (${l}s left)"; continue; }
  case $v in base) var=$V; c=0;; dp4a) var=$V+dp4a; c=0;; claim) var=$V+dp4a; c=1;; esac
  var=${var/+graph/}
  DS4_DP4A_CLAIM=$c timeout $l python3 scripts/profile_step.py --layers 4 --variant "$var" --timeline \
    --out "$OUT/prof_$v.json" > "$OUT/prof_$v.log" 2>&1
  echo "profile $v rc=$? at +$(el)s: $(grep -E 'timeline of one replay' "$OUT/prof_$v.log")"
  grep -E "^(moe_|router_topk|hc_finish_norm|gemv_mma)" "$OUT/prof_$v.log" | head -5
done
rm -f "$OUT"/prof_*.log
echo "total $(el)s"
