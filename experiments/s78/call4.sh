#!/usr/bin/env bash
# Session 78, call 4 (the warm machine of call 3): the final code against the fold's epilogue before session 78, on a
# second H100: the alt build takes experiments/s78/hc_fold_before.cuh (csrc/hc_fold.cuh at d644886) in place of
# csrc/hc_fold.cuh in this machine's copy of the tree; the slope in three processes (final, before, final).
# RAN AND FAILED (no figure): the script put the final hc_fold.cuh back right after the alt build, so every bench
# process saw sources newer than its build and compiled the extension again (ds4: "its sources changed"), and each ran
# past its 60 s timeout. A rerun must keep the swapped file in place until the alt bench has loaded its build, or
# build the alt from a copy of the tree.
# experiments/s78/hc_fold_before.cuh (removed after the call: it is in git) is written by
#   git show d644886:csrc/hc_fold.cuh > experiments/s78/hc_fold_before.cuh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
python3 scripts/build_ext.py -q > /tmp/b.log 2>&1; echo "build (warm) rc=$? at +$(el)s"
cp csrc/hc_fold.cuh /tmp/hc_fold_final.cuh && cp experiments/s78/hc_fold_before.cuh csrc/hc_fold.cuh
ALT_ENV=(DS4_NVCC_FLAGS=-DDS4_ALT_FOLD DS4_EXT_BUILD_DIR="$PWD/.ext_build_alt" DS4_ATTN_NVCC_FLAGS=
         DS4_ATTN_EXT_BUILD_DIR="$PWD/.ext_build/attn")
env "${ALT_ENV[@]}" python3 scripts/build_ext.py -q > "$OUT/build_alt.log" 2>&1; arc=$?
cp /tmp/hc_fold_final.cuh csrc/hc_fold.cuh; echo "alt build rc=$arc at +$(el)s"
[ $arc -ne 0 ] && { tail -20 "$OUT/build_alt.log"; exit 1; }
B=kernels+fused+graph+cap8192
for run in final before final2; do
  if [ $run = before ]; then E=("${ALT_ENV[@]}"); else E=(); fi
  env "${E[@]}" timeout 60 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$B,$B" \
    --out "$OUT/bench_$run.json" > "$OUT/bench_$run.log" 2>&1
  echo "bench $run rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer" "$OUT/bench_$run.log"
done
echo "total $(el)s"
