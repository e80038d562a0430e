#!/usr/bin/env bash
# A short 2-GPU lease after kernel changes: build, the decode-glue / attention kernel tests, the fused
# end-to-end test, the 8-layer step profile at a 64K-entry allocation, the 1-GPU per-layer benchmark
# (FP8 vs the seed's BF16 wo_b.wo_a), and the 8-layer seed-phase sweep. Logs under $OUT.
set -u
OUT=${OUT:-/tmp/ds4_out}; L=/tmp/ds4_logs; mkdir -p "$OUT" "$L"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 MAX_JOBS=32 TORCH_CUDA_ARCH_LIST="9.0"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L; date -u
t0=$(date +%s); stamp() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
python3 scripts/build_ext.py -q > "$L/build.log" 2>&1; echo "build rc=$?"; tail -n 2 "$L/build.log"
PT="python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short"
stamp "A: tests | profile + bench"
CUDA_VISIBLE_DEVICES=0 timeout 110 $PT tests/test_decode_glue_gpu.py tests/test_attn_kernels_gpu.py > "$L/t_glue.log" 2>&1 &
(CUDA_VISIBLE_DEVICES=1 timeout 50 python3 scripts/profile_step.py --layers 8 --variant kernels+fused \
   --long-context 65536 --out "$OUT/profile_step.json" > "$L/profile.log" 2>&1
 CUDA_VISIBLE_DEVICES=1 timeout 60 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
   --variants kernels+fused+graph,kernels+fused+graph+wobf16 --out "$OUT/bench_1gpu.json" > "$L/bench_1gpu.log" 2>&1) &
wait
stamp "B: seed sweep | e2e"
CUDA_VISIBLE_DEVICES=0 timeout 170 python3 -m ds4 ablation=seed_phases model.n_layers=8 tracking=none max_new_tokens=32 \
  experiment=seed_phase1,ds4_best,ds4_cuda_graph,seed_phase4,seed_phase6,seed_phase2,seed_phase3,seed_phase5 \
  hydra.sweep.dir="$L/seed_1gpu" > "$L/seed_1gpu.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 170 $PT tests/test_gpu_e2e.py -k "options and fused_cuda and gemv" > "$L/t_e2e.log" 2>&1 &
wait
python3 -m ds4.compare "$L/seed_1gpu" --baseline seed_phase1 --md "$OUT/seed_phases_1gpu.md" --out "$OUT/seed_phases_1gpu.png" \
  > "$L/compare.log" 2>&1
stamp done
for f in "$L"/*.log; do echo "##### $f"; cat "$f"; done > "$OUT/all_logs.txt"
for f in t_glue t_e2e; do echo "--- $f"; grep -E "passed|failed|Error|^FAILED|^E  " "$L/$f.log" | tail -n 14; done
echo "--- bench_1gpu"; grep -v '^{' "$L/bench_1gpu.log" | grep -v "^\s*$" | tail -n 8
echo "--- profile"; grep -v "^\s*$" "$L/profile.log" | grep -v -i warn | head -n 26
echo "--- seed"; cat "$OUT/seed_phases_1gpu.md" 2>/dev/null | head -n 16
