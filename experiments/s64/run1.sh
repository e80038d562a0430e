#!/usr/bin/env bash
# Session 64, run 1 (one lent GPU, one call): build; the GPU tests of moe=fp4_dp4a (the routed experts' one-token
# gate+up on the integer pipe, csrc/moe_dp4a.cu); its kernel alone against the library's (bench_kernels.py --quick);
# the slope with and without it (alternating, after the bench's warm pass); then its end-to-end rows (small against
# the reference, tiny's 1000-step graph against eager) and the library's MoE kernel tests (the routed launches'
# per-matrix formats). Logs + summary.txt in $OUT.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PJOIN DS4_ATTN_EARLY
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( ${BUDGET:-570} - $(el) )); }
S="$OUT/summary.txt"
nvidia-smi -L | tee "$S"
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$? at +$(el)s" | tee -a "$S"
timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_moe_dp4a_gpu.py > "$OUT/dp4a_tests.log" 2>&1
echo "dp4a tests rc=$?: $(tail -1 "$OUT/dp4a_tests.log") at +$(el)s" | tee -a "$S"
grep -E "FAILED|Error" "$OUT/dp4a_tests.log" | head -8 | tee -a "$S"
timeout 120 python3 scripts/bench_kernels.py --quick --out "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
echo "bench_kernels rc=$? at +$(el)s" | tee -a "$S"; grep -iE "copy|moe fp4 (gate|down|routed)" "$OUT/kernels.log" | head -12 | tee -a "$S"
V=kernels+fused+graph+cap8192
timeout 170 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
  --variants "$V,$V+dp4a,$V,$V+dp4a" --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$? at +$(el)s" | tee -a "$S"; grep -E "^per-layer|copy|warm" "$OUT/bench.log" | tee -a "$S"
l=$(left); if [ $l -gt 30 ]; then
  timeout $l python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_gpu_e2e.py -k "dp4a" > "$OUT/e2e.log" 2>&1
  echo "e2e dp4a rows rc=$?: $(tail -1 "$OUT/e2e.log") at +$(el)s" | tee -a "$S"
  grep -E "FAILED|agreement" "$OUT/e2e.log" | head -6 | tee -a "$S"
else echo "e2e SKIPPED (${l}s left)" | tee -a "$S"; fi
l=$(left); if [ $l -gt 30 ]; then
  timeout $l python3 -m pytest -q -p no:cacheprovider --tb=short -x tests/test_kernels_gpu.py -k "moe" > "$OUT/moe_tests.log" 2>&1
  echo "moe kernel tests rc=$?: $(tail -1 "$OUT/moe_tests.log") at +$(el)s" | tee -a "$S"
else echo "moe kernel tests SKIPPED (${l}s left)" | tee -a "$S"; fi
echo "total $(el)s" | tee -a "$S"
