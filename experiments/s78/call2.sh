#!/usr/bin/env bash
# Session 78, call 2 (one lent GPU): the hc fold's epilogue in the DS4_FOLD_PASS form (csrc/hc_fold.cuh
# hc_fold_sums: the streams' values formed first, each (tile, mix) sum over 8 lanes and 3 shuffles) against the form
# before (the alt build, -DDS4_FOLD_PASS=0). Why: call 1's step probe put 1.79 us of the MoE down's blocks in the
# fold's pass, a few hundred cycles of arithmetic by count.
# Steps: the library's build; the alt build and the probe build (the new form) beside; the GPU tests (the fold,
# moe_ffn, MoE / GEMV kernels, graph = eager [fused] and [fused-hc_fold]); the slope in three processes (new, alt,
# new; two passes each); the probe; on an H200, issue #7's seed sweep. Logs in $OUT (one tarball).
# Usage (carry build/site): OUT=$OUT bash experiments/s78/call2.sh
# (As run, its closing tar failed, "file changed as we read it", so the logs did not come back beyond 8 files;
# call3.sh writes its logs outside $OUT and tars them from there.)
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
ATTN=(DS4_ATTN_NVCC_FLAGS= DS4_ATTN_EXT_BUILD_DIR="$PWD/.ext_build/attn")
ALT_ENV=(DS4_NVCC_FLAGS=-DDS4_FOLD_PASS=0 DS4_EXT_BUILD_DIR="$PWD/.ext_build_alt" "${ATTN[@]}")
PROBE_ENV=(DS4_NVCC_FLAGS=-DDS4_MOE_PROBE DS4_EXT_BUILD_DIR="$PWD/.ext_build_probe" "${ATTN[@]}")
env "${ALT_ENV[@]}" python3 scripts/build_ext.py -q > "$OUT/build_alt.log" 2>&1 &
AB=$!
env "${PROBE_ENV[@]}" python3 scripts/build_ext.py -q > "$OUT/build_probe.log" 2>&1 &
PB=$!
timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_hc_fold_gpu.py tests/test_moe_ffn_gpu.py \
  tests/test_kernels_gpu.py -k "fold or moe or gemv" > "$OUT/units.log" 2>&1
echo "kernel tests rc=$? at +$(el)s: $(tail -1 "$OUT/units.log")"; grep -E "FAILED|ERROR" "$OUT/units.log" | head
G=tests/test_gpu_e2e.py::test_cuda_graph_matches_eager_1000_steps
timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short "$G[fused]" "$G[fused-hc_fold]" > "$OUT/graph.log" 2>&1
echo "graph = eager rc=$? at +$(el)s: $(tail -1 "$OUT/graph.log")"; grep -E "FAILED|ERROR" "$OUT/graph.log" | head
wait $AB; arc=$?; echo "alt build rc=$arc at +$(el)s"
wait $PB; prc=$?; echo "probe build rc=$prc at +$(el)s"
B=kernels+fused+graph+cap8192
for run in new alt new2; do
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
if nvidia-smi -L | grep -q H200; then  # issue #7's seed sweep on an H200 (none since session 46): as s75/call4.sh
  JOBS=experiment=seed_phase1,ds4_best,ds4_cuda_graph,seed_phase4,seed_phase6,seed_phase2,seed_phase3,seed_phase5
  timeout 300 python3 -m ds4 ablation=seed_phases model.n_layers=8 tracking=none max_new_tokens=32 $JOBS \
    hydra.sweep.dir=/tmp/sweep_seed > "$OUT/seed_sweep.log" 2>&1
  echo "sweep rc=$? at +$(el)s"
  python3 -m ds4.compare /tmp/sweep_seed --baseline seed_phase1 --no-plot --md "$OUT/seed_phases.md" \
    > "$OUT/seed_compare.log" 2>&1
  echo "compare rc=$?"; cat "$OUT/seed_phases.md"
  (cd /tmp/sweep_seed && tar czf "$OUT/seed_metrics.tgz" */metrics.json)
fi
echo "total $(el)s"
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude='call*.out' . &&
  find . -type f ! -name logs.tgz ! -name 'call*.out' -delete)
