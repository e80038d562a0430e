#!/usr/bin/env bash
# The seed-phase ablation (issue 7) on a lent 4-GPU (or 2-GPU) H200 machine, in one call:
#   GPU 0:    python -m ds4 ablation=seed_phases model.n_layers=8            (one GPU, full width)
#   GPUs 2-3: torchrun ... ablation=seed_phases parallel.tp=2                (the whole model)
# then ds4.compare turns each sweep into a markdown table with speedups vs seed_phase1.
# Carry .whl (hydra-core, omegaconf, antlr4) as the device README shows. Results land in $OUT.
set -u
OUT=${OUT:-/tmp/ds4_out}; L=/tmp/ds4_logs; mkdir -p "$OUT" "$L"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 MAX_JOBS=32 TORCH_CUDA_ARCH_LIST="9.0"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
NGPU=$(nvidia-smi -L | wc -l); nvidia-smi -L; date -u; git log -1 --format=%h 2>/dev/null
python3 scripts/build_ext.py -q > "$L/build.log" 2>&1 || { tail -30 "$L/build.log"; exit 1; }
COMMON="tracking=none max_new_tokens=32"
CUDA_VISIBLE_DEVICES=0 timeout 540 python3 -m ds4 ablation=seed_phases model.n_layers=8 $COMMON \
  hydra.sweep.dir="$L/seed_1gpu" > "$L/seed_1gpu.log" 2>&1 &
if [ "$NGPU" -ge 4 ]; then TP_GPUS=2,3; else TP_GPUS=0,1; wait; fi
CUDA_VISIBLE_DEVICES=$TP_GPUS timeout 540 torchrun --nproc-per-node 2 -m ds4 ablation=seed_phases parallel.tp=2 \
  task.fidelity=false $COMMON hydra.sweep.dir="$L/seed_tp2" > "$L/seed_tp2.log" 2>&1 &
wait
for s in seed_1gpu seed_tp2; do
  python3 -m ds4.compare "$L/$s" --baseline seed_phase1 --md "$OUT/$s.md" --out "$OUT/$s.png"
done
for f in "$L"/*.log; do echo "##### $f"; tail -n 40 "$f"; done > "$OUT/logs.txt"
