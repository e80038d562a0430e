#!/usr/bin/env bash
# Session 72, call 5 (one lent GPU): the review's refactor of the power-of-two scale (ds4::Pow2Scale,
# act_quant_value shared by numerics=qat's activation simulation and the attention entries' FP8 simulation; the same
# arithmetic) against the GPU tests that compare those simulations with their torch twins bit for bit.
# Usage: OUT=$OUT bash experiments/s72/call5.sh   (carry build/site; BUDGET=330 s)
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_ACT_QUANT
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( ${BUDGET:-330} - $(el) )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
l=$(left); [ $l -lt 20 ] && { echo "tests SKIPPED"; exit 1; }
timeout $l python3 -m pytest -q -p no:cacheprovider --tb=short -n 4 tests/test_qat_cuda_gpu.py \
  tests/test_decode_glue_gpu.py tests/test_attn_kernels_gpu.py > "$OUT/tests.log" 2>&1
echo "tests rc=$? at +$(el)s: $(tail -1 "$OUT/tests.log")"; grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -8
echo "total $(el)s"
