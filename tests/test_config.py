"""Every config option composes; defaults are what the README says; bad values are caught early."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from ds4 import app, compare
from ds4.model.args import ModelArgs
from ds4.registry import COMPONENTS

CONF = Path(__file__).resolve().parents[1] / "ds4" / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


def _compose(overrides=(), hydra_cfg=False):
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra_cfg)


def test_groups_are_the_documented_ones():
    assert set(GROUPS) == {"model", "weights", "attn", "indexer", "hc", "moe", "linear", "reduce", "numerics",
                           "runtime", "parallel", "task", "tracking", "experiment", "ablation"}


def test_defaults():
    cfg = _compose()
    assert (cfg.device, cfg.dtype, cfg.seed, cfg.max_new_tokens, cfg.max_seq_len, cfg.batch) == ("auto", "auto", 0, 32, 512, 1)
    assert (cfg.model.preset, cfg.weights.kind, cfg.task.name, cfg.tracking.name, cfg.tracking.mode) == \
        ("tiny", "synthetic", "generate", "wandb", "offline")
    assert (cfg.numerics.name, cfg.reduce.name, cfg.runtime.name) == ("plain", "fp32", "eager")
    spec = app.build_spec(cfg)
    cuda = torch.cuda.is_available()
    assert spec.device.type == ("cuda" if cuda else "cpu")
    assert spec.dtype == (torch.bfloat16 if cuda else torch.float32)
    assert spec.impls.attn == "torch" and spec.impls.moe == "dequant"


@pytest.mark.parametrize("group,option", [o for o in OPTIONS if o[0] not in ("experiment", "ablation")])
def test_every_option_composes(group, option):
    over = [f"{group}={option}", "device=cpu"]
    if group == "weights" and option == "checkpoint":
        with pytest.raises(app.UserError, match="weights.path is required"):
            app.build_spec(_compose(over))
        return
    cfg = _compose(over)
    spec = app.build_spec(cfg)
    if group in COMPONENTS:
        assert getattr(spec.impls, group) == option   # registry coverage: tests/test_registry.py
    if group == "model":
        assert isinstance(app.model_args(spec), ModelArgs)


@pytest.mark.parametrize("name", [o for g, o in OPTIONS if g == "experiment"])
def test_experiments_compose(name):
    spec = app.build_spec(_compose([f"experiment={name}", "device=cpu"]))
    assert isinstance(app.model_args(spec), ModelArgs)


@pytest.mark.parametrize("name", [o for g, o in OPTIONS if g == "ablation"])
def test_ablations_are_sweeps(name):
    cfg = _compose([f"ablation={name}", "device=cpu"], hydra_cfg=True)
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    params = cfg.hydra.sweeper.params
    assert params, f"ablation/{name}.yaml sweeps nothing"
    for key, values in params.items():
        for v in str(values).split(","):
            over = [f"{key}={v}", "device=cpu"]
            if key in GROUPS:
                assert (CONF / key / f"{v}.yaml").is_file(), f"ablation/{name}: no option {key}/{v}"
            app.build_spec(_compose([f"ablation={name}"] + over))


def test_model_n_layers_trims():
    spec = app.build_spec(_compose(["model=v4_flash", "model.n_layers=4", "device=cpu"]))
    assert app.model_args(spec).n_layers == 4
    assert app.build_spec(_compose(["model=v4_flash", "device=cpu"])).max_seq_len == 8192


@pytest.mark.parametrize("overrides,message", [
    (["max_new_tokens=abc"], "max_new_tokens must be an integer"),
    (["max_new_tokens=0"], "max_new_tokens must be >= 1"),
    (["batch=1.5"], "batch must be an integer"),
    (["batch=4", "max_batch=2"], "larger than the allocated max_batch=2"),
    (["profile=maybe"], "profile must be true or false"),
    (["dtype=int3"], "dtype='int3'"),
    (["device=tpu"], "device="),
    (["numerics.name=fp2"], "numerics=fp2 is not available"),
    (["weights=checkpoint"], "weights.path is required"),
])
def test_bad_values_are_user_errors(overrides, message):
    with pytest.raises(app.UserError, match=message):
        app.build_spec(_compose(overrides + (["device=cpu"] if not any(o.startswith("device") for o in overrides) else [])))


def test_bad_model_and_checkpoint_path(tmp_path):
    with pytest.raises(app.UserError, match="no such directory"):
        app.model_args(app.build_spec(_compose(["weights=checkpoint", f"weights.path={tmp_path}/nope", "device=cpu"])))
    with pytest.raises(app.UserError, match="no config.json"):
        app.model_args(app.build_spec(_compose(["weights=checkpoint", f"weights.path={tmp_path}", "device=cpu"])))
    with pytest.raises(app.UserError, match="model.*n_layers"):
        app.model_args(app.build_spec(_compose(["model.n_layers=99", "device=cpu"])))
    with pytest.raises(app.UserError, match="model.overrides"):
        app.model_args(app.build_spec(_compose(["+model.overrides.nope=1", "device=cpu"])))


def test_no_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(app.UserError, match="CUDA is not available"):
        app.build_spec(_compose(["device=cuda"]))


def test_compare_reads_records(tmp_path):
    base = {"task": "bench", "overrides": ["device=cpu"], "figures": {}}
    for i, (moe, status, fig) in enumerate([
            ("dequant", "ok", {"decode_tok_s": 10.0, "e2e_tok_s": 8.0, "tpot_ms": 100.0}),
            ("bf16_cache", "ok", {"decode_tok_s": 20.0, "e2e_tok_s": 15.0, "tpot_ms": 50.0, "fid_top1": 0.98}),
            ("fp4_topk", "failed", {})]):
        d = tmp_path / str(i)
        d.mkdir()
        rec = {**base, "status": status, "overrides": base["overrides"] + [f"moe={moe}"], "figures": fig,
               "error": None if status == "ok" else "moe=fp4_topk cannot run here: needs a CUDA device"}
        (d / "metrics.json").write_text(json.dumps(rec))
    recs = compare.load(tmp_path)
    assert [r["_label"] for r in recs] == ["moe=dequant", "moe=bf16_cache", "moe=fp4_topk"]
    text = compare.table(recs)
    assert "20.00" in text and "0.980" in text and "cannot run here" in text
    png = compare.chart(recs, tmp_path / "c.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert compare.main([str(tmp_path / "missing")]) == 2


def _job(root: Path, path: str, overrides: list[str], tpot: float | None, status: str = "ok", p90: float | None = None,
         **extra):
    d = root / path
    d.mkdir(parents=True)
    fig = {} if tpot is None else {"tpot_ms": tpot, "decode_tok_s": 1000.0 / tpot}
    if p90 is not None:
        fig["tpot_ms_p90"] = p90
    (d / "metrics.json").write_text(json.dumps({"task": "bench", "status": status, "overrides": overrides,
                                                "figures": fig, "error": None if status == "ok" else "x", **extra}))


def test_compare_speedup_against_the_same_sweeps_baseline(tmp_path):
    """Each job's speedup is against the baseline job of its own sweep folder with its other settings (the same
    machine and session, e.g. the same model.n_layers); a failed or NaN baseline gives no speedup, and says so."""
    e = lambda x: f"experiment={x}"
    _job(tmp_path, "a/0", [e("seed_phase1"), "model.n_layers=4"], 40.0, started="2026-12-05T01:00:00", commit="abc")
    _job(tmp_path, "a/1", [e("ds4_best"), "model.n_layers=4"], 0.4)
    _job(tmp_path, "a/2", [e("seed_phase1"), "model.n_layers=8"], 80.0)
    _job(tmp_path, "a/3", [e("ds4_best"), "model.n_layers=8"], 1.0)
    _job(tmp_path, "b/0", [e("seed_phase1"), "model.n_layers=4"], None, status="failed")  # another sweep
    _job(tmp_path, "b/1", [e("ds4_best"), "model.n_layers=4"], 0.5)
    _job(tmp_path, "c/0", [e("seed_phase1"), "model.n_layers=4"], float("nan"))
    _job(tmp_path, "c/1", [e("ds4_best"), "model.n_layers=4"], 0.5)
    recs = compare.load(tmp_path)
    notes = compare.add_speedup(recs, "seed_phase1")
    sp = {r["_path"]: (r.get("figures") or {}).get("speedup") for r in recs}
    assert sp["a/0"] == 1.0 and sp["a/1"] == 100.0 and sp["a/2"] == 1.0 and sp["a/3"] == 80.0
    assert sp["b/1"] is None and sp["c/1"] is None and len(notes) == 2 and "no speedup" in notes[0]
    assert len({r["_label"] for r in recs}) == len(recs)  # the same overrides in two sweeps: told apart by folder
    md = compare.markdown(recs, speedup=True, notes=notes)
    head = md.splitlines()[2]
    assert "max\\|dlogit\\|" in head and head.count(" | ") + 2 == md.splitlines()[3].count("|")  # one cell each
    assert "commit: abc, not recorded" in md and "started 2026-12-05T01:00:00" in md and "failed: x" in md


def test_compare_notes_a_baseline_whose_steps_spread(tmp_path):
    """A baseline whose TPOT p90 is over SPREAD_NOTE x its median gets one note (however many jobs it serves), and the
    speedup table shows every job's p90; a steady baseline, or one without a recorded p90, gets none."""
    e = lambda x: f"experiment={x}"
    for sweep, p90 in (("noisy", 88.4), ("steady", 76.0), ("unrecorded", None)):
        _job(tmp_path / sweep, "s/0", [e("seed_phase1")], 75.5, p90=p90)
        _job(tmp_path / sweep, "s/1", [e("ds4_best")], 1.338)
        _job(tmp_path / sweep, "s/2", [e("ds4_cuda_graph")], 1.974)
    recs = compare.load(tmp_path / "noisy")
    notes = compare.add_speedup(recs, "seed_phase1")
    assert len(notes) == 1 and "experiment=seed_phase1" in notes[0] and "1.17x its median" in notes[0]
    md = compare.markdown(recs, speedup=True, notes=notes)
    assert "TPOT p90 ms" in md.splitlines()[2] and "| 88.400 |" in md and "1.17x its median" in md
    for sweep in ("steady", "unrecorded"):
        assert compare.add_speedup(compare.load(tmp_path / sweep), "seed_phase1") == []


