"""The product as users run it: `python -m ds4` in a subprocess, multirun, compare, bad input.

The tiny model on CPU; few tokens; tracking=none except where wandb itself is under test.
The bench/eval tasks run in-process (same code after Hydra) to keep the suite short.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from ds4 import app

ROOT = Path(__file__).resolve().parents[1]
FAST = ["device=cpu", "prompt=Hi there", "max_new_tokens=3"]


def ds4(*args: str, cwd: Path, wandb: bool = False, module: str = "ds4") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["WANDB_SILENT"] = "true"
    if wandb:
        env["WANDB_MODE"] = "offline"
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def metrics(root: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(root.rglob("metrics.json"))]


def offline_runs(root: Path) -> list[Path]:
    return sorted(root.rglob("offline-run-*"))


def test_default_run(tmp_path):
    """No arguments at all, on a fresh directory: generates, prints the figures, leaves metrics.json
    and one offline wandb run."""
    r = ds4(cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    for what in ("implementations:", "attn", "TTFT", "TPOT median", "decode", "tok/s", "end-to-end",
                 "stage profile:", "--- generated ---"):
        assert what in r.stdout, what
    (rec,) = metrics(tmp_path / "outputs")
    assert rec["status"] == "ok" and rec["task"] == "generate"
    assert rec["resolved"] == {"attn": "torch", "indexer": "torch", "hc": "torch", "moe": "dequant", "linear": "dequant"}
    assert rec["choices"]["model"] == "tiny" and rec["choices"]["tracking"] == "wandb"
    assert rec["figures"]["decode_tok_s"] > 0 and rec["figures"]["e2e_tok_s"] > 0
    assert len(rec["generated_ids"][0]) >= 1 and len(rec["prompt_ids"]) > 1
    assert rec["profile"], "profile=true by default: the stage table is recorded"
    assert len(offline_runs(tmp_path / "outputs")) == 1


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    d = tmp_path_factory.mktemp("sweep")
    r = ds4("--multirun", "numerics=plain,qat", "attn=torch,auto", *FAST, f"hydra.sweep.dir={d / 'mr'}",
            cwd=d, wandb=True)
    return d / "mr", r


def test_multirun_2x2(sweep):
    mr, r = sweep
    assert r.returncode == 0, r.stdout + r.stderr
    recs = metrics(mr)
    assert len(recs) == 4 and all(x["status"] == "ok" for x in recs), [x.get("error") for x in recs]
    combos = {(x["choices"]["numerics"], x["choices"]["attn"]) for x in recs}
    assert combos == {("plain", "torch"), ("plain", "auto"), ("qat", "torch"), ("qat", "auto")}
    assert len(offline_runs(mr)) == 4
    assert "ds4 sweep: 4 jobs" in r.stdout and "0 failed" in r.stdout


def test_compare_on_sweep(sweep, tmp_path):
    mr, _ = sweep
    png = tmp_path / "chart.png"
    r = ds4(str(mr), "--out", str(png), cwd=tmp_path, module="ds4.compare")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "decode tok/s" in lines[0] and "top-1" in lines[0]
    assert sum(line.startswith(("numerics=", "attn=")) for line in lines) == 4
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_failing_job_is_recorded_and_sweep_goes_on(tmp_path):
    r = ds4("--multirun", "moe=fp4_topk,dequant", "tracking=none", *FAST, f"hydra.sweep.dir={tmp_path / 'mr'}",
            cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    recs = {x["choices"]["moe"]: x for x in metrics(tmp_path / "mr")}
    assert recs["dequant"]["status"] == "ok"
    assert recs["fp4_topk"]["status"] == "failed" and "moe=fp4_topk" in recs["fp4_topk"]["error"]
    assert "1 failed" in r.stdout


@pytest.mark.parametrize("args,message", [
    (["attn=nope"], "Could not find 'attn/nope'"),
    (["max_new_tokens=many"], "max_new_tokens must be an integer"),
    (["weights=checkpoint"], "weights.path is required"),
    (["weights=checkpoint", "weights.path=/no/such/dir"], "no such directory"),
    (["max_seq_len=8"], "longer than max_seq_len=8"),
    (["batch=2", "max_batch=1"], "larger than the allocated max_batch=1"),
    (["moe=fp4_topk"], "moe=fp4_topk"),
    (["parallel.tp=2"], "torchrun --nproc-per-node 2"),           # tp asked, one process launched
    (["runtime=cuda_graph"], "runtime=cuda_graph needs a CUDA device"),
    (["parallel.comm=ring"], "parallel.comm=ring"),
    (["parallel.experts=dp"], "parallel.experts=dp"),
    (["parallel.shared_expert=ep"], "parallel.shared_expert=ep"),
    (["parallel.comm=ll"], "parallel.comm=ll needs CUDA devices"),           # explicit, cannot run: before weights
    (["+model.overrides.window_size=0"], "window_size must be >= 1"),          # else a traceback after the load
    (["+model.overrides.n_heads=four"], "n_heads must be an integer, got 'four'"),
])
def test_bad_input_is_one_clear_error(tmp_path, args, message):
    r = ds4(*args, "tracking=none", "device=cpu", cwd=tmp_path)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr + r.stdout


# ---- tasks, in-process (the same path as the CLI after Hydra composed the config) ---------------
def _spec(*overrides: str):
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "ds4" / "conf")):
        cfg = compose("config", overrides=["tracking=none", "device=cpu", "dtype=float32", *overrides])
    return app.build_spec(cfg)


def test_bench_figures():
    spec = _spec("task=bench", "numerics=qat", "max_new_tokens=5", "task.warmup=1", "task.prompt_len=8",
                 "task.prefill_lens=[8,600]", "task.fidelity_tokens=3", "profile=true", "task.copy_bytes=67108864")
    rec = {}
    res = app.execute(spec, rec, log=lambda *_: None)
    f = res["figures"]
    for k in ("tpot_ms", "tpot_ms_p90", "tpot_mean_ms", "decode_tok_s", "e2e_tok_s", "ttft_ms", "prefill_tok_s_L8",
              "bytes_per_token", "copy_gb_s", "achieved_gb_s", "bw_ratio", "peak_rss_gib", "fid_top1", "fid_max_abs",
              "fid_mean_abs", "fid_kl"):
        assert k in f, k
    assert "prefill_tok_s_L600" not in f and any("600" in n for n in res["notes"])
    assert f["tpot_ms_p90"] >= f["tpot_ms"] > 0 and f["tpot_mean_ms"] > 0 and f["bytes_per_token"] > 0
    assert f["bw_ratio"] == pytest.approx(f["achieved_gb_s"] / f["copy_gb_s"])
    assert 0 <= f["fid_top1"] <= 1 and f["fid_steps"] == 3
    assert [r["stage"] for r in res["profile"]], "profiled pass recorded"
    assert rec["resolved"]["moe"] == "dequant"


def test_bench_reference_skips_fidelity_and_eval_ppl(tmp_path):
    res = app.execute(_spec("task=bench", "max_new_tokens=3", "task.prefill_lens=[]", "task.prompt_len=4",
                            "profile=false", "task.copy_bytes=67108864"), {}, log=lambda *_: None)
    assert "fid_top1" not in res["figures"] and any("is the torch reference" in n for n in res["notes"])
    assert res["profile"] == []
    text = tmp_path / "t.txt"
    text.write_text("Hello world, this is a small text to score.")
    res = app.execute(_spec("task=eval", f"task.text_file={text}", "task.max_tokens=12", "numerics=qat"), {},
                      log=lambda *_: None)
    f = res["figures"]
    assert f["eval_tokens"] == 11 and f["ppl"] > 1 and f["ref_ppl"] > 1 and 0 <= f["fid_top1"] <= 1
    assert torch.isfinite(torch.tensor(f["nll"]))


def test_eval_says_where_the_text_is_cut(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("x" * 40)
    res = app.execute(_spec("task=eval", f"task.text_file={text}", "task.max_tokens=12", "profile=false",
                            "batch=2"), {}, log=lambda *_: None)
    assert res["figures"]["eval_tokens"] == 11
    assert "first 12 of 41 tokens" in res["notes"][0] and "batch=2 not used" in res["notes"][0]
    res = app.execute(_spec("task=eval", f"task.text_file={text}", "profile=false"), {}, log=lambda *_: None)
    assert res["notes"][0] == f"text: {text}" and res["figures"]["eval_tokens"] == 40


def test_compare_logits_definitions():
    """Top-1 agreement (a step with a NaN logit agrees with nothing, though argmax would pick the NaN), the confident
    steps by the reference's top-2 margin, the logit differences and KL(ref || run) in nats, against hand values."""
    from ds4.tasks.common import compare_logits
    ref = torch.tensor([[3.0, 1.0, 0.0], [1.0, 0.8, 0.0], [0.0, 2.0, 1.0]])
    run = torch.tensor([[3.0, 1.0, 0.0], [0.5, 0.9, 0.0], [0.0, float("nan"), 1.0]])
    f = compare_logits(run, ref, margin=0.5)
    assert f["fid_steps"] == 3 and f["fid_top1"] == pytest.approx(1 / 3)
    assert f["fid_confident_steps"] == 2 and f["fid_top1_confident"] == pytest.approx(0.5)
    g = compare_logits(run[:2], ref[:2], margin=0.5)
    p, q = ref[1].softmax(-1), run[1].softmax(-1)
    assert g["fid_kl"] == pytest.approx(float((p * (p / q).log()).sum()) / 2, rel=1e-5)
    assert g["fid_max_abs"] == pytest.approx(0.5) and g["fid_mean_abs"] == pytest.approx(0.6 / 6)


