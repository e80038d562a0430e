#!/usr/bin/env bash
# Session 73, call 6 (one lent GPU): the grouped wo_a at depth 4 / 8 (DS4_GROUPED_DEPTH, bench tokens gd4 / gd8; the
# per-shape rule says 2). Why: call 1-3's profiles show wo_a + wo_b 3.4 us longer when wo_a's blocks launch only at the
# attention core's end than when they launch while the combine runs, i.e. the rounds they load before their PDL wait
# are worth that window; deeper, more of wo_a lands in it.
#   1. build; 2. the slope (4 and 12 layers): the defaults, gd4, gd8, two passes each in one process.
# Needs experiments/s73/grouped_depth.diff applied (git apply): its DS4_GROUPED_DEPTH and tokens gdN.
# Logs in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s73/call6.sh   (BUDGET=300 s)
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_ACT_QUANT DS4_GROUPED_DEPTH
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
B=kernels+fused+graph+cap8192
V=$B,$B+gd4,$B+gd8,$B,$B+gd4,$B+gd8
timeout 150 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V" --out "$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer" "$OUT/bench.log"
echo "total $(el)s"
