#!/usr/bin/env bash
# Session 69's third device call (one lent GPU): the fix for the two seed-sweep jobs that failed in call 2
# (attn=fused_cuda_wo_bf16's merged BF16 wo_b.wo_a, 32768 values a row, sent to the BF16 GEMV launch whose staging
# holds 20480): its GPU tests, then the whole seed sweep again (as experiments/s69/seed.sh).
# Usage (device call, carry build/site): OUT=$OUT bash experiments/s69/gpu3.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/fix_build.log" 2>&1; echo "build rc=$? at +$(el)s"
timeout 150 python3 -m pytest -v -p no:cacheprovider --tb=short tests/test_decode_glue_gpu.py \
  tests/test_kernels_gpu.py -k "merged_wo or linear_bf16 or linear_prefill or gemv_bf16" > "$OUT/fix_tests.log" 2>&1
echo "tests rc=$? at +$(el)s: $(tail -1 "$OUT/fix_tests.log")"; grep -E "FAILED|ERROR" "$OUT/fix_tests.log" | head -5
SWEEP_S=300 bash experiments/s69/seed.sh 2>&1 | grep -v "^GPU 0\|^build rc" | sed 's/^/  /'
rm -f "$OUT"/seed_metrics_*.json "$OUT/seed_build.log"  # (a call brings back at most 8 files: the table has them)
echo "total $(el)s"
