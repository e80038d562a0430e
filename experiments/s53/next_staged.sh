#!/usr/bin/env bash
# NOT RUN: session 53's planned run 2 (one lent H200), which got no machine (the device stopped answering, then none was
# lent). For the next session: numerics=qat's FP8 activation simulation inside the one-row tensor-core GEMVs'
# activation staging (DS4_ACT_QUANT=staged: wq_a + wkv, q_norm + wq_b, wo_b with its hc fold, the MoE kernels; act_quant=True). GPU tests
# (staged = launch = twin bit for bit; the qat logits and graph tests; the q_up and GEMV kernel tests), then the slope:
# plain, qat (the launch), qat with the staging (aqstaged); a qat profile with the staging.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
t0=$(date +%s); st() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
st build; python3 scripts/build_ext.py -q > /tmp/build.log 2>&1; echo "build rc=$?"; tail -5 /tmp/build.log
st tests
timeout 200 python3 -m pytest -q tests/test_qat_cuda_gpu.py tests/test_decode_glue_gpu.py \
  > "$OUT/tests_run2.log" 2>&1; echo "tests rc=$?"; grep -E "passed|failed|Error|assert" "$OUT/tests_run2.log" | tail -12
timeout 60 python3 -m pytest -q tests/test_kernels_gpu.py -k "gemv or argmax or dequant" >> "$OUT/tests_run2.log" 2>&1
echo "kernels rc=$?"; tail -1 "$OUT/tests_run2.log"
V=kernels+fused+graph+cap8192
st bench
timeout 200 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
  --variants "$V,$V+qat,$V+qat+aqstaged,$V,$V+qat+aqstaged" --out "$OUT/bench_run2.json" > "$OUT/bench_run2.log" 2>&1
echo "bench rc=$?"; grep -E "^per-layer" "$OUT/bench_run2.log"
st profile
DS4_ACT_QUANT=staged timeout 60 python3 scripts/profile_step.py --layers 4 --variant kernels+fused+qat --out "$OUT/profile_qat_run2.json" \
  > "$OUT/profile_qat_run2.log" 2>&1; echo "profile rc=$?"; sed -n 3,16p "$OUT/profile_qat_run2.log"
st done
