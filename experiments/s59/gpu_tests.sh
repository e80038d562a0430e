#!/usr/bin/env bash
# Session 59, one call on one lent GPU: the GPU tests written without a GPU in sessions 58 and 59, most important
# first, each under its own limit and all inside the call's budget (BUDGET seconds from the start; a group that
# does not fit is reported as skipped). Logs and summary.txt in $OUT.
#   bash experiments/s59/gpu_tests.sh            # first call: build, then groups 1..
#   ONLY="graph_fused long_context" bash ...    # a later call: those groups only
# Session 60 added the sweep_* groups (every one-GPU module, not in the default list): experiments/s60/run3.sh.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS
BUDGET=${BUDGET:-575}
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi -L | tee "$OUT/summary.txt"
git log --oneline -1 | tee -a "$OUT/summary.txt"
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$? at +$(el)s" | tee -a "$OUT/summary.txt"
PT="python3 -m pytest -q -p no:cacheprovider --tb=short -s"
run() {  # name limit pytest-args...
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - $(el) ))
  if [ $left -lt 30 ]; then echo "$name SKIPPED (${left}s left)" | tee -a "$OUT/summary.txt"; return; fi
  [ $limit -gt $left ] && limit=$left
  timeout "$limit" $PT "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? (limit ${limit}s) at +$(el)s: $(grep -E '[0-9]+ (passed|failed|skipped|error)' "$OUT/$name.log" | tail -1)" \
    | tee -a "$OUT/summary.txt"
  grep -hE "^FAILED|^ERROR|agreement|part at|Error:" "$OUT/$name.log" | head -8
}
G=${ONLY:-"graph_new s59_kernels argmax e2e_new graph_fused long_context"}
for g in $G; do
  case $g in
    graph_new) run graph_new 150 tests/test_gpu_e2e.py -k "max_seq_len or sampled_generate or graph_pool" ;;
    s59_kernels) run s59_kernels 90 tests/test_attn_kernels_gpu.py -k "zero_sinkhorn or past_the_grid" ;;
    argmax) run argmax 60 tests/test_kernels_gpu.py -k argmax ;;
    e2e_new) run e2e_new 240 tests/test_gpu_e2e.py -k "qat_options or rounding_allows or 1000_steps_on_small" ;;
    graph_fused) run graph_fused 90 "tests/test_gpu_e2e.py::test_cuda_graph_matches_eager_1000_steps[fused]" ;;
    long_context) run long_context 150 tests/test_decode_glue_gpu.py -k long_context ;;
    sweep_attn) run sweep_attn 120 tests/test_attn_kernels_gpu.py ;;
    sweep_kernels) run sweep_kernels 150 tests/test_kernels_gpu.py tests/test_hc_fold_gpu.py tests/test_moe_ffn_gpu.py ;;
    sweep_glue_qat) run sweep_glue_qat 90 tests/test_decode_glue_gpu.py tests/test_qat_cuda_gpu.py ;;
    sweep_capture_ar) run sweep_capture_ar 60 tests/test_capture_join_gpu.py tests/test_allreduce_1gpu.py ;;
    sweep_e2e) run sweep_e2e 400 tests/test_gpu_e2e.py -k "not qat_options and not rounding_allows and not \
1000_steps_on_small and not sampled_generate and not tp2" ;;
    # session 61: sweep_e2e in two halves (it ran past 310 s with 8 of its tests done), and the router test fixed
    # (-k ride: test_router_refuses_a_ride_it_cannot_take and a dequant test whose name holds "strided"; the router's
    # other ride tests ran in sweep_kernels)
    router_ride) run router_ride 60 tests/test_kernels_gpu.py -k "ride" ;;
    e2e_rest_graph) run e2e_rest_graph 300 tests/test_gpu_e2e.py -k "not options_agree and not long_prompt and not \
qat_options and not rounding_allows and not 1000_steps_on_small and not sampled_generate and not tp2" ;;
    e2e_rest_options) run e2e_rest_options 330 tests/test_gpu_e2e.py -k "options_agree and (HC_ROUTER or HC_FOLD or \
FP4_TILE or MOE_FFN)" ;;
    # (the two rows of e2e_rest_options that its time did not reach)
    e2e_ffn) run e2e_ffn 200 tests/test_gpu_e2e.py -k "options_agree and MOE_FFN" ;;
  esac
done
echo "--- summary"; cat "$OUT/summary.txt"
