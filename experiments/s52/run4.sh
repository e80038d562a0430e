#!/usr/bin/env bash
# Session 52, run 4 (one lent H200): what numerics=qat (the official reference's FP8 / FP4 activation simulations,
# today torch ops around the kernels) costs the decode step against plain, with the library's fastest options:
# the slope, plain and qat alternating, two passes each (bench token qat, new this session).
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
t0=$(date +%s); st() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
st build; python3 scripts/build_ext.py -q > /tmp/build.log 2>&1; echo "build rc=$?"
V=kernels+fused+graph+cap8192
st bench
timeout 300 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
  --variants "$V,$V+qat,$V,$V+qat" --out "$OUT/bench_run4.json" > "$OUT/bench_run4.log" 2>&1
echo "bench rc=$?"; grep -E "^per-layer|^ +(4|12) " "$OUT/bench_run4.log"
st done