def test_eval_far_off_logits_give_inf_ppl_and_fidelity(monkeypatch):
    """A run whose logits are far off (mean NLL above exp's range) reports ppl inf and its fidelity figures instead of
    failing with OverflowError."""
    from ds4.model import transformer as T
    logits = T.Transformer.logits
    monkeypatch.setattr(T.Transformer, "logits",
                        lambda self, h, *a, **k: logits(self, h, *a, **k) * (100 if self.numerics == "qat" else 1))
    res = app.execute(_spec("task=eval", "task.max_tokens=12", "numerics=qat", "profile=false"), {}, log=lambda *_: None)
    f = res["figures"]
    assert f["nll"] > 710 and f["ppl"] == float("inf") and f["ref_ppl"] < float("inf") and f["fid_max_abs"] > 100


@pytest.mark.parametrize("experts", ["ep", "tp"])
def test_torchrun_tp2_on_cpu(experts, tmp_path):
    """`torchrun --nproc-per-node 2 -m ds4 parallel.tp=2` on gloo: rank 0 alone writes metrics.json,
    and the greedy tokens equal the single-process run's, with either routed-expert layout."""
    common = ["tracking=none", "device=cpu", "dtype=float32", "max_new_tokens=6", "profile=false"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "ds4",
                        "parallel.tp=2", f"parallel.experts={experts}", *common, f"hydra.run.dir={tmp_path}/tp2"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    r1 = ds4(*common, f"hydra.run.dir={tmp_path}/tp1", cwd=tmp_path)
    assert r1.returncode == 0, r1.stderr[-2000:]
    m2 = json.loads((tmp_path / "tp2" / "metrics.json").read_text())
    m1 = json.loads((tmp_path / "tp1" / "metrics.json").read_text())
    assert m2["tp"] == 2 and m2["experts"] == experts and m2["status"] == "ok"
    assert m2["generated_ids"] == m1["generated_ids"]
    assert r.stdout.count("metrics:") == 1  # only rank 0 reports


def test_torchrun_clean_error_said_once(tmp_path):
    """A setup error is the same on every rank: rank 0 alone prints it (README: only rank 0 prints)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "ds4",
                        "parallel.tp=2", "parallel.shared_expert=tp", "tracking=none", "device=cpu",
                        f"hydra.run.dir={tmp_path}/tp2"], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env=env)
    assert r.returncode != 0
    assert r.stderr.count("ds4: error:") == 1 and "does not fit this model" in r.stderr, r.stderr[-2000:]


def test_chat_prompt_has_one_bos():
    """task.chat=true: the chat encoding already starts with the BOS text; no second BOS."""
    from ds4.tasks.generate import prepare
    from ds4.tokenizer import load_tokenizer
    tok = load_tokenizer(None, 512)
    spec = _spec("task.chat=true", "prompt=Hi")
    ids = prepare(spec, None, tok).prompt_ids
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert ids[:2] == tok.encode(tok.encode_chat([{"role": "user", "content": "Hi"}]))[:2]


@pytest.mark.parametrize("overrides,message", [
    (["task.chat=off"], "task.chat must be true or false, got 'off'"),
    (["task.stop_at_eos=no"], "task.stop_at_eos must be true or false"),
    (["task.top_k=-1"], "top_k -1"),
    (["task.top_p=0"], "top_p 0.0"),
    (["task.temperature=warm"], "task.temperature must be a number, got 'warm'"),
    (["task=bench", "task.warmup=-5"], "task.warmup must be >= 0"),
    (["task=bench", "task.fidelity=off"], "task.fidelity must be true or false"),
    (["task=bench", "task.reference_numerics=fp8"], "task.reference_numerics=fp8"),
    (["task=bench", "task.prefill_lens=[8,x]"], "task.prefill_lens: 'x'"),
    (["task=eval", "task.max_tokens=1"], "task.max_tokens must be >= 2"),
])
def test_task_options_checked_before_the_weights(overrides, message):
    from ds4.tasks.common import InputError
    from ds4.tokenizer import load_tokenizer
    spec = _spec(*overrides)
    task = app._task_module(spec.task)
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace("[", r"\[")):
        task.prepare(spec, app.model_args(spec), load_tokenizer(None, 512))


def test_bench_prefill_points():
    from ds4.tasks import bench
    from ds4.tokenizer import load_tokenizer
    tok = load_tokenizer(None, 512)
    # a point must leave a position to decode: max_seq_len itself is skipped with a note, not a failed job
    spec = _spec("task=bench", "max_seq_len=64", "max_new_tokens=8", "task.prompt_len=8", "task.prefill_lens=[63,64]")
    plan = bench.prepare(spec, app.model_args(spec), tok)
    assert plan.prefill_lens == [63] and any("64" in n and "shorter than max_seq_len" in n for n in plan.notes)
    spec = _spec("task=bench", "task.prefill_lens=16")  # one number: one point
    assert bench.prepare(spec, app.model_args(spec), tok).prefill_lens == [16]


def test_bench_at_batch_2_leaves_out_the_batch_1_byte_figures():
    res = app.execute(_spec("task=bench", "batch=2", "max_batch=2", "max_new_tokens=3", "task.prefill_lens=[]",
                            "task.prompt_len=4", "profile=false", "task.fidelity=false", "task.copy_bytes=67108864",
                            "model.n_layers=1"), {}, log=lambda *_: None)
    f = res["figures"]
    assert f["batch"] == 2 and f["decode_tok_s"] > 0 and "copy_gb_s" in f
    assert not {"bytes_per_token", "achieved_gb_s", "bw_ratio"} & set(f)
    assert any("batch 2" in n for n in res["notes"])


def test_bench_peak_memory_leaves_out_the_copy_buffers(monkeypatch):
    """The copy-bandwidth measurement's buffers are the benchmark's, not the job's: peak memory is read before."""
    from ds4.tasks import bench
    order = []
    peak, copy = bench.peak_memory, bench.copy_bandwidth
    monkeypatch.setattr(bench, "peak_memory", lambda d: (order.append("peak"), peak(d))[1])
    monkeypatch.setattr(bench, "copy_bandwidth", lambda d, n: (order.append("copy"), copy(d, n))[1])
    app.execute(_spec("task=bench", "max_new_tokens=3", "task.prefill_lens=[]", "task.prompt_len=4", "profile=false",
                      "task.fidelity=false", "task.copy_bytes=8388608", "model.n_layers=1"), {}, log=lambda *_: None)
    assert order == ["peak", "copy"]


def test_is_reference_needs_the_reference_reduce_and_runtime():
    from types import SimpleNamespace
    from ds4.tasks.common import is_reference, reference_impls
    ops = SimpleNamespace(chosen=reference_impls())
    ref = _spec()
    assert is_reference(SimpleNamespace(ops=ops, spec=ref), "plain")
    for over in ({"tp": 2, "reduce": "bf16"}, {"runtime": "cuda_graph"}, {"numerics": "qat"}):
        spec = dataclasses.replace(ref, **over)
        assert not is_reference(SimpleNamespace(ops=ops, spec=spec), "plain"), over
    assert is_reference(SimpleNamespace(ops=ops, spec=dataclasses.replace(ref, tp=2, reduce="fp32")), "plain")


def test_tokenizer_path_with_a_tilde(tmp_path, monkeypatch):
    from ds4.tokenizer import load_tokenizer, write_tokenizer_files
    write_tokenizer_files(tmp_path / "ckpt")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_tokenizer("~/ckpt", 512).name.startswith("hf:")


def test_wandb_missing_is_one_clear_error(monkeypatch):
    from ds4 import tracking
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` then raises ImportError
    job = tracking.JobInfo(output_dir=".")
    with pytest.raises(tracking.TrackingError, match="tracking=none"):
        tracking.Tracker({"name": "wandb"}, job, {}, "generate")


def test_sweep_summary_counts_only_this_sweeps_jobs(tmp_path, capsys):
    from omegaconf import OmegaConf
    from ds4.tracking import SweepSummary
    old = tmp_path / "0" / "metrics.json"
    old.parent.mkdir()
    old.write_text(json.dumps({"status": "failed", "error": "an earlier sweep's", "override_dirname": "moe=x"}))
    os.utime(old, (1e9, 1e9))
    cb = SweepSummary()
    cb.on_multirun_start(OmegaConf.create({}))
    new = tmp_path / "1" / "metrics.json"
    new.parent.mkdir()
    new.write_text(json.dumps({"status": "ok"}))
    cb.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))  # no exit: nothing failed
    out = capsys.readouterr().out
    assert "1 jobs" in out and "0 failed" in out and "1 metrics.json of an earlier sweep" in out


def test_ds4_switches_are_recorded_and_printed(monkeypatch):
    monkeypatch.setenv("DS4_SPARSE_MAX_SPLITS", "8")
    rec, lines = {}, []
    app.execute(_spec("max_new_tokens=2", "model.n_layers=1", "profile=false"), rec, log=lines.append)
    assert rec["env"]["DS4_SPARSE_MAX_SPLITS"] == "8"
    assert any(line.startswith("  environment ") and "DS4_SPARSE_MAX_SPLITS=8" in line for line in lines)


@pytest.mark.parametrize("name,value,ok", [
    ("DS4_BULK_STAGE", "dg", True), ("DS4_BULK_STAGE", "all", True), ("DS4_BULK_STAGE", "1", False),
    ("DS4_BULK_STAGE", "dual", False), ("DS4_SPACER", "u", True), ("DS4_SPACER", "all", False)])
def test_kind_switches_take_only_kind_letters(monkeypatch, name, value, ok):
    """The kernel-kind switches (letters g d u) refuse other values before the weights load: the launches look for
    their letter in the value, so "1" would turn nothing on and "dual" the downs and gate+ups, silently."""
    monkeypatch.setenv(name, value)
    loads = []

    def load_weights(*args):
        loads.append(args)
        raise RuntimeError("at the weights")
    monkeypatch.setattr(app, "load_weights", load_weights)
    spec = _spec("max_new_tokens=1", "model.n_layers=1", "profile=false")
    if ok:
        with pytest.raises(RuntimeError, match="at the weights"):  # past the check
            app.execute(spec, {}, log=lambda line: None)
        assert loads
    else:
        with pytest.raises(app.UserError, match=f"{name}='{value}': takes letters of g, d, u"):
            app.execute(spec, {}, log=lambda line: None)
        assert not loads


def test_prompt_null_is_no_text():
    assert _spec("prompt=null").prompt == "" and _spec("prompt=123").prompt == "123"


def test_peak_rss_is_the_jobs():
    """A multirun job after a larger one reports its own peak resident set, not the process's (Linux)."""
    from ds4.tasks.common import peak_memory, reset_memory
    if not sys.platform.startswith("linux"):
        pytest.skip("resets the peak through /proc")
    big = torch.ones(256 << 20, dtype=torch.uint8)  # 256 MiB resident
    del big
    before = peak_memory(torch.device("cpu"))["peak_rss_gib"]
    reset_memory(torch.device("cpu"))
    after = peak_memory(torch.device("cpu"))["peak_rss_gib"]
    assert after < before - 0.2, (before, after)


def test_graph_figures_reported_apart():
    from types import SimpleNamespace
    from ds4.tasks.common import format_figures, graph_figures
    assert graph_figures(SimpleNamespace(graphs={})) == {}
    g = SimpleNamespace(warmup_s=1.5, capture_s=0.25, pool_bytes=3 << 20, graphs={frozenset(): 0, frozenset({4}): 1})
    fig = graph_figures(SimpleNamespace(graphs={(1, "argmax"): g}))
    assert fig == {"graph_warmup_s": 1.5, "graph_capture_s": 0.25, "graph_pool_mib": 3.0, "graphs": 2}
    assert "CUDA graph capture" in format_figures(fig)


def test_peak_memory_gathers_every_ranks_peak_at_the_same_point(monkeypatch):
    """Under tensor parallelism on CUDA each task's peak-memory reading also gathers every rank's, at that point of the
    task (before, the app gathered them after the task, with the copy buffers and the fidelity reference in them)."""
    import torch.distributed as dist
    from ds4.tasks.common import peak_memory
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 4 * 2**30)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)

    def gather(out, obj):
        out[:] = [obj, obj + 1]
    monkeypatch.setattr(dist, "all_gather_object", gather)
    f = peak_memory(torch.device("cuda"))
    assert f == {"peak_mem_gib": 3.0, "peak_reserved_gib": 4.0, "peak_mem_gib_per_rank": [3.0, 4.0]}
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    assert "peak_mem_gib_per_rank" not in peak_memory(torch.device("cuda"))


def test_memory_check_counts_what_the_run_allocates_after_the_load(monkeypatch):
    """The GPU-memory check before loading counts the decode state at (max_batch, max_seq_len), the CUDA-graph
    capture's copy of it, the fidelity reference's state and attn=fused_cuda_wo_bf16's BF16 wo_b.wo_a, not only the
    stored weights: each of these setups passed a weights-only check and ran out of memory after the load."""
    import dataclasses
    from ds4.model.transformer import Transformer
    from ds4.tasks.common import reference_impls
    from ds4.weights.schema import local_tensors
    G = 2**30

    def check(free_gib, *overrides, **fields):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (int(free_gib * G), int(free_gib * G)))
        spec = dataclasses.replace(_spec(*overrides), device=torch.device("cuda", 0), dtype=torch.bfloat16, **fields)
        args = app.model_args(spec)
        weights = sum(s.nbytes for s, _ in local_tensors(args, 0, spec.tp, include_mtp=False, experts=spec.experts,
                                                          shared=spec.shared_expert).values())
        chosen = {**reference_impls(), "attn": spec.impls.attn}
        need = sum(b for _, b in app.memory_need(spec, args, chosen))
        app.check_setup(spec, args)  # the split checks: these setups fit
        with pytest.raises(app.UserError, match="per GPU"):
            app.check_memory(spec, args, chosen)
        return args, spec, weights, need

    args, spec, weights, need = check(78, "model=v4_flash", "model.n_layers=20", "max_seq_len=262144", "max_batch=16")
    state = Transformer.state_bytes(args, 16, 262144, torch.bfloat16)
    assert weights < 78 * G < weights + state and need == weights + state
    args, spec, weights, need = check(78, "model=v4_flash", "model.n_layers=22", "attn=fused_cuda_wo_bf16")
    assert weights < 78 * G < need and need - weights > 22 * args.dim * args.n_heads * args.head_dim * 2
    args, spec, weights, need = check(139, "model=v4_flash", "max_seq_len=1048576", "max_batch=8", "runtime=cuda_graph",
                                      "task=bench", tp=2, experts="tp", shared_expert="tp")
    state = Transformer.state_bytes(args, 8, 1048576, torch.bfloat16)
    assert need == weights + 2 * state + Transformer.state_bytes(args, 1, 1048576, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (200 * G, 200 * G))  # the README's 4 layers fit
    spec = dataclasses.replace(_spec("model=v4_flash", "model.n_layers=4"), device=torch.device("cuda", 0),
                               dtype=torch.bfloat16)
    app.check_memory(spec, app.model_args(spec), reference_impls())


def test_memory_check_under_tp_names_the_rank_with_the_least_room(monkeypatch):
    """Each rank checks its own GPU; the ranks agree on the one with the least room, so rank 0 (the only one that
    prints) says it, and every rank stops before loading (not rank 1 alone, silently, with rank 0 loading on)."""
    import dataclasses
    import torch.distributed as dist
    from ds4.tasks.common import reference_impls
    G = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (500 * G, 500 * G))  # this rank (0): plenty
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

    def gather(out, obj, group=None):  # rank 1's GPU has 64 MiB free (small's weights alone are 0.2 GiB a rank)
        out[0], out[1] = obj, (2**26 - obj[2], 2**26, obj[2])
    monkeypatch.setattr(dist, "all_gather_object", gather)
    spec = dataclasses.replace(_spec("model=small"), device=torch.device("cuda", 0), dtype=torch.bfloat16, tp=2)
    with pytest.raises(app.UserError, match="rank 1's GPU has 64 MiB free"):
        app.check_memory(spec, app.model_args(spec), reference_impls())


# ---- desk review of the user-facing surface (session 59) ----------------------------------------
def test_bench_says_when_the_prompt_text_is_not_used():
    """task=bench benches task.prompt_len random ids: a `prompt=...` given with it is said to be unused, not dropped
    without a word; task.prompt_len=null benches the text."""
    from ds4.tasks import bench
    from ds4.tokenizer import load_tokenizer
    tok = load_tokenizer(None, 512)
    spec = _spec("task=bench", "prompt=Hello")
    plan = bench.prepare(spec, app.model_args(spec), tok)
    assert len(plan.prompt_ids) == 32 and any("prompt text is not used" in n for n in plan.notes)
    spec = _spec("task=bench", "prompt=Hello", "task.prompt_len=null")
    plan = bench.prepare(spec, app.model_args(spec), tok)
    assert len(plan.prompt_ids) == 6 and not any("prompt text" in n for n in plan.notes)


def test_generate_says_top_k_and_top_p_do_nothing_when_greedy():
    res = app.execute(_spec("task.top_k=5", "max_new_tokens=2", "model.n_layers=1", "profile=false"), {},
                      log=lambda *_: None)
    assert any("no effect at task.temperature=0" in n for n in res["notes"]), res["notes"]
    from ds4.tasks import generate
    from ds4.tokenizer import load_tokenizer
    spec = _spec("task.top_p=0.9", "task.temperature=0.7")
    assert generate.prepare(spec, app.model_args(spec), load_tokenizer(None, 512)).notes == []


def test_batch_figures_say_which_counts_are_per_row():
    """decode_figures records one row's prompt but every row's new tokens: the printed labels say so at batch > 1."""
    from ds4.tasks.common import format_figures
    out = format_figures({"prompt_tokens": 10, "new_tokens": 24, "batch": 3})
    assert "prompt tokens (per row)" in out and "new tokens (all rows)" in out
    assert "(per row)" not in format_figures({"prompt_tokens": 10, "new_tokens": 8, "batch": 1})


def test_eval_figures_are_formatted_and_say_the_profiler_was_on():
    from ds4.tasks.common import format_figures
    out = format_figures({"nll": 1.234567891, "eval_tok_s": 12.345678})
    assert "mean NLL" in out and "1.2346 nats" in out and "12.3 tok/s" in out and "1.234567891" not in out
    res = app.execute(_spec("task=eval", "task.max_tokens=4", "model.n_layers=1", "profile=true"), {},
                      log=lambda *_: None)
    assert any("stage profiler on" in n for n in res["notes"])


def test_load_time_is_printed():
    lines = []
    rec = {}
    app.execute(_spec("max_new_tokens=2", "model.n_layers=1", "profile=false"), rec, log=lines.append)
    assert any(line.startswith("  weights loaded in ") for line in lines) and rec["load_s"] >= 0


def test_wandb_run_gets_the_records_run_facts_and_notes(monkeypatch):
    """wandb's config holds device=auto / dtype=auto; the commit, GPU, DS4_* switches and the task's notes that
    metrics.json records go to the run too, so runs that differ only by them do not look alike."""
    import types
    from ds4 import tracking
    seen = {"config": {}, "summary": {}}

    class Config(dict):
        def update(self, d, allow_val_change=False):
            seen["config"].update(d)

    class Summary(dict):
        def update(self, d):
            seen["summary"].update(d)

        def __setitem__(self, k, v):
            seen["summary"][k] = v

    run = types.SimpleNamespace(config=Config(), summary=Summary(), log=lambda *_: None, finish=lambda **_: None)
    stub = types.SimpleNamespace(init=lambda **kw: run, Settings=lambda **kw: None, Table=lambda **kw: None)
    monkeypatch.setitem(sys.modules, "wandb", stub)
    t = tracking.Tracker({"name": "wandb"}, tracking.JobInfo(output_dir="."), {}, "bench")
    t.log({"status": "ok", "figures": {"tpot_ms": 1.0}, "resolved": {"moe": "dequant"}, "commit": "abc123",
           "torch": "2.13", "device": "cuda:0", "dtype": "bfloat16", "gpu": "NVIDIA H200", "tp": 1,
           "env": {"DS4_MMA": "0"}, "task_notes": ["fidelity off (task.fidelity=false)"]})
    assert seen["config"]["run"] == {"commit": "abc123", "torch": "2.13", "device": "cuda:0", "dtype": "bfloat16",
                                     "gpu": "NVIDIA H200", "tp": 1, "env": {"DS4_MMA": "0"}}
    assert seen["summary"]["notes"] == ["fidelity off (task.fidelity=false)"] and seen["summary"]["tpot_ms"] == 1.0


def test_cpu_run_checks_host_memory_before_loading(monkeypatch):
    """device=auto without CUDA puts the README's `model=v4_flash model.n_layers=4` (15 GiB of weights) on the CPU: it
    stops with one line before loading where the host lacks the room, not under the OOM killer with no message."""
    from ds4.tasks.common import reference_impls
    G = 2**30
    spec = _spec("model=v4_flash", "model.n_layers=4", "task=bench")
    monkeypatch.setattr(app, "host_available", lambda: 8 * G)
    with pytest.raises(app.UserError, match="of host memory .* but 8.0 GiB are available"):
        app.check_memory(spec, app.model_args(spec), reference_impls())
    monkeypatch.setattr(app, "host_available", lambda: 64 * G)
    app.check_memory(spec, app.model_args(spec), reference_impls())
    monkeypatch.setattr(app, "host_available", lambda: None)  # not Linux: no check
    app.check_memory(spec, app.model_args(spec), reference_impls())


def test_cpu_memory_check_counts_the_torch_moes_largest_gather():
    """On the CPU the check also counts the fp32 experts the torch MoE dequantises in its largest forward (a one-layer
    V4-Flash run's resident set rose 0.63 GiB in a 6-row decode step, session 68's experiments/s68/rss_gap.py): w1,
    w3 and w2 of the gathered (token, slot) rows, or of one expert where every forward loops. A short prompt's
    prefill gathers too (batch x length tokens; session 81's review: 64 rows for tiny's 16-token prompt), so at
    batch 1 that is 10 tokens x 6 = 60 rows; not on a GPU, which counts weights and state only."""
    import dataclasses
    from ds4.ops.moe_torch import GATHER_MAX_ROWS
    from ds4.tasks.common import reference_impls
    G = 2**30

    def transient(*overrides, device="cpu"):
        spec = dataclasses.replace(_spec("model=v4_flash", "model.n_layers=1", *overrides), device=torch.device(device))
        return [b for what, b in app.memory_need(spec, app.model_args(spec), reference_impls()) if "fp32" in what]

    assert GATHER_MAX_ROWS == 64  # the figures below
    assert transient() == [3 * 60 * 2048 * 4096 * 4] and 5.6 * G < transient()[0] < 5.7 * G
    assert transient("max_batch=8") == [3 * 60 * 2048 * 4096 * 4]  # batch 1's 10-token prompt
    assert transient("batch=8") == [3 * 48 * 2048 * 4096 * 4]  # 8 rows of one token, decode and prefill alike
    assert transient("batch=11") == [3 * 2048 * 4096 * 4]  # 66 rows: every forward loops over the experts
    assert transient(device="cuda") == []


def test_host_available_counts_a_containers_memory_limit(tmp_path):
    """A container's cgroup limit (v2 or v1, on the cgroup or a parent) caps what the host-memory check counts: a
    24 GiB limit on a 500 GiB host is 24 GiB less what the cgroup uses (its inactive file cache not counted)."""
    G = 2**30
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {512 * G // 1024} kB\nMemAvailable: {500 * G // 1024} kB\n")

    def tree(version, limit, usage, inactive, at):
        tag = f"{version}_{at.replace('/', '_')}_{limit}"
        root = tmp_path / f"cg{tag}"
        base = root if version == 2 else root / "memory"
        leaf = base / "job" / "step"
        leaf.mkdir(parents=True)
        lim_f, use_f, key = (("memory.max", "memory.current", "inactive_file") if version == 2 else
                             ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
        for d in (base, base / "job", leaf):  # no limit anywhere but `at`
            (d / lim_f).write_text("max\n" if version == 2 else "9223372036854771712\n")
            (d / use_f).write_text(f"{usage}\n")
            (d / "memory.stat").write_text(f"anon 1\n{key} {inactive}\n")
        (base / at / lim_f if at else base / lim_f).write_text(f"{limit}\n")
        proc = tmp_path / f"self_cgroup{tag}"
        proc.write_text("0::/job/step\n" if version == 2 else "5:cpu:/\n4:memory:/job/step\n")
        return str(root), str(proc)

    for version in (2, 1):
        for at in ("job/step", "job", ""):
            root, proc = tree(version, 24 * G, 6 * G, 2 * G, at)
            assert app.host_available(str(meminfo), root, str(proc)) == 20 * G, (version, at)
    # no limit set: the host's MemAvailable; a limit above it: MemAvailable still
    root, proc = tree(2, 2**63, 6 * G, 0, "job")
    assert app.host_available(str(meminfo), root, str(proc)) == 500 * G
    root, proc = tree(1, 600 * G, 1 * G, 0, "")
    assert app.host_available(str(meminfo), root, str(proc)) == 500 * G
    # nothing readable: None (no check); only the cgroup readable: its room
    missing = str(tmp_path / "none")
    assert app.host_available(missing, missing, missing) is None
    root, proc = tree(2, 10 * G, 4 * G, 0, "job/step")
    assert app.host_available(missing, root, proc) == 6 * G
