#!/usr/bin/env bash
# Session 84, call 6 (an H200 if one comes): the library's defaults on the GPU (the last H200 slope is session
# 79's) and the split-K pair beside them, one process per variant; then the MoE rows alone. Logs: one tarball in $OUT.
# Usage (carry build/site): OUT=$OUT bash experiments/s84/call6.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA DS4_BULK_STAGE DS4_MOE_SPLITK DS4_MOE_FFN
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
L=/tmp/s84_call6; rm -rf "$L"; mkdir -p "$L"
snap() { tar czf "$OUT/logs.tgz" -C "$L" .; }
trap 'snap; echo "total $(el)s"' EXIT
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$L/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { grep -E "error" "$L/build.log" | head -20; tail -20 "$L/build.log"; exit 1; }
export DS4_NO_JIT=1
B=kernels+fused+graph+cap8192
i=0
for v in "$B" "$B+splitk" "$B" "$B+splitk"; do
  [ "$(el)" -gt 480 ] && { echo "the rest skipped at +$(el)s"; break; }
  i=$((i + 1))
  timeout 100 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$v,$v" \
    --out "$L/bench_$i.json" > "$L/bench_$i.log" 2>&1
  echo "bench $i $v rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer|Error" "$L/bench_$i.log" | tail -3; snap
done
[ "$(el)" -lt 520 ] && { timeout 60 python3 scripts/bench_kernels.py --moe-bound > "$L/bench_kernels.log" 2>&1;
  echo "bench_kernels rc=$? at +$(el)s"; grep -E "^  moe fp4|Error" "$L/bench_kernels.log"; }
