#!/usr/bin/env bash
# Session 74, call 1 (one lent GPU): the routed down's weights requested into L2 by the routed gate+up's own blocks
# (ds4.ops.prefetch sites t / s: each block an equal share of the chosen experts' w2 + scales, at its end / start; no
# side branch, no launch). Why: the 8-layer timelines (s73 call 3) put the routed down at 15-17 us on the path for
# 25 MB (1.5 TB/s) right after the FP4 gate+up, which is ALU-bound with HBM to spare.
#   1. build; 2. GPU tests of the form (kernel test, graph = eager on tiny, the prefetch tests);
#   3. the slope (4 and 12 layers): the defaults, pft, pfs, two passes each in one process; 4. the 8-layer timeline
#   with t.
# Logs in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s74/call1.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_ACT_QUANT DS4_L2_PREFETCH
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_kernels_gpu.py tests/test_gpu_e2e.py \
  -k "l2_prefetch or prefetch_branch or gate_up_prefetch or routed_gate_up_depth" > "$OUT/tests.log" 2>&1
echo "tests rc=$? at +$(el)s: $(tail -1 "$OUT/tests.log")"
B=kernels+fused+graph+cap8192
V=$B,$B+pft,$B+pfs,$B,$B+pft,$B+pfs
timeout 170 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V" --out "$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer" "$OUT/bench.log"
DS4_L2_PREFETCH=t timeout 90 python3 scripts/profile_step.py --layers 8 --variant kernels+fused+cap8192 --timeline \
  --timeline-replays 6 --out "$OUT/profile_t.json" > "$OUT/profile_t.log" 2>&1
echo "profile rc=$? at +$(el)s"; sed -n 4,20p "$OUT/profile_t.log"
echo "total $(el)s"
