#!/usr/bin/env bash
# Session 81, call 1: session 80's ready script (experiments/s80/next_bsd_dpre0.sh) with one step added: the GEMV's
# bulk-staging GPU test (session 79's review mend, 63dacd3, never run on a GPU for the plain GEMV).
# (That script is now a pointer here.) The reading left for the routed down's
# 3.2-3.5 us of staging h (session 79: not the block's load path; session 80 call 1: not the lines' L2 slices): h is
# requested after the block's own weight rounds and comes back behind them. With DS4_BULK_STAGE=d (thread 0 issues h's
# bulk copies right after the PDL wait, before prefetch_rest) and DS4_PREFETCH_DOWN=0 (no weight round before the wait)
# h is the block's first request. The probe shows whether the staging then drops; the slope whether the step gains.
# Steps: the library's build and the probe build beside it; the probe with base / bsd / dpre0 / bsd+dpre0 / bsd+dpre1;
# the slope with the same variants interleaved. About 6 device minutes. Logs: one tarball in $OUT.
# Usage (carry build/site): OUT=$OUT [SLIM=1] bash experiments/s81/call1.sh (SLIM: 2 variants, 2 probes;
#   ULTRA=1: SLIM's variants, no probes)
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA DS4_BULK_STAGE DS4_PREFETCH_DOWN
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
L=/tmp/s81_call1; rm -rf "$L"; mkdir -p "$L"
snap() { tar czf "$OUT/logs.tgz" -C "$L" .; }
trap 'snap; echo "total $(el)s"' EXIT
nvidia-smi -L; date -u
PROBE_ENV=(DS4_NVCC_FLAGS=-DDS4_MOE_PROBE DS4_EXT_BUILD_DIR="$PWD/.ext_build_probe" DS4_ATTN_NVCC_FLAGS=
           DS4_ATTN_EXT_BUILD_DIR="$PWD/.ext_build/attn")
python3 scripts/build_ext.py -q > "$L/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { grep -E "error" "$L/build.log" | head -20; exit 1; }
PB=
# ULTRA (the session's last minutes): no probe build, no probes
[ "${ULTRA:-0}" = 1 ] || { env "${PROBE_ENV[@]}" python3 scripts/build_ext.py -q > "$L/build_probe.log" 2>&1 & PB=$!; }
B=kernels+fused+graph+cap8192
V="$B,$B+bsd,$B+dpre0,$B+bsd+dpre0,$B+bsd+dpre1,$B,$B+bsd+dpre0"
PV="base bsd_dpre0 bsd dpre0 bsd_dpre1"  # the pair that answers first
if [ "${SLIM:-0}" = 1 ] || [ "${ULTRA:-0}" = 1 ]; then  # short device time
  V="$B,$B+bsd+dpre0,$B,$B+bsd+dpre0"; PV="base bsd_dpre0"
fi
DS4_NO_JIT=1 timeout 240 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V" \
  --out "$L/bench.json" > "$L/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer|Error" "$L/bench.log"; snap
timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_bulk_stage_gpu.py -k gemv \
  > "$L/bulk_gemv_tests.log" 2>&1
echo "bulk gemv tests rc=$? at +$(el)s: $(tail -1 "$L/bulk_gemv_tests.log")"; snap
[ -n "$PB" ] || exit 0
wait $PB; prc=$?; echo "probe build rc=$prc at +$(el)s"
if [ $prc -eq 0 ]; then
  for pv in $PV; do
    case $pv in base) E=();; bsd) E=(DS4_BULK_STAGE=d);; dpre0) E=(DS4_PREFETCH_DOWN=0);;
      bsd_dpre0) E=(DS4_BULK_STAGE=d DS4_PREFETCH_DOWN=0);; bsd_dpre1) E=(DS4_BULK_STAGE=d DS4_PREFETCH_DOWN=1);; esac
    env "${PROBE_ENV[@]}" "${E[@]}" DS4_NO_JIT=1 timeout 50 python3 scripts/probe_moe_step.py --layers 8 --replays 6 \
      --out "$L/probe_$pv.json" > "$L/probe_$pv.log" 2>&1
    echo "probe $pv rc=$? at +$(el)s"; sed -n '/^medians/,$p' "$L/probe_$pv.log" | grep -E "^alone|^step|down block"
    snap
  done
fi
