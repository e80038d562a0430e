#!/usr/bin/env bash
# Session 52, run 5 (one lent H200): numerics=qat's FP8 activation simulation in one launch (csrc/act_quant.cu,
# ds4.ops.qat_cuda) instead of the torch twin's dozen. The new GPU tests (the kernel against the twin bit for bit;
# qat decode on every fused kernel: the twin's logits, graph = eager), the layer-level tests, the end-to-end
# options tests; then the slope: plain, qat (kernel), qat with the twin (aqtorch).
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
t0=$(date +%s); st() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
st build; python3 scripts/build_ext.py -q > /tmp/build.log 2>&1; echo "build rc=$?"; tail -5 /tmp/build.log
st tests
timeout 200 python3 -m pytest -q tests/test_qat_cuda_gpu.py "tests/test_decode_glue_gpu.py::test_long_context_decode_agrees_with_torch" \
  > "$OUT/tests_run5.log" 2>&1; echo "tests rc=$?"; tail -4 "$OUT/tests_run5.log"
timeout 150 python3 -m pytest -q tests/test_gpu_e2e.py -k "options_agree" >> "$OUT/tests_run5.log" 2>&1
echo "e2e rc=$?"; tail -2 "$OUT/tests_run5.log"
V=kernels+fused+graph+cap8192
st bench
timeout 240 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
  --variants "$V,$V+qat,$V+qat+aqtorch,$V,$V+qat" --out "$OUT/bench_run5.json" > "$OUT/bench_run5.log" 2>&1
echo "bench rc=$?"; grep -E "^per-layer|^ +(4|12) " "$OUT/bench_run5.log"
st done
