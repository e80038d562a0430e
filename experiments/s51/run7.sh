#!/usr/bin/env bash
# Session 51, run 7 (one lent H200): a fresh 8-layer stage profile of the library defaults (session 49's GPU code; the
# last default-code profile is session 45's) for issue #5's attention side: the critical path of one replay at
# context 64 and the step at position 65536. scripts/attn_side.py splits the path into attention and FFN sides.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
t0=$(date +%s); st() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
st build; python3 scripts/build_ext.py -q > /tmp/build.log 2>&1; echo "build rc=$?"
st profile
timeout 200 python3 scripts/profile_step.py --layers 8 --variant kernels+fused --timeline --long-context 65536 \
  --out "$OUT/profile_step_8l_run7.json" > "$OUT/profile_run7.log" 2>&1; echo "profile rc=$?"
python3 scripts/attn_side.py "$OUT/profile_step_8l_run7.json"
grep -E "wall|long" "$OUT/profile_run7.log" | head -6
st done
