#!/usr/bin/env bash
# Session 80, call 1 (one lent GPU): DS4_H_COPIES (session 79's unrun trial, experiments/s79/h_copies.diff applied:
# the one-token MoE gate+up writes h R times, the down's block b stages copy b mod R). Why: session 79's probe put the
# routed down's staging of h (24 KB, all 256 blocks reading the same lines right after the PDL wait) at about 3.1 us
# alone whatever the load path (thread loads, bulk copies, no weight loads in flight); spreading the reads over R times
# the lines tests whether those shared lines (their L2 slices) bound it.
# Steps: the library's build and the probe build beside it; the trial's GPU tests and graph = eager
# [fused-hc_fold-h_copies]; the slope with R = 4, 8 interleaved in one process; the probe with R = 1, 4, 8.
# Logs: one tarball in $OUT. The trial is out of the tree (not faster): first git apply -3 experiments/s79/h_copies.diff.
# Usage (carry build/site): OUT=$OUT bash experiments/s80/call1.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA DS4_BULK_STAGE DS4_H_COPIES
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
L=/tmp/s80_logs1; rm -rf "$L"; mkdir -p "$L"
finish() { tar czf "$OUT/logs.tgz" -C "$L" .; echo "total $(el)s"; }
trap finish EXIT
nvidia-smi -L; date -u
PROBE_ENV=(DS4_NVCC_FLAGS=-DDS4_MOE_PROBE DS4_EXT_BUILD_DIR="$PWD/.ext_build_probe" DS4_ATTN_NVCC_FLAGS=
           DS4_ATTN_EXT_BUILD_DIR="$PWD/.ext_build/attn")
python3 scripts/build_ext.py -q > "$L/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { grep -E "error" "$L/build.log" | head -20; tail -20 "$L/build.log"; exit 1; }
env "${PROBE_ENV[@]}" python3 scripts/build_ext.py -q > "$L/build_probe.log" 2>&1 &
PB=$!
timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_staging_trials_gpu.py -k h_copies \
  > "$L/trial_tests.log" 2>&1
echo "trial tests rc=$? at +$(el)s: $(tail -1 "$L/trial_tests.log")"; grep -E "FAILED|ERROR|Error" "$L/trial_tests.log" | head
G=tests/test_gpu_e2e.py::test_cuda_graph_matches_eager_1000_steps
timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short "$G[fused-hc_fold-h_copies]" > "$L/graph.log" 2>&1
echo "graph = eager rc=$? at +$(el)s: $(tail -1 "$L/graph.log")"; grep -E "FAILED|ERROR" "$L/graph.log" | head
wait $PB; prc=$?; echo "probe build rc=$prc at +$(el)s"
if [ $prc -eq 0 ]; then
  for r in 1 8 4; do
    env "${PROBE_ENV[@]}" DS4_H_COPIES=$r DS4_NO_JIT=1 timeout 50 python3 scripts/probe_moe_step.py --layers 8 \
      --replays 6 --out "$L/probe_h$r.json" > "$L/probe_h$r.log" 2>&1
    echo "probe copies=$r rc=$? at +$(el)s"; sed -n '/^step/,$p' "$L/probe_h$r.log"
  done
fi
B=kernels+fused+graph+cap8192
V="$B,$B+hcopy8,$B+hcopy4,$B,$B+hcopy8,$B+hcopy4"
DS4_NO_JIT=1 timeout 200 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V" \
  --out "$L/bench.json" > "$L/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer|Error" "$L/bench.log"
