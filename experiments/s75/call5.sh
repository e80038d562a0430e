#!/usr/bin/env bash
# Session 75, call 5 (one lent GPU): the shared expert's branch forked by programmatic edges (DS4_PFORK=shared, bench
# token pfsh), its gate+up (one expert, no routing) loading its first weight rounds before its PDL wait, so they
# overlap the FFN site's hc finish and the router's top-k (why: call 1's timeline has the shared down, starved beside
# the routed gate+up, ending 1.5-4.3 us after it, on the critical path).
#   1. build; 2. GPU tests: graph = eager over 1000 steps (tiny: the fork with DS4_MMA=all, the defaults, the hc fold
#   row) and the shared-expert kernel tests; 3. the slope: defaults and pfsh, three passes in one process;
#   4. pfsh's 8-layer timeline.
# NOT RUN in session 75: no machine could be started for it before the device budget ran out. It needs the tree with
# experiments/s75/shared_programmatic_fork.diff applied (git apply; the diff applies to the commit after 16267b5).
# Logs in $OUT. Usage (carry build/site): BUDGET=200 OUT=$OUT bash experiments/s75/call5.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_ACT_QUANT DS4_L2_PREFETCH DS4_COMBINE_TRIGGER DS4_HC_TRIGGER \
  DS4_ROUTER_TRIGGER DS4_PFORK DS4_PJOIN DS4_MMA
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
G=tests/test_gpu_e2e.py::test_cuda_graph_matches_eager_1000_steps
timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short "$G[fused-programmatic_fork_shared]" "$G[fused]" \
  "$G[fused-hc_fold]" > "$OUT/tests.log" 2>&1
echo "graph = eager rc=$? at +$(el)s: $(tail -1 "$OUT/tests.log")"; grep -E "FAILED|ERROR" "$OUT/tests.log" | head
timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_kernels_gpu.py tests/test_capture_join_gpu.py \
  -k "shared_expert or programmatic" > "$OUT/tests_kernels.log" 2>&1
echo "kernel tests rc=$? at +$(el)s: $(tail -1 "$OUT/tests_kernels.log")"
grep -E "FAILED|ERROR" "$OUT/tests_kernels.log" | head
B=kernels+fused+graph+cap8192
V=$B,$B+pfsh,$B,$B+pfsh,$B,$B+pfsh
timeout 120 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V" --out "$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer" "$OUT/bench.log"
grep -o '"programmatic_forks": [0-9]*' "$OUT/bench.json" | sort | uniq -c
[ $(el) -gt ${BUDGET:-280} ] && { echo "profile SKIPPED"; echo "total $(el)s"; exit 0; }
DS4_PFORK=shared timeout 45 python3 scripts/profile_step.py --layers 8 --variant kernels+fused+cap8192 \
  --timeline --timeline-replays 6 --out "$OUT/profile_pfsh.json" > "$OUT/profile_pfsh.log" 2>&1
echo "profile rc=$? at +$(el)s"; sed -n 4,12p "$OUT/profile_pfsh.log"
echo "total $(el)s"
