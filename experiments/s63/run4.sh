#!/usr/bin/env bash
# Session 63, run 4 (one lent GPU, one call): the IDP4A probe (run 3's binary, built on the workstation and carried as
# build/probe_dp4a; built here where it cannot run), then the extension's build and the default slope, two passes
# after the bench's warm pass; before it the library's kernels alone (bench_kernels.py --quick). Logs + summary.txt in
# $OUT.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PJOIN DS4_ATTN_EARLY
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
S="$OUT/summary.txt"; L="$OUT/probe_dp4a.log"
nvidia-smi -L | tee "$S"
if ! timeout 120 build/probe_dp4a > "$L" 2>&1; then
  echo "carried binary failed; building here" | tee -a "$S"
  INC=$(python3 -c "import torch.utils.cpp_extension as c; print(' '.join('-I'+p for p in c.include_paths()))")
  nvcc -std=c++17 -O3 -arch=sm_90 -DDS4_PROBE scripts/probe_dp4a.cu -o /tmp/probe_dp4a $INC > "$OUT/probe_build.log" 2>&1
  timeout 120 /tmp/probe_dp4a > "$L" 2>&1
fi
echo "probe done at +$(el)s" | tee -a "$S"
grep -E "copy|tensor cores U1|int8 x, R2, 1024|16-bit x, R1, 4096 k per" "$L" | tee -a "$S"
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$? at +$(el)s" | tee -a "$S"
# the library's routed-MoE kernels alone on this GPU (the probe's library rows are the dense GEMV form of the same
# bytes, which session 51 found slower than the MoE kernels)
timeout 150 python3 scripts/bench_kernels.py --quick --out "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
echo "bench_kernels rc=$? at +$(el)s" | tee -a "$S"; grep -iE "copy|moe" "$OUT/kernels.log" | head -20 | tee -a "$S"
V=kernels+fused+graph+cap8192
left=$(( ${BUDGET:-500} - $(el) ))
if [ $left -gt 40 ]; then
  timeout $left python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V,$V" \
    --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "bench rc=$? at +$(el)s" | tee -a "$S"; grep -E "^per-layer|copy|warm" "$OUT/bench.log" | tee -a "$S"
else echo "bench SKIPPED (${left}s left)" | tee -a "$S"; fi
echo "total $(el)s" | tee -a "$S"
