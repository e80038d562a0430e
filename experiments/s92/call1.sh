#!/usr/bin/env bash
# Session 92, call 1 (one lent GPU; either kind; not run in session 92: no machine started): session 91's call 2, the
# staged wo_a beside it, and on an H200 only session 89's figures, so that one machine start serves all three.
#   1. `experiments/s90/call1.sh` with `x_woa_early`'s successor `x_woa_stage.diff` (beside this script: session 91's
#      xwoa2 diagnostic plus the experiment woas) applied: the build, the kernel tests (x_woa / grouped / fp8t, the
#      woas test among them), the slope of the defaults and xwoa2 (three interleaved passes in one process), their
#      8-layer timelines. Logs: $OUT/xwoa2/logs.tgz.
#   2. The same build: the slope of the defaults and woas (DS4_WOA_STAGE=1: wo_a kept fp8 and streamed through shared
#      memory at one tile per block, 3 of its 4 stages requested before the PDL wait), three interleaved passes, and
#      woas's 8-layer timeline. Logs: $OUT/woas/logs.tgz.
#   3. On an H200 only: the diff taken off again (the ninja build then recompiles what it touched), then
#      `experiments/s88/call1.sh` without its slope (BUDGET=0; step 1 gives the defaults' slope on the same GPU):
#      issue #7's seed sweep (8 layers, the eight jobs) and its table, the weight kernels alone. Logs:
#      $OUT/seed/logs.tgz. On an H100 it stops after step 2.
# Usage (carry build/site; about 300 s on an H100, about 480 s on an H200): OUT=$OUT bash experiments/s92/call1.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT/xwoa2" "$OUT/woas" "$OUT/seed"
HERE=$(dirname "$0"); D=$HERE/x_woa_stage.diff; t0=$(date +%s)
X_DIFF=$D X_TOKEN=xwoa2 X_MODE=2 X_LOGS=/tmp/s92_xwoa2 OUT=$OUT/xwoa2 bash "$HERE/../s90/call1.sh" \
  || { echo "step 1 stopped (the diff or the build): nothing more"; exit 1; }
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 DS4_NO_JIT=1 WANDB_SILENT=true
unset DS4_X_WOA_EARLY DS4_WOA_STAGE
W=/tmp/s92_woas; rm -rf "$W"; mkdir -p "$W"; B=kernels+fused+graph+cap8192; R=$B,$B+woas
snap() { tar czf "$OUT/woas/logs.tgz" -C "$W" .; }
timeout 200 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$R,$R,$R" \
  --out "$W/bench.json" > "$W/bench.log" 2>&1
echo "woas bench rc=$? at +$(( $(date +%s) - t0 ))s"; grep -E "copy bandwidth|us/layer|Error" "$W/bench.log"; snap
DS4_WOA_STAGE=1 timeout 60 python3 scripts/profile_step.py --layers 8 --variant kernels+fused+cap8192 --timeline \
  --timeline-replays 6 --out "$W/profile_woas.json" > "$W/profile_woas.log" 2>&1
echo "woas profile rc=$? at +$(( $(date +%s) - t0 ))s"; sed -n 4,10p "$W/profile_woas.log"; snap
if ! nvidia-smi -L | grep -q H200; then echo "not an H200: the seed sweep not run"; exit 0; fi
git apply -R "$D" 2>/dev/null || patch -R -p1 -s < "$D" || { echo "the diff did not come off: nothing more"; exit 1; }
OUT=$OUT/seed BUDGET=0 bash "$HERE/../s88/call1.sh"
