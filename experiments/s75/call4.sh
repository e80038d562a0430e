#!/usr/bin/env bash
# Session 75, call 4 (one lent GPU): issue #7's seed-phase sweep on whatever card the call got (8 layers of V4-Flash,
# the eight jobs). On an H200 it is the issue's figure (not run there since session 69's fix); on an H100 it checks that
# every seed-phase option still runs on this code (sessions 70-74 changed the kernels since session 69's H100 sweep,
# seed_phases_h100_s69.md) and gives the ratio there. Logs in $OUT; the jobs' metrics.json files as one tarball.
# Usage (carry build/site): OUT=$OUT bash experiments/s75/call4.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
JOBS=experiment=seed_phase1,ds4_best,ds4_cuda_graph,seed_phase4,seed_phase6,seed_phase2,seed_phase3,seed_phase5
timeout 400 python3 -m ds4 ablation=seed_phases model.n_layers=8 tracking=none max_new_tokens=32 $JOBS \
  hydra.sweep.dir=/tmp/sweep_seed > "$OUT/seed_sweep.log" 2>&1
echo "sweep rc=$? at +$(el)s"
python3 -m ds4.compare /tmp/sweep_seed --baseline seed_phase1 --no-plot --md "$OUT/seed_phases.md" \
  > "$OUT/seed_compare.log" 2>&1
echo "compare rc=$?"; cat "$OUT/seed_phases.md"
(cd /tmp/sweep_seed && tar czf "$OUT/seed_metrics.tgz" */metrics.json)
date -u; echo "total $(el)s"
