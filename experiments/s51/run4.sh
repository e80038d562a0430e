#!/usr/bin/env bash
# Session 51, run 4 (one lent H200): scripts/probe_hfma.cu with real fp4h words (DEC 2: the fp16 layout of
# scripts/fp4_decode_search.py, 6 LOP3 per word, the words permuted on the device from the same fp4t bytes) beside
# session 50's rows; scripts/probe_fp16_decode.cu after its decode moved to scripts/probe_fp4h.cuh (its host check of
# every nibble at every position, and its timings). Binaries built on the dev machine (carried in build/):
#   nvcc -std=c++17 -O3 -arch=sm_90 -DDS4_PROBE scripts/probe_hfma.cu -o build/probe_hfma
#   nvcc -std=c++17 -O3 -arch=sm_90 scripts/probe_fp16_decode.cu -o build/probe_fp16
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
timeout 120 build/probe_fp16 > "$OUT/probe_fp16_run4.log" 2>&1; echo "probe_fp16 rc=$?"
timeout 400 build/probe_hfma > "$OUT/probe_hfma_run4.log" 2>&1; echo "probe_hfma rc=$?"
cat "$OUT/probe_fp16_run4.log" "$OUT/probe_hfma_run4.log"
