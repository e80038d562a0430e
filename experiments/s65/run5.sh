#!/usr/bin/env bash
# Session 65, run 5 (one lent GPU, one call, the session's last device time): where the dp4a step's 1-3 us per layer
# go. profile_step.py --timeline-replays 12 (each kernel's critical-path charge and each layer's attention / FFN side
# as mean +- sd over 12 replays) on 12 layers, V and V+dp4a, twice, alternating. JSON per process under $OUT.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PJOIN DS4_ATTN_EARLY DS4_DP4A_CLAIM
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( ${BUDGET:-330} - $(el) )); }
nvidia-smi -L
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
V=kernels+fused+graph+cap8192
i=0
for v in base dp4a base dp4a; do
  i=$((i + 1))
  l=$(left); [ $l -lt 40 ] && { echo "profile $i $v SKIPPED (${l}s left)"; continue; }
  var=$V; [ $v = dp4a ] && var=$V+dp4a
  timeout $l python3 scripts/profile_step.py --layers 12 --variant "$var" --timeline --timeline-replays 12 \
    --out "$OUT/prof12_${i}_$v.json" > "$OUT/prof12_${i}_$v.log" 2>&1
  echo "== profile $i $v rc=$? at +$(el)s"
  sed -n '/^over 12 replays/,$p' "$OUT/prof12_${i}_$v.log" | grep -vE "^(gemv_kernel|kv_store|compress|indexer|topk|hc_post|hc_partials|hc_finish_kernel|native|argmax|vectorized|Memcpy|Memset|sparse)" | head -34
  grep -E "^step wall" "$OUT/prof12_${i}_$v.log"
done
rm -f "$OUT"/prof12_*.log
echo "total $(el)s"
