#!/usr/bin/env bash
# Session 48, run 6 (one lent H200): where one V4-Flash layer's grouped prompt MoE spends its time
# (experiments/s47/probe_grouped.py) on the final code.
set -u
OUT=${OUT:-/tmp/ds4_out}
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0
python3 scripts/build_ext.py -q > /tmp/build0.log 2>&1; echo "build rc=$?"; tail -2 /tmp/build0.log
timeout 300 python3 experiments/s47/probe_grouped.py 2>&1 | tee "$OUT/probe_grouped.log" | tail -12
