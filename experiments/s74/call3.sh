#!/usr/bin/env bash
# Session 74, call 3 (one lent GPU): the compressors' branches forked by programmatic edges (DS4_PFORK=1, bench token
# pfork): their projections launch at the hc finish's trigger, beside wq_a + wkv, before wq_b's blocks fill the SMs.
# Why: in the 8-layer timelines (s73 call 3) the HCA layers' projection wins the race for the SMs and runs before
# wq_b, the CSA layers' loses it and runs after (9.4 us of projection, then 4.3 of compressor step on the path).
#   1. build; 2. GPU tests (graph = eager over 1000 tiny steps, plain and forked); 3. the slope (4 and 12 layers):
#   the defaults and pfork, three passes each in one process; 4. the pfork timeline.
# Logs in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s74/call3.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_ACT_QUANT DS4_L2_PREFETCH DS4_PFORK
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
G=tests/test_gpu_e2e.py::test_cuda_graph_matches_eager_1000_steps
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short "$G[fused]" "$G[fused-programmatic_fork]" \
  "$G[fused-programmatic_join]" > "$OUT/tests.log" 2>&1
echo "tests rc=$? at +$(el)s: $(tail -1 "$OUT/tests.log")"; grep -E "FAILED|ERROR" "$OUT/tests.log" | head
B=kernels+fused+graph+cap8192
V=$B,$B+pfork,$B,$B+pfork,$B,$B+pfork
timeout 170 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V" --out "$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer" "$OUT/bench.log"
python3 -c "import json; print([(r['variant'], r['n_layers'], r.get('programmatic_forks')) for r in json.load(open('$OUT/bench.json'))['rows']][:4])" 2>&1 | tail -1
DS4_PFORK=1 timeout 90 python3 scripts/profile_step.py --layers 8 --variant kernels+fused+cap8192 \
  --timeline --timeline-replays 6 --out "$OUT/profile_pfork.json" > "$OUT/profile_pfork.log" 2>&1
echo "profile rc=$? at +$(el)s"; sed -n 4,20p "$OUT/profile_pfork.log"
echo "total $(el)s"
