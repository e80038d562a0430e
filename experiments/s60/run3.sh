#!/usr/bin/env bash
# Session 60, run 3 (one lent GPU, one call): a regression sweep of the current tree's GPU modules. The kernel
# modules first (each fast; the attention wrappers that session 59 changed before the rest), then test_gpu_e2e.py
# less what run 1 ran, while time is left (BUDGET seconds from the start). Logs and summary.txt in $OUT.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS
BUDGET=${BUDGET:-560}
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi -L | tee "$OUT/summary.txt"
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$? at +$(el)s" | tee -a "$OUT/summary.txt"
PT="python3 -m pytest -q -p no:cacheprovider --tb=short -rfE"
run() {  # name limit pytest-args...
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - $(el) ))
  if [ $left -lt 20 ]; then echo "$name SKIPPED (${left}s left)" | tee -a "$OUT/summary.txt"; return; fi
  [ $limit -gt $left ] && limit=$left
  timeout "$limit" $PT "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? (limit ${limit}s) at +$(el)s: $(grep -E '[0-9]+ (passed|failed|skipped|error)' "$OUT/$name.log" | tail -1)" \
    | tee -a "$OUT/summary.txt"
  grep -hE "^FAILED|^ERROR" "$OUT/$name.log" | head -8 | tee -a "$OUT/summary.txt"
}
run attn 120 tests/test_attn_kernels_gpu.py
run kernels 150 tests/test_kernels_gpu.py tests/test_hc_fold_gpu.py tests/test_moe_ffn_gpu.py
run glue_qat 90 tests/test_decode_glue_gpu.py tests/test_qat_cuda_gpu.py
run capture_ar 60 tests/test_capture_join_gpu.py tests/test_allreduce_1gpu.py
run e2e 400 tests/test_gpu_e2e.py -k "not qat_options and not rounding_allows and not 1000_steps_on_small and not sampled_generate and not tp2"
echo "--- summary"; cat "$OUT/summary.txt"
