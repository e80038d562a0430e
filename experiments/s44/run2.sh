#!/usr/bin/env bash
# Session 44, run 2 (one lent H200): the indexer scores kernel looping over chunks on a long cache (q staged once per
# block), and the top-k's checks in Python. Build; the top-k / indexer GPU tests; bench_attn's indexer and top-k rows;
# the 8-layer step at position 1048000 and the default profile (position 65536).
set -u
OUT=${OUT:-/tmp/ds4_out}
PYTEST_ARGS="tests/test_decode_glue_gpu.py tests/test_attn_kernels_gpu.py" PYTEST_K="topk or indexer" \
  bash scripts/gpu_lease.sh pytest,profile
export PYTHONPATH=/tmp/site:$PWD
DS4_TOPK_WIDE=1 timeout 120 python3 scripts/profile_step.py --layers 8 --variant kernels+fused --timeline \
  --long-context 1048000 --out "$OUT/profile_1m.json" > "$OUT/profile_1m.log" 2>&1
echo "profile 1M rc=$?"; grep -E "^step wall|^timeline of one" "$OUT/profile_1m.log"
for op in indexer topk; do
  timeout 150 python3 scripts/bench_attn.py --only "$op" --out "$OUT/bench_attn_$op.json" > "$OUT/bench_attn_$op.log" 2>&1
  echo "bench_attn $op rc=$?"; sed -n '/^op /,$p' "$OUT/bench_attn_$op.log"
done
