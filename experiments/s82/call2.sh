#!/usr/bin/env bash
# Session 82, call 2: is the routed down's h staging (3.3-4.0 us in the step on an H100, call 1) the latency of h's
# loads behind the weight traffic? The alt build -DDS4_DOWN_H_FIRST=1 (csrc/moe_mma.cu; a diagnostic, the same bits)
# requests the down's weight rounds left after the PDL wait only once h has landed; with DS4_PREFETCH_DOWN=0 no weight
# round of the launch is requested before h. Steps: the probe build and the probe build with the switch, side by
# side (each with its own attention build: no two builds write one folder); the MoE step probe: base and dpre0 in
# the first, hf and hf_dpre0 in the second. No library build: the default build's code is unchanged (ptxas: the same
# registers and spills for all 156 moe_mma.cu kernels). Logs: one tarball in $OUT.
# Usage (carry build/site): OUT=$OUT bash experiments/s82/call2.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA DS4_BULK_STAGE DS4_PREFETCH_DOWN
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
L=/tmp/s82_call2; rm -rf "$L"; mkdir -p "$L"
snap() { tar czf "$OUT/logs.tgz" -C "$L" .; }
trap 'snap; echo "total $(el)s"' EXIT
nvidia-smi -L; date -u
env DS4_NVCC_FLAGS=-DDS4_MOE_PROBE DS4_EXT_BUILD_DIR="$PWD/.ext_build_probe" DS4_ATTN_NVCC_FLAGS= \
  DS4_ATTN_EXT_BUILD_DIR="$PWD/.ext_build_probe/attn" python3 scripts/build_ext.py -q > "$L/build_probe.log" 2>&1 &
PA=$!
env DS4_NVCC_FLAGS="-DDS4_MOE_PROBE -DDS4_DOWN_H_FIRST=1" DS4_EXT_BUILD_DIR="$PWD/.ext_build_probe_hf" \
  DS4_ATTN_NVCC_FLAGS= DS4_ATTN_EXT_BUILD_DIR="$PWD/.ext_build_probe_hf/attn" python3 scripts/build_ext.py -q \
  > "$L/build_probe_hf.log" 2>&1 &
PH=$!
wait $PA; ra=$?; wait $PH; rh=$?; echo "probe builds rc=$ra/$rh at +$(el)s"
for f in build_probe build_probe_hf; do grep -E "error" "$L/$f.log" | head -5; done
for pv in base dpre0 hf hf_dpre0; do
  case $pv in base|dpre0) D=$PWD/.ext_build_probe; F=-DDS4_MOE_PROBE; [ $ra -eq 0 ] || continue;;
    *) D=$PWD/.ext_build_probe_hf; F="-DDS4_MOE_PROBE -DDS4_DOWN_H_FIRST=1"; [ $rh -eq 0 ] || continue;; esac
  case $pv in *dpre0) P=0;; *) P=;; esac
  env DS4_NVCC_FLAGS="$F" DS4_EXT_BUILD_DIR="$D" DS4_ATTN_NVCC_FLAGS= DS4_ATTN_EXT_BUILD_DIR="$D/attn" \
    ${P:+DS4_PREFETCH_DOWN=$P} DS4_NO_JIT=1 timeout 50 python3 scripts/probe_moe_step.py --layers 8 --replays 6 \
    --out "$L/probe_$pv.json" > "$L/probe_$pv.log" 2>&1
  echo "probe $pv rc=$? at +$(el)s"; sed -n '/^medians/,$p' "$L/probe_$pv.log" | grep -E "^alone|^step|down block|waited"
  snap
done
