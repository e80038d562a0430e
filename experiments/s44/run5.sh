#!/usr/bin/env bash
# Session 44, run 5 (one lent H200): the top-k after the review's refactor (shared helpers of the one-block and wide
# forms): build the attention extension only, its top-k GPU tests, the top-k probe.
set -u
OUT=${OUT:-/tmp/ds4_out}
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
python3 -c "from ds4 import kernels_attn; kernels_attn.load()" > "$OUT/build.log" 2>&1; echo "build rc=$?"
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/test_decode_glue_gpu.py -k "topk" \
  > "$OUT/pytest_topk.log" 2>&1; echo "pytest rc=$?"; tail -n 3 "$OUT/pytest_topk.log"
nvcc -std=c++17 -O3 -arch=sm_90 -I. -Icsrc/attn -Icsrc -Iscripts -DTOPK_SRC='"csrc/attn/topk.cu"' \
  scripts/probe_topk.cu -o /tmp/probe_topk && timeout 120 /tmp/probe_topk > "$OUT/probe_topk.log" 2>&1
echo "probe rc=$?"; cat "$OUT/probe_topk.log"
