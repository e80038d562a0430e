#!/usr/bin/env bash
# Session 85, call 3 (one lent GPU): the weight streams' L2 prefetch-size hint. Two builds of the GEMV / MoE
# extension, the default and -DDS4_STREAM_L2_256B (ld_stream16 asks .L2::256B: a miss fetches the whole aligned
# 256-byte block; csrc/ds4_common.cuh), the attention extension shared; then the weight kernels alone on each
# (bench_kernels.py: the dense GEMV rows, then the routed MoE rows); then the decode slope, one process per build,
# alternating A B A B, as time allows. Logs: one tarball in $OUT.
# Not run in session 85 (no machine could be started). The flag is not in the tree: apply the diff first.
# Known bug (found in session 87, call 1): `timeout` cannot run the shell function `hint`, so every row of the
# hinted build exits 127 and measures nothing. The fixed script is experiments/s87/call2.sh; use that one.
# Usage (carry build/site): git apply experiments/s85/stream_l2_256b.diff;
#   OUT=$OUT [BUDGET=seconds, default 560] bash experiments/s85/call3.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA DS4_BULK_STAGE DS4_MOE_SPLITK DS4_MOE_FFN
unset DS4_EXT_BUILD_DIR DS4_ATTN_EXT_BUILD_DIR
BUDGET=${BUDGET:-560}
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
L=/tmp/s85_call3; rm -rf "$L"; mkdir -p "$L"
snap() { tar czf "$OUT/logs.tgz" -C "$L" .; }
trap 'snap; echo "total $(el)s"' EXIT
nvidia-smi -L; date -u
ATTN=$PWD/.ext_build/attn
hint() {  # the hinted build's environment: its own GEMV / MoE folder, the default attention build, no flags there
  env DS4_EXT_BUILD_DIR=$PWD/.ext_build_l2p DS4_ATTN_EXT_BUILD_DIR="$ATTN" DS4_NVCC_FLAGS=-DDS4_STREAM_L2_256B \
    DS4_ATTN_NVCC_FLAGS= "$@"
}
python3 scripts/build_ext.py -q > "$L/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { grep -E "error" "$L/build.log" | head -20; tail -20 "$L/build.log"; exit 1; }
hint python3 scripts/build_ext.py -q > "$L/build_l2p.log" 2>&1; rc=$?; echo "build l2p rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { grep -E "error" "$L/build_l2p.log" | head -20; tail -20 "$L/build_l2p.log"; exit 1; }
cat "$L/build.log" "$L/build_l2p.log"
export DS4_NO_JIT=1
for mode in dense moe; do
  for w in def l2p; do
    [ "$(el)" -gt $((BUDGET - 40)) ] && break
    pre=(); [ $w = l2p ] && pre=(hint)
    args=(--quick --dense-only); [ $mode = moe ] && args=(--moe-bound)
    timeout 60 "${pre[@]}" python3 scripts/bench_kernels.py "${args[@]}" > "$L/kernels_${mode}_$w.log" 2>&1
    echo "kernels $mode $w rc=$? at +$(el)s"; grep -E "gemv|moe|copy" "$L/kernels_${mode}_$w.log" | head -14; snap
  done
done
B=kernels+fused+graph+cap8192
i=0
for w in def l2p def l2p; do
  [ "$(el)" -gt $((BUDGET - 90)) ] && { echo "the rest skipped at +$(el)s"; break; }
  i=$((i + 1)); pre=(); [ $w = l2p ] && pre=(hint)
  timeout 100 "${pre[@]}" python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$B,$B" \
    --out "$L/bench_${i}_$w.json" > "$L/bench_${i}_$w.log" 2>&1
  echo "bench $i $w rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer|Error" "$L/bench_${i}_$w.log" | tail -3; snap
done
