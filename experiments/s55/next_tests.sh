#!/usr/bin/env bash
# NOT RUN (written in session 55, which had no device machine): the GPU tests of the code session 55 changed, for a
# second call after experiments/s54/next_staged.sh (which builds the extensions and runs the one-token MoE kernel
# tests, test_moe_one_token_kernels's none_local case among them: a down launch with no local slot, whose stream
# setup session 55 changed in csrc/mma_dot.cuh). Here: fidelity under runtime=cuda_graph now replays the captured
# step (Generator.teacher_forced_logits), against eager decode; the batch-1 graph = eager test beside it; the MoE
# down kernels' tests in every layout (the same MmaStream change).
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
t0=$(date +%s); st() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
st build; python3 scripts/build_ext.py -q > /tmp/build.log 2>&1; echo "build rc=$?"; tail -3 /tmp/build.log
st e2e
timeout 240 python3 -m pytest -q tests/test_gpu_e2e.py -k "teacher_forced or batch1_graph" \
  > "$OUT/tests_e2e.log" 2>&1; echo "e2e rc=$?"; grep -E "passed|failed|Error|assert" "$OUT/tests_e2e.log" | tail -8
st kernels
timeout 240 python3 -m pytest -q tests/test_kernels_gpu.py -k "moe_routed_fp4 or moe_fp4t or routed_fp8t or down" \
  > "$OUT/tests_moe.log" 2>&1; echo "moe rc=$?"; tail -1 "$OUT/tests_moe.log"
st done
