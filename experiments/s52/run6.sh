#!/usr/bin/env bash
# Session 52, run 6 (one lent H200): the act_quant_sim binding's error message fixed (numbers through num(), as every
# message of the bindings: check_text.h); the new GPU tests again with the qat layer-level test; then where a qat
# decode step's time goes (scripts/profile_step.py with the new qat token: kernel totals of 4 layers, plain beside).
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
t0=$(date +%s); st() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
st build; python3 scripts/build_ext.py -q > /tmp/build.log 2>&1; echo "build rc=$?"; tail -2 /tmp/build.log
st tests
timeout 200 python3 -m pytest -q tests/test_qat_cuda_gpu.py "tests/test_decode_glue_gpu.py::test_long_context_decode_agrees_with_torch" \
  > "$OUT/tests_run6.log" 2>&1; echo "tests rc=$?"; tail -3 "$OUT/tests_run6.log"
for v in kernels+fused+qat kernels+fused; do
  st "profile $v"
  timeout 120 python3 scripts/profile_step.py --layers 4 --variant $v --out "$OUT/profile_4l_${v//+/_}_run6.json" \
    > "$OUT/profile_${v//+/_}_run6.log" 2>&1; echo "profile rc=$?"
  head -45 "$OUT/profile_${v//+/_}_run6.log"
done
st done
