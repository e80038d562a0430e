#!/usr/bin/env bash
# Session 74, call 2 (one lent GPU): the compressors' projections in line right after wq_a + wkv, each forming its
# product before its PDL wait (x is the hc finish's, two launches back), their steps left in the branches
# (DS4_COMPRESS_EARLY=1 / 2, bench tokens ce1 / ce2). Why: in the 8-layer timelines (s73 call 3) the CSA layers'
# branch GEMVs start only as wq_b's blocks leave (13 us after the hc finish), so the projection and the step sit
# on the path after wq_b (9.4 + 4.3 us); the HCA layers' projection wins the race and runs before wq_b.
#   1. build; 2. GPU tests (the kernel's bits, graph = eager over 1000 tiny steps with each form);
#   3. the slope (4 and 12 layers): the defaults, ce1, ce2, two passes each in one process; 4. the ce1 timeline.
# Logs in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s74/call2.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_ACT_QUANT DS4_L2_PREFETCH DS4_COMPRESS_EARLY
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
G=tests/test_gpu_e2e.py::test_cuda_graph_matches_eager_1000_steps
K=tests/test_kernels_gpu.py::test_gemv_x_early_gives_the_same_bits
timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short "$K" \
  "$G[fused]" "$G[fused-compress_early1]" "$G[fused-compress_early2]" > "$OUT/tests.log" 2>&1
echo "tests rc=$? at +$(el)s: $(tail -1 "$OUT/tests.log")"; grep -E "FAILED|ERROR" "$OUT/tests.log" | head
B=kernels+fused+graph+cap8192
V=$B,$B+ce1,$B+ce2,$B,$B+ce1,$B+ce2
timeout 170 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V" --out "$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer" "$OUT/bench.log"
DS4_COMPRESS_EARLY=1 timeout 90 python3 scripts/profile_step.py --layers 8 --variant kernels+fused+cap8192 \
  --timeline --timeline-replays 6 --out "$OUT/profile_ce1.json" > "$OUT/profile_ce1.log" 2>&1
echo "profile rc=$? at +$(el)s"; sed -n 4,20p "$OUT/profile_ce1.log"
echo "total $(el)s"
