#!/usr/bin/env bash
# Session 51, run 3 (one lent H200): FMT_FP8T's tensor-core decode by the hardware conversion cvt.rn.f16x2.e4m3x2 and
# f16 MMAs (alt build -DDS4_FP8_CVT=1; activations staged as f16 with a power of two per 128-value block; the fp8t
# words in the stored byte order: DS4_FP8T_PLAIN=1 for ds4.quant in that build's processes) against the default
# (fp8p_regs' bf16 decode). Both builds side by side; the alt build's kernel / hc-fold / one-launch FFN GPU tests;
# every kernel of issue #4 alone in each build; the per-layer slope, three passes in each build. Run 3: the depth-8
# kernels (wo_b, wq_a + wkv, the shared gate+up) stage with 4 loads in flight per thread again (mma_stage_loads).
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
t0=$(date +%s); st() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
left() { echo $(( 585 - ($(date +%s) - t0) )); }
ALT=(DS4_NVCC_FLAGS=-DDS4_FP8_CVT=1 DS4_FP8T_PLAIN=1 DS4_EXT_BUILD_DIR=$PWD/.ext_build_alt
     DS4_ATTN_EXT_BUILD_DIR=$PWD/.ext_build_alt/attn)
st build
( env "${ALT[@]}" python3 scripts/build_ext.py -q > /tmp/build_alt.log 2>&1; echo "alt build rc=$?" >> /tmp/build_alt.log ) &
python3 scripts/build_ext.py -q > /tmp/build.log 2>&1; echo "build rc=$?"; wait; tail -n 1 /tmp/build_alt.log
st alt_tests
env "${ALT[@]}" timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/test_kernels_gpu.py \
  tests/test_moe_ffn_gpu.py tests/test_hc_fold_gpu.py > "$OUT/tests_alt_run3.log" 2>&1
echo "alt tests rc=$?"; tail -n 1 "$OUT/tests_alt_run3.log"; grep -E "^FAILED|^ERROR" "$OUT/tests_alt_run3.log" | head -8
st kbench
timeout 100 python3 scripts/bench_kernels.py --quick --out "$OUT/kbench_run3.json" > /tmp/kbench_run3.log 2>&1
echo "kbench rc=$?"
st kbench_alt
env "${ALT[@]}" timeout 100 python3 scripts/bench_kernels.py --quick --out "$OUT/kbench_run3_alt.json" \
  > /tmp/kbench_run3_alt.log 2>&1
echo "kbench alt rc=$?"
for f in kbench_run3 kbench_run3_alt; do echo "--- $f"; grep -E "^fp8t|^shared .*fp8t|copy bandwidth" "/tmp/$f.log" | cut -c1-110; done
V=kernels+fused+graph+cap8192
st bench; L=$(( $(left) / 2 - 5 ))
timeout $L python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V,$V,$V" --out "$OUT/bench_run3.json" \
  > "$OUT/bench_run3.log" 2>&1; echo "bench rc=$?"
st bench_alt
env "${ALT[@]}" timeout $(( $(left) - 5 )) python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V,$V,$V" \
  --out "$OUT/bench_run3_alt.json" > "$OUT/bench_run3_alt.log" 2>&1; echo "bench alt rc=$?"
st done
for f in bench_run3 bench_run3_alt; do echo "--- $f"; grep -v '^{' "$OUT/$f.log" | grep -v "^\s*$" | tail -n 8; done
