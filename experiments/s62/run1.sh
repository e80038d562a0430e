#!/usr/bin/env bash
# Session 62, run 1 (one lent GPU, one call): the attention core's flat loads (DS4_SPARSE_FLAT, default on; token
# noflat = the form before). Build (the phase probe compiles beside it), the tests that cover the two kernels
# (bits flat vs not, the torch twin, the 1000-step graph-vs-eager on small), the slope A/B alternating in one process,
# then the probe's per-kernel times (flat 0 / 1, inputs L2-resident). Logs and summary.txt in $OUT.
# It ran at 3aa6d85. The flat form was reverted after it (experiments/s62_attempts/attn_flat_rounds.diff), so on a
# later tree its noflat token is unknown and its bits test absent.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
S="$OUT/summary.txt"
nvidia-smi -L | tee "$S"
( nvcc -std=c++17 -O3 -arch=sm_90 -DDS4_PROBE scripts/probe_phases.cu -o /tmp/probe_bin > "$OUT/probe_build.log" 2>&1;
  echo "probe build rc=$?" >> "$OUT/probe_build.log" ) &
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$? at +$(el)s" | tee -a "$S"
PT="python3 -m pytest -q -p no:cacheprovider --tb=short"
run() {  # name limit pytest-args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" $PT "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? at +$(el)s: $(grep -E '[0-9]+ (passed|failed|skipped|error)' "$OUT/$name.log" | tail -1)" | tee -a "$S"
  grep -hE "^FAILED|^ERROR|Error:" "$OUT/$name.log" | head -8
}
run glue 120 tests/test_decode_glue_gpu.py -k "decode_attention or xcombine or long_context"
run attn 90 tests/test_attn_kernels_gpu.py -k "sparse or fused_attention"
run graph 120 "tests/test_gpu_e2e.py::test_cuda_graph_matches_eager_1000_steps[fused]"
V=kernels+fused+graph+cap8192
left=$(( 545 - $(el) ))
if [ $left -gt 60 ]; then
  timeout $left python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
    --variants "$V,$V+noflat,$V,$V+noflat" --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "bench rc=$? at +$(el)s" | tee -a "$S"; grep -E "^per-layer|copy" "$OUT/bench.log" | tee -a "$S"
else echo "bench SKIPPED (${left}s left)" | tee -a "$S"; fi
wait
left=$(( 590 - $(el) ))
if [ -x /tmp/probe_bin ] && [ $left -gt 10 ]; then
  timeout $left /tmp/probe_bin sparse > "$OUT/probe_sparse.log" 2>&1
  grep -E "sparse_|copy" "$OUT/probe_sparse.log" | tee -a "$S"
else echo "probe SKIPPED ($(tail -1 "$OUT/probe_build.log"), ${left}s left)" | tee -a "$S"; fi
echo "total $(el)s" | tee -a "$S"
