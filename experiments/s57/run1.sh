#!/usr/bin/env bash
# VOID (see experiments/decode_session57_h200.md): the bench function set the alt folders but not DS4_NVCC_FLAGS, so
# every alt process rebuilt the folder it loaded with the default flags. run2.sh / run3.sh are the fixed forms.
# Session 57, run 1 (one lent H200, one call): two build-time A/Bs against the default build, in one alt build.
#   down16: the MoE down kernels in 16-warp blocks (-DDS4_DOWN_WARPS=16, csrc/moe_mma.cu; session 54's idea, never run)
#   kc16:   the attention chunk kernel at 16 keys per block (-DDS4_SP_KC=16, csrc/attn/sparse_attn.cu)
# Each flag changes one extension only (down16: ds4.kernels; kc16: ds4.kernels_attn), so the alt build holds both and
# a process picks each extension's folder on its own: default / down16 / kc16 / both are four processes' choices of
# (DS4_EXT_BUILD_DIR, DS4_ATTN_EXT_BUILD_DIR). The slope (4 -> 12 layers, two passes per process) in the order
# default, down16, kc16, both, twice; then the 8-layer profile (critical path, +65536 positions) in default and kc16;
# then the tests on the alt build (both flags): MoE / fold / FFN kernels, attention kernels, decode glue, e2e.
set -u
OUT=${OUT:-/tmp/ds4_out}; W=/tmp/s57; mkdir -p "$OUT" "$W"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
# st also packs what has run so far into $OUT (a call cut at its limit still brings the logs back)
save() { tar czf "$OUT/s57_run1.tgz" -C "$W" . 2>/dev/null; cp "$W/summary.txt" "$OUT/" 2>/dev/null; }
t0=$(date +%s); st() { save; echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
nvidia-smi -L
D_MAIN=$PWD/.ext_build; D_ATTN=$PWD/.ext_build/attn
A_MAIN=$PWD/.ext_build_alt; A_ATTN=$PWD/.ext_build_alt/attn
st build
( DS4_NVCC_FLAGS="-DDS4_DOWN_WARPS=16 -DDS4_SP_KC=16" DS4_EXT_BUILD_DIR=$A_MAIN DS4_ATTN_EXT_BUILD_DIR=$A_ATTN \
    python3 scripts/build_ext.py -q > "$W/build_alt.log" 2>&1; echo "alt build rc=$?" >> "$W/build_alt.log" ) &
python3 scripts/build_ext.py -q > "$W/build.log" 2>&1; echo "build rc=$?"; wait
tail -n 3 "$W/build.log" "$W/build_alt.log"
V=kernels+fused+graph+cap8192
bench() {  # tag main-dir attn-dir
  DS4_EXT_BUILD_DIR=$2 DS4_ATTN_EXT_BUILD_DIR=$3 timeout 100 python3 scripts/bench_decode.py --layers 4,12 \
    --new-tokens 48 --variants "$V,$V" --out "$W/bench_$1.json" > "$W/bench_$1.log" 2>&1
  echo "$1 rc=$?: $(grep -E '^per-layer' "$W/bench_$1.log" | sed 's/^per-layer //' | tr '\n' ' ')" | tee -a "$W/summary.txt"
}
st bench
for pass in a b; do
  bench default_$pass "$D_MAIN" "$D_ATTN"
  bench down16_$pass "$A_MAIN" "$D_ATTN"
  bench kc16_$pass "$D_MAIN" "$A_ATTN"
  bench both_$pass "$A_MAIN" "$A_ATTN"
done
st profile
for t in default kc16; do
  a=$D_ATTN; [ $t = kc16 ] && a=$A_ATTN
  DS4_ATTN_EXT_BUILD_DIR=$a timeout 60 python3 scripts/profile_step.py --layers 8 --variant kernels+fused --timeline \
    --long-context 65536 --out "$W/profile_$t.json" > "$W/profile_$t.log" 2>&1
  echo "profile $t rc=$?"; grep -iE "wall|65536|sparse_chunk|sparse_combine" "$W/profile_$t.log" | head -9
done
st tests
export DS4_EXT_BUILD_DIR=$A_MAIN DS4_ATTN_EXT_BUILD_DIR=$A_ATTN
PT="python3 -m pytest -q -p no:cacheprovider --tb=short"
timeout 120 $PT tests/test_kernels_gpu.py tests/test_hc_fold_gpu.py tests/test_moe_ffn_gpu.py \
  -k "moe or fold or shared_expert or routed or spacer or down" > "$W/tests_moe_alt.log" 2>&1
echo "moe tests (alt) rc=$?"; grep -E "passed|failed|^FAILED" "$W/tests_moe_alt.log" | tail -6
timeout 120 $PT tests/test_attn_kernels_gpu.py tests/test_decode_glue_gpu.py > "$W/tests_attn_alt.log" 2>&1
echo "attn tests (alt) rc=$?"; grep -E "passed|failed|^FAILED" "$W/tests_attn_alt.log" | tail -6
timeout 80 $PT tests/test_gpu_e2e.py -k "teacher_forced or batch1_graph" > "$W/tests_e2e_alt.log" 2>&1
echo "e2e tests (alt) rc=$?"; grep -E "passed|failed|^FAILED" "$W/tests_e2e_alt.log" | tail -6
st done
echo "--- summary (us per layer, median; mean in brackets)"; cat "$W/summary.txt"
