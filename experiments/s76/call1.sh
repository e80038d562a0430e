#!/usr/bin/env bash
# Session 76, call 1 (one lent GPU). What runs depends on the card the call got:
#   - H200: issue #7's seed-phase sweep and the defaults' slope (experiments/s71/call.sh's H200 branch; not run on
#     an H200 since session 69's fix).
#   - otherwise: session 75's unrun shared-expert programmatic fork (experiments/s75/call5.sh, with
#     experiments/s75/shared_programmatic_fork.diff applied to the device's copy of the tree first).
# Usage (carry build/site): OUT=$OUT bash experiments/s76/call1.sh
set -u
if nvidia-smi -L | grep -q H200; then BUDGET=560 exec bash experiments/s71/call.sh; fi
D=experiments/s75/shared_programmatic_fork.diff
git apply $D 2>/dev/null || patch -p1 -s < $D || { echo "the diff did not apply"; exit 1; }
echo "applied experiments/s75/shared_programmatic_fork.diff"
BUDGET=330 exec bash experiments/s75/call5.sh
