#!/usr/bin/env bash
# Session 71, call 2 (one lent GPU): are the per-shape depth / width rules, tuned on H200s (sessions 23-51), also the
# best on the H100s that recent sessions got? One process per layer count, the defaults first and last (drift), each
# knob alone: rd2 / rd8 (routed gate+up depth; rule 4), dn4 (MoE downs; rule 2), lrd4 (the rule-8 kernels), shd4
# (shared gate+up), d4 (one depth for all), w4 / w1 (chunks per lane and row; default 2), mma8 (every FP8 product on
# the tensor cores). On an H200 the seed sweep (experiments/s71/call.sh's H200 branch) runs first.
# Usage: OUT=$OUT bash experiments/s71/tune.sh   (carry build/site; BUDGET=570 s)
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( ${BUDGET:-570} - $(el) )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
if nvidia-smi -L | grep -q H200; then
  JOBS=experiment=seed_phase1,ds4_best,ds4_cuda_graph,seed_phase4,seed_phase6,seed_phase2,seed_phase3,seed_phase5
  timeout 330 python3 -m ds4 ablation=seed_phases model.n_layers=8 tracking=none max_new_tokens=32 $JOBS \
    hydra.sweep.dir=/tmp/sweep_seed > "$OUT/seed_sweep.log" 2>&1
  echo "sweep rc=$? at +$(el)s"
  python3 -m ds4.compare /tmp/sweep_seed --baseline seed_phase1 --no-plot --md "$OUT/seed_phases.md" \
    > "$OUT/seed_compare.log" 2>&1
  echo "compare rc=$?"; cat "$OUT/seed_phases.md"
  (cd /tmp/sweep_seed && tar czf "$OUT/seed_metrics.tgz" */metrics.json)
fi
B=kernels+fused+graph+cap8192
V=$B,$B+rd2,$B+rd8,$B+dn4,$B+lrd4,$B+shd4,$B+d4,$B+w4,$B+w1,$B+mma8,$B
l=$(left); [ $l -lt 60 ] && { echo "tune SKIPPED (${l}s left)"; exit 0; }
timeout $l python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V" --out "$OUT/tune.json" \
  > "$OUT/tune.log" 2>&1
echo "tune rc=$? at +$(el)s"
grep -E "copy bandwidth|us/layer" "$OUT/tune.log"
echo "total $(el)s"
