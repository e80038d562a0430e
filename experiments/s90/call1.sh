#!/usr/bin/env bash
# Session 90, call 1 (one lent GPU, H100 or H200: an A/B inside the call): the ceiling of overlapping wo_a's weight
# stream with the attention core (session 89's head-group pipeline, its larger half), by the removal diagnostic xwoa
# (DS4_X_WOA_EARLY=1: wo_a's GEMV stages its activations and multiplies before its PDL wait, writes clamped outputs
# after it; wrong outputs). The diagnostic is not in the tree: `x_woa_early.diff` beside this script (csrc/gemv.cu,
# the bench token, its GPU test), applied here to the device's copy first.
#   0. apply the diff; 1. build; 2. the diagnostic's kernel test and the grouped GEMV tests; 3. the slope (4 and 12
#   layers), the defaults and xwoa, three interleaved passes in one process; 4. 8-layer timelines of both (6 replays
#   each).
# Logs: one tarball in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s90/call1.sh
# Another diff / mode of the diagnostic (session 91's call 2): X_DIFF, X_TOKEN, X_MODE, X_LOGS (defaults below).
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA DS4_BULK_STAGE DS4_X_WOA_EARLY
unset DS4_EXT_BUILD_DIR DS4_ATTN_EXT_BUILD_DIR
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
L=${X_LOGS:-/tmp/s90_call1}; rm -rf "$L"; mkdir -p "$L"
snap() { tar czf "$OUT/logs.tgz" -C "$L" .; }
trap 'snap; echo "total $(el)s"' EXIT
nvidia-smi -L; date -u
D=${X_DIFF:-experiments/s90/x_woa_early.diff}
git apply $D 2>/dev/null || patch -p1 -s < $D || { echo "the diff did not apply"; exit 1; }
python3 scripts/build_ext.py -q > "$L/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { grep -E "error" "$L/build.log" | head -20; tail -20 "$L/build.log"; exit 1; }
export DS4_NO_JIT=1
timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_kernels_gpu.py \
  -k "x_woa or grouped or fp8t" > "$L/units.log" 2>&1
echo "kernel tests rc=$? at +$(el)s: $(tail -1 "$L/units.log")"; grep -E "FAILED|ERROR" "$L/units.log" | head; snap
B=kernels+fused+graph+cap8192
R=$B,$B+${X_TOKEN:-xwoa}
timeout 200 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$R,$R,$R" \
  --out "$L/bench.json" > "$L/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer|Error" "$L/bench.log"; snap
for s in 0 "${X_MODE:-1}"; do
  export DS4_X_WOA_EARLY=$s
  timeout 60 python3 scripts/profile_step.py --layers 8 --variant kernels+fused+cap8192 --timeline \
    --timeline-replays 6 --out "$L/profile_x$s.json" > "$L/profile_x$s.log" 2>&1
  echo "profile x$s rc=$? at +$(el)s"; sed -n 4,10p "$L/profile_x$s.log"; snap
done
