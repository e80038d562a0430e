#!/usr/bin/env bash
# Session 77, call 3 (one lent GPU): the MoE down's early loads after its PDL wait (DS4_DOWN_EARLY, the default;
# nodnearly the form before): `add` loaded right after the wait, h staged in one round trip in the fold's form.
#   1. the library's build, then the probe build (main extension only);
#   2. GPU tests: the hc fold tests (incl. the early loads' bit-exactness), the MoE kernel tests, moe_ffn,
#      graph = eager [fused] and [fused-hc_fold];
#   3. the slope: defaults against nodnearly, three interleaved passes; 4. the step probe with and without.
# Logs in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s77/call3.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA DS4_DOWN_EARLY
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
PROBE_ENV=(DS4_NVCC_FLAGS=-DDS4_MOE_PROBE DS4_ATTN_NVCC_FLAGS= DS4_EXT_BUILD_DIR="$PWD/.ext_build_probe"
           DS4_ATTN_EXT_BUILD_DIR="$PWD/.ext_build/attn")
env "${PROBE_ENV[@]}" python3 scripts/build_ext.py -q > "$OUT/build_probe.log" 2>&1 &
PB=$!
timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_hc_fold_gpu.py tests/test_moe_ffn_gpu.py \
  tests/test_kernels_gpu.py -k "fold or moe or step_probe" > "$OUT/units.log" 2>&1
echo "kernel tests rc=$? at +$(el)s: $(tail -1 "$OUT/units.log")"; grep -E "FAILED|ERROR" "$OUT/units.log" | head
G=tests/test_gpu_e2e.py::test_cuda_graph_matches_eager_1000_steps
timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short "$G[fused]" "$G[fused-hc_fold]" > "$OUT/graph.log" 2>&1
echo "graph = eager rc=$? at +$(el)s: $(tail -1 "$OUT/graph.log")"; grep -E "FAILED|ERROR" "$OUT/graph.log" | head
B=kernels+fused+graph+cap8192
R=$B,$B+nodnearly
timeout 120 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$R,$R,$R" --out "$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer" "$OUT/bench.log"
wait $PB; prc=$?; echo "probe build rc=$prc at +$(el)s"
if [ $prc -eq 0 ]; then
  for e in 1 0; do
    DS4_DOWN_EARLY=$e env "${PROBE_ENV[@]}" timeout 60 python3 scripts/probe_moe_step.py --layers 8 --replays 6 \
      --out "$OUT/probe_early$e.json" > "$OUT/probe_early$e.log" 2>&1
    echo "probe DS4_DOWN_EARLY=$e rc=$? at +$(el)s"; sed -n '/^medians/,$p' "$OUT/probe_early$e.log" | sed -n '/^step/,$p'
  done
fi
echo "total $(el)s"
