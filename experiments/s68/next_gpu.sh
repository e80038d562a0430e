#!/usr/bin/env bash
# Session 68's first device call: what session 67 left unrun on a GPU (its record, experiments/session67.md).
#   - tests/test_moe_dp4a_gpu.py whole, for the mended exactness bar (tests/dp4a_bar.py) that only ran on CPU;
#   - the rows of tests/test_gpu_e2e.py no GPU has reached since session 65 (long prompts, qat, bf16 dense, the
#     graph rows other than dp4a's, capture / pool / sampled / fp8t / moe_ffn);
#   - session 68's table form of dequant_fp4 (tests/test_quant.py's CUDA case, run with the dp4a file);
#   - the slope of the defaults last, if time is left (no CUDA source changed since session 67's H100 121.8).
# The memcheck of session 67 (0 errors) is not repeated: no CUDA source changed since.
# Usage (device call, carry nothing): OUT=$OUT bash experiments/s68/next_gpu.sh   (BUDGET=560 s)
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( ${BUDGET:-560} - $(el) )); }
nvidia-smi -L
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
run() {  # name, limit, command...
  local name=$1 lim=$2; shift 2
  local l=$(left); [ $l -lt 20 ] && { echo "$name SKIPPED (${l}s left)"; return; }
  [ $lim -gt $l ] && lim=$l
  timeout $lim "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? (limit ${lim}s) at +$(el)s: $(grep -E 'passed|failed|us/layer|slope' "$OUT/$name.log" | tail -2 | tr '\n' ' ')"
  grep -E "^FAILED|^ERROR" "$OUT/$name.log" | head -8
}
PYT="python3 -m pytest -q -p no:cacheprovider --tb=short --durations=15"
run dp4a 80 $PYT tests/test_moe_dp4a_gpu.py tests/test_quant.py
run e2e_rest 330 $PYT tests/test_gpu_e2e.py -k "not options_agree and not tp2 and not dp4a and not sinkhorn_ride \
and not all_fused_agree"
run bench 90 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants kernels+fused+graph+cap8192 \
  --out "$OUT/bench.json"
echo "total $(el)s"
