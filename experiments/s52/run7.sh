#!/usr/bin/env bash
# Session 52, run 7 (one lent H200): the final tree's GPU code (run 6's) once more with the end-to-end option tests
# (plain numerics: every implementation option against the torch reference on small) and the kernel module's
# GEMV / argmax / dequant tests (the bindings gained act_quant_sim).
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
t0=$(date +%s); st() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
st build; python3 scripts/build_ext.py -q > /tmp/build.log 2>&1; echo "build rc=$?"; tail -2 /tmp/build.log
st kernels
timeout 150 python3 -m pytest -q tests/test_kernels_gpu.py -k "gemv or argmax or dequant" > "$OUT/tests_run7.log" 2>&1
echo "kernel tests rc=$?"; tail -2 "$OUT/tests_run7.log"
st e2e
timeout 320 python3 -m pytest -q tests/test_gpu_e2e.py -k "options_agree" >> "$OUT/tests_run7.log" 2>&1
echo "e2e rc=$?"; tail -2 "$OUT/tests_run7.log"
st done
