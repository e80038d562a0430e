#!/usr/bin/env bash
# Session 84, call 1 (one lent GPU): the routed experts' split-K pair (csrc/moe_splitk.cu, DS4_MOE_SPLITK=1, bench
# token splitk), written this session without a GPU. Steps: the library's build; the pair's GPU tests
# (tests/test_moe_splitk_gpu.py); the routed MoE rows alone (bench_kernels.py --moe-bound: the separate pair, the
# split-K pair, the bound); the slope, one process per variant: the library's default, splitk, again both; then, as
# time allows, small's end-to-end option row and the separate kernels' tests (their bindings changed).
# Logs: one tarball in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s84/call1.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA DS4_BULK_STAGE DS4_MOE_SPLITK DS4_MOE_FFN
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
L=/tmp/s84_call1; rm -rf "$L"; mkdir -p "$L"
snap() { tar czf "$OUT/logs.tgz" -C "$L" .; }
trap 'snap; echo "total $(el)s"' EXIT
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$L/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { grep -E "error" "$L/build.log" | head -20; tail -20 "$L/build.log"; exit 1; }
export DS4_NO_JIT=1
py() { timeout "$1" python3 -m pytest -q -p no:cacheprovider --tb=short "${@:2}"; }
py 150 tests/test_moe_splitk_gpu.py > "$L/splitk_tests.log" 2>&1
echo "splitk tests rc=$? at +$(el)s: $(tail -1 "$L/splitk_tests.log")"
grep -E "^FAILED|^ERROR|Error:|assert" "$L/splitk_tests.log" | head -12; snap
timeout 100 python3 scripts/bench_kernels.py --moe-bound > "$L/bench_kernels.log" 2>&1
echo "bench_kernels rc=$? at +$(el)s"; grep -E "moe fp4|Error" "$L/bench_kernels.log"; snap
B=kernels+fused+graph+cap8192
i=0
for v in "$B" "$B+splitk" "$B" "$B+splitk"; do
  [ "$(el)" -gt 420 ] && { echo "the rest of the slopes skipped at +$(el)s"; break; }
  i=$((i + 1))
  timeout 100 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$v,$v" \
    --out "$L/bench_$i.json" > "$L/bench_$i.log" 2>&1
  echo "bench $i $v rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer|Error" "$L/bench_$i.log" | tail -3; snap
done
left() { echo $(( 570 - $(el) )); }
if [ "$(left)" -gt 60 ]; then
  T=tests/test_gpu_e2e.py::test_options_agree_with_reference_on_small
  py "$(left)" -s "$T[all-fused,DS4_MOE_SPLITK=1,HC_FOLD=1,MMA=all]" > "$L/e2e_small.log" 2>&1
  echo "small e2e rc=$? at +$(el)s: $(tail -1 "$L/e2e_small.log")"; grep -E "^agreement|^FAILED" "$L/e2e_small.log"
  snap
fi
if [ "$(left)" -gt 40 ]; then
  py "$(left)" tests/test_kernels_gpu.py -k "moe_routed_fp4 or fp4p_layout" tests/test_bulk_stage_gpu.py \
    > "$L/regress.log" 2>&1
  echo "regression rc=$? at +$(el)s: $(tail -1 "$L/regress.log")"; grep -E "^FAILED" "$L/regress.log" | head
fi
