#!/usr/bin/env bash
# Session 71's device calls (one lent GPU). What runs depends on the card the call got:
#   - H200: issue #7's seed-phase sweep (`python -m ds4 ablation=seed_phases model.n_layers=8`), not yet run on an
#     H200 since session 69's fix of the merged BF16 wo rows (b6c49b7); then the defaults' slope (4 and 12 layers).
#   - H100: the six plain options-against-reference rows that session 70's budget cut (they passed in session 69 on
#     the code before the fix), by node id; then the defaults' slope where time is left.
# Logs in $OUT; the sweep's eight metrics.json files travel as one tarball (a call returns at most 8 files).
# Usage (device call, carry build/site: hydra-core 1.3.8, omegaconf 2.3.1, antlr4 4.9.3, PyYAML 6.0.4 installed
# with `pip install --no-deps --target build/site`): OUT=$OUT bash experiments/s71/call.sh   (BUDGET=570 s)
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( ${BUDGET:-570} - $(el) )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
bench() {
  local l=$(left); [ $l -lt 40 ] && { echo "bench SKIPPED (${l}s left)"; return; }
  [ $l -gt 120 ] && l=120
  timeout $l python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants kernels+fused+graph+cap8192 \
    --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "bench rc=$? at +$(el)s"; grep -E "us/layer|slope" "$OUT/bench.log" | tail -4
}
if nvidia-smi -L | grep -q H200; then
  JOBS=experiment=seed_phase1,ds4_best,ds4_cuda_graph,seed_phase4,seed_phase6,seed_phase2,seed_phase3,seed_phase5
  timeout 330 python3 -m ds4 ablation=seed_phases model.n_layers=8 tracking=none max_new_tokens=32 $JOBS \
    hydra.sweep.dir=/tmp/sweep_seed > "$OUT/seed_sweep.log" 2>&1
  echo "sweep rc=$? at +$(el)s"
  python3 -m ds4.compare /tmp/sweep_seed --baseline seed_phase1 --no-plot --md "$OUT/seed_phases.md" \
    > "$OUT/seed_compare.log" 2>&1
  echo "compare rc=$?"; cat "$OUT/seed_phases.md"
  (cd /tmp/sweep_seed && tar czf "$OUT/seed_metrics.tgz" */metrics.json)
  bench
else
  T=tests/test_gpu_e2e.py::test_options_agree_with_reference_on_small
  l=$(left); [ $l -gt 420 ] && l=420
  timeout $l python3 -m pytest -v -p no:cacheprovider --tb=short \
    "$T[all-fused,DS4_HC_FOLD=1,MMA=all]" "$T[all-fused,DS4_HC_FOLD=1,MMA=all,DS4_HC_QKV=1]" \
    "$T[all-fused,DS4_FP4_TILE=0]" "$T[all-fused,DS4_MOE_FFN=1]" "$T[all-fused,DS4_MOE_FFN=1,HC_FOLD=1,MMA=all]" \
    "$T[all-fused,moe=fp4_dp4a]" > "$OUT/options_rest.log" 2>&1
  echo "options_rest rc=$? at +$(el)s: $(tail -1 "$OUT/options_rest.log")"
  grep -E "PASSED|FAILED|ERROR" "$OUT/options_rest.log"
  bench
fi
echo "total $(el)s"
