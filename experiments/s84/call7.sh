#!/usr/bin/env bash
# Session 84, call 7 (one lent GPU): the review's mend of moe=fp4_topk's split-K selection (splitk_refusal, its
# warning): the pair's GPU tests, the MoE op's, and small's end-to-end row with it. Logs: one tarball in $OUT.
# Usage (carry build/site): OUT=$OUT bash experiments/s84/call7.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_MOE_SPLITK DS4_MOE_FFN
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
L=/tmp/s84_call7; rm -rf "$L"; mkdir -p "$L"
trap 'tar czf "$OUT/logs.tgz" -C "$L" .; echo "total $(el)s"' EXIT
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$L/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { grep -E "error" "$L/build.log" | head -20; exit 1; }
export DS4_NO_JIT=1
T=tests/test_gpu_e2e.py::test_options_agree_with_reference_on_small
timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_moe_splitk_gpu.py \
  "$T[all-fused,DS4_MOE_SPLITK=1,HC_FOLD=1,MMA=all]" > "$L/tests.log" 2>&1
echo "tests rc=$? at +$(el)s: $(tail -1 "$L/tests.log")"; grep -E "^FAILED|^ERROR" "$L/tests.log" | head
echo "refusal warnings in the log (the calls here are all eligible: 0 expected): $(grep -c 'the separate gate+up and down launches run' "$L/tests.log")"
