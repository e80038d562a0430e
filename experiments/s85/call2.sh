#!/usr/bin/env bash
# Session 85, call 2 (one lent GPU): the end-to-end rows call 1 left unfinished (its options
# process hit the time limit after 14 rows): four processes side by side on the one GPU. Logs: a tarball in $OUT.
# Usage (carry build/site): OUT=$OUT bash experiments/s85/call2.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA DS4_BULK_STAGE DS4_MOE_SPLITK DS4_MOE_FFN
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
L=/tmp/s85_call2; rm -rf "$L"; mkdir -p "$L"
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
run e2e_moe $E -k "options_agree and (MOE_FFN or SPLITK)"
run e2e_dp4a $E -k "options_agree and dp4a"
run e2e_qat $E -k "qat_options"
run e2e_fused $E -k "all_fused or bf16_dense"
wait
snap
for f in "$L"/*.log; do echo "== $(basename "$f")"; grep -E "^FAILED|^ERROR|passed|failed" "$f" | tail -6; done
