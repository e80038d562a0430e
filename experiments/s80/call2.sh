#!/usr/bin/env bash
# Session 80, call 2 (one lent GPU): DS4_DOWN_SHARED (the trial: the shared expert's down inside the routed down
# launch, 2 of each block's 8 warps on its fp8t w2; its side branch the gate+up alone). Why: the session 79 H200
# timeline shows the routed down launching only once the shared expert's down has ended, 1.7 us after the routed
# gate+up, whose wave holds the SM slots that down's blocks need.
# Steps: the library's build; the GPU tests (the trial's own, the MoE / fold kernels and the bulk staging, whose down
# code moved, as time allows; graph = eager [fused-hc_fold-down_shared]); the slope with dsh and the removal
# diagnostic xshared (XSHARED=1) interleaved in one process. Logs: one tarball in $OUT.
# The trial is out of the tree (not faster): first git apply experiments/s80/down_shared.diff (it adds the trial, its
# tests and the bench token dsh). Run in session 80 as END=395 (the call's limit was 430 s).
# Usage (carry build/site): [END=SECONDS] [XSHARED=1] OUT=$OUT bash experiments/s80/call2.sh
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/build/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 MAX_JOBS=16 WANDB_SILENT=true
unset DS4_NVCC_FLAGS DS4_ATTN_NVCC_FLAGS DS4_PFORK DS4_PJOIN DS4_MMA DS4_BULK_STAGE DS4_DOWN_SHARED
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
L=/tmp/s80_logs2; rm -rf "$L"; mkdir -p "$L"
snap() { tar czf "$OUT/logs.tgz" -C "$L" .; }  # after every step: a run cut at its limit keeps what it did
finish() { snap; echo "total $(el)s"; }
trap finish EXIT
nvidia-smi -L; date -u
python3 scripts/build_ext.py -q > "$L/build.log" 2>&1; rc=$?; echo "build rc=$rc at +$(el)s"
[ $rc -ne 0 ] && { grep -E "error" "$L/build.log" | head -20; tail -20 "$L/build.log"; exit 1; }
timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_down_shared_gpu.py > "$L/trial_tests.log" 2>&1
echo "trial tests rc=$? at +$(el)s: $(tail -1 "$L/trial_tests.log")"; grep -E "FAILED|ERROR|Error|assert" "$L/trial_tests.log" | head
snap
G=tests/test_gpu_e2e.py::test_cuda_graph_matches_eager_1000_steps
timeout 70 python3 -m pytest -q -p no:cacheprovider --tb=short "$G[fused-hc_fold-down_shared]" > "$L/graph.log" 2>&1
echo "graph = eager rc=$? at +$(el)s: $(tail -1 "$L/graph.log")"; grep -E "FAILED|ERROR|assert" "$L/graph.log" | head
snap
B=kernels+fused+graph+cap8192
V="$B,$B+dsh,$B,$B+dsh"; [ "${XSHARED:-0}" = 1 ] && V="$V,$B+xshared"
DS4_NO_JIT=1 timeout 200 python3 scripts/bench_decode.py --layers 4,12 --new-tokens 48 --variants "$V" \
  --out "$L/bench.json" > "$L/bench.log" 2>&1
echo "bench rc=$? at +$(el)s"; grep -E "copy bandwidth|us/layer|Error" "$L/bench.log"
snap
# the down kernels' other instances (their code moved into a lambda): as much as the time left allows
END=${END:-470}  # the wall second the unit tests must end by (the call's limit, less the tarball's time)
timeout $(( END - $(el) > 10 ? END - $(el) : 10 )) python3 -m pytest -q -p no:cacheprovider --tb=short \
  tests/test_bulk_stage_gpu.py tests/test_hc_fold_gpu.py tests/test_kernels_gpu.py -k "moe or fold" > "$L/units.log" 2>&1
echo "kernel tests rc=$? at +$(el)s: $(tail -1 "$L/units.log")"; grep -E "FAILED|ERROR" "$L/units.log" | head
