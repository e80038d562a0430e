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
    # Label each job by the overrides that differ between jobs (the sweep axes); jobs of several sweeps with the same
    # overrides also by their folder.
    sets = [set(r.get("overrides") or []) for r in recs]
    common = set.intersection(*sets) if sets else set()
    for r, s in zip(recs, sets):
        diff = [o for o in (r.get("overrides") or []) if o not in common]
        r["_label"] = ",".join(diff) or r.get("override_dirname") or r["_path"]
    seen = [r["_label"] for r in recs]
    for r in recs:
        if seen.count(r["_label"]) > 1:
            r["_label"] = f"{r['_label']} [{r['_path']}]"
    return recs


def _natural(s: str):
    return (0, int(s), "") if s.isdigit() else (1, 0, s)


def _fmt(v, fmt: str) -> str:
    """A figure's cell: "-" where it was not measured; nan / inf as such (a measured figure that went wrong)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return fmt.format(v) if math.isfinite(v) else str(float(v))
    return "-"


def _cell(f: dict, key: str, fmt: str) -> str:
    if key == "fid_top1_confident" and f.get("fid_confident_steps") == 0:
        return "-"  # no step above task.margin: nothing to agree on (recorded as NaN)
    return _fmt(f.get(key), fmt)


def _tpot(r: dict) -> float | None:
    """A finished job's TPOT (ms), or None."""
    t = (r.get("figures") or {}).get("tpot_ms")
    ok = r.get("status") == "ok" and isinstance(t, (int, float)) and not isinstance(t, bool)
    return t if ok and math.isfinite(t) and t > 0 else None


def _rest(r: dict, keys: set[str]) -> list[str]:
    """r's overrides apart from those of `keys`."""
    return sorted(o for o in (r.get("overrides") or []) if o.split("=", 1)[0] not in keys)


def _naming(r: dict, baseline: str) -> set[str]:
    """The keys of r's overrides whose value names `baseline`."""
    return {o.split("=", 1)[0] for o in (r.get("overrides") or []) if baseline in o}


# A baseline whose TPOT p90 exceeds its median by more than this gets a note: its steps spread, and every speedup
# against it moves with them. The torch reference path (seed_phase1) dispatches one Python call per op, so its pace is
# the host's: on the lent H100s of session 88 its median ran 67-115 ms and its p90 up to 1.64x that from run to run,
# where ds4_best's median stayed at 1.309-1.338 ms (experiments/seed_phases_h100_s88.md).
SPREAD_NOTE = 1.10


def add_speedup(recs: list[dict], baseline: str) -> list[str]:
    """figures['speedup'] = the baseline's TPOT / this job's TPOT. A job's baseline is the finished job of the same
    sweep folder whose overrides name `baseline` (e.g. experiment=seed_phase1) on every key where a job of that
    folder names it (`--baseline dequant` over moe x linear: moe=dequant and linear=dequant) and are otherwise the
    job's own, so the same machine, session and other settings (e.g. model.n_layers). Returns a note for each
    finished job that has none, and one for each baseline whose TPOT p90 is over SPREAD_NOTE x its median."""
    axes: dict[Path, set[str]] = {}  # folder -> the keys whose values name the baseline there
    for b in recs:
        axes.setdefault(Path(b["_path"]).parent, set()).update(_naming(b, baseline))
    notes, spread_noted = [], set()
    for r in recs:
        if _tpot(r) is None:
            continue
        folder = Path(r["_path"]).parent
        keys, found = axes[folder], None
        for b in recs:
            if (keys and Path(b["_path"]).parent == folder and _naming(b, baseline) == keys
                    and _tpot(b) is not None and _rest(b, keys) == _rest(r, keys)):
                found = b
                break
        if found is None:
            notes.append(f"{r['_label']}: no finished {baseline} job with its other settings in {folder} "
                         "(no speedup)")
            continue
        r["figures"]["speedup"] = _tpot(found) / _tpot(r)
        spread = _spread(found)
        if spread is not None and spread > SPREAD_NOTE and id(found) not in spread_noted:
            spread_noted.add(id(found))
            notes.append(f"{found['_label']} (a baseline): TPOT p90 {found['figures']['tpot_ms_p90']:.3f} ms is "
                         f"{spread:.2f}x its median: its steps spread, and the speedups against it move with them")
    return notes


def _spread(r: dict) -> float | None:
    """A finished job's TPOT p90 / median, or None where its p90 was not recorded."""
    p90 = (r.get("figures") or {}).get("tpot_ms_p90")
    ok = isinstance(p90, (int, float)) and not isinstance(p90, bool) and math.isfinite(p90)
    return p90 / _tpot(r) if ok and _tpot(r) is not None else None


def _rows(recs: list[dict], speedup: bool = False) -> tuple[list[str], list[list[str]]]:
    # with a speedup the TPOT's p90 beside it: how far the steps (of the baseline above all) spread
    extra = [("TPOT p90 ms", "tpot_ms_p90", "{:.3f}"), ("speedup", "speedup", "{:.2f}x")]
    cols = COLUMNS + (extra if speedup else [])
    head = ["job", "status", "task"] + [c[0] for c in cols]
    rows = []
    for r in recs:
        f = r.get("figures") or {}
        rows.append([r["_label"], r.get("status", "?"), r.get("task") or "-"] + [_cell(f, k, fmt) for _, k, fmt in cols])
    return head, rows


def _md(cell: str) -> str:
    return str(cell).replace("|", "\\|")  # a bare | would split the cell (max|dlogit|)


def markdown(recs: list[dict], speedup: bool = False, notes: list[str] = ()) -> str:
    """The same table as markdown, with the machine, dates and commits of the jobs, failed jobs' errors and notes."""
    head, rows = _rows(recs, speedup)
    gpus = sorted({str(r.get("gpu") or r.get("device") or "?") for r in recs})
    started = sorted(str(r["started"]) for r in recs if r.get("started"))
    commits = sorted({str(r.get("commit") or "not recorded") for r in recs})
    out = [f"GPU: {', '.join(gpus)}; jobs: {len(recs)}"
           + (f"; started {started[0]} .. {started[-1]}" if started else "") + f"; commit: {', '.join(commits)}",
           "", "| " + " | ".join(_md(h) for h in head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(_md(c) for c in r) + " |" for r in rows]
    extra = [f"- {r['_label']} failed: {r.get('error')}" for r in recs if r.get("status") != "ok"]
    extra += [f"- {n}" for n in notes]
    return "\n".join(out + ([""] + extra if extra else [])) + "\n"


def table(recs: list[dict], speedup: bool = False) -> str:
    head, rows = _rows(recs, speedup)
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
    p.add_argument("--baseline", help="add a speedup column: each job against the finished job of its sweep folder "
                                      "whose overrides name this (e.g. seed_phase1) and are otherwise its own")
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
    notes = add_speedup(recs, a.baseline) if a.baseline else []
    print(table(recs, speedup=bool(a.baseline)))
    for n in notes:
        print(f"note: {n}")
    if a.md:
        Path(a.md).parent.mkdir(parents=True, exist_ok=True)
        Path(a.md).write_text(markdown(recs, speedup=bool(a.baseline), notes=notes))
        print(f"markdown: {a.md}")
    if not a.no_plot:
        print(f"chart: {chart(recs, a.out or root / 'compare.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
