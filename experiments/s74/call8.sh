#!/usr/bin/env bash
# Session 74, call 8 (one lent GPU): the final tree's GPU tests around what changed (the combine's and the hc finishes'
# early triggers are the defaults): the attention kernels, the decode glue, and the decode end to end (all fused
# against the reference on small, graph = eager in every form, the Sinkhorn ride, batch-1 / teacher-forced replays).
# Logs in $OUT. Usage (carry build/site): BUDGET=300 OUT=$OUT bash experiments/s74/call8.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_ACT_QUANT DS4_L2_PREFETCH DS4_COMBINE_TRIGGER DS4_HC_TRIGGER \
  DS4_ROUTER_TRIGGER
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( ${BUDGET:-300} - $(el) )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_attn_kernels_gpu.py \
  tests/test_decode_glue_gpu.py > "$OUT/units.log" 2>&1
echo "attention + glue rc=$? at +$(el)s: $(tail -1 "$OUT/units.log")"; grep -E "FAILED|ERROR" "$OUT/units.log" | head
l=$(left); [ $l -lt 20 ] && { echo "e2e SKIPPED"; exit 0; }
timeout $l python3 -m pytest -v -p no:cacheprovider --tb=short tests/test_gpu_e2e.py \
  -k "all_fused_agree or 1000_steps or sinkhorn_ride or batch1_graph or teacher_forced" > "$OUT/e2e.log" 2>&1
echo "e2e rc=$? at +$(el)s: $(tail -1 "$OUT/e2e.log")"; grep -cE "PASSED" "$OUT/e2e.log"; grep -E "FAILED|ERROR" "$OUT/e2e.log" | head
echo "total $(el)s"
