#!/usr/bin/env bash
# Session 72, call 2 (one lent GPU): numerics=qat's CSA layers without the torch glue on their critical path — the
# merged wq_b + indexer wq_b's RowSkip inside the staged GEMV, the indexer's bf16 scores written as fp32 for the top-k.
#   1. build; the GPU tests of the changed paths (test_qat_cuda_gpu.py, test_decode_glue_gpu.py) and qat's end-to-end
#      rows against the reference on `small`;
#   2. the slope (4 and 12 layers): qat, qat+aqlaunch, plain, two passes each in one process;
#   3. scripts/profile_step.py --timeline at 8 layers for qat (6 replays' paths).
# Logs in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s72/call2.sh   (BUDGET=560 s)
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_ACT_QUANT
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( ${BUDGET:-560} - $(el) )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short -n 4 tests/test_qat_cuda_gpu.py \
  tests/test_decode_glue_gpu.py > "$OUT/tests.log" 2>&1
echo "tests rc=$? at +$(el)s: $(tail -1 "$OUT/tests.log")"; grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -8
B=kernels+fused+graph+cap8192
V=$B+qat,$B+qat+aqlaunch,$B,$B+qat,$B+qat+aqlaunch,$B
timeout 120 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V" --out "$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer" "$OUT/bench.log"
l=$(left); [ $l -gt 100 ] && l=100
timeout $l python3 scripts/profile_step.py --layers 8 --variant kernels+fused+cap8192+qat --timeline \
  --timeline-replays 6 --out "$OUT/profile_qat.json" > "$OUT/profile_qat.log" 2>&1
echo "profile qat rc=$? at +$(el)s"; grep -A10 "^layer " "$OUT/profile_qat.log" | head -10
l=$(left); [ $l -lt 40 ] && { echo "e2e SKIPPED"; exit 0; }
timeout $l python3 -m pytest -v -p no:cacheprovider --tb=short tests/test_gpu_e2e.py -k "qat_options" \
  > "$OUT/qat_e2e.log" 2>&1
echo "qat_e2e rc=$? at +$(el)s: $(tail -1 "$OUT/qat_e2e.log")"; grep -E "PASSED|FAILED|ERROR" "$OUT/qat_e2e.log" | head -8
echo "total $(el)s"
