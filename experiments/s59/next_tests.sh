#!/usr/bin/env bash
# NOT RUN (written in session 59, which had no device machine): the GPU tests session 59 added, in one call on one
# GPU (the attention extension's build, about 15 s on a fresh machine, then about a minute of tests):
#   bash experiments/s59/next_tests.sh
# Session 59's sampling-inside-the-graph test is test_gpu_e2e.py::test_sampled_generate_graph_matches_eager, which
# experiments/s58/next_tests.sh runs (its graph_new group).
# - test_attn_kernels_gpu.py -k zero_sinkhorn: hc_sinkhorn_iters=0 through the fused finish and the ride against TorchHC
# - test_attn_kernels_gpu.py -k past_the_grid: a 70000-token prompt's hc_pre / hc_post_pre / head_rope in row chunks
# A failing bar is a finding to record (the figure it printed), not a threshold to loosen without one.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS
t0=$(date +%s)
nvidia-smi -L
timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=short -s tests/test_attn_kernels_gpu.py \
  -k "zero_sinkhorn or past_the_grid" > "$OUT/s59_kernels.log" 2>&1
echo "s59_kernels rc=$? at +$(( $(date +%s) - t0 ))s: $(grep -E '[0-9]+ (passed|failed)' "$OUT/s59_kernels.log" | tail -1)"
grep -hE "^FAILED|Error" "$OUT/s59_kernels.log" | head -12
