#!/usr/bin/env bash
# Session 88, call 4 (only if the device tool lends an H200; on any other GPU it exits at once, to spend no more of
# the session's last device time): session 87's H200 slope script (`experiments/s87/call3.sh`: the default build,
# the weight kernels alone, the slope) within the time left.
# Usage (carry build/site): OUT=$OUT bash experiments/s88/call4.sh
set -u
nvidia-smi -L
if ! nvidia-smi -L | grep -q H200; then echo "not an H200: nothing run"; exit 0; fi
BUDGET=${BUDGET:-230} exec bash "$(dirname "$0")/../s87/call3.sh"
