#!/usr/bin/env bash
# Session 46, run 1 (one lent H200): two ablation knobs of the dense tensor-core GEMVs (both off by default).
#   l2aN (DS4_L2_AHEAD=N): each warp requests its next N weight rounds into L2 right after its PDL wait, while the
#        activations are staged (the depth-2 GEMVs otherwise have nothing in flight then);
#   srdN (DS4_SHORT_ROW_DEPTH=N): the dense GEMVs whose per-shape rule says depth 2 (wq_b, wo_a, the indexer's wq_b).
# The new bit-exactness test and the fp8t GEMV tests, then the per-layer slope, two passes each.
set -u
OUT=${OUT:-/tmp/ds4_out}
V=kernels+fused+graph+cap8192
export PYTEST_ARGS="tests/test_kernels_gpu.py" PYTEST_K="fp8t or prefetch_split"
export BENCH_VARIANTS=$V,$V+l2a3,$V+srd4,$V,$V+l2a3,$V+srd4
bash scripts/gpu_lease.sh pytest,bench 2>&1 | sed -n '/^--- /,$p'
