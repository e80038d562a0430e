#!/usr/bin/env bash
# Session 45, run 2 (one lent H200): the fp8t bit layout again, the whole check. Build both (the alt build is the
# stored byte order, -DDS4_FP8T_PLAIN=1 with DS4_FP8T_PLAIN=1 for ds4.quant in its process); every GPU kernel test
# module; the per-layer slope, two passes new, two passes old; the end-to-end tests that run fp8t in the model.
set -u
OUT=${OUT:-/tmp/ds4_out}
V=kernels+fused+graph+cap8192
export ALT_NVCC_FLAGS=-DDS4_FP8T_PLAIN=1 BENCH_VARIANTS=$V,$V
bash scripts/gpu_lease.sh kernel_tests,bench 2>&1 | sed -n '/^--- /,$p'
DS4_FP8T_PLAIN=1 bash scripts/gpu_lease.sh bench_alt 2>&1 | sed -n '/^--- bench/,$p'
export PYTHONPATH=/tmp/site:$PWD
PYTHONUNBUFFERED=1 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/test_gpu_e2e.py \
  -k "batch1_graph or fp8t or (agree_with_reference and gemv_cuda and fused_cuda and not DS4)" > "$OUT/e2e.log" 2>&1
echo "e2e rc=$?"; tail -n 5 "$OUT/e2e.log"
