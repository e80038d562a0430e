#!/usr/bin/env bash
# Session 75, call 2 (one lent GPU).
#   H200: issue #7's seed-phase sweep (experiments/s71/call.sh's H200 branch), nothing else.
#   H100: the router's top-k letting the routed gate+up launch only once it has written the ids
#   (DS4_ROUTER_TRIGGER=late, bench token rlate), and the routed gate+up on part of a resident wave (rw85 / rw70: the
#   shared expert's gate+up, launched at the same moment, holds about half the SM slots; with the whole wave the
#   routed launch's last blocks start only as those leave). 1. build; 2. graph = eager over 1000 steps (tiny) with
#   the late trigger; 3. the slope: defaults, rlate, rw85, rw70, three passes in one process; 4. rlate's timeline.
# Logs in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s75/call2.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
nvidia-smi -L; date -u
if nvidia-smi -L | grep -q H200; then BUDGET=560 exec bash experiments/s71/call.sh; fi
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_ACT_QUANT DS4_L2_PREFETCH DS4_COMBINE_TRIGGER DS4_HC_TRIGGER \
  DS4_ROUTER_TRIGGER DS4_ROUTED_WAVE
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
G=tests/test_gpu_e2e.py::test_cuda_graph_matches_eager_1000_steps
timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short "$G[fused-router_trigger_late]" > "$OUT/graph.log" 2>&1
echo "graph = eager rc=$? at +$(el)s: $(tail -1 "$OUT/graph.log")"; grep -E "FAILED|ERROR" "$OUT/graph.log" | head
B=kernels+fused+graph+cap8192
V=$B,$B+rlate,$B+rw85,$B+rw70,$B,$B+rlate,$B+rw85,$B+rw70,$B,$B+rlate,$B+rw85,$B+rw70
timeout 200 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V" --out "$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer" "$OUT/bench.log"
DS4_ROUTER_TRIGGER=late timeout 60 python3 scripts/profile_step.py --layers 8 --variant kernels+fused+cap8192 \
  --timeline --timeline-replays 6 --out "$OUT/profile_rlate.json" > "$OUT/profile_rlate.log" 2>&1
echo "profile rc=$? at +$(el)s"; sed -n 4,12p "$OUT/profile_rlate.log"
echo "total $(el)s"
