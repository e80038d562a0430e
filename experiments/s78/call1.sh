#!/usr/bin/env bash
# Session 78, call 1 (one lent GPU):
#   A. the activation staging of the one-token tensor-core kernels starting at a 128-byte line of its own per block
#      (DS4_STAGE_ROT, csrc/mma_dot.cuh stage_mma_rows; the alt build with 0 is the form before). Why: the routed
#      down's 256 blocks all read the same 24 KB of h right after the same PDL wait (session 77, call 3).
#   B. the MoE step probe with the down's epilogue split (marks 8, 9: rows stored, the hc fold's copies landed). Why:
#      the epilogue took 2.56 us in the step against 0.26 alone (session 77, call 2); the fold's arithmetic is
#      a few hundred cycles by count.
# Steps: the library's build (rotation on); the alt build (-DDS4_STAGE_ROT=0) and the probe build beside; the GPU tests
# (MoE / GEMV / fold kernels, moe_ffn, graph = eager [fused]); the slope, rotation then alt, one process each (two
# passes); the probe. Logs in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s78/call1.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
ATTN=(DS4_ATTN_NVCC_FLAGS= DS4_ATTN_EXT_BUILD_DIR="$PWD/.ext_build/attn")
ALT_ENV=(DS4_NVCC_FLAGS=-DDS4_STAGE_ROT=0 DS4_EXT_BUILD_DIR="$PWD/.ext_build_alt" "${ATTN[@]}")
PROBE_ENV=(DS4_NVCC_FLAGS=-DDS4_MOE_PROBE DS4_EXT_BUILD_DIR="$PWD/.ext_build_probe" "${ATTN[@]}")
env "${ALT_ENV[@]}" python3 scripts/build_ext.py -q > "$OUT/build_alt.log" 2>&1 &
AB=$!
env "${PROBE_ENV[@]}" python3 scripts/build_ext.py -q > "$OUT/build_probe.log" 2>&1 &
PB=$!
timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_kernels_gpu.py tests/test_moe_ffn_gpu.py \
  tests/test_hc_fold_gpu.py -k "fp4t or fp8t or fold or gemv or moe or step_probe" > "$OUT/units.log" 2>&1
echo "kernel tests rc=$? at +$(el)s: $(tail -1 "$OUT/units.log")"; grep -E "FAILED|ERROR" "$OUT/units.log" | head
G=tests/test_gpu_e2e.py::test_cuda_graph_matches_eager_1000_steps
timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short "$G[fused]" > "$OUT/graph.log" 2>&1
echo "graph = eager rc=$? at +$(el)s: $(tail -1 "$OUT/graph.log")"
wait $AB; arc=$?; echo "alt build rc=$arc at +$(el)s"
wait $PB; prc=$?; echo "probe build rc=$prc at +$(el)s"
B=kernels+fused+graph+cap8192
for run in rot alt; do
  if [ $run = alt ]; then [ $arc -ne 0 ] && continue; E=("${ALT_ENV[@]}"); else E=(); fi
  env "${E[@]}" timeout 60 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$B,$B" \
    --out "$OUT/bench_$run.json" > "$OUT/bench_$run.log" 2>&1
  echo "bench $run rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer" "$OUT/bench_$run.log"
done
if [ $prc -eq 0 ]; then
  env "${PROBE_ENV[@]}" timeout 60 python3 scripts/probe_moe_step.py --layers 8 --replays 6 --out "$OUT/probe.json" \
    > "$OUT/probe.log" 2>&1
  echo "probe rc=$? at +$(el)s"; sed -n '/^medians/,$p' "$OUT/probe.log"
fi
echo "total $(el)s"
