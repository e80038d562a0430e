#!/usr/bin/env bash
# Session 72, call 4 (one lent GPU): the rest of the GPU tests that the indexer's new out_f32 argument and the staged
# q_up's row skip reach — the attention kernels module and the end-to-end graph and all-fused rows on `small` — on the
# committed code.
# Usage: OUT=$OUT bash experiments/s72/call4.sh   (carry build/site; BUDGET=500 s)
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_ACT_QUANT
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( ${BUDGET:-500} - $(el) )); }
nvidia-smi -L; date -u; git log --oneline -1 2>/dev/null
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short -n 4 tests/test_attn_kernels_gpu.py > "$OUT/attn.log" 2>&1
echo "attn rc=$? at +$(el)s: $(tail -1 "$OUT/attn.log")"; grep -E "^FAILED|^ERROR" "$OUT/attn.log" | head -8
l=$(left); [ $l -lt 40 ] && { echo "e2e SKIPPED"; exit 0; }
timeout $l python3 -m pytest -v -p no:cacheprovider --tb=short tests/test_gpu_e2e.py \
  -k "all_fused_agree or 1000_steps_on_small or batch1_graph or teacher_forced_logits_replay" > "$OUT/e2e.log" 2>&1
echo "e2e rc=$? at +$(el)s: $(tail -1 "$OUT/e2e.log")"; grep -E "PASSED|FAILED|ERROR" "$OUT/e2e.log" | head -12
echo "total $(el)s"
