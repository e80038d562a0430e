#!/usr/bin/env bash
# Session 45, run 1 (one lent H200): the fp8t words' bits permuted for a cheaper decode (fp8p_regs), A/B against the
# stored byte order in a second build (-DDS4_FP8T_PLAIN=1, with DS4_FP8T_PLAIN=1 for ds4.quant in that process).
# Build both; the fp8 GPU tests; SASS op counts of the FP8T GEMV kernels; kbench and the per-layer slope, new then old.
set -u
OUT=${OUT:-/tmp/ds4_out}
export ALT_NVCC_FLAGS=-DDS4_FP8T_PLAIN=1 BENCH_VARIANTS=kernels+fused+graph+cap8192 KBENCH_ARGS=--quick
PYTEST_ARGS="tests/test_kernels_gpu.py tests/test_hc_fold_gpu.py tests/test_gpu_e2e.py" PYTEST_K="fp8" \
  bash scripts/gpu_lease.sh pytest kbench
export PYTHONPATH=/tmp/site:$PWD
for b in .ext_build .ext_build_alt; do
  so=$(ls $b/*/ds4_ext*.so $b/*.so 2>/dev/null | head -n 1)
  echo "--- SASS $b ($so): gemv_mma_kernel<5,...> / moe_gate_up_mma_kernel<5,...>"
  cuobjdump --dump-sass "$so" > /tmp/sass_$b.txt 2>&1
  python3 scripts/sass_ops.py 'gemv_mma_kernelILi5E' < /tmp/sass_$b.txt 2>&1 | head -n 12
done
DS4_FP8T_PLAIN=1 bash scripts/gpu_lease.sh kbench_alt 2>&1 | sed -n '/^--- kbench_alt/,$p'
bash scripts/gpu_lease.sh bench 2>&1 | sed -n '/^--- bench/,$p'
DS4_FP8T_PLAIN=1 bash scripts/gpu_lease.sh bench_alt 2>&1 | sed -n '/^--- bench/,$p'
