#!/usr/bin/env bash
# Session 84, call 5 (one lent GPU): the GPU tests around what this session changed in the library — the bindings of
# moe_gate_up / moe_down (kernel kinds SPLITK / SPLITK_K, the optional w2 / s2), gate_up_pairs' hook, the split-K pair
# — at the final commit: the MoE kernel tests, the integer-pipe gate+up, qat's staged kernels, the one-launch FFN, the
# pair's own tests, and graph = eager on tiny for the fused rows. Logs: one tarball in $OUT.
# Usage (carry build/site): OUT=$OUT bash experiments/s84/call5.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA DS4_BULK_STAGE DS4_MOE_SPLITK DS4_MOE_FFN
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
L=/tmp/s84_call5; rm -rf "$L"; mkdir -p "$L"
snap() { tar czf "$OUT/logs.tgz" -C "$L" .; }
trap 'snap; echo "total $(el)s"' EXIT
nvidia-smi -L; date -u; git log --oneline -1 2>/dev/null
python3 scripts/build_ext.py -q > "$L/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { grep -E "error" "$L/build.log" | head -20; tail -20 "$L/build.log"; exit 1; }
export DS4_NO_JIT=1
left() { echo $(( 560 - $(el) )); }
run() {  # name, pytest args...
  local n=$1; shift
  [ "$(left)" -lt 20 ] && { echo "$n skipped at +$(el)s"; return; }
  timeout "$(left)" python3 -m pytest -q -p no:cacheprovider --tb=short "$@" > "$L/$n.log" 2>&1
  echo "$n rc=$? at +$(el)s: $(tail -1 "$L/$n.log")"; grep -E "^FAILED|^ERROR" "$L/$n.log" | head -8; snap
}
run splitk tests/test_moe_splitk_gpu.py
run moe tests/test_kernels_gpu.py -k "moe" tests/test_moe_dp4a_gpu.py tests/test_moe_ffn_gpu.py
run qat tests/test_qat_cuda_gpu.py
run graph tests/test_gpu_e2e.py -k "graph_matches_eager_1000_steps and (kernels or fused-hc_fold or fused-dp4a)"
