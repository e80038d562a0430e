#!/usr/bin/env bash
# Session 50, run 8 (one lent H200): where the routed gate+up's and wq_b's warps stall, per SASS instruction (Nsight
# Compute's warp-state sampling, source page): how many samples sit on the block barriers (the staging one after
# the activations' loads, or the last one after the stream), on the weight loads' first uses, and elsewhere.
set -u
OUT=${OUT:-/tmp/ds4_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
t0=$(date +%s); st() { echo "== $1 at +$(( $(date +%s) - t0 ))s"; }
st build; python3 scripts/build_ext.py -q > "$OUT/build.log" 2>&1; echo "build rc=$?"; tail -n 1 "$OUT/build.log"
for k in moe_gate_up_mma gemv_mma; do
  st "ncu $k"
  timeout 150 ncu --clock-control none --kernel-name regex:"$k" --launch-skip 1 --launch-count 1 \
    --section WarpStateStats --section SourceCounters -f -o "$OUT/src_$k" python3 scripts/ncu_kernels.py --reps 2 \
    > "$OUT/ncu_$k.log" 2>&1; echo "ncu rc=$?"
  ncu -i "$OUT/src_$k.ncu-rep" --page source --print-source sass --csv > "$OUT/src_$k.csv" 2>&1; echo "page rc=$?"
done
st done
for k in moe_gate_up_mma gemv_mma; do
python3 - "$OUT/src_$k.csv" "$k" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hi = next((i for i, r in enumerate(rows) if any("Source" == c for c in r)), None)
if hi is None:
    print(sys.argv[2], "no source table; first lines:", rows[:3]); sys.exit()
hdr = rows[hi]; body = [r for r in rows[hi + 1:] if len(r) == len(hdr)]
src = hdr.index("Source")
col = next((i for i, h in enumerate(hdr) if h.startswith("Warp Stall Sampling (All")), None)
if col is None:
    print(sys.argv[2], "columns:", hdr); sys.exit()
def num(v):
    try: return float(v.replace(",", ""))
    except ValueError: return 0.0
tot = sum(num(r[col]) for r in body)
bar = [(num(r[col]), r[src]) for r in body if "BAR" in r[src]]
print(f"--- {sys.argv[2]}: {len(body)} SASS lines, {tot:.0f} samples; barriers {sum(b for b, _ in bar):.0f} "
      f"({100 * sum(b for b, _ in bar) / max(tot, 1):.1f} %):", [(int(b), s.strip()[:40]) for b, s in bar])
top = sorted(((num(r[col]), i, r[src].strip()[:60]) for i, r in enumerate(body)), reverse=True)[:14]
for n, i, s in top:
    print(f"  {n:7.0f} {100 * n / max(tot, 1):5.1f} %  line {i:5d}  {s}")
PY
done
