#!/usr/bin/env bash
# Session 44, run 3 (one lent H200): the attention chunk kernel's blocks merging several chunks (splits capped at
# 64), the indexer's chunk loop, the wide top-k. Build; all GPU kernel test modules; the default profile (position
# 65536); the step at position 1048000; bench_attn's attention and indexer rows under the two knobs; the per-layer
# slope.
set -u
OUT=${OUT:-/tmp/ds4_out}
BENCH_VARIANTS=kernels+fused+graph+cap8192 bash scripts/gpu_lease.sh kernel_tests,profile
export PYTHONPATH=/tmp/site:$PWD
timeout 120 python3 scripts/profile_step.py --layers 8 --variant kernels+fused --timeline \
  --long-context 1048000 --out "$OUT/profile_1m.json" > "$OUT/profile_1m.log" 2>&1
echo "profile 1M rc=$?"; grep -E "^step wall|^timeline of one" "$OUT/profile_1m.log"
for v in 1000 2 4 6; do
  DS4_INDEXER_BLOCKS_PER_SM=$v timeout 60 python3 scripts/bench_attn.py --only indexer --no-ref \
    > "$OUT/bench_attn_ix$v.log" 2>&1; echo "indexer blocks/SM $v"; sed -n '/^op /,$p' "$OUT/bench_attn_ix$v.log"
done
for v in 64 100000; do
  DS4_SPARSE_MAX_SPLITS=$v timeout 90 python3 scripts/bench_attn.py --only attn --no-ref \
    > "$OUT/bench_attn_sp$v.log" 2>&1; echo "attn max splits $v"; sed -n '/^op /,$p' "$OUT/bench_attn_sp$v.log"
done
BENCH_VARIANTS=kernels+fused+graph+cap8192 bash scripts/gpu_lease.sh bench 2>&1 | tail -n 8
