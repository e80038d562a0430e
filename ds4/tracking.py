"""wandb + metrics.json: what a job leaves behind.

One wandb run per Hydra job (multirun jobs share a process, so the run is always finished in a
`finally` and opened with reinit="finish_previous"). wandb is imported only when tracking=wandb;
it runs offline unless WANDB_MODE is set. `metrics.json` is written in the job's output
directory whatever the tracking choice, so `python -m ds4.compare` works without a wandb server.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

METRICS = "metrics.json"
RUN_FACTS = ("commit", "torch", "device", "dtype", "gpu", "tp", "env")  # metrics.json keys also given to wandb


@dataclass
class JobInfo:
    """What Hydra knows about the current job, as plain data."""
    output_dir: str
    choices: dict[str, str] = field(default_factory=dict)   # group -> option (hydra/* left out)
    overrides: list[str] = field(default_factory=list)
    override_dirname: str = ""
    multirun: bool = False
    num: int = 0
    sweep_dir: str | None = None

    @property
    def ablation(self) -> str | None:
        return self.choices.get("ablation")


def job_info() -> JobInfo:
    hc = HydraConfig.get()
    choices = {k: str(v) for k, v in hc.runtime.choices.items() if not k.startswith("hydra/") and v is not None}
    multirun = hc.mode == RunMode.MULTIRUN
    return JobInfo(
        output_dir=hc.runtime.output_dir, choices=choices, overrides=list(hc.overrides.task),
        override_dirname=hc.job.override_dirname or "", multirun=multirun,
        num=int(hc.job.get("num", 0) or 0), sweep_dir=str(hc.sweep.dir) if multirun else None)


def config_dict(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain data (unresolvable values kept as written)."""
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except Exception:
        return OmegaConf.to_container(cfg, resolve=False)


def group_name(tracking: dict, job: JobInfo) -> str | None:
    if tracking.get("group"):
        return str(tracking["group"])
    sweep = "_".join(Path(job.sweep_dir).parts[-2:]) if job.multirun and job.sweep_dir else None
    if job.ablation:  # one group per run of the ablation (the 1-GPU and tp=2 sweeps, reruns: apart)
        return f"{job.ablation}-{sweep}" if sweep else job.ablation
    if sweep:
        return "sweep-" + sweep
    return None


class TrackingError(ValueError):
    """A tracking setup that cannot run here (printed as one line)."""


class Tracker:
    """A wandb run for one job, or nothing (tracking=none)."""

    def __init__(self, tracking: dict, job: JobInfo, config: dict, task: str):
        self.run = None
        self._wandb = None
        if tracking.get("name") != "wandb":
            return
        try:
            import wandb  # lazy: the GPU machine has no wandb and runs with tracking=none
        except ImportError as e:
            raise TrackingError(f"tracking=wandb needs wandb ({e}); install it (pip install wandb) or run with "
                               "tracking=none") from None
        self._wandb = wandb
        tags = [f"{k}={v}" for k, v in sorted(job.choices.items())] + [str(t) for t in tracking.get("tags") or []]
        self.run = wandb.init(
            project=tracking.get("project") or "ds4", entity=tracking.get("entity"),
            group=group_name(tracking, job), job_type=task, name=job.override_dirname or None,
            tags=[t[:64] for t in tags], config={**config, "choices": dict(job.choices), "overrides": list(job.overrides)},
            dir=job.output_dir, mode=os.environ.get("WANDB_MODE") or tracking.get("mode") or "offline",
            reinit="finish_previous", settings=wandb.Settings(silent=True, console="off"))

    def log(self, record: dict) -> None:
        if self.run is None:
            return
        figures = {k: v for k, v in record.get("figures", {}).items() if _is_number(v)}
        self.run.summary.update(figures)
        self.run.summary["status"] = record.get("status")
        if record.get("error"):
            self.run.summary["error"] = record["error"]
        if record.get("task_notes"):  # what the figures leave out or how they were taken (e.g. profiler on)
            self.run.summary["notes"] = list(record["task_notes"])
        if record.get("resolved"):
            self.run.config.update({"resolved": record["resolved"], "resolved_notes": record.get("notes", {})},
                                   allow_val_change=True)
        # what metrics.json records beside the config: without it, runs that differ only by a DS4_* switch, the
        # commit or the GPU look alike in wandb (the config holds device=auto, dtype=auto)
        facts = {k: record[k] for k in RUN_FACTS if record.get(k) is not None}
        if facts:
            self.run.config.update({"run": facts}, allow_val_change=True)
        rows = record.get("profile") or []
        if rows:
            cols = ["stage", "calls", "total_ms", "mean_us"]
            table = self._wandb.Table(columns=cols, data=[[r[c] for c in cols] for r in rows])
            self.run.log({"stage_profile": table})

    def finish(self, ok: bool) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if ok else 1)
            self.run = None


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def write_metrics(output_dir: str, record: dict) -> Path:
    path = Path(output_dir) / METRICS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str, allow_nan=True) + "\n")
    return path


class SweepSummary(Callback):
    """After a multirun: one line per job, and a non-zero exit when any job failed (each failed
    job was recorded and the others still ran). Only this sweep's jobs count: a reused sweep directory's older
    metrics.json files (written before the sweep started) are left out."""

    started: float = 0.0

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = math.floor(time.time()) - 1  # a second's slack for file systems that keep whole seconds

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = Path(str(config.hydra.sweep.dir))
        records, older = [], 0
        for p in sorted(sweep.rglob(METRICS)):
            try:
                if p.stat().st_mtime < self.started:
                    older += 1
                    continue
                records.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                continue
        failed = [r for r in records if r.get("status") != "ok"]
        print(f"\nds4 sweep: {len(records)} jobs in {sweep}, {len(failed)} failed"
              f"  (table and chart: python -m ds4.compare {sweep})")
        if older:
            print(f"  ({older} metrics.json of an earlier sweep in this directory left out; ds4.compare reads them too)")
        for r in failed:
            print(f"  failed: {r.get('override_dirname') or r.get('output_dir')}: {r.get('error')}")
        if failed:
            sys.stdout.flush()
            sys.exit(1)
