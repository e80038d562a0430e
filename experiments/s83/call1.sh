#!/usr/bin/env bash
# Session 83, one GPU (about 4-5 device minutes with the start): session 82's ready call (experiments/s82/next.sh:
# scripts/probe_h_read.cu, bench_kernels.py --moe-bound) and scripts/probe_splitk_tail.cu: the launch boundary of
# today's routed pair (h written, then staged by every down block) against a split-K pair's tail (partials written,
# then reduced).
# Usage (carry build/site): OUT=$OUT bash experiments/s83/call1.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
nvcc -std=c++17 -O3 -arch=sm_90 scripts/probe_splitk_tail.cu -o /tmp/probe_tail && /tmp/probe_tail 2>&1 \
  | tee "$OUT/probe_splitk_tail.log"
OUT=$OUT bash experiments/s82/next.sh
