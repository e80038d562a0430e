#!/usr/bin/env bash
# Session 74, call 4 (one lent GPU): the attention combine lets the next launch (the grouped wo_a GEMV) launch at its
# start, before its own PDL wait (DS4_COMBINE_TRIGGER=early, bench token ctrig). Why: wo_a's blocks load their first
# weight rounds before their wait, and session 73 measured that window worth 3.4 us of wo_a + wo_b; today it is the
# combine's run (3-5 us), with the early trigger also the chunk kernel's (7.5-9.5 us). Not tried per kernel before
# (s26's early trigger was every kernel's).
#   1. build; 2. GPU tests (graph = eager over 1000 tiny steps, plain and early); 3. the slope: the defaults and
#   ctrig, three passes each in one process; 4. the ctrig timeline.
# Logs in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s74/call4.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_ACT_QUANT DS4_L2_PREFETCH DS4_COMBINE_TRIGGER
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
G=tests/test_gpu_e2e.py::test_cuda_graph_matches_eager_1000_steps
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short "$G[fused]" "$G[fused-combine_trigger_early]" \
  > "$OUT/tests.log" 2>&1
echo "tests rc=$? at +$(el)s: $(tail -1 "$OUT/tests.log")"; grep -E "FAILED|ERROR" "$OUT/tests.log" | head
B=kernels+fused+graph+cap8192
V=$B,$B+ctrig,$B,$B+ctrig,$B,$B+ctrig
timeout 170 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V" --out "$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer" "$OUT/bench.log"
DS4_COMBINE_TRIGGER=early timeout 90 python3 scripts/profile_step.py --layers 8 --variant kernels+fused+cap8192 \
  --timeline --timeline-replays 6 --out "$OUT/profile_ctrig.json" > "$OUT/profile_ctrig.log" 2>&1
echo "profile rc=$? at +$(el)s"; sed -n 4,20p "$OUT/profile_ctrig.log"
echo "total $(el)s"
