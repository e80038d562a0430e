#!/usr/bin/env bash
# Session 49, run 2 (one lent H200): the final tree (run 1's prefetch site reverted; the review refactor c95e664 of
# the prompt MoE, pairs_by_expert / shared_block, never run on a GPU before): every GEMV / MoE / dequant / prefetch GPU
# test, the 200-token end-to-end prefill test, the dense GEMVs cold and L2-hot again (another machine than run 1), and
# ds4_best's prefill of 8 layers of V4-Flash at 256 and 2048 tokens.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
t0=$(date +%s); st() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
st build; python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$?"; tail -n 2 "$OUT/build.log"
st kernel_tests
timeout 270 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/test_kernels_gpu.py > "$OUT/kernel_tests.log" 2>&1
echo "kernel tests rc=$?"; tail -n 3 "$OUT/kernel_tests.log"
st e2e
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/test_gpu_e2e.py -k "long_prompt" > "$OUT/e2e.log" 2>&1
echo "e2e rc=$?"; tail -n 2 "$OUT/e2e.log"
st kbench
timeout 60 python3 scripts/bench_kernels.py --quick --dense-only --out "$OUT/kb_cold.json" > "$OUT/kb_cold.log" 2>&1
timeout 60 python3 scripts/bench_kernels.py --quick --dense-only --l2-hot --out "$OUT/kb_hot.json" > "$OUT/kb_hot.log" 2>&1
st prefill
export PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
timeout 110 python3 -m ds4 task=bench experiment=ds4_best model=v4_flash model.n_layers=8 tracking=none \
  max_new_tokens=8 task.fidelity=false task.prompt_len=2048 "task.prefill_lens=[256,2048]" \
  hydra.run.dir=/tmp/ds4_prefill > "$OUT/prefill.log" 2>&1; echo "prefill rc=$?"
st done
echo "--- kbench (cold | L2-hot: us, GB/s)"
paste <(grep -E "^fp8" "$OUT/kb_cold.log" | cut -c1-75) <(grep -E "^fp8" "$OUT/kb_hot.log" | awk '{print $(NF-5), $(NF-2)}')
grep -h "^copy bandwidth" "$OUT/kb_cold.log" "$OUT/kb_hot.log"
echo "--- prefill"; grep -E "prefill @|TPOT median" "$OUT/prefill.log" | tr -s ' '
grep -E "^FAILED|^ERROR" "$OUT/kernel_tests.log" "$OUT/e2e.log" | head -20
