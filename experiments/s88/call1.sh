#!/usr/bin/env bash
# Session 88, call 1 (whichever GPU the device tool lends; asked for nvidia-h200): the tree's defaults measured again.
# The default build; issue #7's seed sweep (8 layers of V4-Flash, the eight jobs) and its table; the weight kernels
# alone (bench_kernels.py: the dense GEMV rows, then the routed MoE rows); then the slope (4 and 12 layers), three
# processes. Logs: one tarball in $OUT.
# Usage (carry build/site): OUT=$OUT [BUDGET=seconds, default 540] bash experiments/s88/call1.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA DS4_BULK_STAGE DS4_MOE_SPLITK DS4_MOE_FFN
unset DS4_EXT_BUILD_DIR DS4_ATTN_EXT_BUILD_DIR
BUDGET=${BUDGET:-540}
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
L=/tmp/s88_call1; rm -rf "$L"; mkdir -p "$L"
snap() { tar czf "$OUT/logs.tgz" -C "$L" .; }
trap 'snap; echo "total $(el)s"' EXIT
nvidia-smi -L; date -u; git log -1 --format=%h 2>/dev/null
python3 scripts/build_ext.py -q > "$L/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { grep -E "error" "$L/build.log" | head -20; tail -20 "$L/build.log"; exit 1; }
export DS4_NO_JIT=1
JOBS=experiment=seed_phase1,ds4_best,ds4_cuda_graph,seed_phase4,seed_phase6,seed_phase2,seed_phase3,seed_phase5
date -u +"sweep start %H:%M:%S"
timeout 240 python3 -m ds4 ablation=seed_phases model.n_layers=8 tracking=none max_new_tokens=32 $JOBS \
  hydra.sweep.dir=/tmp/sweep_seed > "$L/seed_sweep.log" 2>&1
echo "sweep rc=$? at +$(el)s"; date -u +"sweep end %H:%M:%S"
python3 -m ds4.compare /tmp/sweep_seed --baseline seed_phase1 --no-plot --md "$L/seed_phases.md" \
  > "$L/seed_compare.log" 2>&1
echo "compare rc=$?"; cat "$L/seed_phases.md"
(cd /tmp/sweep_seed && tar czf "$L/seed_metrics.tgz" */metrics.json); snap
for mode in dense moe; do
  args=(--quick --dense-only); [ $mode = moe ] && args=(--moe-bound)
  timeout 60 python3 scripts/bench_kernels.py "${args[@]}" > "$L/kernels_$mode.log" 2>&1
  echo "kernels $mode rc=$? at +$(el)s"; grep -E "^  (fp8|moe)" "$L/kernels_$mode.log" | head -14; snap
done
B=kernels+fused+graph+cap8192
for i in 1 2 3; do
  [ "$(el)" -gt $((BUDGET - 40)) ] && { echo "the rest skipped at +$(el)s"; break; }
  timeout 100 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$B,$B" \
    --out "$L/bench_$i.json" > "$L/bench_$i.log" 2>&1
  echo "bench $i rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer|Error" "$L/bench_$i.log" | tail -3; snap
done
