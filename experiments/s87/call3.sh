#!/usr/bin/env bash
# Session 87, call 3 (one lent H200, if one starts): the defaults' decode slope on an H200, the first since
# session 79 (sessions 80-87 ran on H100s). The default build; the weight kernels alone (bench_kernels.py: the dense
# GEMV rows, then the routed MoE rows); then the slope (4 and 12 layers), three processes. Logs: one tarball in $OUT.
# Usage (carry build/site): OUT=$OUT [BUDGET=seconds, default 400] bash experiments/s87/call3.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA DS4_BULK_STAGE DS4_MOE_SPLITK DS4_MOE_FFN
unset DS4_EXT_BUILD_DIR DS4_ATTN_EXT_BUILD_DIR
BUDGET=${BUDGET:-400}
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
L=/tmp/s87_call3; rm -rf "$L"; mkdir -p "$L"
snap() { tar czf "$OUT/logs.tgz" -C "$L" .; }
trap 'snap; echo "total $(el)s"' EXIT
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$L/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { grep -E "error" "$L/build.log" | head -20; tail -20 "$L/build.log"; exit 1; }
export DS4_NO_JIT=1
for mode in dense moe; do
  args=(--quick --dense-only); [ $mode = moe ] && args=(--moe-bound)
  timeout 60 python3 scripts/bench_kernels.py "${args[@]}" > "$L/kernels_$mode.log" 2>&1
  echo "kernels $mode rc=$? at +$(el)s"; grep -E "^  (fp8|moe)" "$L/kernels_$mode.log" | head -14; snap
done
B=kernels+fused+graph+cap8192
for i in 1 2 3; do
  [ "$(el)" -gt $((BUDGET - 40)) ] && { echo "the rest skipped at +$(el)s"; break; }
  timeout 100 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$B,$B" \
    --out "$L/bench_$i.json" > "$L/bench_$i.log" 2>&1
  echo "bench $i rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer|Error" "$L/bench_$i.log" | tail -3; snap
done
