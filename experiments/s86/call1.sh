#!/usr/bin/env bash
# Session 86, call 1 (one lent GPU). The tree with two uncommitted changes: (a) the MoE gate+up launches' shared
# tables as one struct (csrc/moe_dev.cuh PairTables; moe_mma.cu, moe_ffn.cu, moe_splitk.cu), and (b) session 85's
# L2 prefetch-size flag (experiments/s85/stream_l2_256b.diff, -DDS4_STREAM_L2_256B). Builds the default extension,
# then runs the GPU test modules of the MoE kernels and a few end-to-end rows on it while the hinted GEMV / MoE
# build compiles in its own folder (the attention extension shared); then the weight kernels alone on each build
# (bench_kernels.py --moe-bound, then the dense rows), then the decode slope alternating the builds, as time allows.
# Logs: one tarball in $OUT (unpacked in experiments/s86/call1/). Ran with BUDGET=420 (device time was short): the
# end-to-end rows took 277 s, so the guard skipped the benchmarks; the first change is commit 3e733c8.
# Usage (carry build/site): OUT=$OUT [BUDGET=seconds, default 570] bash experiments/s86/call1.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA DS4_BULK_STAGE DS4_MOE_SPLITK DS4_MOE_FFN
unset DS4_EXT_BUILD_DIR DS4_ATTN_EXT_BUILD_DIR
BUDGET=${BUDGET:-570}
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
L=/tmp/s86_call1; rm -rf "$L"; mkdir -p "$L"
snap() { tar czf "$OUT/logs.tgz" -C "$L" .; }
trap 'snap; echo "total $(el)s"' EXIT
nvidia-smi -L; date -u; git log --oneline -1 2>/dev/null; git diff --stat 2>/dev/null | tail -1
ATTN=$PWD/.ext_build/attn
hint() {  # the hinted build's environment: its own GEMV / MoE folder, the default attention build, no flags there
  env DS4_EXT_BUILD_DIR=$PWD/.ext_build_l2p DS4_ATTN_EXT_BUILD_DIR="$ATTN" DS4_NVCC_FLAGS=-DDS4_STREAM_L2_256B \
    DS4_ATTN_NVCC_FLAGS= "$@"
}
python3 scripts/build_ext.py -q > "$L/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { grep -E "error" "$L/build.log" | head -20; tail -20 "$L/build.log"; exit 1; }
export DS4_NO_JIT=1
run() {  # name, pytest args... (in the background, on the default build)
  local n=$1; shift
  ( timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=short --durations=10 "$@" > "$L/$n.log" 2>&1
    echo "$n rc=$? at +$(el)s: $(grep -E "passed|failed|error" "$L/$n.log" | tail -1)" ) &
}
run moe_kernels tests/test_kernels_gpu.py -k "moe" tests/test_moe_ffn_gpu.py tests/test_moe_splitk_gpu.py \
  tests/test_bulk_stage_gpu.py tests/test_qat_cuda_gpu.py tests/test_hc_fold_gpu.py
run e2e tests/test_gpu_e2e.py -k "options_agree and (MMA or MOE_FFN or MOE_SPLITK or fp4_topk)"
hint python3 scripts/build_ext.py -q > "$L/build_l2p.log" 2>&1; rc=$?; echo "build l2p rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { grep -E "error" "$L/build_l2p.log" | head -20; tail -20 "$L/build_l2p.log"; wait; exit 1; }
wait
snap
for f in "$L"/moe_kernels.log "$L"/e2e.log; do
  echo "== $(basename "$f")"; grep -E "^FAILED|^ERROR|passed|failed" "$f" | tail -8
done
for mode in moe dense; do
  for w in def l2p; do
    [ "$(el)" -gt $((BUDGET - 45)) ] && break
    pre=(); [ $w = l2p ] && pre=(hint)
    args=(--moe-bound); [ $mode = dense ] && args=(--quick --dense-only)
    timeout 60 "${pre[@]}" python3 scripts/bench_kernels.py "${args[@]}" > "$L/kernels_${mode}_$w.log" 2>&1
    echo "kernels $mode $w rc=$? at +$(el)s"
    grep -E "^  |copy bandwidth|Error" "$L/kernels_${mode}_$w.log" | head -16; snap
  done
done
B=kernels+fused+graph+cap8192
i=0
for w in def l2p def l2p; do
  [ "$(el)" -gt $((BUDGET - 85)) ] && { echo "the rest skipped at +$(el)s"; break; }
  i=$((i + 1)); pre=(); [ $w = l2p ] && pre=(hint)
  timeout 100 "${pre[@]}" python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$B,$B" \
    --out "$L/bench_${i}_$w.json" > "$L/bench_${i}_$w.log" 2>&1
  echo "bench $i $w rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer|Error" "$L/bench_${i}_$w.log" | tail -3; snap
done
