#!/usr/bin/env bash
# Session 56, run 1 (one lent H200): the GPU code sessions 53-55 wrote and never ran, in one call.
# 1) experiments/s54/next_staged.sh: numerics=qat's FP8 activation simulation in the one-row tensor-core kernels'
#    staging (DS4_ACT_QUANT=staged): its bit-for-bit tests, the GEMV / MoE kernel tests, the slope plain / qat /
#    qat+aqstaged, a qat profile with the staging.
# 2) experiments/s55/next_tests.sh: fidelity under runtime=cuda_graph replays the captured step; batch-1 graph = eager;
#    the MoE down kernels in every layout (session 55's MmaStream change for a down with no local slot).
# 3) this session: BF16 dense weights on linear=gemv_cuda take the GEMV launch (kernel + e2e tests).
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
t0=$(date +%s); st() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
nvidia-smi -L; git log --oneline -1 2>/dev/null
st build; python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$?"; tail -3 "$OUT/build.log"
PT="python3 -m pytest -q -p no:cacheprovider --tb=short"
st tests_qat
timeout 150 $PT tests/test_qat_cuda_gpu.py tests/test_decode_glue_gpu.py > "$OUT/tests_qat.log" 2>&1
echo "qat rc=$?"; grep -E "passed|failed|^FAILED|^E " "$OUT/tests_qat.log" | tail -10
st tests_kernels
timeout 150 $PT tests/test_kernels_gpu.py -k "gemv or moe or routed or down or argmax or dequant" \
  > "$OUT/tests_kernels.log" 2>&1; echo "kernels rc=$?"; grep -E "passed|failed|^FAILED" "$OUT/tests_kernels.log" | tail -8
st tests_e2e
timeout 120 $PT tests/test_gpu_e2e.py -k "teacher_forced or batch1_graph or bf16_dense" > "$OUT/tests_e2e.log" 2>&1
echo "e2e rc=$?"; grep -E "passed|failed|^FAILED|^E " "$OUT/tests_e2e.log" | tail -8
V=kernels+fused+graph+cap8192
st bench
timeout 170 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
  --variants "$V,$V+qat,$V+qat+aqstaged,$V,$V+qat+aqstaged" --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; grep -E "^per-layer" "$OUT/bench.log"
st profile
DS4_ACT_QUANT=staged timeout 50 python3 scripts/profile_step.py --layers 4 --variant kernels+fused+qat \
  --out "$OUT/profile_qat_staged.json" > "$OUT/profile_qat_staged.log" 2>&1; echo "profile rc=$?"
grep -iE "kernels per step|wall" "$OUT/profile_qat_staged.log" | head -4
st done
