#!/usr/bin/env bash
# Session 47, run 2 (one lent H200): the dequant op's own error path (run 1's segfault); GPU tests of prefill's device
# dequantisation, the grouped expert loop (torch._grouped_mm, and one matmul per expert), prompt routing by one fp32
# GEMM, the mHC prompt partials by cuBLAS, the attention kernel on a prompt's rows, and the long-prompt end-to-end
# test; then prefill tok/s on 8 layers of V4-Flash (ds4_best): the MoE in decode-kernel chunks up to 4096 tokens, the
# grouped loop above 8 tokens, and that with the torch reference's prompt attention (DS4_PREFILL_ATTN=torch); the
# stage profile of a 2048-token prefill in each.
set -u
OUT=${OUT:-/tmp/ds4_out}
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0
python3 scripts/build_ext.py -q > /tmp/build0.log 2>&1; echo "build rc=$?"; tail -3 /tmp/build0.log
timeout 120 python3 -X faulthandler experiments/s47/dequant_throw.py > "$OUT/throw.log" 2>&1; rc=$?
echo "== dequant_throw rc=$rc"; head -c 1200 "$OUT/throw.log"
K="dequant or prefill or linear_impl or prompt_routing or grouped"
[ $rc -ne 0 ] && K="($K) and not op_checks"
K="$K or long_prompt or hc_pre_post_head or hc_post_pre or sparse_prompt or fused_attention_class or sparse_multi"
export PYTEST_ARGS="tests/test_kernels_gpu.py tests/test_gpu_e2e.py tests/test_attn_kernels_gpu.py" PYTEST_K="$K"
bash scripts/gpu_lease.sh pytest 2>&1 | tee "$OUT/pytest.log" | sed -n '/^--- /,$p' | grep -v "^  File\|^    " | tail -30
export PYTHONPATH=/tmp/site:$PWD
for cfg in chunks:4096:kernel grouped:8:kernel grouped_attntorch:8:torch; do
  IFS=: read -r name lim attn <<< "$cfg"
  export DS4_MOE_CHUNKED_TOKENS=$lim DS4_PREFILL_ATTN=$attn
  log="$OUT/prefill_$name.log"
  timeout 120 python3 -m ds4 task=bench experiment=ds4_best model=v4_flash model.n_layers=8 tracking=none \
    max_new_tokens=8 task.fidelity=false task.prompt_len=2048 profile=true \
    "task.prefill_lens=[128,256,512,1024,2048,8000]" hydra.run.dir=/tmp/ds4_prefill_$name > "$log" 2>&1
  echo "== $cfg rc=$?"; grep -E "prefill @|TPOT median" "$log" | tr -s ' ' | paste -sd' '
done
for f in "$OUT"/prefill_*.log; do echo "== $f"; sed -n '/stage profile/,$p' "$f" | sed -n '3,14p'; done
