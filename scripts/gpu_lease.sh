#!/usr/bin/env bash
# One lease of a lent H200 machine (1, 2 or 4 GPUs): build both CUDA extensions once, then run the
# named stages. Groups run one after the other; the lanes of a group joined by "+" run side by side,
# one GPU each (lane i of a group on GPU i), and the stages of a lane joined by "," one after the
# other, so a short lease covers more. Logs, JSON, tables and charts go under $OUT; a summary is
# printed at the end.
#
#   bash scripts/gpu_lease.sh kernel_tests,bench+e2e_tests seed+profile tp2
#
# Stages:
#   kernel_tests   GPU kernel test modules (GEMV/MoE, attention, decode glue)
#   kbench         GEMV/MoE micro-benchmark (scripts/bench_kernels.py: tensor-core vs FMA kernels; $MMA_SHAPES:
#                  its --mma list, e.g. w2d8,w2d4; $KBENCH_ARGS: more options, e.g. --quick)
#   ncu            Nsight Compute counters of the batch-1 weight kernels alone (scripts/ncu_kernels.py; ncu.txt
#                  and ncu_pipes.txt under $OUT) and the SASS of the GEMV / MoE kernels (sass_moe_gemv.txt.gz)
#   ncu_step       Nsight Compute counters of one kernel form inside the captured decode step (4 layers of V4-Flash,
#                  variant kernels+fused+graph+cap8192; $NCU_KERNEL: a regex on the demangled name as ncu prints it,
#                  "(int)4" for a template argument 4; default the folding routed down in fp4t; $NCU_COUNT launches;
#                  ncu_step.txt under $OUT). Session 16's first run matched nothing (its regex lacked the "(int)")
#   probe          phase probe of single kernels (scripts/probe_phases.cu, no torch; $PROBE_ARCH; $PROBE_ARGS: modes,
#                  space-separated, e.g. "hc packed"; "indexer": the indexer scores kernel with and without its RoPE,
#                  and sparse_chunk; "tlb": the same bytes read from near or far pages)
#   probe_bulk     the FP4 tensor-core arithmetic apart from its memory stream (scripts/probe_bulk.cu, sm_90, no torch:
#                  the register stream, a bulk-copy stream, and the arithmetic alone / with parts left out)
#   pytest         a diagnostic pytest run ($PYTEST_ARGS: files and options, split at spaces; $PYTEST_K: a -k expression,
#                  kept whole — a quoted -k inside $PYTEST_ARGS is split and selects nothing, as in session 35's run 1;
#                  CUDA_LAUNCH_BLOCKING=1, long tracebacks)
#   e2e_tests      end-to-end GPU tests on one GPU (options vs reference, CUDA graph vs eager; pytest -k "$E2E_K")
#   tp2_tests      the 2-GPU tests (comm=ll's kernel; tp=2 vs tp=1, graph vs eager; pytest -k "$TP2_K"); alone in its group
#   bench          1-GPU per-layer slope (4 -> 12 layers, $BENCH_VARIANTS)
#   profile        per-kernel profile of an 8-layer step, the critical path of one replay (ds4.timeline) and
#                  the step's time at position 65536 ($PROFILE_VARIANT, default kernels+fused; PROFILE_PDL=0:
#                  without PDL; PROFILE_INLINE=1: side-stream branches in line too — both, and each
#                  kernel's time is its own; $PROFILE_ARGS: more options, e.g. --phases 64)
#   profile_tp2    the same profile of rank 0 in an 8-layer step of the full-width model at tp=2 (torchrun; routed experts
#                  sliced, caches for 8192 positions; $PROFILE_TP2_VARIANT, default kernels+fused+ll+shtp+cap8192 (ds4_best's
#                  all-reduce and shared-expert layout), e.g. kernels+fused+symm+cap8192); alone in its group
#   profile0       the same without PDL (DS4_PDL=0: each kernel's own time, the strict critical path),
#                  beside profile in one lease ($OUT/profile_step_nopdl.json)
#   seed           seed-phase sweep on 8 layers of V4-Flash, one GPU, + ds4.compare table and chart ($SEED_JOBS:
#                  the sweep's experiment=... list, default all of it)
#   tp2 / tp4      the full 43-layer model at tp=2 / tp=4 (8 and 43 layers: per-layer slope; $TP_LAYERS: another
#                  list, e.g. 43; $TP_EXPERTS: routed-expert layouts, default tp, e.g. tp,ep; $TP_SHARED: shared-expert
#                  layouts, default replicate, e.g. replicate,tp); alone in a group
#   fid            ds4_best's fidelity against the reference on 8 layers of V4-Flash, with the hc fold (the default)
#                  and without it (DS4_HC_FOLD=0): one job each, tables fid_hcf1.md / fid_hcf0.md under $OUT
#   NAME_alt       bench, kbench or profile on a second build of both extensions with the extra nvcc flags
#                  $ALT_NVCC_FLAGS (a -D switch of the CUDA sources; built in .ext_build_alt beside the default
#                  build), outputs tagged _alt: a build-time ablation in a second process on the same machine
#                  (session 21's L2-hint A/B, experiments/decode_session21_h200.md); bench_alt takes
#                  $BENCH_ALT_VARIANTS where set, else $BENCH_VARIANTS
#   seed_tp2       seed-phase sweep on the full model at tp=2 (long; alone in its group; $SEED_TP2_TIMEOUT s, default 540)
set -u
# Each finished stage appends its logs to $OUT/logs.txt (one file: a call brings back at most 8), so a
# lease cut short by its time limit still returns what ran. Sweeps' run folders live in S.
OUT=${OUT:-/tmp/ds4_out}; L=/tmp/ds4_logs; S=/tmp/ds4_sweeps; mkdir -p "$OUT" "$L" "$S"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 MAX_JOBS=32
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}   # the lent GPUs are sm_90; CI compiles sm_80
if ls .whl/*.whl >/dev/null 2>&1; then   # hydra-core / omegaconf wheels carried from the dev machine
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
elif [ -d build/site/hydra ]; then   # or the same packages installed into build/site (pip install --target)
  export PYTHONPATH=$PWD/build/site:$PWD
else
  export PYTHONPATH=$PWD
fi
BENCH_VARIANTS=${BENCH_VARIANTS:-kernels+fused+graph}
SEED_JOBS=${SEED_JOBS:-experiment=seed_phase1,ds4_best,ds4_cuda_graph,seed_phase4,seed_phase6,seed_phase2,seed_phase3,seed_phase5}
TP_VARIANTS=${TP_VARIANTS:-kernels+fused+graph,kernels+fused+graph+bf16,kernels+fused+graph+symm}
PT="python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short"
NGPU=$(nvidia-smi -L | wc -l); nvidia-smi -L; date -u
t0=$(date +%s); stamp() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
stamp build
ALT_ENV=(DS4_NVCC_FLAGS="${ALT_NVCC_FLAGS:-}" DS4_EXT_BUILD_DIR="$PWD/.ext_build_alt" DS4_ATTN_EXT_BUILD_DIR="$PWD/.ext_build_alt/attn")
[ -n "${ALT_NVCC_FLAGS:-}" ] && { env "${ALT_ENV[@]}" python3 scripts/build_ext.py -q > "$L/build_alt.log" 2>&1
  echo "alt build ($ALT_NVCC_FLAGS) rc=$?" >> "$L/build_alt.log"; } &
python3 scripts/build_ext.py -q > "$L/build.log" 2>&1; echo "build rc=$?"; tail -n 2 "$L/build.log"
wait; [ -f "$L/build_alt.log" ] && tail -n 2 "$L/build_alt.log"

stage() {  # stage name, GPU index[, output tag]
  local g=$2 X=${3:-}
  case $1 in
    *_alt) ( export "${ALT_ENV[@]}"; BENCH_VARIANTS=${BENCH_ALT_VARIANTS:-$BENCH_VARIANTS}; stage "${1%_alt}" "$g" _alt ) ;;
    kernel_tests) CUDA_VISIBLE_DEVICES=$g timeout 200 $PT tests/test_kernels_gpu.py tests/test_attn_kernels_gpu.py \
                    tests/test_decode_glue_gpu.py tests/test_hc_fold_gpu.py tests/test_moe_ffn_gpu.py \
                    tests/test_capture_join_gpu.py \
                    > "$L/kernel_tests.log" 2>&1 ;;
    kbench) CUDA_VISIBLE_DEVICES=$g timeout 300 python3 scripts/bench_kernels.py --out "$OUT/bench_kernels$X.json" --mma "${MMA_SHAPES:-w2d8}" \
        ${KBENCH_ARGS:-} > "$L/kbench$X.log" 2>&1 ;;
    ncu)
      local so; so=$(ls .ext_build/*/ds4_ext*.so .ext_build/*.so 2>/dev/null | head -n 1)
      [ -n "$so" ] && cuobjdump --dump-sass "$so" 2>&1 | gzip > "$OUT/sass_moe_gemv.txt.gz"
      CUDA_VISIBLE_DEVICES=$g timeout 200 ncu --clock-control none --kernel-name regex:"moe_|gemv" \
        --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis --section Occupancy \
        --section LaunchStats --section MemoryWorkloadAnalysis python3 scripts/ncu_kernels.py > "$OUT/ncu.txt" 2>&1
      CUDA_VISIBLE_DEVICES=$g timeout 120 ncu --clock-control none --kernel-name regex:"moe_|gemv" --csv --metrics \
"gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,\
sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active,\
sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,\
sm__issue_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum" python3 scripts/ncu_kernels.py \
        > "$OUT/ncu_pipes.txt" 2>&1
      grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Stall|Achieved Occ|Registers Per" \
        "$OUT/ncu.txt" > "$L/ncu.log" 2>&1 ;;
    ncu_step)
      CUDA_VISIBLE_DEVICES=$g timeout 240 ncu --clock-control none --graph-profiling node --kernel-name-base demangled \
        --kernel-name regex:"${NCU_KERNEL:-moe_down_mma_kernel<\(int\)4, \(int\)[0-9], \(int\)2, \(bool\)0, \(bool\)1>}" \
        --launch-count "${NCU_COUNT:-4}" \
        --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
        --section LaunchStats --section SchedulerStats --section SourceCounters python3 scripts/bench_decode.py --layers 4 --new-tokens 8 \
        --variants kernels+fused+graph+cap8192 --out /tmp/ds4_ncu_step_bench.json > "$OUT/ncu_step.txt" 2>&1
      grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Stall|Achieved Occ|Registers Per|No Eligible|Active Warps|Warp Stall Sampling|Branch Instructions" \
        "$OUT/ncu_step.txt" > "$L/ncu_step.log" 2>&1 ;;
    probe) nvcc -std=c++17 -O3 -arch=${PROBE_ARCH:-sm_90} -DDS4_PROBE scripts/probe_phases.cu -o /tmp/ds4_probe \
        > "$L/probe.log" 2>&1 || return
      local m; for m in ${PROBE_ARGS:-all}; do   # modes, space-separated (all: the default probe set)
        CUDA_VISIBLE_DEVICES=$g timeout 150 /tmp/ds4_probe ${m/#all/} >> "$L/probe.log" 2>&1
      done ;;
    probe_bulk) nvcc -std=c++17 -O3 -arch=sm_90 -DDS4_PROBE scripts/probe_bulk.cu -o /tmp/ds4_probe_bulk \
        > "$L/probe_bulk.log" 2>&1 || return
      CUDA_VISIBLE_DEVICES=$g timeout 150 /tmp/ds4_probe_bulk >> "$L/probe_bulk.log" 2>&1 ;;
    pytest) CUDA_VISIBLE_DEVICES=$g CUDA_LAUNCH_BLOCKING=1 timeout 200 python3 -X faulthandler -m pytest -m gpu -q \
        -p no:cacheprovider --tb=long $PYTEST_ARGS ${PYTEST_K:+-k "$PYTEST_K"} > "$L/pytest.log" 2>&1 ;;
    e2e_tests) CUDA_VISIBLE_DEVICES=$g timeout 420 $PT tests/test_gpu_e2e.py -k "${E2E_K:-not tp2}" > "$L/e2e_tests.log" 2>&1 ;;
    tp2_tests) CUDA_VISIBLE_DEVICES=0,1 timeout 300 $PT tests/test_allreduce_gpu.py tests/test_gpu_e2e.py \
        -k "${TP2_K:-tp2 or all_reduce}" > "$L/tp2_tests.log" 2>&1 ;;
    bench) CUDA_VISIBLE_DEVICES=$g timeout 320 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
        --variants "$BENCH_VARIANTS" --out "$OUT/bench_1gpu$X.json" > "$L/bench_1gpu$X.log" 2>&1 ;;
    profile|profile0)  # profile0: the same without PDL (each kernel's own time; the strict critical path)
      local ovl=1 pdl=${PROFILE_PDL:-1} tag=""; [ "${PROFILE_INLINE:-0}" = 1 ] && ovl=0
      [ "$1" = profile0 ] && { pdl=0; tag=_nopdl; }
      tag=$tag$X
      DS4_PDL=$pdl DS4_COMPRESS_OVERLAP=$ovl DS4_ATTN_OVERLAP=$ovl DS4_SHARED_OVERLAP=$ovl \
        CUDA_VISIBLE_DEVICES=$g timeout 90 python3 scripts/profile_step.py --layers 8 --variant "${PROFILE_VARIANT:-kernels+fused}" --timeline \
        --long-context 65536 ${PROFILE_ARGS:-} --out "$OUT/profile_step$tag.json" > "$L/$1$X.log" 2>&1 ;;
    profile_tp2)
      CUDA_VISIBLE_DEVICES=0,1 timeout 150 torchrun --nproc-per-node 2 scripts/profile_step.py --layers 8 \
        --variant "${PROFILE_TP2_VARIANT:-kernels+fused+ll+shtp+cap8192}" --timeline --out "$OUT/profile_step_tp2.json" \
        > "$L/$1.log" 2>&1 ;;
    seed)
      CUDA_VISIBLE_DEVICES=$g timeout 240 python3 -m ds4 ablation=seed_phases model.n_layers=8 tracking=none \
        max_new_tokens=32 $SEED_JOBS hydra.sweep.dir="$S/seed_1gpu" > "$L/seed_1gpu.log" 2>&1
      python3 -m ds4.compare "$S/seed_1gpu" --baseline seed_phase1 --md "$OUT/seed_phases_1gpu.md" \
        --out "$OUT/seed_phases_1gpu.png" > "$L/compare_1gpu.log" 2>&1 ;;
    fid)
      local f; for f in 1 0; do
        DS4_HC_FOLD=$f CUDA_VISIBLE_DEVICES=$g timeout 150 python3 -m ds4 ablation=seed_phases model.n_layers=8 tracking=none \
          max_new_tokens=32 experiment=ds4_best hydra.sweep.dir="$S/fid_hcf$f" > "$L/fid_run$f.log" 2>&1
        python3 -m ds4.compare "$S/fid_hcf$f" --md "$OUT/fid_hcf$f.md" > /dev/null 2>> "$L/fid.log"
        { echo "DS4_HC_FOLD=$f"; cat "$OUT/fid_hcf$f.md"; } >> "$L/fid.log" 2>&1
      done ;;
    seed_tp2)
      CUDA_VISIBLE_DEVICES=0,1 timeout ${SEED_TP2_TIMEOUT:-540} torchrun --nproc-per-node 2 -m ds4 ablation=seed_phases parallel.tp=2 \
        task.fidelity=false tracking=none max_new_tokens=32 $SEED_JOBS hydra.sweep.dir="$S/seed_tp2" > "$L/seed_tp2.log" 2>&1
      python3 -m ds4.compare "$S/seed_tp2" --baseline seed_phase1 --md "$OUT/seed_phases_tp2.md" \
        --out "$OUT/seed_phases_tp2.png" > "$L/compare_tp2.log" 2>&1 ;;
    tp2|tp4)
      local n=${1#tp}
      [ "$NGPU" -ge "$n" ] || { echo "$1: needs $n GPUs, have $NGPU" > "$L/$1.log"; return; }
      timeout 240 torchrun --nproc-per-node "$n" scripts/bench_decode.py --layers "${TP_LAYERS:-8,43}" --new-tokens 48 \
        --variants "$TP_VARIANTS" --experts "${TP_EXPERTS:-tp}" \
        --shared "${TP_SHARED:-replicate}" --out "$OUT/bench_$1.json" > "$L/bench_$1.log" 2>&1 ;;
    *) echo "unknown stage $1" ;;
  esac
}

logs_of() {  # the log names a stage writes
  case $1 in
    bench) echo bench_1gpu ;;
    bench_alt) echo bench_1gpu_alt ;;
    tp2|tp4) echo "bench_$1" ;;
    seed) echo "seed_1gpu compare_1gpu" ;;
    seed_tp2) echo "seed_tp2 compare_tp2" ;;
    pytest_alt) echo pytest ;;  # (the alt build's run writes the same log)
    *) echo "$1" ;;
  esac
}

for group in "$@"; do
  stamp "$group"
  i=0
  for lane in ${group//+/ }; do
    ( g=$(( i % NGPU ))
      for s in ${lane//,/ }; do
        stage "$s" $g
        for f in $(logs_of "$s"); do
          [ -f "$L/$f.log" ] && { echo "##### $f"; cat "$L/$f.log"; } >> "$OUT/logs.txt"
        done
      done ) &
    i=$(( i + 1 ))
  done
  wait
done
stamp done
for f in kernel_tests e2e_tests tp2_tests; do
  [ -f "$L/$f.log" ] && { echo "--- $f"; grep -E "passed|failed|Error|^FAILED|^E  " "$L/$f.log" | tail -n 14; }
done
[ -f "$L/pytest.log" ] && { echo "--- pytest"; grep -v "^\s*$" "$L/pytest.log" | tail -n 60; }
[ -f "$L/ncu.log" ] && { echo "--- ncu"; head -n 120 "$L/ncu.log"; }
[ -f "$L/ncu_step.log" ] && { echo "--- ncu_step"; head -n 60 "$L/ncu_step.log"; }
[ -f "$L/probe.log" ] && { echo "--- probe"; grep -v -i warn "$L/probe.log"; }
[ -f "$L/probe_bulk.log" ] && { echo "--- probe_bulk"; grep -v -i warn "$L/probe_bulk.log"; }
for f in kbench kbench_alt; do [ -f "$L/$f.log" ] && { echo "--- $f"; sed -n '/^kernel /,$p' "$L/$f.log"; }; done
for f in bench_1gpu bench_1gpu_alt bench_tp2 bench_tp4; do
  [ -f "$L/$f.log" ] && { echo "--- $f"; grep -v '^{' "$L/$f.log" | grep -v "^\s*$" | tail -n 12; }
done
for f in profile profile0 profile_alt profile0_alt profile_tp2; do  # the critical path's table, then the per-kernel table (the path itself: logs.txt)
  [ -f "$L/$f.log" ] && { echo "--- $f"; sed -n '/^timeline of one replay/,/^the critical path in order/p' "$L/$f.log" | head -n 30
    sed -n '/^NVIDIA .*n_layers=/,$p' "$L/$f.log" | grep -v "^\s*$" | head -n 26; }
done
[ -f "$L/fid.log" ] && { echo "--- fid"; grep -E "^DS4_HC_FOLD|^\| (ablation|experiment|job)" "$L/fid.log"; }
for f in "$OUT"/seed_phases_*.md; do [ -f "$f" ] && { echo "--- $f"; head -n 16 "$f"; }; done
exit 0
