#!/usr/bin/env bash
# Session 47, run 1 (one lent H200): prefill's device dequantisation (csrc/dequant.cu) and the grouped expert loop.
# GPU tests of the kernel, the linear prefill and the MoE prefill paths; then prefill tok/s on 8 layers of V4-Flash
# (ds4_best) at 16..8000 prompt tokens in three settings: the torch dequantisation with the old chunk limit (4096),
# the kernel with that limit, and the kernel with every prompt above 8 tokens on the grouped loop; each with the
# stage profile of a 2048-token prefill (the profile pass's prompt).
set -u
OUT=${OUT:-/tmp/ds4_out}
export PYTEST_ARGS="tests/test_kernels_gpu.py" PYTEST_K="dequant or prefill or linear_impl"
bash scripts/gpu_lease.sh pytest 2>&1 | sed -n '/^--- /,$p' | tail -25
export PYTHONPATH=/tmp/site:$PWD
for cfg in torch:4096 kernel:4096 kernel:8; do
  kind=${cfg%%:*} lim=${cfg##*:}
  if [ $kind = torch ]; then export DS4_DEQUANT_KERNEL=0; else unset DS4_DEQUANT_KERNEL; fi
  export DS4_MOE_CHUNKED_TOKENS=$lim
  log="$OUT/prefill_${kind}_$lim.log"
  timeout 170 python3 -m ds4 task=bench experiment=ds4_best model=v4_flash model.n_layers=8 tracking=none \
    max_new_tokens=8 task.fidelity=false task.prompt_len=2048 profile=true \
    "task.prefill_lens=[16,32,64,128,512,2048,8000]" hydra.run.dir=/tmp/ds4_prefill_${kind}_$lim > "$log" 2>&1
  echo "== $cfg rc=$?"; grep -E "TTFT|prefill|TPOT median" "$log" | tr -s ' ' | paste -sd' '
done
for f in "$OUT"/prefill_*.log; do echo "== $f"; sed -n '/stage profile/,$p' "$f" | head -24; done
