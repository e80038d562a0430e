#!/usr/bin/env bash
# Session 56, run 2 (one lent H200; NOT RUN: the call that carried it returned nothing (likeliest: a build lock), see
# experiments/decode_session56_h200.md). A call re-sends the tree, apparently with new file times, so plan for both
# builds compiling again (about 2 minutes side by side); plan about 8 device minutes.
# experiments/s54/next_down16.sh trimmed to one call: the MoE down kernels in 16-warp blocks (alt build
# -DDS4_DOWN_WARPS=16, csrc/moe_mma.cu): the MoE / fold / one-launch-FFN kernel tests on the alt build, then the
# slope in both builds (two passes each). 16 becomes the default only if the slope gains beyond the passes' spread.
set -u
V=kernels+fused+graph+cap8192
ALT_NVCC_FLAGS=-DDS4_DOWN_WARPS=16 \
PYTEST_ARGS="tests/test_kernels_gpu.py tests/test_hc_fold_gpu.py tests/test_moe_ffn_gpu.py" \
PYTEST_K="moe or fold or shared_expert or routed or spacer" \
BENCH_VARIANTS=$V,$V \
  bash scripts/gpu_lease.sh pytest_alt bench bench_alt
