#!/usr/bin/env bash
# NOT RUN (written in session 54, which had no device machine): the A/B of the MoE down kernels in 16-warp blocks, an
# alt build (-DDS4_DOWN_WARPS=16; csrc/moe_mma.cu). V4's 256 down tiles are one block each, about 2 blocks of 8 warps
# per SM; 16-warp blocks at 64 registers (depth 2, the rule's; ptxas here: the down instances with the hc fold spill
# about 100 bytes, all in the fold's epilogue after the MMA loop, the others nothing) give each tile twice the warps.
# One H200, one call (the two builds compile side by side): the MoE, fold, qat-staging and one-launch-FFN kernel tests
# on the alt build (against the torch reference within TOL, and the kernels' own bit-for-bit pairs), the kernels alone
# (routed down, shared down) in both builds, then the slope in both builds (two passes each). Make 16 the default of
# DS4_DOWN_WARPS only if the slope gains beyond the passes' spread; else record it in TRIED.md with the diff.
set -u
ALT_NVCC_FLAGS=-DDS4_DOWN_WARPS=16 \
PYTEST_ARGS="tests/test_kernels_gpu.py tests/test_hc_fold_gpu.py tests/test_qat_cuda_gpu.py tests/test_moe_ffn_gpu.py" \
PYTEST_K="moe or fold or shared_expert or routed or depth_knobs or spacer" \
KBENCH_ARGS=--quick \
BENCH_VARIANTS=kernels+fused+graph+cap8192,kernels+fused+graph+cap8192 \
  bash scripts/gpu_lease.sh pytest_alt kbench kbench_alt bench bench_alt
