#!/usr/bin/env bash
# Session 45, run 3 (one lent H200), the final code (fp8t words permuted): the 8-layer stage profile (context 64 and
# position 65536), and the per-layer slope with two depth knobs of the FP8 kernels whose decode got cheaper (lrd4: the
# long-row FP8 GEMVs at depth 4; shd4: the shared expert's gate+up at depth 4), two passes each.
set -u
V=kernels+fused+graph+cap8192
BENCH_VARIANTS=$V,$V+lrd4,$V+shd4,$V,$V+lrd4,$V+shd4 bash scripts/gpu_lease.sh profile,bench 2>&1 | sed -n '/^--- /,$p'
