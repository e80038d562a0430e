#!/usr/bin/env bash
# Session 48, run 3 (one lent H200): run 2 again where it failed — the dequant op's own error path (run 2 still
# segfaulted; its out argument is now const at::Tensor&, as in hc_sinkhorn whose throws are caught) and the prefill
# benchmarks (run 2 lacked the hydra wheels). Prefill tok/s on 8 layers of V4-Flash (ds4_best): the MoE in
# decode-kernel chunks up to 4096 tokens, the grouped loop above 8 tokens (torch._grouped_mm), that with one matmul per
# expert (DS4_GROUPED_MM=0: the sm_80 path), and with the torch reference's prompt attention (DS4_PREFILL_ATTN=torch).
set -u
OUT=${OUT:-/tmp/ds4_out}
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0
python3 scripts/build_ext.py -q > /tmp/build0.log 2>&1; echo "build rc=$?"; tail -3 /tmp/build0.log
timeout 120 python3 -X faulthandler experiments/s47/dequant_throw.py > "$OUT/throw.log" 2>&1; rc=$?
echo "== dequant_throw rc=$rc"; head -c 600 "$OUT/throw.log"
K="op_checks or refuses_what_it_cannot_take"
[ $rc -ne 0 ] && K="refuses_what_it_cannot_take"
export PYTEST_ARGS="tests/test_kernels_gpu.py" PYTEST_K="$K"
bash scripts/gpu_lease.sh pytest 2>&1 | tee "$OUT/pytest.log" | sed -n '/^--- /,$p' | grep -v "^  File\|^    " | tail -8
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import hydra; print('hydra', hydra.__version__)"
for cfg in chunks:4096:kernel:1 grouped:8:kernel:1 loop:8:kernel:0 grouped_attntorch:8:torch:1; do
  IFS=: read -r name lim attn gmm <<< "$cfg"
  export DS4_MOE_CHUNKED_TOKENS=$lim DS4_PREFILL_ATTN=$attn DS4_GROUPED_MM=$gmm
  log="$OUT/prefill_$name.log"
  timeout 110 python3 -m ds4 task=bench experiment=ds4_best model=v4_flash model.n_layers=8 tracking=none \
    max_new_tokens=8 task.fidelity=false task.prompt_len=2048 profile=true \
    "task.prefill_lens=[16,64,128,256,512,1024,2048,8000]" hydra.run.dir=/tmp/ds4_prefill_$name > "$log" 2>&1
  echo "== $cfg rc=$?"; grep -E "prefill @|TPOT median" "$log" | tr -s ' ' | paste -sd' '
done
for f in "$OUT"/prefill_*.log; do echo "== $f"; sed -n '/stage profile/,$p' "$f" | sed -n '3,12p'; done
