#!/usr/bin/env bash
# Session 65, run 3 (one lent GPU, one call): the GPU tests of the tree as it lands (session 64's code and its review
# mends, which no GPU had run: the dp4a grid from resident_wave, the registry's dp4a_ok rule, seed_of in gpu_common;
# session 65 adds only profile_step.py's dp4a token). Every GPU test file but the end-to-end one whole, then the
# end-to-end file's option rows as time allows. Per-file logs under $OUT; a table on stdout.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PJOIN DS4_ATTN_EARLY DS4_DP4A_CLAIM
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( ${BUDGET:-570} - $(el) )); }
nvidia-smi -L
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
run() {  # name, limit, pytest args...
  local name=$1 lim=$2; shift 2
  local l=$(left); [ $l -lt 20 ] && { echo "$name SKIPPED (${l}s left)"; return; }
  [ $lim -gt $l ] && lim=$l
  timeout $lim python3 -m pytest -q -p no:cacheprovider --tb=line "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? (limit ${lim}s) at +$(el)s: $(tail -1 "$OUT/$name.log")"
  grep -E "^FAILED|^ERROR" "$OUT/$name.log" | head -5
}
run units 200 tests/test_moe_dp4a_gpu.py tests/test_kernels_gpu.py tests/test_hc_fold_gpu.py tests/test_moe_ffn_gpu.py \
  tests/test_capture_join_gpu.py tests/test_allreduce_1gpu.py
run attn 120 tests/test_attn_kernels_gpu.py -k "not end_to_end"
run glue_qat 120 tests/test_decode_glue_gpu.py tests/test_qat_cuda_gpu.py
run e2e_options 400 tests/test_gpu_e2e.py -k "options_agree or all_fused or dp4a or 1000_steps_on_small"
echo "total $(el)s"
