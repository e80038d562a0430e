#!/usr/bin/env bash
# Session 49, run 3 (one lent H200): what limits the batch-1 weight kernels today, in the layouts the library runs
# (routed experts fp4t, dense FP8 fp8t): Nsight Compute pipe and issue counters of each kernel alone
# (scripts/ncu_kernels.py, caches flushed, no PDL neighbours), its stall reasons, and the SASS opcode counts.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
t0=$(date +%s); st() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
st build; python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$?"; tail -n 1 "$OUT/build.log"
st sass
so=$(ls .ext_build/ds4_ext*.so .ext_build/*/ds4_ext*.so 2>/dev/null | head -n 1); echo "so=$so"
cuobjdump --dump-sass "$so" > /tmp/sass.txt 2>&1
for k in moe_gate_up_mma_kernelILi4E moe_down_mma_kernelILi4E gemv_mma_kernelILi5E; do
  python3 scripts/sass_ops.py "$k" < /tmp/sass.txt > "$OUT/sass_$k.txt" 2>&1
done
st ncu_pipes
M=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,dram__throughput.avg.pct_of_peak_sustained_elapsed
M=$M,sm__issue_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active
M=$M,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active
M=$M,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active
M=$M,smsp__inst_executed.sum,smsp__inst_executed_pipe_alu.sum,smsp__warps_active.avg.per_cycle_active
timeout 150 ncu --clock-control none --kernel-name regex:"moe_|gemv" --csv --metrics "$M" python3 scripts/ncu_kernels.py \
  > "$OUT/ncu_pipes.csv" 2>&1; echo "ncu pipes rc=$?"
st ncu_stalls
timeout 200 ncu --clock-control none --kernel-name regex:"moe_|gemv" --launch-skip 0 --launch-count 12 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
  python3 scripts/ncu_kernels.py > "$OUT/ncu_sections.txt" 2>&1; echo "ncu sections rc=$?"
st done
python3 - "$OUT/ncu_pipes.csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr = rows[0]; ix = {h: i for i, h in enumerate(hdr)}
per = collections.defaultdict(dict)
for r in rows[1:]:
    if "Kernel Name" not in ix: break
    key = (r[ix["ID"]], r[ix["Kernel Name"]][:48]); per[key][r[ix["Metric Name"]]] = r[ix["Metric Value"]]
short = {"gpu__time_duration.sum": "ns", "sm__cycles_elapsed.avg.per_second": "clk", "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram%",
         "sm__issue_active.avg.pct_of_peak_sustained_active": "issue%", "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active": "alu%",
         "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active": "fma%", "sm__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active": "fmah%",
         "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "hmma%", "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active": "lsu%",
         "smsp__inst_executed.sum": "inst", "smsp__inst_executed_pipe_alu.sum": "alu_inst", "smsp__warps_active.avg.per_cycle_active": "warps/smsp"}
for (i, k), m in per.items():
    print(i, k, " ".join(f"{short.get(n, n)}={v}" for n, v in m.items()))
PY
grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Achieved Occupancy|Registers Per|No Eligible|One or More Eligible|Stall" \
  "$OUT/ncu_sections.txt" | head -n 90
for k in moe_gate_up_mma_kernelILi4E moe_down_mma_kernelILi4E gemv_mma_kernelILi5E; do echo "--- sass $k"; head -c 1500 "$OUT/sass_$k.txt"; done
