#!/usr/bin/env bash
# Session 64, run 3 (one lent GPU, one call): what the library dp4a gate+up would gain with its scale bytes in lane
# order (the probe's layout; run 2: the library kernel in the probe's harness 25.8-28.4 us against the probe's
# 21.25). The lane-order build in the probe harness (carried binaries, scales read in lane order and checked so), then
# the extension built with -DDS4_DP4A_SCALE_LANE=1 (a timing diagnostic: on the stored scales its h is wrong) and the
# slope of the default against +dp4a on that build, alternating. Logs + summary.txt in $OUT.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
unset DS4_PJOIN DS4_ATTN_EARLY
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
S="$OUT/summary.txt"
nvidia-smi -L | tee "$S"
for b in lane s1v1; do for ne in 64 256; do
  echo "$b NE=$ne: $(timeout 60 build/probe_dp4a_lib_$b $ne 2>&1 | tail -1)" | tee -a "$S"
done; done
export DS4_NVCC_FLAGS=-DDS4_DP4A_SCALE_LANE=1 DS4_ATTN_NVCC_FLAGS=
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build (lane-order diag) rc=$? at +$(el)s" | tee -a "$S"
timeout 120 python3 scripts/bench_kernels.py --quick --out "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
echo "bench_kernels rc=$? at +$(el)s" | tee -a "$S"; grep -iE "copy|moe fp4 (gate|routed)" "$OUT/kernels.log" | head -6 | tee -a "$S"
V=kernels+fused+graph+cap8192
timeout 200 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
  --variants "$V,$V+dp4a,$V,$V+dp4a" --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$? at +$(el)s" | tee -a "$S"; grep -E "^per-layer|copy|warm" "$OUT/bench.log" | tee -a "$S"
echo "total $(el)s" | tee -a "$S"
