#!/usr/bin/env bash
# Session 63, run 3 (one lent GPU, one call): the IDP4A probe's second form (a warp per rows x K slice) against the
# library's tensor-core register stream. The binary is built on the workstation (nvcc 13.0, sm_90) and carried as
# build/probe_dp4a (the device's build of run 2 took 281 s); where it cannot run, it is built here. Log in $OUT.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
t0=$(date +%s)
L="$OUT/probe_dp4a.log"
nvidia-smi -L | tee "$L"
B=build/probe_dp4a
if ! timeout 240 $B >> "$L" 2>&1; then
  echo "carried binary failed (rc=$?); building here" | tee -a "$L"
  INC=$(python3 -c "import torch.utils.cpp_extension as c; print(' '.join('-I'+p for p in c.include_paths()))")
  nvcc -std=c++17 -O3 -arch=sm_90 -DDS4_PROBE scripts/probe_dp4a.cu -o /tmp/probe_dp4a $INC > "$OUT/probe_build.log" 2>&1
  echo "build rc=$? at +$(( $(date +%s) - t0 ))s" | tee -a "$L"
  timeout 240 /tmp/probe_dp4a >> "$L" 2>&1
fi
cat "$L"
echo "total $(( $(date +%s) - t0 ))s" | tee -a "$L"
