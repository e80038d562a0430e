#!/usr/bin/env bash
# Session 49, run 1 (one lent H200): the cross-layer L2 prefetch (ds4.ops.prefetch site n: the next block's wq_a + wkv
# and wq_b requested beside this block's FFN, whose FP4 products leave HBM room; keep: the requests L2::evict_last
# with a persisting set-aside). GPU tests of the prefetch kernel and its captured branch; the dense GEMVs with their
# weights L2-resident (--l2-hot) against rotated ones; the per-layer slope with and without the site; an 8-layer
# profile with it. Its code is c95e664 with experiments/s49_attempts/l2_next_block_prefetch.diff applied (reverted after).
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
t0=$(date +%s); st() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
st build; python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$?"; tail -n 2 "$OUT/build.log"
st pytest
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/test_kernels_gpu.py \
  -k "prefetch or persist" > "$OUT/pytest.log" 2>&1; tail -n 4 "$OUT/pytest.log"
python3 -c "from ds4 import kernels; kernels.load(); print('persisting L2 set-aside max:', kernels.l2_persist_limit(-1), \
'bytes'); kernels.l2_persist_limit(0)" 2>&1 | tail -1
st kbench
timeout 100 python3 scripts/bench_kernels.py --quick --dense-only --out "$OUT/kb_cold.json" > "$OUT/kb_cold.log" 2>&1
timeout 100 python3 scripts/bench_kernels.py --quick --dense-only --l2-hot --out "$OUT/kb_hot.json" > "$OUT/kb_hot.log" 2>&1
st bench
V=kernels+fused+graph+cap8192
timeout 330 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
  --variants "$V,$V+pfn+keep,$V+pfn,$V+pfn+keep,$V" --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
st profile
DS4_L2_PREFETCH=n DS4_L2_PERSIST=max timeout 90 python3 scripts/profile_step.py --layers 8 --variant kernels+fused \
  --timeline --out "$OUT/profile_pfn_keep.json" > "$OUT/profile_pfn_keep.log" 2>&1; echo "profile rc=$?"
st done
echo "--- kbench (cold | L2-hot)"
paste <(grep -E "^fp8" "$OUT/kb_cold.log" | cut -c1-75) <(grep -E "^fp8" "$OUT/kb_hot.log" | awk '{print $(NF-5), $(NF-2)}')
grep "copy bandwidth" "$OUT/kb_cold.log" "$OUT/kb_hot.log"
echo "--- bench"; grep -v '^{' "$OUT/bench.log" | grep -v "^\s*$" | tail -n 14
echo "--- profile"; sed -n '/^timeline of one replay/,/^the critical path in order/p' "$OUT/profile_pfn_keep.log" | head -n 30
