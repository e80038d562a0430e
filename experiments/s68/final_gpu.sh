#!/usr/bin/env bash
# Session 68's second device call: the GPU regression of the tree after the session's CPU-side changes that GPU
# runs also take (ds4/quant/formats.py: dequant_fp4 by a byte table, dequant_fp8's scales in place, used by the torch
# reference and as the GPU tests' reference; ds4/model/weights_module.py: the experts stacked one by one, also on the
# GPU when synthetic weights are made there): every one-GPU test module, the end-to-end rows that the first call
# (next_gpu.sh) deselected last.
# Usage (device call, carry nothing): OUT=$OUT bash experiments/s68/final_gpu.sh   (BUDGET=560 s)
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( ${BUDGET:-560} - $(el) )); }
nvidia-smi -L
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
run() {  # name, limit, pytest args...
  local name=$1 lim=$2; shift 2
  local l=$(left); [ $l -lt 20 ] && { echo "$name SKIPPED (${l}s left)"; return; }
  [ $lim -gt $l ] && lim=$l
  timeout $lim python3 -m pytest -q -p no:cacheprovider --tb=short "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? (limit ${lim}s) at +$(el)s: $(tail -1 "$OUT/$name.log")"
  grep -E "^FAILED|^ERROR" "$OUT/$name.log" | head -8
}
run units 150 tests/test_quant.py tests/test_weights.py tests/test_kernels_gpu.py tests/test_hc_fold_gpu.py \
  tests/test_moe_ffn_gpu.py tests/test_capture_join_gpu.py tests/test_allreduce_1gpu.py
run attn 120 tests/test_attn_kernels_gpu.py
run glue_qat 100 tests/test_decode_glue_gpu.py tests/test_qat_cuda_gpu.py
run e2e_options 400 tests/test_gpu_e2e.py -k "options_agree or all_fused_agree or dp4a or sinkhorn_ride"
echo "total $(el)s"
