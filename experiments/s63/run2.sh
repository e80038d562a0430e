#!/usr/bin/env bash
# Session 63, run 2 (one lent GPU, one call): the IDP4A probe of the one-token FP4 product (scripts/probe_dp4a.cu)
# against the library's tensor-core register stream on the same bytes. Log in $OUT.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi -L | tee "$OUT/probe_dp4a.log"
INC=$(python3 -c "import torch.utils.cpp_extension as c; print(' '.join('-I'+p for p in c.include_paths()))")
nvcc -std=c++17 -O3 -arch=sm_90 -DDS4_PROBE scripts/probe_dp4a.cu -o /tmp/probe_dp4a $INC > "$OUT/probe_build.log" 2>&1
echo "build rc=$? at +$(( $(date +%s) - t0 ))s" | tee -a "$OUT/probe_dp4a.log"
timeout 240 /tmp/probe_dp4a 2>&1 | tee -a "$OUT/probe_dp4a.log"
echo "total $(( $(date +%s) - t0 ))s" | tee -a "$OUT/probe_dp4a.log"
