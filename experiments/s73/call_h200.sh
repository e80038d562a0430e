#!/usr/bin/env bash
# Session 73: issue #7's seed-phase sweep on an H200 (not run there since session 69's fix, b6c49b7), only where the
# call got one: on any other card it stops before building (a call costs its start only).
# Usage (carry build/site): OUT=$OUT bash experiments/s73/call_h200.sh   (then experiments/s71/call.sh's H200 branch)
set -u
nvidia-smi -L; date -u
if ! nvidia-smi -L | grep -q H200; then echo "not an H200: nothing run"; exit 0; fi
BUDGET=${BUDGET:-560} exec bash experiments/s71/call.sh
