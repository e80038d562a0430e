#!/usr/bin/env bash
# One lease of a 4-GPU (or 2-GPU) H200 machine: build the extensions, run the GPU tests, and
# benchmark one GPU (per-layer slope), the full model at tp=2 and (with 4 GPUs) tp=4.
# Usage on the device machine:  bash scripts/gpu_session.sh   (logs and JSON under $OUT)
set -u
OUT=${OUT:-/tmp/ds4_out}; L=/tmp/ds4_logs; mkdir -p "$OUT" "$L"   # $OUT returns at most 8 files
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 MAX_JOBS=32
export TORCH_CUDA_ARCH_LIST="9.0"   # this lease only runs sm_90; CI compiles sm_80 separately
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
NGPU=$(nvidia-smi -L | wc -l); nvidia-smi -L; date -u
t0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }

stamp build
python3 scripts/build_ext.py -q > "$L/build_ext.log" 2>&1; echo "extensions rc=$?"   # both extensions, once

stamp "phase A: 1-GPU tests | 1-GPU bench | tp=2 full-model bench"
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ > "$L/gpu_tests.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 240 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
  --variants ref,kernels,kernels+fused,kernels+graph,kernels+fused+graph --out "$OUT/bench_1gpu.json" > "$L/bench_1gpu.log" 2>&1 &
if [ "$NGPU" -ge 4 ]; then
  CUDA_VISIBLE_DEVICES=2,3 timeout 240 torchrun --nproc-per-node 2 scripts/bench_decode.py --layers 43 --new-tokens 48 \
    --variants kernels+fused+graph,kernels+fused+graph+bf16,kernels+fused+graph+symm,kernels+fused,ref \
    --out "$OUT/bench_tp2.json" > "$L/bench_tp2.log" 2>&1 &
fi
wait

stamp "phase B: 2-GPU tests | CLI bench"
CUDA_VISIBLE_DEVICES=0,1 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_e2e.py -k tp2 > "$L/gpu_tests_tp2.log" 2>&1 &
if [ "$NGPU" -ge 4 ]; then
  CUDA_VISIBLE_DEVICES=2 timeout 150 python3 -m ds4 task=bench model=v4_flash model.n_layers=4 linear=gemv_cuda moe=fp4_topk \
    tracking=none hydra.run.dir="$L/cli_bench" > "$L/cli_bench.log" 2>&1 &
fi
wait
if [ "$NGPU" -lt 4 ]; then
  stamp "tp=2 full-model bench"
  timeout 200 torchrun --nproc-per-node 2 scripts/bench_decode.py --layers 43 --new-tokens 48 \
    --variants kernels+fused+graph,kernels+fused+graph+bf16,kernels+fused+graph+symm,kernels+fused \
    --out "$OUT/bench_tp2.json" > "$L/bench_tp2.log" 2>&1
else
  stamp "phase C: tp=4 full-model bench"
  timeout 200 torchrun --nproc-per-node 4 scripts/bench_decode.py --layers 43 --new-tokens 48 \
    --variants kernels+fused+graph,kernels+fused+graph+bf16,kernels+fused+graph+symm,kernels+fused \
    --out "$OUT/bench_tp4.json" > "$L/bench_tp4.log" 2>&1
fi
stamp done
cp "$L/cli_bench/metrics.json" "$OUT/cli_metrics.json" 2>/dev/null
for f in "$L"/*.log; do echo "##### $f"; cat "$f"; done > "$OUT/all_logs.txt"
for f in gpu_tests gpu_tests_tp2; do echo "--- $f"; tail -n 15 "$L/$f.log"; done
for f in bench_1gpu bench_tp2 bench_tp4 cli_bench; do
  [ -f "$L/$f.log" ] && { echo "--- $f"; grep -v '^{' "$L/$f.log" | tail -n 22; }
done
