#!/usr/bin/env bash
# Session 50, run 5 (one lent H200): fresh figures of the final tree for the closing notes: every kernel of issue #4
# alone (scripts/bench_kernels.py --quick) and the per-layer slope, two passes of the default variant.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
t0=$(date +%s); st() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
st build; python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$?"; tail -n 1 "$OUT/build.log"
st kbench
timeout 150 python3 scripts/bench_kernels.py --quick --out "$OUT/kbench_run5.json" > "$OUT/kbench_run5.log" 2>&1
echo "kbench rc=$?"
st bench
V=kernels+fused+graph+cap8192
timeout $(( 585 - ($(date +%s) - t0) )) python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
  --variants "$V,$V" --out "$OUT/bench_run5.json" > "$OUT/bench_run5.log" 2>&1
echo "bench rc=$?"
st done
grep -E "^(fp8|fp4|moe|shared|ffn|router)|copy bandwidth" "$OUT/kbench_run5.log" | cut -c1-110
grep -v '^{' "$OUT/bench_run5.log" | grep -v "^\s*$" | tail -n 8
