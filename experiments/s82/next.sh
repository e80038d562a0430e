#!/usr/bin/env bash
# Ready for session 83 (one GPU, about 4 device minutes with the start): two questions session 82 left.
#   1. scripts/probe_h_read.cu: does staging 24 KB from L2 in 256 blocks take ~3.5 us whatever the case (written right
#      before, re-read, distinct or 8 copies, evicted, one block, all loads in flight, nc / cg loads)? If so, the
#      routed down's h staging (3.3-4.0 us of its block life in the step) is the memory system's latency for it.
#   2. scripts/bench_kernels.py --moe-bound: the routed pair (gate+up, down) against the gate+up alone at 1.5x V4's
#      inter (the pair's weight bytes in one launch): the bound of a split-K fused pair, which stages no h after a
#      launch boundary, before its reduction's cost.
# Usage (carry build/site): OUT=$OUT bash experiments/s82/next.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1 & B=$!
nvcc -std=c++17 -O3 -arch=sm_90 scripts/probe_h_read.cu -o /tmp/probe_h && /tmp/probe_h 2>&1 | tee "$OUT/probe_h_read.log"
wait $B; rc=$?; echo "build rc=$rc at +$(el)s"; [ $rc -eq 0 ] || { grep -E "error" "$OUT/build.log" | head; exit 1; }
DS4_NO_JIT=1 timeout 240 python3 scripts/bench_kernels.py --moe-bound --out "$OUT/moe_bound.json" 2>&1 \
  | tee "$OUT/moe_bound.log" | tail -12
echo "total $(el)s"
