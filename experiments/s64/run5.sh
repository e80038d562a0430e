#!/usr/bin/env bash
# Session 64, run 5 (one lent GPU, one call): the user's path — moe=fp4_dp4a through the Hydra entry point, beside
# ds4_best's own choice (auto -> fp4_topk), as one multirun of the bench task on 8 full-width layers of V4-Flash
# (synthetic weights), and ds4.compare's table (speed, and fidelity against the torch reference). Logs in $OUT.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
# hydra-core, omegaconf, antlr4 and yaml: pure-Python copies from the workstation venv, carried as build/site
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi -L
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$? at +$(el)s"
timeout ${SWEEP_S:-300} python3 -m ds4 --multirun experiment=ds4_best moe=auto,fp4_dp4a model=v4_flash model.n_layers=8 \
  task=bench tracking=none hydra.sweep.dir=/tmp/sweep_moe > "$OUT/sweep.log" 2>&1
echo "sweep rc=$? at +$(el)s"
python3 -m ds4.compare /tmp/sweep_moe --no-plot --md "$OUT/moe_dp4a_8l.md" > "$OUT/compare.log" 2>&1
echo "compare rc=$?"; cat "$OUT/moe_dp4a_8l.md"
for f in /tmp/sweep_moe/*/metrics.json; do cp "$f" "$OUT/metrics_$(basename $(dirname $f)).json"; done
grep -E "moe=|resolved|auto ->" "$OUT/sweep.log" | head -6
echo "total $(el)s"
