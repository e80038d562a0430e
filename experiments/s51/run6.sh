#!/usr/bin/env bash
# Session 51, run 6 (one lent H200): the kernels whose per-shape rule says depth 8 (wq_a + wkv, wo_b, the shared
# expert's gate+up) at depth 2 (DS4_LONG_ROW_DEPTH=2, bench token lrd2; only lrd4 was measured before, sessions 34,
# 41, 45). Why: run 5 showed the routed down (depth 2, U1) reading its bytes 3 us faster than the dense GEMV form at
# depth 4 or 8. The library defaults (ba4ca6d's GPU code): the dense rows of bench_kernels --quick at the rule's
# depths and with DS4_LONG_ROW_DEPTH=2 / 4; the slope, default and lrd2 alternating, three passes each.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
t0=$(date +%s); st() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
st build; python3 scripts/build_ext.py -q > /tmp/build.log 2>&1; echo "build rc=$?"
K="^fp8t |^shared .*fp8t|copy bandwidth"
for d in "" 2 4; do
  st "kbench ${d:+lrd$d}"
  env ${d:+DS4_LONG_ROW_DEPTH=$d} timeout 60 python3 scripts/bench_kernels.py --quick \
    --out "$OUT/kbench_run6${d:+_lrd$d}.json" > /tmp/kb.log 2>&1
  grep -E "$K" /tmp/kb.log | cut -c1-100
done
V=kernels+fused+graph+cap8192
st bench
timeout 200 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
  --variants "$V,$V+lrd2,$V,$V+lrd2,$V,$V+lrd2" --out "$OUT/bench_run6.json" > "$OUT/bench_run6.log" 2>&1
echo "bench rc=$?"; grep "^per-layer" "$OUT/bench_run6.log"
st done
