#!/usr/bin/env bash
# Session 62, run 3 (the same warm machine as run 2): the two GPU modules the chunk kernel's change touches, whole
# (test_attn_kernels_gpu.py, test_decode_glue_gpu.py), then three more alternating slope passes of the default
# against pja+early. Logs and summary.txt in $OUT.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PJOIN DS4_ATTN_EARLY
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
S="$OUT/summary.txt"
nvidia-smi -L | tee "$S"
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$? at +$(el)s" | tee -a "$S"
PT="python3 -m pytest -q -p no:cacheprovider --tb=short"
run() {  # name limit pytest-args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" $PT "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? at +$(el)s: $(grep -E '[0-9]+ (passed|failed|skipped|error)' "$OUT/$name.log" | tail -1)" | tee -a "$S"
  grep -hE "^FAILED|^ERROR|Error:" "$OUT/$name.log" | head -8
}
run attn 150 tests/test_attn_kernels_gpu.py
run glue 150 tests/test_decode_glue_gpu.py
V=kernels+fused+graph+cap8192
left=$(( 500 - $(el) ))
if [ $left -gt 60 ]; then
  timeout $left python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
    --variants "$V,$V+pja+early,$V,$V+pja+early,$V,$V+pja+early" --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "bench rc=$? at +$(el)s" | tee -a "$S"; grep -E "^per-layer|copy" "$OUT/bench.log" | tee -a "$S"
else echo "bench SKIPPED (${left}s left)" | tee -a "$S"; fi
echo "total $(el)s" | tee -a "$S"
