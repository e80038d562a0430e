#!/usr/bin/env bash
# Ready for a later session (not run): call 4 of session 78 done right, the final hc fold's epilogue against the form
# before it (csrc/hc_fold.cuh at d644886) on another machine. Fixes call 4's failure: the swapped file stays in place
# until the alt build's bench has run, the final file goes back with its own mtime (cp -p: ninja sees nothing newer
# than the library's build), and every bench process runs with DS4_NO_JIT=1, so a stale build fails at once instead of
# compiling past the timeout. The slope in three processes: final, before, final. Logs in $OUT.
# Usage: first, here, git show d644886:csrc/hc_fold.cuh > experiments/s78/hc_fold_before.cuh (an untracked file
# travels with the tree); then, carrying build/site: OUT=$OUT bash experiments/s78/next_fold_ab.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
ALT_ENV=(DS4_EXT_BUILD_DIR="$PWD/.ext_build_alt" DS4_ATTN_NVCC_FLAGS= DS4_ATTN_EXT_BUILD_DIR="$PWD/.ext_build/attn")
B=kernels+fused+graph+cap8192
bench() {  # $1: the log's name; the rest: environment
  local name=$1; shift
  env "$@" DS4_NO_JIT=1 timeout 60 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$B,$B" \
    --out "$OUT/bench_$name.json" > "$OUT/bench_$name.log" 2>&1
  echo "bench $name rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer|Error" "$OUT/bench_$name.log"
}
bench final
cp -p csrc/hc_fold.cuh /tmp/hc_fold_final.cuh
[ -s experiments/s78/hc_fold_before.cuh ] || { echo "experiments/s78/hc_fold_before.cuh missing (see Usage)"; exit 1; }
cp experiments/s78/hc_fold_before.cuh csrc/hc_fold.cuh
env "${ALT_ENV[@]}" python3 scripts/build_ext.py -q > "$OUT/build_alt.log" 2>&1; arc=$?
echo "alt build rc=$arc at +$(el)s"
[ $arc -eq 0 ] && bench before "${ALT_ENV[@]}"
cp -p /tmp/hc_fold_final.cuh csrc/hc_fold.cuh
bench final2
echo "total $(el)s"
