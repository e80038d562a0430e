#!/usr/bin/env bash
# Session 77, call 2 (one lent GPU): the routed MoE kernels' step probe (csrc/moe_mma.cu, -DDS4_MOE_PROBE; its own
# build folder) read block by block inside the replayed decode step and alone (scripts/probe_moe_step.py), then
# issue #7's seed-phase sweep on whatever card this is (as experiments/s75/call4.sh).
#   1. the library's build, then the probe build (main extension only; the attention one shared);
#   2. GPU tests: the probe's refusal in the library build, the MoE kernel tests, graph = eager [fused];
#   3. the probe: 8 layers, 6 replays, and the pair alone; 4. the sweep (8 layers, the eight jobs) and its table.
# Logs in $OUT. Usage (carry build/site): OUT=$OUT bash experiments/s77/call2.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
PROBE_ENV=(DS4_NVCC_FLAGS=-DDS4_MOE_PROBE DS4_EXT_BUILD_DIR="$PWD/.ext_build_probe"
           DS4_ATTN_EXT_BUILD_DIR="$PWD/.ext_build/attn")
env "${PROBE_ENV[@]}" python3 scripts/build_ext.py -q > "$OUT/build_probe.log" 2>&1; prc=$?
echo "probe build rc=$prc at +$(el)s"; [ $prc -ne 0 ] && tail -20 "$OUT/build_probe.log"
timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_kernels_gpu.py \
  -k "moe or step_probe" > "$OUT/units.log" 2>&1
echo "kernel tests rc=$? at +$(el)s: $(tail -1 "$OUT/units.log")"; grep -E "FAILED|ERROR" "$OUT/units.log" | head
G=tests/test_gpu_e2e.py::test_cuda_graph_matches_eager_1000_steps
timeout 45 python3 -m pytest -q -p no:cacheprovider --tb=short "$G[fused]" > "$OUT/graph.log" 2>&1
echo "graph = eager rc=$? at +$(el)s: $(tail -1 "$OUT/graph.log")"
if [ $prc -eq 0 ]; then
  env "${PROBE_ENV[@]}" timeout 90 python3 scripts/probe_moe_step.py --layers 8 --replays 6 \
    --out "$OUT/probe_moe_step.json" > "$OUT/probe_moe_step.log" 2>&1
  echo "probe rc=$? at +$(el)s"; sed -n '/^medians/,$p' "$OUT/probe_moe_step.log"; tail -3 "$OUT/probe_moe_step.log"
fi
JOBS=experiment=seed_phase1,ds4_best,ds4_cuda_graph,seed_phase4,seed_phase6,seed_phase2,seed_phase3,seed_phase5
timeout 300 python3 -m ds4 ablation=seed_phases model.n_layers=8 tracking=none max_new_tokens=32 $JOBS \
  hydra.sweep.dir=/tmp/sweep_seed > "$OUT/seed_sweep.log" 2>&1
echo "sweep rc=$? at +$(el)s"
python3 -m ds4.compare /tmp/sweep_seed --baseline seed_phase1 --no-plot --md "$OUT/seed_phases.md" \
  > "$OUT/seed_compare.log" 2>&1
echo "compare rc=$?"; cat "$OUT/seed_phases.md"
date -u; echo "total $(el)s"
