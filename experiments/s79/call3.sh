#!/usr/bin/env bash
# Session 79, call 3 (one lent GPU): DS4_H_COPIES (the trial: the one-token MoE gate+up writes h R times, the down's
# block b stages copy b mod R). Why: call 1's probe put the routed down's staging of h (24 KB, all 256 blocks reading
# the same lines right after the PDL wait) at about 3.1 us alone whatever the load path (thread loads, bulk copies, no
# weight loads in flight); spreading the reads over R times the lines tests whether those shared lines bound it.
# Steps (cut to fit the 469 s of device time left): the library's build; the GPU tests
# (tests/test_staging_trials_gpu.py, the MoE kernels, graph = eager [fused], [fused-hc_fold], [fused-hc_fold-h_copies]);
# the slope with R = 4, 8 interleaved in one process; with PROBE=1 also the probe build and the probe with R = 1, 4, 8.
# Logs: one tarball in $OUT. SLIM=1 (for 289 s of device time left): the trial's own tests only, no graph test, the
# slope's variants R = 1, 4, 8, 1.
# Not run in session 79 (too little device time was left to start a machine). The trial is not in the tree: first,
# here, git apply experiments/s79/h_copies.diff (it adds the trial and its tests, tests/test_bulk_stage_gpu.py renamed
# tests/test_staging_trials_gpu.py), then
# Usage (carry build/site): [SLIM=1] OUT=$OUT bash experiments/s79/call3.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA DS4_BULK_STAGE DS4_H_COPIES
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
L=/tmp/s79_logs3; rm -rf "$L"; mkdir -p "$L"
finish() { tar czf "$OUT/logs.tgz" -C "$L" .; echo "total $(el)s"; }
trap finish EXIT
nvidia-smi -L; date -u
PROBE_ENV=(DS4_NVCC_FLAGS=-DDS4_MOE_PROBE DS4_EXT_BUILD_DIR="$PWD/.ext_build_probe" DS4_ATTN_NVCC_FLAGS=
           DS4_ATTN_EXT_BUILD_DIR="$PWD/.ext_build/attn")
python3 scripts/build_ext.py -q > "$L/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { grep -E "error" "$L/build.log" | head -20; tail -20 "$L/build.log"; exit 1; }
PB=
if [ "${PROBE:-0}" = 1 ]; then
  env "${PROBE_ENV[@]}" python3 scripts/build_ext.py -q > "$L/build_probe.log" 2>&1 &
  PB=$!
fi
K=(); [ "${SLIM:-0}" = 1 ] && K=(-k h_copies)
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_staging_trials_gpu.py "${K[@]}" \
  > "$L/trial_tests.log" 2>&1
echo "trial tests rc=$? at +$(el)s: $(tail -1 "$L/trial_tests.log")"
grep -E "FAILED|ERROR|Error" "$L/trial_tests.log" | head
[ "${SLIM:-0}" = 1 ] || timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_hc_fold_gpu.py \
  tests/test_moe_ffn_gpu.py tests/test_kernels_gpu.py -k "moe" > "$L/units.log" 2>&1
echo "kernel tests rc=$? at +$(el)s: $(tail -1 "$L/units.log")"; grep -E "FAILED|ERROR" "$L/units.log" | head
G=tests/test_gpu_e2e.py::test_cuda_graph_matches_eager_1000_steps
[ "${SLIM:-0}" = 1 ] || timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short "$G[fused]" "$G[fused-hc_fold]" \
  "$G[fused-hc_fold-h_copies]" > "$L/graph.log" 2>&1
echo "graph = eager rc=$? at +$(el)s: $(tail -1 "$L/graph.log")"; grep -E "FAILED|ERROR" "$L/graph.log" | head
B=kernels+fused+graph+cap8192
V="$B,$B+hcopy4,$B+hcopy8,$B,$B+hcopy4,$B+hcopy8"; [ "${SLIM:-0}" = 1 ] && V="$B,$B+hcopy4,$B+hcopy8,$B"
DS4_NO_JIT=1 timeout 200 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V" \
  --out "$L/bench.json" > "$L/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer|Error" "$L/bench.log"
if [ -n "$PB" ] && wait $PB; then
  for r in 1 4 8; do
    env "${PROBE_ENV[@]}" DS4_H_COPIES=$r DS4_NO_JIT=1 timeout 60 python3 scripts/probe_moe_step.py --layers 8 \
      --replays 6 --out "$L/probe_h$r.json" > "$L/probe_h$r.log" 2>&1
    echo "probe copies=$r rc=$? at +$(el)s"
    sed -n '/^medians/,$p' "$L/probe_h$r.log" | grep -E "^alone|^step|down block"
  done
fi
