#!/usr/bin/env bash
# Session 64, run 6 (one lent GPU, one call, the session's last device time): the dp4a gate+up with x's staging
# loads issued together (one round trip to x instead of four at dim 4096). The library kernel in the probe's harness
# (carried binary); build; the dp4a GPU tests; the kernels alone; the slope against the default, alternating; the
# end-to-end dp4a rows and the probe's own kernel where time is left. (Comment reworded after the run: it had said
# the probe's staging was unrolled, which its SASS does not show; experiments/session64.md.)
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PJOIN DS4_ATTN_EARLY
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( ${BUDGET:-280} - $(el) )); }
S="$OUT/summary.txt"
nvidia-smi -L | tee "$S"
for ne in 64 256; do
  echo "probe_dp4a_lib NE=$ne: $(timeout 60 build/probe_dp4a_lib $ne 2>&1 | tail -1)" | tee -a "$S"
done
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$? at +$(el)s" | tee -a "$S"
timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_moe_dp4a_gpu.py > "$OUT/dp4a_tests.log" 2>&1
echo "dp4a tests rc=$?: $(tail -1 "$OUT/dp4a_tests.log") at +$(el)s" | tee -a "$S"
grep -E "FAILED|Error" "$OUT/dp4a_tests.log" | head -8 | tee -a "$S"
timeout 60 python3 scripts/bench_kernels.py --quick --out "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
echo "bench_kernels rc=$? at +$(el)s" | tee -a "$S"; grep -iE "copy|moe fp4 (gate|routed)" "$OUT/kernels.log" | head -6 | tee -a "$S"
V=kernels+fused+graph+cap8192
l=$(left); if [ $l -gt 40 ]; then
  timeout $l python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
    --variants "$V,$V+dp4a,$V,$V+dp4a" --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "bench rc=$? at +$(el)s" | tee -a "$S"; grep -E "^per-layer|copy" "$OUT/bench.log" | tee -a "$S"
else echo "bench SKIPPED (${l}s left)" | tee -a "$S"; fi
l=$(left); if [ $l -gt 50 ]; then
  timeout $l python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_gpu_e2e.py -k "dp4a" > "$OUT/e2e.log" 2>&1
  echo "e2e dp4a rows rc=$?: $(tail -1 "$OUT/e2e.log") at +$(el)s" | tee -a "$S"
else echo "e2e SKIPPED (${l}s left)" | tee -a "$S"; fi
l=$(left); if [ $l -gt 15 ]; then
  timeout $l build/probe_dp4a_moe_256 > "$OUT/probe_moe_256.log" 2>&1
  echo "probe_dp4a_moe_256 rc=$?" | tee -a "$S"; grep -E "resident" "$OUT/probe_moe_256.log" | tee -a "$S"
else echo "probe_dp4a_moe_256 SKIPPED (${l}s left)" | tee -a "$S"; fi
echo "total $(el)s" | tee -a "$S"
