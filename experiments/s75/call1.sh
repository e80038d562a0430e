#!/usr/bin/env bash
# Session 75, call 1 (one lent GPU): GPU tests of fe0df59 (session 74's review mend moved the three early-trigger forms
# onto one helper pair in csrc/pdl.cuh; it compiled but never ran on a GPU), then the slope.
#   H200: issue #7's seed-phase sweep first (experiments/s71/call.sh's H200 branch), nothing else.
#   H100: 1. build; 2. test_attn_kernels_gpu.py + test_decode_glue_gpu.py; 3. graph = eager over 1000 steps (tiny:
#   the defaults, each old trigger order, the router's opt-in; small: one graph); 4. e2e subset; 5. the slope, the
#   defaults against noctrig+nohtrig and pja+early (the opt-in programmatic join of the attention branches, s62),
#   two passes; 6. the defaults' 8-layer timeline.
# Logs in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s75/call1.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
nvidia-smi -L; date -u
if nvidia-smi -L | grep -q H200; then BUDGET=560 exec bash experiments/s71/call.sh; fi
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_ACT_QUANT DS4_L2_PREFETCH DS4_COMBINE_TRIGGER DS4_HC_TRIGGER \
  DS4_ROUTER_TRIGGER
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( ${BUDGET:-560} - $(el) )); }
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
timeout 110 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_attn_kernels_gpu.py \
  tests/test_decode_glue_gpu.py > "$OUT/units.log" 2>&1
echo "attention + glue rc=$? at +$(el)s: $(tail -1 "$OUT/units.log")"; grep -E "FAILED|ERROR" "$OUT/units.log" | head
G=tests/test_gpu_e2e.py::test_cuda_graph_matches_eager_1000_steps
timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short "$G[fused]" "$G[fused-combine_trigger_wait]" \
  "$G[fused-hc_trigger_wait]" "$G[fused-router_trigger_early]" "${G}_on_small[one_graph]" > "$OUT/graph.log" 2>&1
echo "graph = eager rc=$? at +$(el)s: $(tail -1 "$OUT/graph.log")"; grep -E "FAILED|ERROR" "$OUT/graph.log" | head
B=kernels+fused+graph+cap8192
V=$B,$B+noctrig+nohtrig,$B+pja+early,$B,$B+noctrig+nohtrig,$B+pja+early
timeout 150 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V" --out "$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer" "$OUT/bench.log"
timeout 90 python3 scripts/profile_step.py --layers 8 --variant kernels+fused+cap8192 --timeline \
  --timeline-replays 6 --out "$OUT/profile.json" > "$OUT/profile.log" 2>&1
echo "profile rc=$? at +$(el)s"
l=$(left); [ $l -lt 30 ] && { echo "e2e SKIPPED"; echo "total $(el)s"; exit 0; }
timeout $l python3 -m pytest -v -p no:cacheprovider --tb=short tests/test_gpu_e2e.py \
  -k "all_fused_agree or sinkhorn_ride or batch1_graph or teacher_forced or graph_pool" > "$OUT/e2e.log" 2>&1
echo "e2e rc=$? at +$(el)s: $(tail -1 "$OUT/e2e.log")"; grep -cE "PASSED" "$OUT/e2e.log"
grep -E "FAILED|ERROR" "$OUT/e2e.log" | head
echo "total $(el)s"
