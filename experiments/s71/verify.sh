#!/usr/bin/env bash
# Session 71, call 5 (one lent GPU): with DS4_ACT_QUANT=staged the default, numerics=qat's GPU tests (the module, and the
# end-to-end qat rows against the reference on `small`), then the slope of qat by default, with aqlaunch and with
# aqstaged named, and plain, two passes each in one process.
# Usage: OUT=$OUT bash experiments/s71/verify.sh   (carry build/site; BUDGET=540 s)
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_ACT_QUANT
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( ${BUDGET:-540} - $(el) )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
B=kernels+fused+graph+cap8192
V=$B+qat,$B+qat+aqlaunch,$B+qat+aqstaged,$B,$B+qat,$B+qat+aqlaunch,$B+qat+aqstaged,$B
timeout 120 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V" --out "$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer" "$OUT/bench.log"
l=$(left); [ $l -gt 120 ] && l=120
timeout $l python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_qat_cuda_gpu.py > "$OUT/qat_cuda.log" 2>&1
echo "qat_cuda rc=$? at +$(el)s: $(tail -1 "$OUT/qat_cuda.log")"; grep -E "^FAILED|^ERROR" "$OUT/qat_cuda.log" | head -8
l=$(left); [ $l -lt 30 ] && { echo "e2e SKIPPED"; exit 0; }
timeout $l python3 -m pytest -v -p no:cacheprovider --tb=short tests/test_gpu_e2e.py -k "qat_options" \
  > "$OUT/qat_e2e.log" 2>&1
echo "qat_e2e rc=$? at +$(el)s: $(tail -1 "$OUT/qat_e2e.log")"; grep -E "PASSED|FAILED|ERROR" "$OUT/qat_e2e.log" | head -8
echo "total $(el)s"
