#!/usr/bin/env bash
# Session 57, run 2 (one lent H200, one call): run 1 again, fixed. Two build-time A/Bs against the default build:
#   down16: the MoE down kernels in 16-warp blocks (-DDS4_DOWN_WARPS=16, csrc/moe_mma.cu; session 54's idea)
#   kc16:   the attention chunk kernel at 16 keys per block (-DDS4_SP_KC=16, csrc/attn/sparse_attn.cu)
# One alt build holds both: DS4_NVCC_FLAGS for ds4.kernels, DS4_ATTN_NVCC_FLAGS for ds4.kernels_attn (this
# session's per-extension flags). A process loads each extension from the default or the alt folder WITH that
# folder's flags: run 1 set only the folders, so its processes rebuilt the alt folders with the default flags
# (torch hashes the flags): its kc16 rows timed the default code, its down16 rows ran out of time rebuilding.
# Here every .so's mtime is checked after each process (a rebuild is reported, and the row void).
# Order: the slope (4 -> 12 layers, two passes per process) default, down16, kc16, both; the alt tests (MoE / fold /
# FFN kernels on down16; attention kernels and decode glue on kc16); the slope again; the 8-layer profile (critical
# path, +65536 positions) of default and kc16 while time is left.
# SHORT=1 (about 4 device minutes; session 57's "run 3", tried with 399 s left): the build, one slope process each of
# default, down16 and kc16, then the kc16 attention tests while time is left; nothing else.
set -u
OUT=${OUT:-/tmp/ds4_out}; W=/tmp/s57; rm -rf "$W"; mkdir -p "$OUT" "$W"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS
save() { tar czf "$OUT/s57_run2${SHORT:+_short}.tgz" -C "$W" . 2>/dev/null; cp "$W/summary.txt" "$OUT/" 2>/dev/null; }
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }; st() { save; echo "== $1 at +$(el)s"; }
nvidia-smi -L
D_MAIN=$PWD/.ext_build; D_ATTN=$PWD/.ext_build/attn
A_MAIN=$PWD/.ext_build_alt; A_ATTN=$PWD/.ext_build_alt/attn
FD=-DDS4_DOWN_WARPS=16; FK=-DDS4_SP_KC=16
st build
( DS4_NVCC_FLAGS=$FD DS4_ATTN_NVCC_FLAGS=$FK DS4_EXT_BUILD_DIR=$A_MAIN DS4_ATTN_EXT_BUILD_DIR=$A_ATTN \
    python3 scripts/build_ext.py -q > "$W/build_alt.log" 2>&1; echo "alt build rc=$?" >> "$W/build_alt.log" ) &
python3 scripts/build_ext.py -q > "$W/build.log" 2>&1; echo "build rc=$?"; wait
tail -n 3 "$W/build.log" "$W/build_alt.log"
sos() { stat -c '%Y' $D_MAIN/ds4_ext.so $D_ATTN/*.so $A_MAIN/ds4_ext.so $A_ATTN/*.so 2>&1 | tr '\n' ' '; }
SO0=$(sos); echo "so mtimes: $SO0"
V=kernels+fused+graph+cap8192
TB=75; [ -n "${SHORT:-}" ] && TB=50  # a slope process's limit (about 35 s when its libraries load as built)
run_as() {  # config command...: the command with that config's folders and flags
  local c=$1; shift
  local m=$D_MAIN a=$D_ATTN fm="" fa=""
  case $c in down16|both) m=$A_MAIN; fm=$FD ;; esac
  case $c in kc16|both) a=$A_ATTN; fa=$FK ;; esac
  DS4_EXT_BUILD_DIR=$m DS4_ATTN_EXT_BUILD_DIR=$a DS4_NVCC_FLAGS=$fm DS4_ATTN_NVCC_FLAGS=$fa "$@"
}
bench() {  # config pass
  run_as $1 timeout $TB python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V,$V" \
    --out "$W/bench_$1_$2.json" > "$W/bench_$1_$2.log" 2>&1
  local rc=$? note=""; [ "$(sos)" != "$SO0" ] && { note=" REBUILT (void)"; SO0=$(sos); }
  echo "$1 $2 rc=$rc$note: $(grep -E '^per-layer' "$W/bench_$1_$2.log" | sed 's/^per-layer //' | tr '\n' ' ')" \
    | tee -a "$W/summary.txt"
}
st bench_a
CONFIGS="default down16 kc16 both"; [ -n "${SHORT:-}" ] && CONFIGS="default down16 kc16"
for c in $CONFIGS; do bench $c a; done
st tests
PT="python3 -m pytest -q -p no:cacheprovider --tb=short"
if [ -n "${SHORT:-}" ]; then
  left=$(( 240 - $(el) ))
  [ $left -gt 20 ] && run_as kc16 timeout $left $PT tests/test_attn_kernels_gpu.py tests/test_decode_glue_gpu.py \
    > "$W/tests_kc16.log" 2>&1
else
  run_as down16 timeout 75 $PT tests/test_kernels_gpu.py tests/test_hc_fold_gpu.py tests/test_moe_ffn_gpu.py \
    -k "moe or fold or shared_expert or routed or spacer or down" > "$W/tests_down16.log" 2>&1
  echo "down16 tests rc=$?: $(grep -E 'passed|failed' "$W/tests_down16.log" | tail -1)" | tee -a "$W/summary.txt"
  run_as kc16 timeout 90 $PT tests/test_attn_kernels_gpu.py tests/test_decode_glue_gpu.py > "$W/tests_kc16.log" 2>&1
fi
# session 58 (no device) changed how greedy decoding picks the argmax kernel (ds4.registry.Ops.ds4_ext): its GPU test
run_as default timeout 40 $PT tests/test_kernels_gpu.py -k argmax > "$W/tests_argmax.log" 2>&1
echo "argmax tests rc=$?: $(grep -E 'passed|failed' "$W/tests_argmax.log" | tail -1)" | tee -a "$W/summary.txt"
[ -f "$W/tests_kc16.log" ] && echo "kc16 tests: $(grep -E 'passed|failed' "$W/tests_kc16.log" | tail -1)" | tee -a "$W/summary.txt"
grep -hE "^FAILED" "$W"/tests_*.log 2>/dev/null | head -8
[ "$(sos)" != "$SO0" ] && { echo "tests REBUILT an extension"; SO0=$(sos); }
if [ -z "${SHORT:-}" ]; then
  st bench_b
  for c in $CONFIGS; do [ "$(el)" -lt 450 ] && bench $c b; done
  st profile
  for c in default kc16; do
    [ "$(el)" -lt 500 ] || break
    run_as $c timeout 45 python3 scripts/profile_step.py --layers 8 --variant kernels+fused --timeline \
      --long-context 65536 --out "$W/profile_$c.json" > "$W/profile_$c.log" 2>&1
    echo "profile $c rc=$?"; grep -E "step wall|^sparse_(chunk|combine)_kernel" "$W/profile_$c.log" | head -6
  done
fi
st done
echo "--- summary (us per layer, median; mean in brackets)"; cat "$W/summary.txt"
