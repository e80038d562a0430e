#!/usr/bin/env bash
# Session 70's device calls (one lent GPU). What runs depends on the card the call got:
#   - H200: issue #7's seed-phase sweep (`python -m ds4 ablation=seed_phases model.n_layers=8`), not run on an H200
#     since session 69's fix of the merged BF16 wo rows (b6c49b7); then the defaults' slope (4 and 12 layers).
#   - H100, MODE=qat (call 1): both qat options rows (session 69's call cut the second), then the slope.
#   - H100, MODE=suite (later calls): the one-GPU test modules on the final code (session 69 ran only the fix's
#     tests), then the end-to-end rows other than the options rows and tp=2, as far as the budget goes.
#   - H100, MODE=options: the end-to-end options-against-reference rows (plain and qat) on the final code.
# Logs in $OUT; the sweep's eight metrics.json files travel as one tarball (a call returns at most 8 files).
# Usage (device call, carry build/site: hydra-core 1.3.8, omegaconf 2.3.1, antlr4 4.9.3, PyYAML 6.0.4 installed
# with `pip install --no-deps --target build/site`): OUT=$OUT bash experiments/s70/call.sh   (BUDGET=570 s)
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
elif [ "${MODE:-qat}" = suite ]; then
  run() {  # name, limit, pytest args...
    local name=$1 lim=$2; shift 2
    local l=$(left); [ $l -lt 20 ] && { echo "$name SKIPPED (${l}s left)"; return; }
    [ $lim -gt $l ] && lim=$l
    timeout $lim python3 -m pytest -q -p no:cacheprovider --tb=short "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$? (limit ${lim}s) at +$(el)s: $(tail -1 "$OUT/$name.log")"
    grep -E "^FAILED|^ERROR" "$OUT/$name.log" | head -8
  }
  run units 150 tests/test_quant.py tests/test_weights.py tests/test_kernels_gpu.py tests/test_hc_fold_gpu.py \
    tests/test_moe_ffn_gpu.py tests/test_capture_join_gpu.py tests/test_allreduce_1gpu.py tests/test_moe_dp4a_gpu.py
  run attn 120 tests/test_attn_kernels_gpu.py
  run glue_qat 100 tests/test_decode_glue_gpu.py tests/test_qat_cuda_gpu.py
  run e2e_rest 600 tests/test_gpu_e2e.py -k "not options_agree and not tp2"
elif [ "${MODE:-qat}" = options ]; then
  timeout $(left) python3 -m pytest -v -p no:cacheprovider --tb=short tests/test_gpu_e2e.py -k "options_agree" \
    > "$OUT/options.log" 2>&1
  echo "options rc=$? at +$(el)s: $(tail -1 "$OUT/options.log")"; grep -cE " PASSED" "$OUT/options.log"
  grep -E "FAILED|ERROR" "$OUT/options.log" | head -8
else
  l=$(left); [ $l -gt 300 ] && l=300
  timeout $l python3 -m pytest -v -p no:cacheprovider --tb=short tests/test_gpu_e2e.py -k "qat_options_agree" \
    > "$OUT/qat_options.log" 2>&1
  echo "qat_options rc=$? at +$(el)s: $(tail -1 "$OUT/qat_options.log")"
  grep -E "PASSED|FAILED|ERROR" "$OUT/qat_options.log"
  bench
fi
echo "total $(el)s"
