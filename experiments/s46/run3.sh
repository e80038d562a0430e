#!/usr/bin/env bash
# Session 46, run 3 (one lent H200): the seed-phase sweep (issue #7's ablation) on today's code, 8 layers of
# V4-Flash, all eight jobs in one sweep, then ds4.compare's table and chart.
set -u
OUT=${OUT:-/tmp/ds4_out}
bash scripts/gpu_lease.sh seed 2>&1 | sed -n '/^--- /,$p'
cp /tmp/ds4_logs/seed_1gpu.log "$OUT/seed_1gpu.log" 2>/dev/null
