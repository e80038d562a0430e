#!/usr/bin/env bash
# Session 50, run 7 (one lent H200): the stall reasons of the batch-1 weight kernels in full (session 49's run 3
# printed only the top one: L1TEX 4.6 of the gate+up's 12.8 cycles per issued instruction). Each kernel alone
# (scripts/ncu_kernels.py: routed gate+up and down in fp4t, wq_b and wo_b in fp8t), every
# smsp__average_warps_issue_stalled_*_per_issue_active ratio (cycles per issued instruction, by reason).
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
t0=$(date +%s); st() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
st build; python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$?"; tail -n 1 "$OUT/build.log"
st ncu
timeout 300 ncu --clock-control none --kernel-name regex:"moe_|gemv" --csv \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__warps_active.avg.per_cycle_active,smsp__issue_active.avg.per_cycle_active" \
  python3 scripts/ncu_kernels.py --reps 2 > "$OUT/ncu_stalls_run7.csv" 2>&1; echo "ncu rc=$?"
st done
python3 - "$OUT/ncu_stalls_run7.csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr = rows[0]; ix = {h: i for i, h in enumerate(hdr)}
per = collections.OrderedDict()
for r in rows[1:]:
    key = (r[ix["ID"]], r[ix["Kernel Name"]][:40])
    per.setdefault(key, {})[r[ix["Metric Name"]]] = r[ix["Metric Value"]]
for (i, k), m in per.items():
    st = {n.replace("smsp__average_warps_issue_stalled_", "").replace("_per_issue_active.ratio", ""): float(v.replace(",", ""))
          for n, v in m.items() if "stalled" in n}
    tot = sum(st.values())
    top = sorted(st.items(), key=lambda kv: -kv[1])[:9]
    print(i, k, f"sum={tot:.2f}", "warps/smsp=" + m.get("smsp__warps_active.avg.per_cycle_active", "?"),
          "issue/cycle=" + m.get("smsp__issue_active.avg.per_cycle_active", "?"))
    print("    " + "  ".join(f"{n}={v:.2f}" for n, v in top))
PY
