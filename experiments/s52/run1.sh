#!/usr/bin/env bash
# Session 52, run 1 (one lent H200): scripts/probe_fp8mma.cu — the one-token FP4 product on E4M3 tensor cores
# (mma.sync m16n8k32, activations act-quantised per 128 as under numerics=qat) against the library's BF16 product in
# the same stream, and the library's gemv_mma kernel; plus the SASS opcodes of the E4M3 MMA kernel. Binary built on
# the dev machine (carried in build/):
#   nvcc -std=c++17 -O3 -arch=sm_90 -DDS4_PROBE scripts/probe_fp8mma.cu -o build/probe_fp8mma
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
timeout 400 build/probe_fp8mma > "$OUT/probe_fp8mma_run1.log" 2>&1; echo "probe_fp8mma rc=$?"
CUOBJ=$(command -v cuobjdump || ls /usr/local/cuda*/bin/cuobjdump 2>/dev/null | head -1)
if [ -n "$CUOBJ" ]; then
  "$CUOBJ" -sass build/probe_fp8mma > /tmp/sass.txt 2>&1
  python3 scripts/sass_ops.py '_ZN2f811fp4t_kernelILi2ELi[01]ELi0ELi3E' < /tmp/sass.txt > "$OUT/sass_fp8mma_run1.txt" 2>&1
  grep -o "[HQ]MMA[A-Z0-9_.]*" /tmp/sass.txt | sort | uniq -c >> "$OUT/sass_fp8mma_run1.txt"
else
  echo "no cuobjdump" > "$OUT/sass_fp8mma_run1.txt"
fi
cat "$OUT/probe_fp8mma_run1.log" "$OUT/sass_fp8mma_run1.txt"
