"""`python -m ds4.compare DIR [--out PNG]`: a table and a chart over finished jobs.

Reads every `metrics.json` under DIR (a multirun directory, or `outputs/`), prints one row per
job and writes a PNG (speed and fidelity per job). Needs no wandb server and no GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

COLUMNS = [  # header, figure key, format
    ("decode tok/s", "decode_tok_s", "{:.2f}"), ("TPOT ms", "tpot_ms", "{:.3f}"),
    ("e2e tok/s", "e2e_tok_s", "{:.2f}"), ("TTFT ms", "ttft_ms", "{:.1f}"),
    ("bw_ratio", "bw_ratio", "{:.3g}"), ("top-1", "fid_top1", "{:.3f}"),
    ("top-1 conf", "fid_top1_confident", "{:.3f}"), ("KL", "fid_kl", "{:.3g}"),
    ("max|dlogit|", "fid_max_abs", "{:.3g}"), ("ppl", "ppl", "{:.2f}"),
]


def load(root: str | Path) -> list[dict]:
    """The records under `root`, in directory order; each gets `_path` and a short `_label`."""
    root = Path(root)
    recs = []
    for p in sorted(root.rglob("metrics.json"), key=lambda p: [_natural(s) for s in p.relative_to(root).parts]):
        try:
            r = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            print(f"skipping {p}: {e}", file=sys.stderr)
            continue
        r["_path"] = str(p.parent.relative_to(root)) or "."
        recs.append(r)
    # Label each job by the overrides that differ between jobs (the sweep axes).
    sets = [set(r.get("overrides") or []) for r in recs]
    common = set.intersection(*sets) if sets else set()
    for r, s in zip(recs, sets):
        diff = [o for o in (r.get("overrides") or []) if o not in common]
        r["_label"] = ",".join(diff) or r.get("override_dirname") or r["_path"]
    return recs


def _natural(s: str):
    return (0, int(s), "") if s.isdigit() else (1, 0, s)


def _fmt(v, fmt: str) -> str:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return fmt.format(v)
    return "-"


def add_speedup(recs: list[dict], baseline: str) -> None:
    """figures['speedup'] = TPOT of the first job whose label contains `baseline` / this job's TPOT
    (measured in the same sweep, so the same machine and session)."""
    base = next((r for r in recs if baseline in r["_label"] and (r.get("figures") or {}).get("tpot_ms")), None)
    if base is None:
        print(f"ds4.compare: no finished job matches baseline {baseline!r}", file=sys.stderr)
        return
    for r in recs:
        f = r.get("figures") or {}
        if f.get("tpot_ms"):
            f["speedup"] = base["figures"]["tpot_ms"] / f["tpot_ms"]


def _rows(recs: list[dict]) -> tuple[list[str], list[list[str]]]:
    cols = COLUMNS + ([("speedup", "speedup", "{:.2f}x")] if any("speedup" in (r.get("figures") or {}) for r in recs) else [])
    head = ["job", "status", "task"] + [c[0] for c in cols]
    rows = []
    for r in recs:
        f = r.get("figures") or {}
        rows.append([r["_label"], r.get("status", "?"), r.get("task") or "-"] + [_fmt(f.get(k), fmt) for _, k, fmt in cols])
    return head, rows


def markdown(recs: list[dict]) -> str:
    """The same table as markdown, with the machine each job ran on."""
    head, rows = _rows(recs)
    gpus = sorted({str(r.get("gpu") or r.get("device") or "?") for r in recs})
    out = [f"GPU: {', '.join(gpus)}; jobs: {len(recs)}", "", "| " + " | ".join(head) + " |",
           "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def table(recs: list[dict]) -> str:
    head, rows = _rows(recs)
    width = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda xs: "  ".join(str(x).ljust(w) if i < 3 else str(x).rjust(w) for i, (x, w) in enumerate(zip(xs, width)))
    out = [line(head), line(["-" * w for w in width])] + [line(r) for r in rows]
    for r in recs:
        if r.get("status") != "ok":
            out.append(f"{r['_label']}: {r.get('error')}")
    return "\n".join(out)


def chart(recs: list[dict], out: str | Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["_label"] for r in recs]
    fig_of = [r.get("figures") or {} for r in recs]
    num = lambda f, k: f.get(k) if isinstance(f.get(k), (int, float)) and math.isfinite(f.get(k)) else 0.0
    y = list(range(len(recs)))
    h = max(3.0, 0.45 * len(recs) + 1.6)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, h), sharey=True)
    ax1.barh([i - 0.2 for i in y], [num(f, "decode_tok_s") for f in fig_of], height=0.4, label="decode tok/s")
    ax1.barh([i + 0.2 for i in y], [num(f, "e2e_tok_s") for f in fig_of], height=0.4, label="end-to-end tok/s")
    ax1.set_yticks(y, labels)
    ax1.invert_yaxis()
    ax1.set_xlabel("tokens / s")
    ax1.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=2, fontsize=9, frameon=False)   # doubles as title
    ax2.barh(y, [num(f, "fid_top1") for f in fig_of], height=0.5, color="tab:green")
    ax2.set_xlim(0, 1.05)
    ax2.set_xlabel("top-1 agreement with the torch reference (teacher-forced)")
    ax2.set_title("fidelity")
    for i, (r, f) in enumerate(zip(recs, fig_of)):
        if r.get("status") != "ok":
            for ax in (ax1, ax2):
                ax.text(0, i, " failed", va="center", color="tab:red", fontsize=8)
        elif "fid_top1" not in f:
            ax2.text(0, i, " reference / not measured", va="center", color="gray", fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds4.compare", description=__doc__.splitlines()[0])
    p.add_argument("dir", help="a multirun directory (or any folder holding metrics.json files)")
    p.add_argument("--out", help="PNG to write (default: DIR/compare.png)")
    p.add_argument("--no-plot", action="store_true", help="print the table only")
    p.add_argument("--baseline", help="add a speedup column relative to the job whose label contains this")
    p.add_argument("--md", help="also write the table as markdown to this file")
    a = p.parse_args(argv)
    root = Path(a.dir)
    if not root.is_dir():
        print(f"ds4.compare: error: {root} is not a directory", file=sys.stderr)
        return 2
    recs = load(root)
    if not recs:
        print(f"ds4.compare: error: no metrics.json under {root}", file=sys.stderr)
        return 2
    if a.baseline:
        add_speedup(recs, a.baseline)
    print(table(recs))
    if a.md:
        Path(a.md).parent.mkdir(parents=True, exist_ok=True)
        Path(a.md).write_text(markdown(recs))
        print(f"markdown: {a.md}")
    if not a.no_plot:
        print(f"chart: {chart(recs, a.out or root / 'compare.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
