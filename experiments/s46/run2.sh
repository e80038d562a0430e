#!/usr/bin/env bash
# Session 46, run 2 (one lent H200): run 1's knobs reverted (the default GPU code again). The compressor projection
# deferred for the HCA layers alone (deferh8: their ratio-128 compressor projects 8 tokens at once on every 8th step;
# the CSA layers keep their per-token step), against the default and defer8 (CSA 4, HCA 8), two passes each, median
# and mean; the deferred step's GPU test with n = 8 first.
set -u
V=kernels+fused+graph+cap8192
export PYTEST_ARGS="tests/test_decode_glue_gpu.py" PYTEST_K="compress_deferred"
export BENCH_VARIANTS=$V,$V+deferh8,$V+defer8,$V,$V+deferh8,$V+defer8
bash scripts/gpu_lease.sh pytest,bench 2>&1 | sed -n '/^--- /,$p'
