#!/usr/bin/env bash
# Session 51, run 5 (one lent H200): the routed experts' FP4 product with packed fp16 FMAs on fp4h words (alt build
# -DDS4_FP4_HFMA=1: MmaStream's fp4p / fp4t rounds by HFMA2, activations staged as fp16 with a power of two per
# 32-value chunk; DS4_FP4_HFMA=1 for ds4.quant in that build's processes, so pack_fp4_mma writes fp4h words) against
# the default BF16 mma.sync. Both builds side by side; the alt build's kernel / one-launch FFN / hc-fold GPU tests
# (the shared-memory stream, depth "smem", is not ported: deselected); the MoE kernels alone in each build (the
# routed gate+up at its default depth 4 and at 2 / 8 in the alt build); the per-layer slope.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
t0=$(date +%s); st() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
left() { echo $(( 585 - ($(date +%s) - t0) )); }
ALT=(DS4_NVCC_FLAGS=-DDS4_FP4_HFMA=1 DS4_FP4_HFMA=1 DS4_EXT_BUILD_DIR=$PWD/.ext_build_alt
     DS4_ATTN_EXT_BUILD_DIR=$PWD/.ext_build_alt/attn)
st build
( env "${ALT[@]}" python3 scripts/build_ext.py -q > /tmp/build_alt.log 2>&1; echo "alt build rc=$?" >> /tmp/build_alt.log ) &
python3 scripts/build_ext.py -q > /tmp/build.log 2>&1; echo "build rc=$?"; wait; tail -n 3 /tmp/build_alt.log
st alt_tests
env "${ALT[@]}" timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/test_kernels_gpu.py \
  tests/test_moe_ffn_gpu.py tests/test_hc_fold_gpu.py -k "not smem" > "$OUT/tests_alt_run5.log" 2>&1
echo "alt tests rc=$?"; tail -n 1 "$OUT/tests_alt_run5.log"; grep -E "^FAILED|^ERROR" "$OUT/tests_alt_run5.log" | head -12
st kbench
K="^moe fp4 |^moe fp4p |^ffn |copy bandwidth"
timeout 60 python3 scripts/bench_kernels.py --quick --out "$OUT/kbench_run5.json" > /tmp/kb.log 2>&1
echo "--- default"; grep -E "$K" /tmp/kb.log | cut -c1-100
for d in "" 2 8; do
  env "${ALT[@]}" ${d:+DS4_ROUTED_DEPTH=$d} timeout 60 python3 scripts/bench_kernels.py --quick \
    --out "$OUT/kbench_run5_alt${d:+_rd$d}.json" > /tmp/kb.log 2>&1
  echo "--- alt ${d:+DS4_ROUTED_DEPTH=$d}"; grep -E "$K" /tmp/kb.log | cut -c1-100
done
V=kernels+fused+graph+cap8192
st bench
timeout 120 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V,$V,$V" \
  --out "$OUT/bench_run5.json" > /tmp/bench.log 2>&1; echo "bench rc=$?"; grep "^per-layer" /tmp/bench.log
st bench_alt
env "${ALT[@]}" timeout $(( $(left) - 5 )) python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 \
  --variants "$V,$V,$V,$V+rd2,$V+rd2" --out "$OUT/bench_run5_alt.json" > /tmp/bench_alt.log 2>&1
echo "bench alt rc=$?"; grep "^per-layer" /tmp/bench_alt.log
st done
