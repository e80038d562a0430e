#!/usr/bin/env bash
# Session 43: scripts/probe_topk.cu against csrc/attn/topk.cu and the switches of topk_variants.cu / topk_cluster.cu
# (sm_90, no torch). The builds run side by side, the probes one after the other. Output: $OUT/probe_topk.log.
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT" /tmp/ptk
V=experiments/s43_attempts/topk_variants.cu
C=experiments/s43_attempts/topk_cluster.cu
build() {  # name, source, extra flags...
  local name=$1 src=$2; shift 2
  echo "$src $*" > /tmp/ptk/$name.what
  nvcc -std=c++17 -O3 -arch=sm_90 -I. -Icsrc/attn -Icsrc "-DTOPK_SRC=\"$src\"" "$@" scripts/probe_topk.cu \
    -o /tmp/ptk/$name > /tmp/ptk/$name.build.log 2>&1
}
NAMES=""
add() { NAMES="$NAMES $1"; build "$@" & }
add csrc csrc/attn/topk.cu
add spread_agg $V -DTOPK_AGG=1
add spread_11 $V -DTOPK_BITS=11
add spread_11_agg $V -DTOPK_BITS=11 -DTOPK_AGG=1
add vec $V -DTOPK_VEC=1
add vec_agg $V -DTOPK_VEC=1 -DTOPK_AGG=1
add strided $V -DTOPK_STRIDED=1
add strided_agg $V -DTOPK_STRIDED=1 -DTOPK_AGG=1
add strided_11_agg $V -DTOPK_STRIDED=1 -DTOPK_BITS=11 -DTOPK_AGG=1
add loads_only $V -DTOPK_DIAG=2
add loads_only_vec $V -DTOPK_DIAG=2 -DTOPK_VEC=1
add loads_only_strided $V -DTOPK_DIAG=2 -DTOPK_STRIDED=1
add cluster8x512 $C -DTOPK_CL=8 -DTOPK_CT=512
add cluster8x1024 $C -DTOPK_CL=8 -DTOPK_CT=1024
add cluster4x1024 $C -DTOPK_CL=4 -DTOPK_CT=1024
add cluster8x256 $C -DTOPK_CL=8 -DTOPK_CT=256
wait
for n in $NAMES; do
  echo "### $n ($(cat /tmp/ptk/$n.what))"; cat /tmp/ptk/$n.build.log; /tmp/ptk/$n; echo "rc=$?"
done > "$OUT/probe_topk.log" 2>&1
cat "$OUT/probe_topk.log"
