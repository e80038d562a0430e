#!/usr/bin/env bash
# Session 64, run 2 (one lent GPU, one call; binaries built on the workstation with nvcc 13.0 and carried): why the
# library's dp4a gate+up (run 1: 28.13 us in bench_kernels.py) is slower than the probe's resident 16-bit form
# (21.06-21.29 us, this session's first call). scripts/probe_dp4a_lib.cu times the library kernel in the probe's
# harness: four builds (scale bytes by shuffles or byte loads; volatile weight loads or not), 64 and 256 experts,
# with and without PDL; and the probe's own kernels with 64 and 256 experts.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
S="$OUT/summary.txt"
nvidia-smi -L | tee "$S"
for b in s0v1 s1v1 s0v0 s1v0; do
  for ne in 64 256; do
    for pdl in 1 0; do
      r=$(DS4_PDL=$pdl timeout 60 build/probe_dp4a_lib_$b $ne 2>&1 | tail -1)
      echo "$b NE=$ne PDL=$pdl: $r" | tee -a "$S"
    done
  done
done
for ne in "" _256; do
  timeout 90 build/probe_dp4a_moe$ne > "$OUT/probe_moe$ne.log" 2>&1
  echo "probe_dp4a_moe$ne rc=$?" | tee -a "$S"; grep -E "experts|IDP4A" "$OUT/probe_moe$ne.log" | tee -a "$S"
done
