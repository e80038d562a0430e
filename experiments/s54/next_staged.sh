#!/usr/bin/env bash
# NOT RUN (written in session 54, which had no device machine): the planned first run of the next session with one lent
# H200. numerics=qat's FP8 activation simulation inside the one-row tensor-core kernels' activation staging
# (DS4_ACT_QUANT=staged: wq_a + wkv, q_norm + wq_b, wo_b with its hc fold, the MoE gate+up / down; act_quant=True),
# as fixed in session 54 (a staged launch takes its plain twin's wave and only the plain launch's depth; q_up's row skip
# after the whole staged GEMV). GPU tests (staged = launch bit for bit; the qat logits and graph tests; the plain
# GEMV / MoE kernel tests, whose instances share the launchers), then the slope: plain, qat (the launch), qat with the
# staging (aqstaged); a qat profile with the staging. If the tests pass and aqstaged is not slower, make "staged" the
# default of DS4_ACT_QUANT (ds4/ops/qat_cuda.py) and keep "kernel" as the ablation.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
t0=$(date +%s); st() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
st build; python3 scripts/build_ext.py -q > /tmp/build.log 2>&1; echo "build rc=$?"; tail -5 /tmp/build.log
st tests
timeout 200 python3 -m pytest -q tests/test_qat_cuda_gpu.py tests/test_decode_glue_gpu.py \
  > "$OUT/tests.log" 2>&1; echo "tests rc=$?"; grep -E "passed|failed|Error|assert" "$OUT/tests.log" | tail -12
timeout 120 python3 -m pytest -q tests/test_kernels_gpu.py -k "gemv or moe_fp4t or moe_one_token or argmax or dequant" \
  > "$OUT/tests_kernels.log" 2>&1; echo "kernels rc=$?"; tail -1 "$OUT/tests_kernels.log"
V=kernels+fused+graph+cap8192
st bench
timeout 200 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
  --variants "$V,$V+qat,$V+qat+aqstaged,$V,$V+qat+aqstaged" --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; grep -E "^per-layer" "$OUT/bench.log"
st profile
DS4_ACT_QUANT=staged timeout 60 python3 scripts/profile_step.py --layers 4 --variant kernels+fused+qat \
  --out "$OUT/profile_qat_staged.json" > "$OUT/profile_qat_staged.log" 2>&1; echo "profile rc=$?"
sed -n 3,16p "$OUT/profile_qat_staged.log"
st done
