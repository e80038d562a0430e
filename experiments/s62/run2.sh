#!/usr/bin/env bash
# Session 62, run 2 (one lent GPU, one call): the attention branches joined to the chunk kernel by programmatic edges
# (DS4_PJOIN=attn, opt-in; bench token pja), and the chunk kernel's early rows (DS4_ATTN_EARLY=1, opt-in; token
# early). Build, the tests that exercise them (the site's rule, early's bits, the capture-join test; graph vs eager
# over 1000 steps on tiny with every join site, and on small with the attention site and early rows), then the slope
# A/B in one process. Logs and summary.txt in $OUT.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PJOIN
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
S="$OUT/summary.txt"
nvidia-smi -L | tee "$S"
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$? at +$(el)s" | tee -a "$S"
PT="python3 -m pytest -q -p no:cacheprovider --tb=short"
run() {  # name limit pytest-args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" $PT "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? at +$(el)s: $(grep -E '[0-9]+ (passed|failed|skipped|error)' "$OUT/$name.log" | tail -1)" | tee -a "$S"
  grep -hE "^FAILED|^ERROR|Error:" "$OUT/$name.log" | head -8
}
run site 90 tests/test_decode_glue_gpu.py tests/test_capture_join_gpu.py -k "join or early"
E2E=tests/test_gpu_e2e.py::test_cuda_graph_matches_eager_1000_steps
DS4_ATTN_EARLY=1 run graph_tiny 120 "$E2E[fused-programmatic_join]" "$E2E[fused]"
DS4_PJOIN=attn DS4_ATTN_EARLY=1 run graph_small 150 tests/test_gpu_e2e.py -k "1000_steps_on_small and one_graph"
V=kernels+fused+graph+cap8192
left=$(( 580 - $(el) ))
if [ $left -gt 60 ]; then
  timeout $left python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
    --variants "$V,$V+pja,$V+pja+early,$V,$V+pja,$V+pja+early" --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "bench rc=$? at +$(el)s" | tee -a "$S"; grep -E "^per-layer|copy|programmatic" "$OUT/bench.log" | tee -a "$S"
  python3 -c "
import json
for r in json.load(open('$OUT/bench.json'))['rows']:
    print(r['n_layers'], r['variant'], 'joins', r.get('programmatic_joins'), 'tpot', round(r['tpot_ms'], 4))
" 2>&1 | tee -a "$S"
else echo "bench SKIPPED (${left}s left)" | tee -a "$S"; fi
echo "total $(el)s" | tee -a "$S"
