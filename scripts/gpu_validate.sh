#!/usr/bin/env bash
# Short device lease (2 GPUs, or 1): build both extensions, run the GPU test modules side by side (one
# GPU each), the 1-GPU per-layer decode benchmark, the per-kernel step profile (with and without PDL)
# and the tp=2 tests. Logs under $OUT.
# Usage on the device machine:  bash scripts/gpu_validate.sh [bench variants]
set -u
OUT=${OUT:-/tmp/ds4_out}; L=/tmp/ds4_logs; mkdir -p "$OUT" "$L"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 MAX_JOBS=32
export TORCH_CUDA_ARCH_LIST="9.0"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
VARIANTS=${1:-kernels+graph,kernels+fused+graph}
NGPU=$(nvidia-smi -L | wc -l); nvidia-smi -L | head -1; date -u; git log -1 --format=%h 2>/dev/null
t0=$(date +%s); stamp() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
stamp build
python3 scripts/build_ext.py -q > "$L/build_ext.log" 2>&1; echo "extensions rc=$?"; tail -n 3 "$L/build_ext.log"
stamp "tests + bench"
PT="python3 -m pytest -m gpu -q -p no:cacheprovider -x --tb=short"
G1=$(( NGPU > 1 ? 1 : 0 ))   # a second GPU when there is one (benchmarks never share a GPU with a test)
CUDA_VISIBLE_DEVICES=0 timeout 330 $PT tests/test_decode_glue_gpu.py tests/test_attn_kernels_gpu.py > "$L/t_glue.log" 2>&1 &
CUDA_VISIBLE_DEVICES=$G1 timeout 330 $PT tests/test_kernels_gpu.py tests/test_gpu_e2e.py -k "not tp2" > "$L/t_kern.log" 2>&1 &
wait
stamp "bench | profile"
CUDA_VISIBLE_DEVICES=0 timeout 330 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
  --variants "$VARIANTS" --out "$OUT/bench_1gpu.json" > "$L/bench_1gpu.log" 2>&1 &
[ "$G1" = 1 ] || wait
(CUDA_VISIBLE_DEVICES=$G1 timeout 150 python3 scripts/profile_step.py --layers 4 --variant kernels+fused \
  --out "$OUT/profile_pdl.json" > "$L/profile_pdl.log" 2>&1
 CUDA_VISIBLE_DEVICES=$G1 DS4_PDL=0 timeout 150 python3 scripts/profile_step.py --layers 4 --variant kernels+fused \
  --out "$OUT/profile_nopdl.json" > "$L/profile_nopdl.log" 2>&1) &
wait
stamp "tp2 tests"
[ "$NGPU" -ge 2 ] && CUDA_VISIBLE_DEVICES=0,1 timeout 200 $PT tests/test_gpu_e2e.py -k tp2 > "$L/t_tp2.log" 2>&1
stamp done
for f in "$L"/*.log; do echo "##### $f"; cat "$f"; done > "$OUT/all_logs.txt"
for f in t_glue t_kern t_tp2; do [ -f "$L/$f.log" ] && { echo "--- $f"; grep -E "passed|failed|error|Error|assert" "$L/$f.log" | tail -n 12; }; done
echo "--- bench_1gpu"; grep -v '^{' "$L/bench_1gpu.log" | tail -n 14
for f in profile_pdl profile_nopdl; do echo "--- $f"; grep -v "^\s*$" "$L/$f.log" | head -n 30; done
