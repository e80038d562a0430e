#!/usr/bin/env bash
# Session 74, call 6 (one lent GPU): the combine's early trigger as the default (calls 4-5: 0.6-1.0 us per layer in 7
# interleaved pairs), and the same for the one-token hc finishes (DS4_HC_TRIGGER=early, bench token htrig): wq_a + wkv's
# blocks would then load their first weights while the MoE down drains.
#   1. build; 2. GPU tests: graph = eager over 1000 steps (tiny: the default, the old combine trigger, the hc trigger;
#   small: the default), the attention kernels' and the decode glue's attention rows; 3. the slope: the defaults,
#   noctrig, htrig, three passes each in one process.
# Logs in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s74/call6.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_ACT_QUANT DS4_L2_PREFETCH DS4_COMBINE_TRIGGER DS4_HC_TRIGGER
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
G=tests/test_gpu_e2e.py::test_cuda_graph_matches_eager_1000_steps
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short "$G[fused]" "$G[fused-combine_trigger_wait]" \
  "$G[fused-hc_trigger_early]" "${G}_on_small[one_graph]" > "$OUT/tests.log" 2>&1
echo "tests rc=$? at +$(el)s: $(tail -1 "$OUT/tests.log")"; grep -E "FAILED|ERROR" "$OUT/tests.log" | head
timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_attn_kernels_gpu.py \
  tests/test_decode_glue_gpu.py -k "sparse or decode_attention" > "$OUT/attn.log" 2>&1
echo "attn tests rc=$? at +$(el)s: $(tail -1 "$OUT/attn.log")"; grep -E "FAILED|ERROR" "$OUT/attn.log" | head
B=kernels+fused+graph+cap8192
V=$B,$B+noctrig,$B+htrig,$B,$B+noctrig,$B+htrig,$B,$B+noctrig,$B+htrig
timeout 200 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V" --out "$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer" "$OUT/bench.log"
echo "total $(el)s"
