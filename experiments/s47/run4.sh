#!/usr/bin/env bash
# Session 48, run 4 (one lent H200): where the dequant op's throw crashes (each call in its own process; cuda-gdb's
# backtrace of the scale case), then the GPU tests of session 47-48's prefill paths with the chunk limit at 128.
set -u
OUT=${OUT:-/tmp/ds4_out}
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0
python3 scripts/build_ext.py -q > /tmp/build0.log 2>&1; echo "build rc=$?"; tail -2 /tmp/build0.log
for c in ok fmt cpu scale; do
  timeout 60 python3 experiments/s47/dequant_throw.py $c > "$OUT/throw_$c.log" 2>&1; echo "== $c rc=$?"; tail -1 "$OUT/throw_$c.log"
done
timeout 150 cuda-gdb -batch -ex run -ex bt --args python3 experiments/s47/dequant_throw.py scale > "$OUT/gdb.log" 2>&1
echo "== gdb rc=$?"; grep -E "^#|SIGSEGV|signal" "$OUT/gdb.log" | cut -c1-230 | head -30
K="dequant or prefill or linear_impl or prompt_routing or grouped or long_prompt or hc_pre_post_head or hc_post_pre"
K="$K or sparse_prompt or fused_attention_class or sparse_multi or chunk"
export PYTEST_ARGS="tests/test_kernels_gpu.py tests/test_gpu_e2e.py tests/test_attn_kernels_gpu.py" PYTEST_K="$K"
bash scripts/gpu_lease.sh pytest 2>&1 | tee "$OUT/pytest.log" | sed -n '/^--- /,$p' | grep -v "^  File\|^    " | tail -25
