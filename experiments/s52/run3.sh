#!/usr/bin/env bash
# Session 52, run 3 (one lent H200): scripts/probe_wgmma.cu with PROD 4 (4 / 2 accumulator sets, the B descriptor formed once) — the FP4 product's arithmetic on wgmma (bf16 m64n8k16
# and e4m3 m64n8k32, A from registers, B from shared memory) against the library's mma.sync product in one skeleton;
# timing only. Plus the SASS MMA opcodes of the probe. Binary built on the dev machine (carried in build/):
#   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -DDS4_PROBE scripts/probe_wgmma.cu -o build/probe_wgmma
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
timeout 400 build/probe_wgmma > "$OUT/probe_wgmma_run3.log" 2>&1; echo "probe_wgmma rc=$?"
CUOBJ=$(command -v cuobjdump || ls /usr/local/cuda*/bin/cuobjdump 2>/dev/null | head -1)
"$CUOBJ" -sass build/probe_wgmma > /tmp/sass.txt 2>&1
python3 scripts/sass_ops.py '_ZN2wg9wg_kernelILi2ELi[034]ELi1ELi3E' < /tmp/sass.txt > "$OUT/sass_wgmma_run3.txt" 2>&1
grep -o "[HQ]G*MMA[A-Z0-9_.]*" /tmp/sass.txt | sort | uniq -c >> "$OUT/sass_wgmma_run3.txt"
cat "$OUT/probe_wgmma_run3.log" "$OUT/sass_wgmma_run3.txt"
