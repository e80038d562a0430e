#!/usr/bin/env bash
# Session 77, call 4 (one lent GPU): the activation staging of the one-token tensor-core kernels starting at a
# 128-byte line of its own per block (DS4_STAGE_ROT, csrc/mma_dot.cuh stage_mma_rows; the alt build with 0 is the form
# before). Why: the routed down's 256 blocks all read the same 24 KB of h right after the same PDL wait (call 3).
#   1. the library's build (rotation on), then the alt build (-DDS4_STAGE_ROT=0, main extension only) beside
#   2. the GPU tests (the MoE / GEMV kernel tests, moe_ffn, the hc fold, graph = eager [fused]);
#   3. the slope in two processes: the build, then the alt build (two passes each).
# NOT RUN in session 77 (no device time was left): the change is not in the tree. Apply it first:
#   git apply experiments/s77/stage_rot.diff
# Logs in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s77/call4.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
ALT_ENV=(DS4_NVCC_FLAGS=-DDS4_STAGE_ROT=0 DS4_ATTN_NVCC_FLAGS= DS4_EXT_BUILD_DIR="$PWD/.ext_build_alt"
         DS4_ATTN_EXT_BUILD_DIR="$PWD/.ext_build/attn")
env "${ALT_ENV[@]}" python3 scripts/build_ext.py -q > "$OUT/build_alt.log" 2>&1 &
AB=$!
timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_kernels_gpu.py tests/test_moe_ffn_gpu.py \
  tests/test_hc_fold_gpu.py -k "fp4t or fp8t or fold" > "$OUT/units.log" 2>&1
echo "kernel tests rc=$? at +$(el)s: $(tail -1 "$OUT/units.log")"; grep -E "FAILED|ERROR" "$OUT/units.log" | head
G=tests/test_gpu_e2e.py::test_cuda_graph_matches_eager_1000_steps
timeout 45 python3 -m pytest -q -p no:cacheprovider --tb=short "$G[fused]" > "$OUT/graph.log" 2>&1
echo "graph = eager rc=$? at +$(el)s: $(tail -1 "$OUT/graph.log")"
wait $AB; arc=$?; echo "alt build rc=$arc at +$(el)s"
B=kernels+fused+graph+cap8192
for run in rot alt; do
  if [ $run = alt ]; then [ $arc -ne 0 ] && continue; E=("${ALT_ENV[@]}"); else E=(); fi
  env "${E[@]}" timeout 60 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$B,$B" \
    --out "$OUT/bench_$run.json" > "$OUT/bench_$run.log" 2>&1
  echo "bench $run rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer" "$OUT/bench_$run.log"
done
echo "total $(el)s"
