#!/usr/bin/env bash
# Session 49, run 7 (one lent H200): the final tree's attention-extension and decode-glue GPU tests (c95e664 touched
# csrc/attn/attn_bindings.cpp: an unused using-declaration removed), which run 2 did not cover.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$?"; tail -n 1 "$OUT/build.log"
timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/test_attn_kernels_gpu.py \
  tests/test_decode_glue_gpu.py > "$OUT/tests_run7.log" 2>&1; echo "tests rc=$?"; tail -n 3 "$OUT/tests_run7.log"
grep -E "^FAILED|^ERROR" "$OUT/tests_run7.log" | head -20
