#!/usr/bin/env bash
# Session 44, run 1 (one lent H200): build; the top-k / indexer GPU tests; the top-k probe (one row, the one-block
# and wide forms); bench_attn --quick (its top-k rows against torch.topk); the 8-layer step at position 1048000
# (262016 compressed entries per CSA row) with the wide top-k and with torch.topk (DS4_TOPK_WIDE=0, as before).
set -u
OUT=${OUT:-/tmp/ds4_out}
PYTEST_ARGS="tests/test_decode_glue_gpu.py tests/test_attn_kernels_gpu.py" PYTEST_K="topk or indexer" \
  bash scripts/gpu_lease.sh pytest
export PYTHONPATH=/tmp/site:$PWD
nvcc -std=c++17 -O3 -arch=sm_90 -I. -Icsrc/attn -Icsrc -Iscripts -DTOPK_SRC='"csrc/attn/topk.cu"' \
  scripts/probe_topk.cu -o /tmp/probe_topk && timeout 120 /tmp/probe_topk > "$OUT/probe_topk.log" 2>&1
echo "probe rc=$?"; cat "$OUT/probe_topk.log"
for w in 1 0; do
  DS4_TOPK_WIDE=$w timeout 120 python3 scripts/profile_step.py --layers 8 --variant kernels+fused --timeline \
    --long-context 1048000 --out "$OUT/profile_1m_wide$w.json" > "$OUT/profile_1m_wide$w.log" 2>&1
  echo "profile DS4_TOPK_WIDE=$w rc=$?"; grep -E "^step wall|^timeline of one" "$OUT/profile_1m_wide$w.log"
done
timeout 150 python3 scripts/bench_attn.py --quick --out "$OUT/bench_attn.json" > "$OUT/bench_attn.log" 2>&1
echo "bench_attn rc=$?"; tail -n 14 "$OUT/bench_attn.log"
