#!/usr/bin/env bash
# Session 51, run 8 (one lent H200): probe_bulk and probe_hfma after their shape setup moved to Fp4tShape
# (scripts/probe_gemv.cuh; the review commit), to check they run and check as before. Binaries built on the dev
# machine and carried in build/:
#   nvcc -std=c++17 -O3 -arch=sm_90 -DDS4_PROBE scripts/probe_bulk.cu -o build/probe_bulk   (likewise probe_hfma)
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
timeout 100 build/probe_hfma > "$OUT/probe_hfma_run8.log" 2>&1; echo "probe_hfma rc=$?"
timeout 100 build/probe_bulk > "$OUT/probe_bulk_run8.log" 2>&1; echo "probe_bulk rc=$?"
cat "$OUT/probe_hfma_run8.log" "$OUT/probe_bulk_run8.log"
