#!/usr/bin/env bash
# Session 73, call 1 (one lent GPU): the attention core of a decode row as one launch of thread-block clusters that
# combine through distributed shared memory (+ a tail launch that takes the ride), against the chunk kernel + combine.
#   1. build; the GPU tests of the attention core (test_decode_glue_gpu.py's decode attention rows, the new cluster
#      row included; test_attn_kernels_gpu.py's sparse rows);
#   2. the slope (4 and 12 layers): the default (cluster) and nocl (the two launches), alternating, two passes each;
#   3. scripts/profile_step.py --timeline at 8 layers for the default (6 replays' paths).
# Needs experiments/s73/attn_cluster_combine.diff applied (git apply): its DS4_ATTN_CLUSTER and tokens nocl, cl2-4.
# Logs in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s73/call1.sh   (BUDGET=560 s)
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_ACT_QUANT DS4_ATTN_CLUSTER
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( ${BUDGET:-560} - $(el) )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short -n 4 tests/test_decode_glue_gpu.py \
  -k "decode_attention or xcombine or join_site" > "$OUT/tests.log" 2>&1
echo "tests rc=$? at +$(el)s: $(tail -1 "$OUT/tests.log")"; grep -E "^FAILED|^ERROR|Error" "$OUT/tests.log" | head -12
timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short -n 4 tests/test_attn_kernels_gpu.py -k "sparse" \
  > "$OUT/attn.log" 2>&1
echo "attn rc=$? at +$(el)s: $(tail -1 "$OUT/attn.log")"; grep -E "^FAILED|^ERROR" "$OUT/attn.log" | head -8
B=kernels+fused+graph+cap8192
V=$B,$B+nocl,$B,$B+nocl
timeout 150 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V" --out "$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer" "$OUT/bench.log"
l=$(left); [ $l -gt 100 ] && l=100; [ $l -lt 30 ] && { echo "profile SKIPPED"; exit 0; }
timeout $l python3 scripts/profile_step.py --layers 8 --variant kernels+fused+cap8192 --timeline \
  --timeline-replays 6 --out "$OUT/profile.json" > "$OUT/profile.log" 2>&1
echo "profile rc=$? at +$(el)s"; grep -A10 "^layer " "$OUT/profile.log" | head -10
echo "total $(el)s"
