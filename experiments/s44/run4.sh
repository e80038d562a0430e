#!/usr/bin/env bash
# Session 44, run 4 (one lent H200): same-process-machine A/B of the two long-context knobs in the 8-layer step at
# position 1048000 (defaults; the indexer at one chunk per block as before; the attention's splits uncapped as
# before), then the end-to-end graph / agreement tests that run the changed kernels in the whole model.
set -u
OUT=${OUT:-/tmp/ds4_out}
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$?"
export PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
for knob in none DS4_INDEXER_BLOCKS_PER_SM=1000 DS4_SPARSE_MAX_SPLITS=100000; do
  log="$OUT/profile_1m_$knob.log"
  env $( [ "$knob" != none ] && echo "$knob" ) timeout 120 python3 scripts/profile_step.py --layers 8 \
    --variant kernels+fused --timeline --long-context 1048000 > "$log" 2>&1
  echo "== $knob rc=$?"; grep -E "^step wall" "$log"
  awk '/^on the critical path/{n++} n==2' "$log" | grep -E "indexer_kernel|sparse_c|topk" | head -n 4
done
PYTHONUNBUFFERED=1 timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/test_gpu_e2e.py \
  -k "batch1_graph or (agree_with_reference and gemv_cuda and fused_cuda and not DS4)" > "$OUT/e2e.log" 2>&1
echo "e2e rc=$?"; tail -n 5 "$OUT/e2e.log"
