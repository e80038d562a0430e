#!/usr/bin/env bash
# Session 91, call 2 (one lent GPU, H100 or H200: an A/B inside the call): session 90's ceiling diagnostic again,
# with wo_a's PDL trigger at its start (xwoa2, DS4_X_WOA_EARLY=2). Call 1 (`experiments/s90/call1.sh`) measured xwoa
# 2.0 us per layer slower; its timeline showed wo_a's charge 6 us shorter but wo_b's 6 us longer: xwoa's trigger sat in
# its late begin(), so wo_b lost the early launch it gets during a plain wo_a. The diagnostic is not in the tree:
# `x_woa_early.diff` beside this script (csrc/gemv.cu, the bench tokens, its GPU test), applied to the device's copy.
#   0. apply the diff; 1. build; 2. the diagnostic's kernel tests and the grouped GEMV tests; 3. the slope (4 and 12
#   layers), the defaults and xwoa2, three interleaved passes in one process; 4. 8-layer timelines of the
#   defaults and xwoa2 (6 replays each).
# Logs: one tarball in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s90/call1.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA DS4_BULK_STAGE DS4_X_WOA_EARLY
unset DS4_EXT_BUILD_DIR DS4_ATTN_EXT_BUILD_DIR
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
L=/tmp/s91_call2; rm -rf "$L"; mkdir -p "$L"
snap() { tar czf "$OUT/logs.tgz" -C "$L" .; }
trap 'snap; echo "total $(el)s"' EXIT
nvidia-smi -L; date -u
D=experiments/s91/x_woa_early.diff
git apply $D 2>/dev/null || patch -p1 -s < $D || { echo "the diff did not apply"; exit 1; }
python3 scripts/build_ext.py -q > "$L/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { grep -E "error" "$L/build.log" | head -20; tail -20 "$L/build.log"; exit 1; }
export DS4_NO_JIT=1
timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_kernels_gpu.py \
  -k "x_woa or grouped or fp8t" > "$L/units.log" 2>&1
echo "kernel tests rc=$? at +$(el)s: $(tail -1 "$L/units.log")"; grep -E "FAILED|ERROR" "$L/units.log" | head; snap
B=kernels+fused+graph+cap8192
R=$B,$B+xwoa2
timeout 240 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$R,$R,$R" \
  --out "$L/bench.json" > "$L/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer|Error" "$L/bench.log"; snap
for s in 0 2; do
  export DS4_X_WOA_EARLY=$s
  timeout 60 python3 scripts/profile_step.py --layers 8 --variant kernels+fused+cap8192 --timeline \
    --timeline-replays 6 --out "$L/profile_x$s.json" > "$L/profile_x$s.log" 2>&1
  echo "profile x$s rc=$? at +$(el)s"; sed -n 4,10p "$L/profile_x$s.log"; snap
done
