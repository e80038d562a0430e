#!/usr/bin/env bash
# Session 79, call 1 (one lent GPU): DS4_BULK_STAGE (csrc/bulk_stage.cuh; the one-token tensor-core kernels' activations
# staged by bulk copies on the TMA unit: g GEMVs, d MoE downs with their add, u MoE gate+ups). Why: the step probe put
# the routed down's staging of h (24 KB from L2) at 3.3 us in the step and 3.5 alone, against 7.1 of weight stream
# (experiments/session78.md); the staging follows the weight rounds requested before the PDL wait.
# Steps: the library's build and the probe build beside it; the GPU tests (tests/test_bulk_stage_gpu.py, since renamed
# tests/test_staging_trials_gpu.py; the MoE / GEMV / fold kernels; graph = eager [fused], [fused-hc_fold],
# [fused-hc_fold-bulk_stage]); the slope with the bulk sites
# interleaved in one process; the probe without and with bsd (and as diagnostics pj, the programmatic join, and dpre0,
# no weight rounds before the down's wait: is its staging slowed by those rounds' loads in flight?); the
# SASS of the V4 instances (for the load scoreboards); on an H200, issue #7's seed sweep. Logs: one tarball in $OUT.
# Usage (carry build/site): OUT=$OUT bash experiments/s79/call1.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA DS4_BULK_STAGE
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
L=/tmp/s79_logs; rm -rf "$L"; mkdir -p "$L"
finish() { tar czf "$OUT/logs.tgz" -C "$L" .; echo "total $(el)s"; }
trap finish EXIT
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$L/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { grep -E "error" "$L/build.log" | head -20; tail -20 "$L/build.log"; exit 1; }
PROBE_ENV=(DS4_NVCC_FLAGS=-DDS4_MOE_PROBE DS4_EXT_BUILD_DIR="$PWD/.ext_build_probe" DS4_ATTN_NVCC_FLAGS=
           DS4_ATTN_EXT_BUILD_DIR="$PWD/.ext_build/attn")
env "${PROBE_ENV[@]}" python3 scripts/build_ext.py -q > "$L/build_probe.log" 2>&1 &
PB=$!
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_bulk_stage_gpu.py > "$L/bulk_tests.log" 2>&1
echo "bulk tests rc=$? at +$(el)s: $(tail -1 "$L/bulk_tests.log")"
grep -E "FAILED|ERROR|Error" "$L/bulk_tests.log" | head
timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_hc_fold_gpu.py tests/test_moe_ffn_gpu.py \
  tests/test_kernels_gpu.py -k "fold or moe or gemv or spacer" > "$L/units.log" 2>&1
echo "kernel tests rc=$? at +$(el)s: $(tail -1 "$L/units.log")"; grep -E "FAILED|ERROR" "$L/units.log" | head
G=tests/test_gpu_e2e.py::test_cuda_graph_matches_eager_1000_steps
timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short "$G[fused]" "$G[fused-hc_fold]" \
  "$G[fused-hc_fold-bulk_stage]" > "$L/graph.log" 2>&1
echo "graph = eager rc=$? at +$(el)s: $(tail -1 "$L/graph.log")"; grep -E "FAILED|ERROR" "$L/graph.log" | head
B=kernels+fused+graph+cap8192
V="$B,$B+bsd,$B+bsg,$B+bsu,$B+bsdgu,$B+pj,$B+pj+bsd,$B,$B+bsd,$B+bsdgu"
DS4_NO_JIT=1 timeout 240 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V" \
  --out "$L/bench.json" > "$L/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer|Error" "$L/bench.log"
wait $PB; prc=$?; echo "probe build rc=$prc at +$(el)s"
if [ $prc -eq 0 ]; then
  for pv in base bsd pj dpre0; do
    case $pv in base) E=();; bsd) E=(DS4_BULK_STAGE=d);; pj) E=(DS4_PJOIN=moe);; dpre0) E=(DS4_PREFETCH_DOWN=0);; esac
    env "${PROBE_ENV[@]}" "${E[@]}" DS4_NO_JIT=1 timeout 60 python3 scripts/probe_moe_step.py --layers 8 --replays 6 \
      --out "$L/probe_$pv.json" > "$L/probe_$pv.log" 2>&1
    echo "probe $pv rc=$? at +$(el)s"; sed -n '/^step/,$p' "$L/probe_$pv.log"
  done
fi
CUOBJ=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
SO=$(ls .ext_build/*.so 2>/dev/null | head -1)
if [ -n "$SO" ] && [ -x "$CUOBJ" ]; then
  PAT='moe_down_mma_kernelILi4ELi1ELi2ELb0ELb1ELb0E|moe_gate_up_mma_kernelILi4ELi2ELi2ELb0E'
  PAT="$PAT|gemv_mma_kernelILi5ELi4ELi2ELb0ELb0ELb0E"
  "$CUOBJ" -sass "$SO" 2>/dev/null | awk -v pat="$PAT" '/Function : /{p = ($0 ~ pat)} p' \
    | gzip > "$L/sass_v4.txt.gz"; echo "sass: $(zcat "$L/sass_v4.txt.gz" | grep -c 'Function :') functions"
fi
if nvidia-smi -L | grep -q H200; then  # issue #7's seed sweep on an H200 (none since session 46)
  JOBS=experiment=seed_phase1,ds4_best,ds4_cuda_graph,seed_phase4,seed_phase6,seed_phase2,seed_phase3,seed_phase5
  timeout 300 python3 -m ds4 ablation=seed_phases model.n_layers=8 tracking=none max_new_tokens=32 $JOBS \
    hydra.sweep.dir=/tmp/sweep_seed > "$L/seed_sweep.log" 2>&1
  echo "sweep rc=$? at +$(el)s"
  python3 -m ds4.compare /tmp/sweep_seed --baseline seed_phase1 --no-plot --md "$L/seed_phases.md" \
    > "$L/seed_compare.log" 2>&1
  echo "compare rc=$?"; cat "$L/seed_phases.md"
  (cd /tmp/sweep_seed && tar czf "$L/seed_metrics.tgz" */metrics.json)
fi
