#!/usr/bin/env bash
# Session 69's first device call: what session 68 left unrun on a GPU at its final code (fd87783, unchanged
# here): the CUDA case of dequant_fp4's byte-table test, and every options-against-reference row on `small`
# (session 68's H100 call ran only the first 7 before its limit), verbose so each row's id is in the log.
# Usage (device call, carry nothing): OUT=$OUT bash experiments/s69/gpu1.sh   (BUDGET=570 s)
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( ${BUDGET:-570} - $(el) )); }
nvidia-smi -L; git log --oneline -1
python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
run() {  # name, limit, pytest args...
  local name=$1 lim=$2; shift 2
  local l=$(left); [ $l -lt 20 ] && { echo "$name SKIPPED (${l}s left)"; return; }
  [ $lim -gt $l ] && lim=$l
  timeout $lim python3 -m pytest -v -p no:cacheprovider --tb=short "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? (limit ${lim}s) at +$(el)s: $(tail -1 "$OUT/$name.log")"
  grep -cE " PASSED" "$OUT/$name.log" | sed 's/^/  passed rows: /'
  grep -E "FAILED|ERROR" "$OUT/$name.log" | head -8
}
run table 60 tests/test_quant.py -k "table_gives"
run options 600 tests/test_gpu_e2e.py -k "options_agree and not qat"
run qat_options 600 tests/test_gpu_e2e.py -k "qat_options_agree"
echo "total $(el)s"
