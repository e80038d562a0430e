#!/usr/bin/env bash
# Session 88, call 2: is call 1's seed_phase1 (75.5 ms per token against 57.4-58.2 in the H100 sweeps of sessions
# 69-77) the host's? The host's CPU and load, then issue #7's two ratio jobs (seed_phase1, ds4_best; 8 layers of
# V4-Flash) as three sweeps in a row on the same machine, each with its own table. Logs: one tarball in $OUT.
# On an H200 it runs call1.sh instead (the full sweep, the kernels and the slope: none on an H200 since session 79).
# Usage (carry build/site): OUT=$OUT bash experiments/s88/call2.sh
set -u
lscpu | grep -E "Model name|^CPU\(s\)"; uptime
if nvidia-smi -L | grep -q H200; then exec bash "$(dirname "$0")/call1.sh"; fi
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_EXT_BUILD_DIR DS4_ATTN_EXT_BUILD_DIR
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
L=/tmp/s88_call2; rm -rf "$L"; mkdir -p "$L"
snap() { tar czf "$OUT/logs.tgz" -C "$L" .; }
trap 'snap; echo "total $(el)s"' EXIT
nvidia-smi -L; date -u
{ lscpu; nproc; uptime; top -bn1 | head -20; python3 -c "import torch; print(torch.__version__)"; } > "$L/host.txt" 2>&1
grep -E "Model name|^CPU\(s\)|MHz|Thread" "$L/host.txt"; uptime
python3 scripts/build_ext.py -q > "$L/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { tail -20 "$L/build.log"; exit 1; }
export DS4_NO_JIT=1
for i in 1 2 3; do
  timeout 150 python3 -m ds4 ablation=seed_phases model.n_layers=8 tracking=none max_new_tokens=32 \
    experiment=seed_phase1,ds4_best hydra.sweep.dir=/tmp/sweep_$i > "$L/sweep_$i.log" 2>&1
  echo "sweep $i rc=$? at +$(el)s"
  python3 -m ds4.compare /tmp/sweep_$i --baseline seed_phase1 --no-plot --md "$L/sweep_$i.md" > /dev/null 2>&1
  grep -E "^\| experiment" "$L/sweep_$i.md" | cut -d'|' -f2,6,15; snap
done
