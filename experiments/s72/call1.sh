#!/usr/bin/env bash
# Session 72, call 1 (one lent GPU): where numerics=qat's time over plain goes, kernel by kernel on the critical path.
#   - H200 only: issue #7's seed-phase sweep first (session 71's call.sh, not yet run on an H200 since b6c49b7).
#   - Then scripts/profile_step.py --timeline at 8 layers, plain and qat (6 replays' paths each, context 64).
# Logs in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s72/call1.sh   (BUDGET=560 s)
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_ACT_QUANT
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( ${BUDGET:-560} - $(el) )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
if nvidia-smi -L | grep -q H200; then
  JOBS=experiment=seed_phase1,ds4_best,ds4_cuda_graph,seed_phase4,seed_phase6,seed_phase2,seed_phase3,seed_phase5
  timeout 300 python3 -m ds4 ablation=seed_phases model.n_layers=8 tracking=none max_new_tokens=32 $JOBS \
    hydra.sweep.dir=/tmp/sweep_seed > "$OUT/seed_sweep.log" 2>&1
  echo "sweep rc=$? at +$(el)s"
  python3 -m ds4.compare /tmp/sweep_seed --baseline seed_phase1 --no-plot --md "$OUT/seed_phases.md" \
    > "$OUT/seed_compare.log" 2>&1
  echo "compare rc=$?"; cat "$OUT/seed_phases.md"
  (cd /tmp/sweep_seed && tar czf "$OUT/seed_metrics.tgz" */metrics.json)
fi
for v in kernels+fused+cap8192 kernels+fused+cap8192+qat; do
  l=$(left); [ $l -lt 60 ] && { echo "profile $v SKIPPED (${l}s left)"; continue; }
  [ $l -gt 150 ] && l=150
  n=$( [ "${v%qat}" != "$v" ] && echo qat || echo plain )
  timeout $l python3 scripts/profile_step.py --layers 8 --variant $v --timeline --timeline-replays 6 \
    --out "$OUT/profile_$n.json" > "$OUT/profile_$n.log" 2>&1
  echo "profile $n rc=$? at +$(el)s"
done
echo "total $(el)s"
