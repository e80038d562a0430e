#!/usr/bin/env bash
# Session 46, run 5 (one lent H200): the MoE prefill chunk limit at its new default (8192). The op-level GPU test
# (chunked kernels and the torch expert loop against moe=dequant, 37 / 100 / 9000 tokens) and a 200-token prompt on
# `small` with every option fused, both limits, against the reference; then prefill tok/s at 2048 and 8000 prompt
# tokens on 8 layers of V4-Flash (ds4_best): the new default against the old limit (DS4_MOE_CHUNKED_TOKENS=64).
set -u
OUT=${OUT:-/tmp/ds4_out}
export PYTEST_ARGS="tests/test_kernels_gpu.py tests/test_gpu_e2e.py" PYTEST_K="moe_prefill_chunks or long_prompt"
bash scripts/gpu_lease.sh pytest 2>&1 | sed -n '/^--- /,$p'
export PYTHONPATH=/tmp/site:$PWD
for lim in default 64; do
  if [ $lim = default ]; then unset DS4_MOE_CHUNKED_TOKENS; else export DS4_MOE_CHUNKED_TOKENS=$lim; fi
  timeout 200 python3 -m ds4 task=bench experiment=ds4_best model=v4_flash model.n_layers=8 tracking=none \
    max_new_tokens=8 task.fidelity=false "task.prefill_lens=[2048,8000]" hydra.run.dir=/tmp/ds4_prefill_$lim \
    > "$OUT/prefill_run5_$lim.log" 2>&1
  echo "== DS4_MOE_CHUNKED_TOKENS=$lim rc=$?"; grep -E "TTFT|prefill|TPOT median" "$OUT/prefill_run5_$lim.log"
done
