#!/usr/bin/env bash
# Session 91, call 2 (one lent GPU, H100 or H200: an A/B inside the call): session 90's ceiling diagnostic again,
# with wo_a's PDL trigger at its start (xwoa2, DS4_X_WOA_EARLY=2). Call 1 (`experiments/s90/call1.sh`) measured xwoa
# 2.0 us per layer slower; its timeline showed wo_a's charge 6 us shorter but wo_b's 6 us longer: xwoa's trigger sat in
# its late begin(), so wo_b lost the early launch it gets during a plain wo_a. The diagnostic is not in the tree:
# `x_woa_early.diff` beside this script (csrc/gemv.cu, the bench tokens, its GPU test), applied to the device's copy.
#   0. apply the diff; 1. build; 2. the diagnostic's kernel tests and the grouped GEMV tests; 3. the slope (4 and 12
#   layers), the defaults and xwoa2, three interleaved passes in one process; 4. 8-layer timelines of the
#   defaults and xwoa2 (6 replays each).
# Logs: one tarball in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s91/call2.sh
X_DIFF=experiments/s91/x_woa_early.diff X_TOKEN=xwoa2 X_MODE=2 X_LOGS=/tmp/s91_call2 \
  exec bash "$(dirname "$0")/../s90/call1.sh"
