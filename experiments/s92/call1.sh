#!/usr/bin/env bash
# Session 92, call 1 (one lent GPU; either kind): session 91's call 2 and, on an H200 only, session 89's figures, in
# one call so that one machine start serves both. Neither ran in session 91 or 92 (no machine started).
#   1. `experiments/s91/call2.sh`: the head-group pipeline's wo_a half bounded by the diagnostic xwoa2 (an A/B inside
#      the call: the slope of the defaults and of xwoa2, three interleaved passes, and their 8-layer timelines).
#   2. On an H200 only: the diagnostic's diff taken off again (its build is incremental: gemv.cu alone), then
#      `experiments/s88/call1.sh` without its slope (step 1 measured the defaults' slope on the same GPU): issue #7's
#      seed sweep (8 layers, the eight jobs) and its table, and the weight kernels alone. On an H100 it stops after
#      step 1: sessions 80-91 measured the tree's defaults on H100s many times.
# Logs: $OUT/xwoa2/logs.tgz and $OUT/seed/logs.tgz. Usage (carry build/site; about 200 s on an H100, about 400 s on an
# H200; the tool's limit 600 s): OUT=$OUT bash experiments/s92/call1.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT/xwoa2" "$OUT/seed"
HERE=$(dirname "$0"); D=experiments/s91/x_woa_early.diff
OUT=$OUT/xwoa2 bash "$HERE/../s91/call2.sh"
if ! nvidia-smi -L | grep -q H200; then echo "not an H200: the seed sweep not run"; exit 0; fi
git apply -R $D 2>/dev/null || patch -R -p1 -s < $D || { echo "the diff did not come off: nothing more run"; exit 1; }
OUT=$OUT/seed BUDGET=0 bash "$HERE/../s88/call1.sh"
