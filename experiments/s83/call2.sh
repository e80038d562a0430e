#!/usr/bin/env bash
# Session 83's ready call (one GPU, about 8 device minutes with the start; not run in session 83: the device time ran
# out). Call 1's scripts/probe_h_read.cu staged the routed down's 24 KB of h in 256 blocks in 0.8 us (H100), where the
# library's down blocks take 3.3-3.9 us. Is the down's first staging a cold start (instruction fetches of code that
# the weight streams evicted from L2, or address translations) rather than its loads? Alt builds of csrc/moe_mma.cu
# (-DDS4_DOWN_STAGE_PROBE, a diagnostic, the same bits; the default build's code is unchanged):
#   1 prewarm: the staging run once before the PDL wait on h as it stands (code and pages warm, h's lines not);
#   2 twice:   h staged again by .cg loads after the staging; the probe's "stage" is the second staging.
# Steps: four builds side by side (the library's, prewarm without the probe, the two probe builds; each its own
# folders), and meanwhile scripts/probe_splitk_tail.cu with and without the library's early trigger and
# scripts/probe_code_fetch.cu (cold code from the SM's caches, L2, DRAM); the MoE step
# probe in the two probe builds (twice first: it answers the question); then the slope, one
# process per build (the library's, prewarm, the library's again, prewarm again). Logs: one tarball in $OUT.
# Usage (carry build/site): OUT=$OUT bash experiments/s83/call2.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA DS4_BULK_STAGE DS4_PREFETCH_DOWN
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
L=/tmp/s83_call2; rm -rf "$L"; mkdir -p "$L"
snap() { tar czf "$OUT/logs.tgz" -C "$L" .; }
trap 'snap; echo "total $(el)s"' EXIT
nvidia-smi -L; date -u
declare -A FLAGS=([base]="" [pw]="-DDS4_DOWN_STAGE_PROBE=1" [sp1]="-DDS4_MOE_PROBE -DDS4_DOWN_STAGE_PROBE=1"
                  [sp2]="-DDS4_MOE_PROBE -DDS4_DOWN_STAGE_PROBE=2")
# a command in a build's environment: its flags and its own folders (no two builds write one folder); the attention
# extension without the flags (they are the MoE's)
in_build() {  # build command...
  local b=$1; shift
  if [ "$b" = base ]; then env DS4_NVCC_FLAGS= DS4_ATTN_NVCC_FLAGS= "$@"; return; fi
  env DS4_NVCC_FLAGS="${FLAGS[$b]}" DS4_EXT_BUILD_DIR="$PWD/.ext_build_$b" DS4_ATTN_NVCC_FLAGS= \
    DS4_ATTN_EXT_BUILD_DIR="$PWD/.ext_build_$b/attn" "$@"
}
for b in base pw sp1 sp2; do
  in_build $b python3 scripts/build_ext.py -q > "$L/build_$b.log" 2>&1 &
done
# while the builds compile (the GPU idle): the launch-boundary probe again, now also with the library's trigger
nvcc -std=c++17 -O3 -arch=sm_90 scripts/probe_splitk_tail.cu -o /tmp/probe_tail && /tmp/probe_tail \
  > "$L/probe_splitk_tail.log" 2>&1; cat "$L/probe_splitk_tail.log"
# and what running cold code costs a block (from the SM's caches, from L2, from DRAM)
nvcc -std=c++17 -O3 -arch=sm_90 scripts/probe_code_fetch.cu -o /tmp/probe_code && /tmp/probe_code \
  > "$L/probe_code_fetch.log" 2>&1; cat "$L/probe_code_fetch.log"; snap
wait; echo "builds at +$(el)s"
for b in base pw sp1 sp2; do grep -q "extension ready" "$L/build_$b.log" || { echo "build $b failed:";
  grep -E "error" "$L/build_$b.log" | head -5; }; done
for b in sp2 sp1; do
  in_build $b env DS4_NO_JIT=1 timeout 50 python3 scripts/probe_moe_step.py \
    --layers 8 --replays 6 --out "$L/probe_$b.json" > "$L/probe_$b.log" 2>&1
  echo "probe $b rc=$? at +$(el)s"; sed -n '/^medians/,$p' "$L/probe_$b.log" | grep -E "^alone|^step|down block"
  snap
done
B=kernels+fused+graph+cap8192
i=0
for b in base pw base pw; do
  [ "$(el)" -gt 470 ] && { echo "the rest skipped at +$(el)s (the per-call limit is 600 s)"; break; }
  i=$((i + 1))
  in_build $b env DS4_NO_JIT=1 timeout 100 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
    --variants "$B,$B" --out "$L/bench_${i}_$b.json" > "$L/bench_${i}_$b.log" 2>&1
  echo "bench $i $b rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer|Error" "$L/bench_${i}_$b.log" | tail -3; snap
done
