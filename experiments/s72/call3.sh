#!/usr/bin/env bash
# Session 72, call 3 (one lent GPU): numerics=qat without the CSA layers' torch glue (call 2) and with its staged
# simulation taking two vectors per trip; A/B on one machine against a copy of the tree with
# experiments/s72/qat_glue.diff reversed (session 71's final code), built in /tmp/old while this tree's GPU tests run.
# Slope of plain and qat, two passes each, in both trees (new, old, new).
# Usage: OUT=$OUT bash experiments/s72/call3.sh   (carry build/site; BUDGET=560 s)
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_ACT_QUANT
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( ${BUDGET:-560} - $(el) )); }
nvidia-smi -L; date -u
NEW=$PWD
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
rm -rf /tmp/old && mkdir /tmp/old && tar --exclude=./.ext_build --exclude=./.git -cf - . | tar -xf - -C /tmp/old
(cd /tmp/old && patch -s -R -p1 < experiments/s72/qat_glue.diff && PYTHONPATH=/tmp/old/build/site:/tmp/old \
  python3 scripts/build_ext.py -q > "$OUT/build_old.log" 2>&1; echo "old build rc=$? at +$(el)s") &
BPID=$!
timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_qat_cuda_gpu.py tests/test_decode_glue_gpu.py \
  > "$OUT/tests.log" 2>&1
echo "tests rc=$? at +$(el)s: $(tail -1 "$OUT/tests.log")"; grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -8
wait $BPID
B=kernels+fused+graph+cap8192
V=$B,$B+qat,$B,$B+qat
bench() {  # tree, out name
  local l=$(left); [ $l -lt 40 ] && { echo "bench $2 SKIPPED (${l}s left)"; return; }
  [ $l -gt 120 ] && l=120
  (cd $1 && PYTHONPATH=$1/build/site:$1 timeout $l python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
    --variants "$V" --out "$OUT/$2.json" > "$OUT/$2.log" 2>&1)
  echo "bench $2 rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer" "$OUT/$2.log"
}
bench $NEW bench_new
bench /tmp/old bench_old
bench $NEW bench_new2
echo "total $(el)s"
