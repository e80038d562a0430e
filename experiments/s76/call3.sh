#!/usr/bin/env bash
# Session 76, call 3 (one lent GPU), on the tree with the shared expert's programmatic fork as the default.
#   H200: issue #7's seed-phase sweep and the defaults' slope (experiments/s71/call.sh's H200 branch).
#   otherwise: 1. build; 2. graph = eager over 1000 steps (tiny: the defaults, the full-edge fork with the mended
#   fork-count check); 3. the slope: the defaults against the existing knobs whose balance the fork may move: the
#   shared expert on part of a resident wave (shw75), its programmatic join to the routed down (pj) and the routed
#   gate+up on 85 % of a wave (rw85), two passes in one process.
# Logs in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s76/call3.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
nvidia-smi -L; date -u
if nvidia-smi -L | grep -q H200; then BUDGET=560 exec bash experiments/s71/call.sh; fi
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_SHARED_WAVE
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
G=tests/test_gpu_e2e.py::test_cuda_graph_matches_eager_1000_steps
timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short "$G[fused]" "$G[fused-fork_full_edge]" \
  > "$OUT/graph.log" 2>&1
echo "graph = eager rc=$? at +$(el)s: $(tail -1 "$OUT/graph.log")"; grep -E "FAILED|ERROR" "$OUT/graph.log" | head
B=kernels+fused+graph+cap8192
R=$B,$B+shw75,$B+pj,$B+rw85
timeout 100 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$R,$R" \
  --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer" "$OUT/bench.log"
echo "total $(el)s"
