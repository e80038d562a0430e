#!/usr/bin/env bash
# Session 85, call 1 (one lent GPU): every GPU test module on the tree as it is (no module had run as a whole since
# session 65), four pytest processes side by side on the one GPU (correctness only: no test times anything), then
# the decode slope. Logs: one tarball in $OUT.
# Usage (carry build/site): OUT=$OUT bash experiments/s85/call1.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA DS4_BULK_STAGE DS4_MOE_SPLITK DS4_MOE_FFN
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
L=/tmp/s85_call1; rm -rf "$L"; mkdir -p "$L"
snap() { tar czf "$OUT/logs.tgz" -C "$L" .; }
trap 'snap; echo "total $(el)s"' EXIT
nvidia-smi -L; date -u; git log --oneline -1 2>/dev/null
python3 scripts/build_ext.py -q > "$L/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { grep -E "error" "$L/build.log" | head -20; tail -20 "$L/build.log"; exit 1; }
export DS4_NO_JIT=1
BUDGET=${BUDGET:-560}
left() { echo $(( BUDGET - $(el) )); }
run() {  # name, pytest args... (in the background)
  local n=$1; shift
  ( timeout "$(left)" python3 -m pytest -q -p no:cacheprovider --tb=short --durations=15 "$@" > "$L/$n.log" 2>&1
    echo "$n rc=$? at +$(el)s: $(grep -E "passed|failed|error" "$L/$n.log" | tail -1)" ) &
}
E=tests/test_gpu_e2e.py
run kernels tests/test_kernels_gpu.py tests/test_attn_kernels_gpu.py tests/test_decode_glue_gpu.py \
  tests/test_hc_fold_gpu.py tests/test_bulk_stage_gpu.py tests/test_capture_join_gpu.py tests/test_moe_dp4a_gpu.py \
  tests/test_moe_ffn_gpu.py tests/test_moe_splitk_gpu.py tests/test_qat_cuda_gpu.py tests/test_allreduce_1gpu.py \
  tests/test_allreduce_gpu.py
run e2e_options $E -k "options_agree or long_prompt or qat_options or all_fused or bf16_dense"
run e2e_graph $E -k "test_cuda_graph_matches_eager_1000_steps and not on_small"
run e2e_rest $E -k "not options_agree and not long_prompt and not qat_options and not all_fused and not bf16_dense \
  and not (test_cuda_graph_matches_eager_1000_steps and not on_small)"
wait
snap
for f in "$L"/*.log; do echo "== $(basename "$f")"; grep -E "^FAILED|^ERROR|passed|failed" "$f" | tail -6; done
