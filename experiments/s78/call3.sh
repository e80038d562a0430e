#!/usr/bin/env bash
# Session 78, call 3 (one lent GPU): the final GPU code (the hc fold's epilogue in hc_fold_sums' form alone, the
# build switch and the form before removed): the build; the GPU tests (the fold, moe_ffn, MoE / GEMV kernels, the step
# probe's library-build test, graph = eager [fused] and [fused-hc_fold]); the slope (two passes); on an H200, issue
# #7's seed sweep (8 layers, the eight jobs; none on an H200 since session 46). Logs in $OUT (one tarball).
# Usage (carry build/site): OUT=$OUT bash experiments/s78/call3.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
L=/tmp/s78_logs; rm -rf "$L"; mkdir -p "$L"
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$L/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$L/build.log"; exit 1; }
timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_hc_fold_gpu.py tests/test_moe_ffn_gpu.py \
  tests/test_kernels_gpu.py -k "fold or moe or gemv or step_probe" > "$L/units.log" 2>&1
echo "kernel tests rc=$? at +$(el)s: $(tail -1 "$L/units.log")"; grep -E "FAILED|ERROR" "$L/units.log" | head
G=tests/test_gpu_e2e.py::test_cuda_graph_matches_eager_1000_steps
timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short "$G[fused]" "$G[fused-hc_fold]" > "$L/graph.log" 2>&1
echo "graph = eager rc=$? at +$(el)s: $(tail -1 "$L/graph.log")"; grep -E "FAILED|ERROR" "$L/graph.log" | head
B=kernels+fused+graph+cap8192
timeout 60 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$B,$B" --out "$L/bench.json" \
  > "$L/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer" "$L/bench.log"
if nvidia-smi -L | grep -q H200; then
  JOBS=experiment=seed_phase1,ds4_best,ds4_cuda_graph,seed_phase4,seed_phase6,seed_phase2,seed_phase3,seed_phase5
  timeout 300 python3 -m ds4 ablation=seed_phases model.n_layers=8 tracking=none max_new_tokens=32 $JOBS \
    hydra.sweep.dir=/tmp/sweep_seed > "$L/seed_sweep.log" 2>&1
  echo "sweep rc=$? at +$(el)s"
  python3 -m ds4.compare /tmp/sweep_seed --baseline seed_phase1 --no-plot --md "$L/seed_phases.md" \
    > "$L/seed_compare.log" 2>&1
  echo "compare rc=$?"; cat "$L/seed_phases.md"
  (cd /tmp/sweep_seed && tar czf "$L/seed_metrics.tgz" */metrics.json)
fi
tar czf "$OUT/logs.tgz" -C "$L" .
echo "total $(el)s"
