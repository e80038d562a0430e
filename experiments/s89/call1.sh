#!/usr/bin/env bash
# Session 89, call 1 (asked for nvidia-h200; only if the device tool lends an H200, else it exits at once so that an
# H100, measured in sessions 80-88, spends no more device time): session 88's call 1 (`experiments/s88/call1.sh`: the
# default build, issue #7's seed sweep and its table, the weight kernels alone, the slope) on the H200.
# Usage (carry build/site): OUT=$OUT bash experiments/s89/call1.sh
set -u
nvidia-smi -L
if ! nvidia-smi -L | grep -q H200; then echo "not an H200: nothing run"; exit 0; fi
exec bash "$(dirname "$0")/../s88/call1.sh"
