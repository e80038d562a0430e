#!/usr/bin/env bash
# Session 49, run 6 (one lent H200): the depth-4 tensor-core kernels (the routed gate+up) at 4 blocks per SM instead of
# 3 (alt build -DDS4_DEPTH4_BLOCKS=4: launch bounds of 64 registers, where the default's 85 allow 80; ptxas spills 192
# bytes in the fp4t gate+up). Run 3's counters showed the gate+up latency-bound at 34 % occupancy, register-limited.
# The slope in each build (two passes), the alt build's routed-MoE GPU tests, then the kernels alone in each build.
# Its code is 7cde017 with experiments/s49_attempts/depth4_four_blocks.diff applied (reverted after).
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
V=kernels+fused+graph+cap8192
export ALT_NVCC_FLAGS=-DDS4_DEPTH4_BLOCKS=4 BENCH_VARIANTS=$V,$V KBENCH_ARGS=--quick
bash scripts/gpu_lease.sh bench,bench_alt 2>&1 | sed -n '/^--- /,$p'
export PYTHONPATH=$PWD
env DS4_NVCC_FLAGS=$ALT_NVCC_FLAGS DS4_EXT_BUILD_DIR=$PWD/.ext_build_alt DS4_ATTN_EXT_BUILD_DIR=$PWD/.ext_build_alt/attn \
  timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/test_kernels_gpu.py -k "moe" \
  > "$OUT/pytest_alt.log" 2>&1; echo "alt pytest rc=$?"; tail -n 2 "$OUT/pytest_alt.log"
bash scripts/gpu_lease.sh kbench,kbench_alt 2>&1 | sed -n '/^--- /,$p' | grep -E "^---|moe fp4 (gate|down|routed)|shared expert fp8t|copy bandwidth"
