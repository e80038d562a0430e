#!/usr/bin/env bash
# Session 74, call 7 (one lent GPU): the hc finishes' early trigger as the default too (call 6: 1.5-1.9 us per layer),
# and the router's top-k letting the routed gate+up launch at its start (DS4_ROUTER_TRIGGER=early, bench token rtrig).
#   1. build; 2. GPU tests: graph = eager over 1000 steps (tiny: the defaults, the old hc trigger, the router trigger;
#   small: the defaults); 3. the slope: the defaults, nohtrig, noctrig+nohtrig (the code before this session), rtrig,
#   three passes each in one process; 4. the defaults' 8-layer timeline.
# Logs in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s74/call7.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_ACT_QUANT DS4_L2_PREFETCH DS4_COMBINE_TRIGGER DS4_HC_TRIGGER \
  DS4_ROUTER_TRIGGER
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
G=tests/test_gpu_e2e.py::test_cuda_graph_matches_eager_1000_steps
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short "$G[fused]" "$G[fused-hc_trigger_wait]" \
  "$G[fused-router_trigger_early]" "${G}_on_small[one_graph]" > "$OUT/tests.log" 2>&1
echo "tests rc=$? at +$(el)s: $(tail -1 "$OUT/tests.log")"; grep -E "FAILED|ERROR" "$OUT/tests.log" | head
B=kernels+fused+graph+cap8192
V=$B,$B+nohtrig,$B+noctrig+nohtrig,$B+rtrig,$B,$B+nohtrig,$B+noctrig+nohtrig,$B+rtrig,$B,$B+nohtrig
V=$V,$B+noctrig+nohtrig,$B+rtrig
timeout 240 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V" --out "$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer" "$OUT/bench.log"
timeout 90 python3 scripts/profile_step.py --layers 8 --variant kernels+fused+cap8192 --timeline \
  --timeline-replays 6 --out "$OUT/profile.json" > "$OUT/profile.log" 2>&1
echo "profile rc=$? at +$(el)s"; sed -n 4,20p "$OUT/profile.log"
echo "total $(el)s"
