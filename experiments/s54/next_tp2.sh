#!/usr/bin/env bash
# NOT RUN (written in session 54, which had no device machine): the planned run for the first session lent
# `nvidia-h200-x2` again (none since session 19, whose full model at tp=2 took 4.866 ms; the one-GPU slope has gone from
# about 125 to 104 µs per layer since). #7's targets at tp=2: the full 43-layer model at TPOT <= 3.3 ms, and the seed
# phase sweep run with tp=2. GPU tests of the collectives and tensor parallelism first, then the full model
# (session 18's best layout: comm=ll, shared expert sliced), then the sweep.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=32 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1
t0=$(date +%s); st() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
st build; python3 scripts/build_ext.py -q > /tmp/build.log 2>&1; echo "build rc=$?"; tail -5 /tmp/build.log
st tests
timeout 240 python3 -m pytest -q tests/test_allreduce_gpu.py tests/test_tensor_parallel.py tests/test_gpu_e2e.py \
  > "$OUT/tests_tp2.log" 2>&1; echo "tests rc=$?"; tail -3 "$OUT/tests_tp2.log"
V=kernels+fused+graph+cap8192+ll
st bench
timeout 300 torchrun --nproc-per-node 2 scripts/bench_decode.py --layers 43 --new-tokens 48 --shared tp \
  --variants "$V,$V+bf16" --out "$OUT/bench_tp2.json" > "$OUT/bench_tp2.log" 2>&1
echo "bench rc=$?"; grep -E "ms|tok/s" "$OUT/bench_tp2.log" | tail -6
st sweep
# (session 17's form: the baseline and ds4_best in one sweep, the whole table does not fit a call's 10 minutes)
timeout 400 torchrun --nproc-per-node 2 -m ds4 ablation=seed_phases parallel.tp=2 task.fidelity=false tracking=none \
  max_new_tokens=32 experiment=seed_phase1,ds4_best hydra.sweep.dir="$OUT/sweep" > "$OUT/sweep_tp2.log" 2>&1
echo "sweep rc=$?"; tail -6 "$OUT/sweep_tp2.log"
python3 -m ds4.compare "$OUT/sweep" --baseline seed_phase1 --md "$OUT/seed_phases_tp2.md"; cat "$OUT/seed_phases_tp2.md"
st done
