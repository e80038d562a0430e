#!/usr/bin/env bash
# Session 51, run 1 (one lent H200): the tensor-core streams' rounds handed to a block's warps dynamically (alt build
# -DDS4_MMA_DYN=1: MmaStream<..., DYN = true> in gemv_mma, the MoE gate+up and down; grains of a tile's rounds claimed
# from a shared-memory counter, partial sums per grain slot, 16 slots per tile) against the default static split.
# Both builds side by side; the alt build's GEMV / MoE / one-launch FFN / hc-fold GPU tests; every kernel of issue #4
# alone in each build (bench_kernels --quick); the alt build's SASS of the routed gate+up (its spill sites).
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
t0=$(date +%s); st() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
ALT=(DS4_NVCC_FLAGS=-DDS4_MMA_DYN=1 DS4_EXT_BUILD_DIR=$PWD/.ext_build_alt DS4_ATTN_EXT_BUILD_DIR=$PWD/.ext_build_alt/attn)
st build
( env "${ALT[@]}" python3 scripts/build_ext.py -q > "$OUT/build_alt.log" 2>&1; echo "alt build rc=$?" >> "$OUT/build_alt.log" ) &
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$?"; wait; tail -n 1 "$OUT/build_alt.log"
st alt_tests
env "${ALT[@]}" timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short -x tests/test_kernels_gpu.py \
  tests/test_moe_ffn_gpu.py tests/test_hc_fold_gpu.py > "$OUT/tests_alt_run1.log" 2>&1
echo "alt tests rc=$?"; tail -n 1 "$OUT/tests_alt_run1.log"; grep -E "^FAILED|^ERROR" "$OUT/tests_alt_run1.log" | head -5
st kbench
timeout 110 python3 scripts/bench_kernels.py --quick --out "$OUT/kbench_run1.json" > "$OUT/kbench_run1.log" 2>&1
echo "kbench rc=$?"
st kbench_alt
env "${ALT[@]}" timeout 110 python3 scripts/bench_kernels.py --quick --out "$OUT/kbench_run1_alt.json" \
  > "$OUT/kbench_run1_alt.log" 2>&1
echo "kbench alt rc=$?"
st sass
so=$(ls .ext_build_alt/*/ds4_ext*.so .ext_build_alt/*.so 2>/dev/null | head -n 1)
[ -n "$so" ] && cuobjdump --dump-sass "$so" 2>/dev/null | awk '/Function : .*moe_gate_up_mma_kernelILi4ELi2ELi2E/{f=1;print;next} /Function : /{f=0} f' \
  | gzip > "$OUT/sass_gate_up_alt_run1.txt.gz"
st done
for f in kbench_run1 kbench_run1_alt; do echo "--- $f"; grep -E "^(fp8|fp4|moe|shared|ffn|router)|copy bandwidth" "$OUT/$f.log" | cut -c1-110; done
