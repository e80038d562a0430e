#!/usr/bin/env bash
# Session 64, run 4 (one lent GPU, one call): the final dp4a gate+up (scale bytes by shuffles wherever they come in
# whole words, no division per item, no per-chunk bounds where dim is a multiple of 1024): in the probe's harness
# (carried binaries) beside the lane-order diagnostic and the probe's own kernels at 256 experts; then the build, the
# GPU tests (the dp4a kernel, its end-to-end rows, the library's MoE kernel tests), the kernels alone
# (bench_kernels.py --quick) and the slope of the default against +dp4a, alternating. Logs + summary.txt in $OUT.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PJOIN DS4_ATTN_EARLY
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( ${BUDGET:-570} - $(el) )); }
S="$OUT/summary.txt"
nvidia-smi -L | tee "$S"
for b in "" _lane; do for ne in 64 256; do
  echo "probe_dp4a_lib$b NE=$ne: $(timeout 60 build/probe_dp4a_lib$b $ne 2>&1 | tail -1)" | tee -a "$S"
done; done
timeout 90 build/probe_dp4a_moe_256 > "$OUT/probe_moe_256.log" 2>&1
echo "probe_dp4a_moe_256 rc=$?" | tee -a "$S"; grep -E "resident" "$OUT/probe_moe_256.log" | tee -a "$S"
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$? at +$(el)s" | tee -a "$S"
timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_moe_dp4a_gpu.py > "$OUT/dp4a_tests.log" 2>&1
echo "dp4a tests rc=$?: $(tail -1 "$OUT/dp4a_tests.log") at +$(el)s" | tee -a "$S"
grep -E "FAILED|Error" "$OUT/dp4a_tests.log" | head -8 | tee -a "$S"
timeout 120 python3 scripts/bench_kernels.py --quick --out "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
echo "bench_kernels rc=$? at +$(el)s" | tee -a "$S"; grep -iE "copy|moe fp4 (gate|routed)" "$OUT/kernels.log" | head -6 | tee -a "$S"
V=kernels+fused+graph+cap8192
timeout 200 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
  --variants "$V,$V+dp4a,$V,$V+dp4a" --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$? at +$(el)s" | tee -a "$S"; grep -E "^per-layer|copy|warm" "$OUT/bench.log" | tee -a "$S"
l=$(left); if [ $l -gt 30 ]; then
  timeout $l python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_gpu_e2e.py -k "dp4a" > "$OUT/e2e.log" 2>&1
  echo "e2e dp4a rows rc=$?: $(tail -1 "$OUT/e2e.log") at +$(el)s" | tee -a "$S"
  grep -E "FAILED|agreement" "$OUT/e2e.log" | head -6 | tee -a "$S"
else echo "e2e SKIPPED (${l}s left)" | tee -a "$S"; fi
l=$(left); if [ $l -gt 20 ]; then
  timeout $l python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_kernels_gpu.py -k "moe" > "$OUT/moe_tests.log" 2>&1
  echo "moe kernel tests rc=$?: $(tail -1 "$OUT/moe_tests.log") at +$(el)s" | tee -a "$S"
else echo "moe kernel tests SKIPPED (${l}s left)" | tee -a "$S"; fi
echo "total $(el)s" | tee -a "$S"
