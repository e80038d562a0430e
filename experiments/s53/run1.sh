#!/usr/bin/env bash
# Session 53, run 1 (one lent H200): numerics=qat's indexer Hadamard + FP4 simulation inside the kernels (the
# compressor step's entry, the scores kernel's query staging, hadamard_fp4) and the indexer query merged into wq_b's
# GEMV under qat. GPU tests (bit tests against the twin; compressor and layer-level tests; qat graph = eager), then
# the slope: plain, qat, qat with the twin's indexer simulation (ixqtorch); a qat profile.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
t0=$(date +%s); st() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
st build; python3 scripts/build_ext.py -q > /tmp/build.log 2>&1; echo "build rc=$?"; tail -5 /tmp/build.log
st tests
timeout 240 python3 -m pytest -q tests/test_qat_cuda_gpu.py tests/test_decode_glue_gpu.py \
  > "$OUT/tests_run1.log" 2>&1; echo "tests rc=$?"; grep -E "passed|failed|Error|assert" "$OUT/tests_run1.log" | tail -15
V=kernels+fused+graph+cap8192
st bench
timeout 200 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
  --variants "$V,$V+qat,$V+qat+ixqtorch,$V+qat" --out "$OUT/bench_run1.json" > "$OUT/bench_run1.log" 2>&1
echo "bench rc=$?"; grep -E "^per-layer|^ +(4|12) " "$OUT/bench_run1.log"
st profile
timeout 80 python3 scripts/profile_step.py --layers 4 --variant kernels+fused+qat --out "$OUT/profile_qat_run1.json" \
  > "$OUT/profile_qat_run1.log" 2>&1; echo "profile rc=$?"; grep -iE "kernels per step|wall" "$OUT/profile_qat_run1.log" | head -5
st done
