#!/usr/bin/env bash
# Session 84, call 2 (one lent GPU): call 1 measured the split-K pair slower than the separate launches (alone 43.41
# against 38.87 us; the step 121.4 against 114.0 us per layer, H100). Its down phase reads each (row, chunk) piece of
# w2 in fp4t: 16 bytes every 64, four other blocks' chunks between them. This call times it with w2 in the chunk-major
# fp4k layout (ds4.quant.chunk_fp4_splitk: every warp load 512 contiguous bytes, a block's columns one run) beside the
# fp4t form and the separate pair, alone (bench_kernels.py --moe-bound, twice), after the pair's GPU tests (both
# layouts). Logs: one tarball in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s84/call2.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA DS4_BULK_STAGE DS4_MOE_SPLITK DS4_MOE_FFN
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
L=/tmp/s84_call2; rm -rf "$L"; mkdir -p "$L"
snap() { tar czf "$OUT/logs.tgz" -C "$L" .; }
trap 'snap; echo "total $(el)s"' EXIT
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$L/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { grep -E "error" "$L/build.log" | head -20; tail -20 "$L/build.log"; exit 1; }
export DS4_NO_JIT=1
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_moe_splitk_gpu.py \
  > "$L/splitk_tests.log" 2>&1
echo "splitk tests rc=$? at +$(el)s: $(tail -1 "$L/splitk_tests.log")"
grep -E "^FAILED|^ERROR|Error:" "$L/splitk_tests.log" | head -12; snap
for i in 1 2; do
  timeout 100 python3 scripts/bench_kernels.py --moe-bound > "$L/bench_kernels_$i.log" 2>&1
  echo "bench_kernels $i rc=$? at +$(el)s"; grep -E "^  moe fp4|Error" "$L/bench_kernels_$i.log"; snap
done
