#!/usr/bin/env bash
# Session 76, call 2 (one lent GPU): GPU tests of the shared expert's programmatic fork as the default (DS4_PFORK
# unset = shared) and of the constants loaded before the PDL wait (DS4_CONSTS_FIRST unset: the router top-k's
# bias, the attention combine's sink and RoPE frequencies), then the slope against their old forms (nopfsh, nocf,
# cfrouter).
#   1. build; 2. graph = eager over 1000 steps (tiny: the defaults, the full-edge fork, the fork with DS4_MMA=all, the
#   hc fold, the constants after the wait; small: one graph); 3. the capture-level fork / join tests, the
#   shared-expert, router and sparse-attention kernel tests; 4. the slope: defaults, nopfsh, nocf, cfrouter, three
#   passes in one process; 5. the defaults' 8-layer timeline; 6. the e2e subset.
# Logs in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s76/call2.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_ACT_QUANT DS4_L2_PREFETCH DS4_COMBINE_TRIGGER DS4_HC_TRIGGER \
  DS4_ROUTER_TRIGGER DS4_PFORK DS4_PJOIN DS4_MMA DS4_SINKHORN_RIDE DS4_CONSTS_FIRST
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( ${BUDGET:-560} - $(el) )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
G=tests/test_gpu_e2e.py::test_cuda_graph_matches_eager_1000_steps
timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short "$G[fused]" "$G[fused-fork_full_edge]" \
  "$G[fused-programmatic_fork_shared]" "$G[fused-hc_fold]" "$G[fused-consts_after_wait]" \
  "${G}_on_small[one_graph]" > "$OUT/graph.log" 2>&1
echo "graph = eager rc=$? at +$(el)s: $(tail -1 "$OUT/graph.log")"; grep -E "FAILED|ERROR" "$OUT/graph.log" | head
timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_kernels_gpu.py \
  tests/test_capture_join_gpu.py \
  tests/test_attn_kernels_gpu.py -k "shared_expert or programmatic or router or sparse_v4" > "$OUT/units.log" 2>&1
echo "kernel tests rc=$? at +$(el)s: $(tail -1 "$OUT/units.log")"; grep -E "FAILED|ERROR" "$OUT/units.log" | head
B=kernels+fused+graph+cap8192
R=$B,$B+nopfsh,$B+nocf,$B+cfrouter
V=$R,$R,$R
timeout 150 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V" --out "$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer" "$OUT/bench.log"
grep -o '"programmatic_forks": [0-9]*' "$OUT/bench.json" | sort | uniq -c
timeout 45 python3 scripts/profile_step.py --layers 8 --variant kernels+fused+cap8192 --timeline --timeline-replays 6 \
  --out "$OUT/profile.json" > "$OUT/profile.log" 2>&1
echo "profile rc=$? at +$(el)s"; sed -n 4,12p "$OUT/profile.log"
l=$(left); [ $l -lt 30 ] && { echo "e2e SKIPPED"; echo "total $(el)s"; exit 0; }
timeout $l python3 -m pytest -v -p no:cacheprovider --tb=short tests/test_gpu_e2e.py \
  -k "all_fused_agree or sinkhorn_ride or batch1_graph or teacher_forced or graph_pool" > "$OUT/e2e.log" 2>&1
echo "e2e rc=$? at +$(el)s: $(tail -1 "$OUT/e2e.log")"; grep -cE "PASSED" "$OUT/e2e.log"
grep -E "FAILED|ERROR" "$OUT/e2e.log" | head
echo "total $(el)s"
