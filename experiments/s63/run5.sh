#!/usr/bin/env bash
# Session 63, run 5 (one lent GPU, one call; run 6 ran only the probe again, its staging spread over 8 threads per block): the IDP4A routed-MoE probe in the MoE kernels' form
# (scripts/probe_dp4a_moe.cu, built on the workstation and carried as build/probe_dp4a_moe; built here where it cannot
# run), then the extension's build and the library's kernels alone (bench_kernels.py --quick: its `moe fp4` rows time
# the library's routed gate+up and down the same way). Logs + summary.txt in $OUT.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
S="$OUT/summary.txt"; L="$OUT/probe_dp4a_moe.log"
nvidia-smi -L | tee "$S"
if ! timeout 120 build/probe_dp4a_moe > "$L" 2>&1; then
  echo "carried binary failed; building here" | tee -a "$S"
  nvcc -std=c++17 -O3 -arch=sm_90 scripts/probe_dp4a_moe.cu -o /tmp/probe_dp4a_moe > "$OUT/probe_build.log" 2>&1
  timeout 120 /tmp/probe_dp4a_moe > "$L" 2>&1
fi
echo "probe rc=$? at +$(el)s" | tee -a "$S"; cat "$L" | tee -a "$S"
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$? at +$(el)s" | tee -a "$S"
timeout 150 python3 scripts/bench_kernels.py --quick --out "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
echo "bench_kernels rc=$? at +$(el)s" | tee -a "$S"; grep -iE "copy|moe fp4 " "$OUT/kernels.log" | head -8 | tee -a "$S"
echo "total $(el)s" | tee -a "$S"
