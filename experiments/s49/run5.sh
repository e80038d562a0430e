#!/usr/bin/env bash
# Session 49, run 5 (one lent H200): scheduling priorities carried by each launch (DS4_NODE_PRIORITY=invert, bench
# token nprio: cudaLaunchAttributePriority, the inverse of the launch stream's priority). Session 36's mprio put the
# captured stream above the side streams, with no change; whether a graph's kernel nodes kept that priority was not
# checked. A launch attribute is kept by the node. With sprio (side streams at -1) the main chain's kernels get priority
# -1 and the side branches' 0. The end-to-end graph tests under the knob, then the slope. Its code is 1a53b5e with
# experiments/s49_attempts/node_priority.diff applied (reverted after).
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
t0=$(date +%s); st() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
st build; python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$?"; tail -n 1 "$OUT/build.log"
st pytest
DS4_NODE_PRIORITY=invert DS4_SIDE_PRIORITY=high timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short \
  tests/test_gpu_e2e.py -k "cuda_graph_matches_eager_1000_steps and not tp2 and (kernels or optins)" > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"; tail -n 2 "$OUT/pytest.log"
st bench
V=kernels+fused+graph+cap8192
timeout 330 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
  --variants "$V,$V+sprio+nprio,$V+sprio,$V+sprio+nprio,$V" --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
st done
grep -v '^{' "$OUT/bench.log" | grep -v "^\s*$" | tail -n 14
