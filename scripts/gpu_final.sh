#!/usr/bin/env bash
# One 2-GPU lease (<= ~9.5 min): build, GPU kernel tests, the 1-GPU per-layer benchmark and step
# profile, the seed-phase ablation on 8 layers (one GPU), the end-to-end GPU tests, and the full
# 43-layer model at tp=2. Everything under $OUT (at most 8 files come back).
set -u
OUT=${OUT:-/tmp/ds4_out}; L=/tmp/ds4_logs; mkdir -p "$OUT" "$L"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 MAX_JOBS=32 TORCH_CUDA_ARCH_LIST="9.0"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L; date -u; git log -1 --format=%h
t0=$(date +%s); stamp() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
python3 scripts/build_ext.py -q > "$L/build.log" 2>&1; echo "build rc=$?"; tail -n 2 "$L/build.log"
PT="python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short"
stamp "A: kernel tests | 1-GPU bench + profile"
CUDA_VISIBLE_DEVICES=0 timeout 130 $PT tests/test_decode_glue_gpu.py tests/test_attn_kernels_gpu.py tests/test_kernels_gpu.py \
  > "$L/t_kernels.log" 2>&1 &
(CUDA_VISIBLE_DEVICES=1 timeout 70 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
   --variants kernels+fused+graph --out "$OUT/bench_1gpu.json" > "$L/bench_1gpu.log" 2>&1
 CUDA_VISIBLE_DEVICES=1 timeout 60 python3 scripts/profile_step.py --layers 8 --variant kernels+fused \
   --long-context 65536 --out "$OUT/profile_step.json" > "$L/profile.log" 2>&1) &
wait
stamp "B: seed-phase ablation (8 layers) | e2e tests"
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m ds4 ablation=seed_phases model.n_layers=8 tracking=none max_new_tokens=32 \
  experiment=seed_phase1,ds4_best,ds4_cuda_graph,seed_phase4,seed_phase6,seed_phase2,seed_phase3,seed_phase5 \
  hydra.sweep.dir="$L/seed_1gpu" > "$L/seed_1gpu.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 200 $PT tests/test_gpu_e2e.py -k "not tp2 and (cuda_graph or fused_cuda)" > "$L/t_e2e.log" 2>&1 &
wait
python3 -m ds4.compare "$L/seed_1gpu" --baseline seed_phase1 --md "$OUT/seed_phases_1gpu.md" --out "$OUT/seed_phases_1gpu.png" \
  > "$L/compare.log" 2>&1
stamp "C: full model tp=2"
timeout 180 torchrun --nproc-per-node 2 scripts/bench_decode.py --layers 8,43 --new-tokens 48 \
  --variants kernels+fused+graph,kernels+fused+graph+bf16,kernels+fused+graph+symm --out "$OUT/bench_tp2.json" \
  > "$L/bench_tp2.log" 2>&1
stamp done
for f in "$L"/*.log; do echo "##### $f"; cat "$f"; done > "$OUT/all_logs.txt"
for f in t_kernels t_e2e; do echo "--- $f"; grep -E "passed|failed|Error|^FAILED|^E  " "$L/$f.log" | tail -n 14; done
for f in bench_1gpu bench_tp2; do echo "--- $f"; grep -v '^{' "$L/$f.log" | grep -v "^\s*$" | tail -n 12; done
echo "--- profile"; grep -v "^\s*$" "$L/profile.log" | grep -v -i warn | head -n 24
echo "--- seed"; cat "$OUT/seed_phases_1gpu.md" 2>/dev/null | head -n 30; tail -n 5 "$L/compare.log"
