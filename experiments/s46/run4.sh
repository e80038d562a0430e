#!/usr/bin/env bash
# Session 46, run 4 (one lent H200): MoE prefill past 64 tokens. The new GPU test (chunked kernels against the torch
# reference at 37 / 100 tokens), then prefill tok/s at 32 / 128 / 512 / 2048 prompt tokens on 8 layers of V4-Flash
# (ds4_best, `python -m ds4 task=bench`), with the MoE's chunk limit at today's 64 (DS4_MOE_CHUNKED_TOKENS=64: longer
# prompts take the torch reference's expert loop) and with every prompt in chunks (DS4_MOE_CHUNKED_TOKENS=1048576).
set -u
OUT=${OUT:-/tmp/ds4_out}
export PYTEST_ARGS="tests/test_kernels_gpu.py" PYTEST_K="moe_prefill_chunks or moe_routed_fp4 or prepare_lays_shared"
bash scripts/gpu_lease.sh pytest 2>&1 | sed -n '/^--- /,$p'
export PYTHONPATH=/tmp/site:$PWD
for lim in 64 1048576; do
  DS4_MOE_CHUNKED_TOKENS=$lim timeout 240 python3 -m ds4 task=bench experiment=ds4_best model=v4_flash \
    model.n_layers=8 tracking=none max_new_tokens=8 task.fidelity=false "task.prefill_lens=[32,128,512,2048]" \
    hydra.run.dir=/tmp/ds4_prefill_$lim > "$OUT/prefill_$lim.log" 2>&1
  echo "== DS4_MOE_CHUNKED_TOKENS=$lim rc=$?"; grep -E "TTFT|prefill|TPOT median" "$OUT/prefill_$lim.log"
done
