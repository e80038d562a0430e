#!/usr/bin/env bash
# Session 63, run 1 (one lent GPU, one call): build; the GPU tests of the opt-in L2 requests of the attention rows
# (DS4_ATTN_L2: the window write and the compressor steps request the rows the attention core and the indexer's scores
# read later in the step) and the 1000-step graph-vs-eager row that carries them; the slope with and without them
# (alternating; the bench's warm pass runs first: its first run on a GPU); the 8-layer step's wall time at context 64
# and at position 65536 without them, at 1 MiB and at 8 MiB (profile_step, no timeline). Logs + summary.txt in $OUT.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PJOIN DS4_ATTN_EARLY DS4_ATTN_L2
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
S="$OUT/summary.txt"
nvidia-smi -L | tee "$S"
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$? at +$(el)s" | tee -a "$S"
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_decode_glue_gpu.py -k "kv_store or compress_step" \
  > "$OUT/glue.log" 2>&1; echo "glue tests rc=$?: $(tail -1 "$OUT/glue.log") at +$(el)s" | tee -a "$S"
timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_gpu_e2e.py \
  -k "test_cuda_graph_matches_eager_1000_steps and optins" > "$OUT/graph.log" 2>&1
echo "graph test (tiny, optins) rc=$?: $(tail -1 "$OUT/graph.log") at +$(el)s" | tee -a "$S"
DS4_ATTN_L2=1024 timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_gpu_e2e.py \
  -k "1000_steps_on_small and one_graph" > "$OUT/graph_small.log" 2>&1
echo "graph test (small, DS4_ATTN_L2=1024) rc=$?: $(tail -1 "$OUT/graph_small.log") at +$(el)s" | tee -a "$S"
V=kernels+fused+graph+cap8192
timeout 150 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
  --variants "$V,$V+l2k1024,$V,$V+l2k1024" --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$? at +$(el)s" | tee -a "$S"; grep -E "^per-layer|copy|warm" "$OUT/bench.log" | tee -a "$S"
for l2 in 0 1024 8192; do
  left=$(( ${BUDGET:-560} - $(el) ))
  [ $left -lt 40 ] && { echo "profile l2=$l2 SKIPPED (${left}s left)" | tee -a "$S"; continue; }
  DS4_ATTN_L2=$l2 timeout $left python3 scripts/profile_step.py --layers 8 --variant kernels+fused \
    --long-context 65536 --out "$OUT/profile_l2_$l2.json" > "$OUT/profile_l2_$l2.log" 2>&1
  echo "profile DS4_ATTN_L2=$l2 rc=$? at +$(el)s" | tee -a "$S"; grep -E "^step wall" "$OUT/profile_l2_$l2.log" | tee -a "$S"
done
echo "total $(el)s" | tee -a "$S"
