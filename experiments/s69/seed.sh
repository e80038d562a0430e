#!/usr/bin/env bash
# Session 69's second device call (one lent GPU): issue #7's seed-phase sweep through the user's entry point, on
# today's code (last run in session 46, commit 518b88e): 8 layers of V4-Flash, all eight jobs in one multirun, then
# ds4.compare's table against seed_phase1 of the same sweep. Logs and each job's metrics.json in $OUT.
# Usage (device call, carry build/site: hydra-core 1.3.8, omegaconf 2.3.1, antlr4 4.9.3 and PyYAML 6.0.4 installed
# with `pip install --no-deps --target build/site` from the workstation's venv):
#   OUT=$OUT bash experiments/s69/seed.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/seed_build.log" 2>&1; echo "build rc=$? at +$(el)s"
JOBS=experiment=seed_phase1,ds4_best,ds4_cuda_graph,seed_phase4,seed_phase6,seed_phase2,seed_phase3,seed_phase5
timeout ${SWEEP_S:-330} python3 -m ds4 ablation=seed_phases model.n_layers=8 tracking=none max_new_tokens=32 $JOBS \
  hydra.sweep.dir=/tmp/sweep_seed > "$OUT/seed_sweep.log" 2>&1
echo "sweep rc=$? at +$(el)s"
python3 -m ds4.compare /tmp/sweep_seed --baseline seed_phase1 --no-plot --md "$OUT/seed_phases.md" \
  > "$OUT/seed_compare.log" 2>&1
echo "compare rc=$?"; cat "$OUT/seed_phases.md"
for f in /tmp/sweep_seed/*/metrics.json; do cp "$f" "$OUT/seed_metrics_$(basename $(dirname $f)).json"; done
grep -E "auto ->|resolved" "$OUT/seed_sweep.log" | head -4
echo "total $(el)s"
