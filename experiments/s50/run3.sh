#!/usr/bin/env bash
# Session 50, run 3 (one lent H200): every GPU test module on the final tree (no GPU code changed since session 49's
# 055ee9c; this run is the fresh evidence for issue #4's closing note): the kernel, attention, decode-glue, hc-fold,
# one-launch FFN, capture-join, prefetch and one-GPU all-reduce modules, then the end-to-end module (its tp=2 tests
# skip on one GPU). Each stage gets the call's remaining time.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
t0=$(date +%s); st() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
left() { echo $(( 585 - ($(date +%s) - t0) )); }
st build; python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$?"; tail -n 1 "$OUT/build.log"
st kernels
timeout $(( $(left) - 200 )) python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/test_kernels_gpu.py \
  tests/test_attn_kernels_gpu.py tests/test_decode_glue_gpu.py tests/test_hc_fold_gpu.py tests/test_moe_ffn_gpu.py \
  tests/test_capture_join_gpu.py tests/test_prefetch.py tests/test_allreduce_1gpu.py > "$OUT/tests_kernels_run3.log" 2>&1
echo "kernel modules rc=$?"; tail -n 1 "$OUT/tests_kernels_run3.log"
st e2e
timeout $(left) python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short -rs tests/test_gpu_e2e.py \
  > "$OUT/tests_e2e_run3.log" 2>&1
echo "e2e rc=$?"; tail -n 1 "$OUT/tests_e2e_run3.log"
st done
grep -E "^FAILED|^ERROR" "$OUT/tests_kernels_run3.log" "$OUT/tests_e2e_run3.log" | head -20
grep -c "SKIPPED" "$OUT/tests_e2e_run3.log"