def test_compare_baseline_names_the_name_on_every_axis(tmp_path):
    """`--baseline dequant` over moe x linear: every job's baseline is moe=dequant,linear=dequant; where that job
    failed none has one (each used to take the first job naming dequant on either axis, itself included)."""
    jobs = [("dequant", "dequant", 8.0), ("dequant", "gemv_cuda", 4.0), ("fp4_topk", "dequant", 2.0),
            ("fp4_topk", "gemv_cuda", 1.0)]
    for sweep in ("ok", "failed"):
        for i, (moe, lin, t) in enumerate(jobs):
            failed = sweep == "failed" and i == 0
            _job(tmp_path / sweep, f"s/{i}", [f"moe={moe}", f"linear={lin}"], None if failed else t,
                 status="failed" if failed else "ok")
    recs = compare.load(tmp_path / "ok")
    assert compare.add_speedup(recs, "dequant") == []
    assert [r["figures"]["speedup"] for r in sorted(recs, key=lambda r: r["_path"])] == [1.0, 2.0, 4.0, 8.0]
    recs = compare.load(tmp_path / "failed")
    notes = compare.add_speedup(recs, "dequant")
    assert len(notes) == 3 and not any("speedup" in (r.get("figures") or {}) for r in recs)


def test_compare_shows_nonfinite_figures(tmp_path):
    """A measured figure that is NaN or inf (a run with broken logits) is shown as such, not as "-" (not measured);
    top-1 on confident steps with no confident step stays "-"."""
    figs = [{"fid_top1": 0.65, "fid_top1_confident": 0.75, "fid_confident_steps": 45, "fid_kl": float("nan"),
             "fid_max_abs": float("nan"), "ppl": float("inf")},
            {"fid_top1": 0.8, "fid_top1_confident": float("nan"), "fid_confident_steps": 0, "fid_kl": 0.1,
             "fid_max_abs": 3.0, "ppl": 10.0},
            {"ppl": 10.0}]
    for i, f in enumerate(figs):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "metrics.json").write_text(json.dumps(
            {"task": "eval", "status": "ok", "overrides": [f"seed={i}"], "figures": f}))
    head, rows = compare._rows(compare.load(tmp_path))
    col = {h: i for i, h in enumerate(head)}
    assert [rows[0][col[h]] for h in ("top-1", "top-1 conf", "KL", "max|dlogit|", "ppl")] == \
        ["0.650", "0.750", "nan", "nan", "inf"]
    assert rows[1][col["top-1 conf"]] == "-" and rows[1][col["KL"]] == "0.1"
    assert rows[2][col["KL"]] == "-" and rows[2][col["top-1"]] == "-"
