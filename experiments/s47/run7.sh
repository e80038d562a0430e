#!/usr/bin/env bash
# Session 48, run 7 (one lent H200): the dequantisation kernel's stores staged through shared memory (512-byte store
# instructions; DS4_DEQUANT_STAGE=0 the direct ones): its GPU tests and the prefill paths' again, the grouped MoE probe
# (both store forms), then the default prefill of 8 layers of V4-Flash (ds4_best).
set -u
OUT=${OUT:-/tmp/ds4_out}
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0
python3 scripts/build_ext.py -q > /tmp/build0.log 2>&1; echo "build rc=$?"; tail -2 /tmp/build0.log
export PYTEST_ARGS="tests/test_kernels_gpu.py tests/test_gpu_e2e.py" PYTEST_K="dequant or prefill or grouped or number_raises or long_prompt or linear_impl"
bash scripts/gpu_lease.sh pytest 2>&1 | tee "$OUT/pytest.log" | sed -n '/^--- /,$p' | grep -v "^  File\|^    " | tail -12
export PYTHONPATH=/tmp/site:$PWD
timeout 150 python3 experiments/s47/probe_grouped.py 2>&1 | tee "$OUT/probe_grouped.log" | tail -8
timeout 100 python3 -m ds4 task=bench experiment=ds4_best model=v4_flash model.n_layers=8 tracking=none \
  max_new_tokens=8 task.fidelity=false task.prompt_len=2048 profile=true "task.prefill_lens=[128,256,512,2048,8000]" \
  hydra.run.dir=/tmp/ds4_prefill_default > "$OUT/prefill_default.log" 2>&1
echo "== default rc=$?"; grep -E "prefill @|TPOT median" "$OUT/prefill_default.log" | tr -s ' ' | paste -sd' '
sed -n '/stage profile/,$p' "$OUT/prefill_default.log" | grep -E "moe.routed|moe.shared |attn.q|attn.out"
