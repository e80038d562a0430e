#!/usr/bin/env bash
# Session 45, run 4 (one lent H200): the attention chunk kernel's and the indexer's mma fragments from shared memory
# by ldmatrix (csrc/attn/attn_common.cuh ldsm_*), A/B against the 32- / 16-bit loads in a second build
# (-DDS4_ATTN_LDS). Build both; the attention / decode-glue GPU tests; bench_attn's attention and indexer rows, new
# then old; the per-layer slope, new then old.
set -u
OUT=${OUT:-/tmp/ds4_out}
V=kernels+fused+graph+cap8192
export ALT_NVCC_FLAGS=-DDS4_ATTN_LDS BENCH_VARIANTS=$V
PYTEST_ARGS="tests/test_attn_kernels_gpu.py tests/test_decode_glue_gpu.py" bash scripts/gpu_lease.sh pytest 2>&1 | \
  sed -n '/^--- /,$p' | tail -n 8
export PYTHONPATH=/tmp/site:$PWD
ALT=(DS4_NVCC_FLAGS=-DDS4_ATTN_LDS DS4_EXT_BUILD_DIR=$PWD/.ext_build_alt DS4_ATTN_EXT_BUILD_DIR=$PWD/.ext_build_alt/attn)
for pass in 1 2; do
  for t in new old; do
    for only in attn indexer; do
      log="$OUT/bench_attn_${t}_$only.log"
      if [ $t = new ]; then timeout 90 python3 scripts/bench_attn.py --only $only --no-ref >> "$log" 2>&1
      else env "${ALT[@]}" timeout 90 python3 scripts/bench_attn.py --only $only --no-ref >> "$log" 2>&1; fi
      echo "== pass $pass $t $only rc=$?"; sed -n '/^op /,$p' "$log" | tail -n +2 | tail -n 6
    done
  done
done
bash scripts/gpu_lease.sh bench 2>&1 | sed -n '/^--- bench/,$p' | tail -n 4
bash scripts/gpu_lease.sh bench_alt 2>&1 | sed -n '/^--- bench/,$p' | tail -n 4
