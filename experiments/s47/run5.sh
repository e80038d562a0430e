#!/usr/bin/env bash
# Session 48, run 5 (one lent H200): numbers in the bindings' messages as text (csrc/check_text.h) — the dequant op's
# throws, each in its own process; the GPU tests of sessions 47-48's prefill paths (chunk limit 128) and of messages
# with numbers; then the whole GEMV/MoE and attention kernel modules (the bindings changed throughout); then the
# default prefill (no knobs) of 8 layers of V4-Flash.
set -u
OUT=${OUT:-/tmp/ds4_out}
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0
python3 scripts/build_ext.py -q > /tmp/build0.log 2>&1; echo "build rc=$?"; tail -2 /tmp/build0.log
for c in ok fmt cpu scale; do
  timeout 60 python3 experiments/s47/dequant_throw.py $c > /tmp/throw_$c.log 2>&1; echo "== $c rc=$? $(tail -1 /tmp/throw_$c.log)"
done
K="dequant or prefill or linear_impl or prompt_routing or grouped or long_prompt or hc_pre_post_head or hc_post_pre"
K="$K or sparse_prompt or fused_attention_class or sparse_multi or chunk or number_raises"
export PYTEST_ARGS="tests/test_kernels_gpu.py tests/test_gpu_e2e.py tests/test_attn_kernels_gpu.py" PYTEST_K="$K"
bash scripts/gpu_lease.sh pytest 2>&1 | tee "$OUT/pytest_subset.log" | sed -n '/^--- /,$p' | grep -v "^  File\|^    " | tail -12
export PYTHONPATH=/tmp/site:$PWD
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_attn_kernels_gpu.py \
  > "$OUT/pytest_full.log" 2>&1; echo "== full modules rc=$?"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/pytest_full.log" | tail -8
unset DS4_MOE_CHUNKED_TOKENS DS4_PREFILL_ATTN DS4_GROUPED_MM
timeout 100 python3 -m ds4 task=bench experiment=ds4_best model=v4_flash model.n_layers=8 tracking=none \
  max_new_tokens=8 task.fidelity=false task.prompt_len=2048 "task.prefill_lens=[128,256,2048]" \
  hydra.run.dir=/tmp/ds4_prefill_default > "$OUT/prefill_default.log" 2>&1
echo "== default rc=$?"; grep -E "prefill @|TPOT median" "$OUT/prefill_default.log" | tr -s ' ' | paste -sd' '
