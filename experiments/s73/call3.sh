#!/usr/bin/env bash
# Session 73, call 3 (one lent GPU): why the cluster form of the attention core was slower (calls 1, 2):
#   cl3 = cl2 with each block's shared memory padded to one block per SM (blocks of a cluster packed onto few SMs?);
#   cl4 = the two launches (chunk kernel + combine) with only the chunk kernel's blocks launched in clusters (the cost
#         of cluster scheduling alone).
#   1. build; the decode attention GPU rows (test_decode_glue_gpu.py);
#   2. the slope (4 and 12 layers): cl3, cl4, nocl, cl2, two passes each;
#   3. scripts/profile_step.py --timeline at 8 layers for cl3 and cl4.
# Needs experiments/s73/attn_cluster_combine.diff applied (git apply): its DS4_ATTN_CLUSTER and tokens nocl, cl2-4.
# Logs in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s73/call3.sh   (BUDGET=400 s)
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_ACT_QUANT DS4_ATTN_CLUSTER
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( ${BUDGET:-400} - $(el) )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=short -n 4 tests/test_decode_glue_gpu.py \
  -k "decode_attention" > "$OUT/tests.log" 2>&1
echo "tests rc=$? at +$(el)s: $(tail -1 "$OUT/tests.log")"; grep -E "^FAILED|^ERROR|Error" "$OUT/tests.log" | head -12
B=kernels+fused+graph+cap8192
V=$B+cl3,$B+cl4,$B+nocl,$B+cl2,$B+cl3,$B+cl4,$B+nocl,$B+cl2
timeout 200 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V" --out "$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer" "$OUT/bench.log"
for m in 3 4; do
  l=$(left); [ $l -gt 60 ] && l=60; [ $l -lt 25 ] && { echo "profile $m SKIPPED"; continue; }
  DS4_ATTN_CLUSTER=$m timeout $l python3 scripts/profile_step.py --layers 8 --variant kernels+fused+cap8192 --timeline \
    --timeline-replays 6 --out "$OUT/profile_cl$m.json" > "$OUT/profile_cl$m.log" 2>&1
  echo "profile cl$m rc=$? at +$(el)s"; grep -A10 "^layer " "$OUT/profile_cl$m.log" | head -10
done
echo "total $(el)s"
