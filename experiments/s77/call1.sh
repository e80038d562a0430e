#!/usr/bin/env bash
# Session 77, call 1 (one lent GPU): the one-token GEMVs' blocks requesting their whole weight shares into L2 before
# their PDL wait (DS4_GEMV_L2, opt-in; bench tokens l2SITES: o wo_a, q wq_b, a wq_a + wkv, b wo_b).
#   1. build; 2. the kernel test of the knob (bit-exact) and the fp8t GEMV tests; graph = eager over 1000 steps with
#   it on every site; 3. the slope: defaults, l2o, l2oq, l2oqa, l2oqab, three interleaved passes in one process;
#   4. 8-layer timelines of the defaults and of l2o (6 replays each).
# Logs in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s77/call1.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_GEMV_L2 DS4_PFORK DS4_PJOIN DS4_MMA
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_kernels_gpu.py \
  -k "l2_share or fp8t or prefetch" > "$OUT/units.log" 2>&1
echo "kernel tests rc=$? at +$(el)s: $(tail -1 "$OUT/units.log")"; grep -E "FAILED|ERROR" "$OUT/units.log" | head
G=tests/test_gpu_e2e.py::test_cuda_graph_matches_eager_1000_steps
timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short "$G[fused-gemv_l2_share]" "$G[fused]" \
  > "$OUT/graph.log" 2>&1
echo "graph = eager rc=$? at +$(el)s: $(tail -1 "$OUT/graph.log")"; grep -E "FAILED|ERROR" "$OUT/graph.log" | head
B=kernels+fused+graph+cap8192
R=$B,$B+l2o,$B+l2oq,$B+l2oqa,$B+l2oqab
timeout 150 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$R,$R,$R" --out "$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer" "$OUT/bench.log"
for s in none o; do
  if [ $s = none ]; then unset DS4_GEMV_L2; else export DS4_GEMV_L2=$s; fi
  timeout 45 python3 scripts/profile_step.py --layers 8 --variant kernels+fused+cap8192 --timeline \
    --timeline-replays 6 --out "$OUT/profile_$s.json" > "$OUT/profile_$s.log" 2>&1
  echo "profile $s rc=$? at +$(el)s"; sed -n 4,10p "$OUT/profile_$s.log"
done
unset DS4_GEMV_L2
echo "total $(el)s"
