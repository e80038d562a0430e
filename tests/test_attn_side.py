"""scripts/attn_side.py: issue #5's split of a decode step's critical path into attention and FFN sides (no GPU)."""
from __future__ import annotations

import json
from pathlib import Path

from script_loader import load_script


def _timeline(layers):
    """A path of (kernel, end_us) entries: per layer the attention site's hc finish, its kernels, wo_b, then the FFN
    site's hc finish and the FFN kernels; the first entry is the step's input kernel."""
    path, t = [{"kernel": "native", "end_us": 3.0}], 3.0
    for attn, ffn in layers:
        for name, dt in [("hc_finish_norm_kernel", 2.0), ("gemv_mma_kernel", attn - 2.0 - 5.0), ("gemv_mma_kernel", 5.0),
                         ("hc_finish_norm_kernel", 1.0), ("moe_down_mma_kernel", ffn - 1.0)]:
            t += dt
            path.append({"kernel": name, "end_us": t})
    return {"path": path, "span_us": t + 7.0}  # the head after the last layer


def test_sides_split_at_the_hc_sites():
    m = load_script("attn_side")
    got = m.sides(_timeline([(50.0, 40.0), (60.0, 45.0)]))
    # layer 0's attention side starts at the input kernel's end; the last FFN side runs to the span's end (the head)
    assert [(round(a, 6), round(f, 6)) for a, f in got] == [(50.0, 40.0), (60.0, 52.0)]


def test_sides_of_session_45s_profile():
    """The figures issue #5's notes quote from session 45's profile: 55.6 us (HCA layer 3), 62.4 us (CSA layer 4)."""
    m = load_script("attn_side")
    prof = Path(__file__).resolve().parents[1] / "experiments" / "s45" / "profile_step_8l_pdl_run3.json"
    got = m.sides(json.loads(prof.read_text())["timeline"])
    assert len(got) == 8
    assert round(got[3][0], 1) == 55.6 and round(got[4][0], 1) == 62.4


def _step(t0, layers):
    """One replay's kernels as one chain (ds4.timeline.Kernel): the input kernel, then per layer the attention site's
    hc finish, a GEMV, wo_b, the FFN site's hc finish and the MoE down, with the given side lengths."""
    from ds4.timeline import Kernel
    ks, t = [Kernel("native", 1, t0, t0 + 3.0)], t0 + 3.0
    for attn, ffn in layers:
        for name, dt in [("hc_finish_norm_kernel", 2.0), ("gemv_mma_kernel", attn - 7.0), ("gemv_mma_kernel", 5.0),
                         ("hc_finish_norm_kernel", 1.0), ("moe_down_mma_kernel", ffn - 1.0)]:
            ks.append(Kernel(name, 1, t, t + dt))
            t += dt
    return ks


def test_profile_step_means_sides_and_charges_over_replays(monkeypatch, capsys):
    """scripts/profile_step.py --timeline-replays: each replay's path split into sides, then mean and sd per layer;
    per kernel the charge's mean and sd."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))  # its sibling imports
    m = load_script("profile_step")
    steps = [_step(0.0, [(50.0, 40.0), (60.0, 45.0)]), _step(1000.0, [(52.0, 40.0), (60.0, 47.0)]),
             _step(2000.0, [(54.0, 40.0), (60.0, 49.0)])]
    got = m.over_replays(steps, layers=2, pdl=True)
    assert got["replays"] == 3
    lay = got["layers"]
    assert [round(r["attention_us"], 6) for r in lay] == [52.0, 60.0]
    assert [round(r["attention_sd"], 6) for r in lay] == [2.0, 0.0]
    assert [round(r["ffn_us"], 6) for r in lay] == [40.0, 47.0]  # (the last layer's side runs to the span's end)
    assert round(lay[1]["ffn_sd"], 6) == 2.0
    assert round(got["span_us"], 6) == 3.0 + 52.0 + 40.0 + 60.0 + 47.0
    assert round(got["parts"]["moe_down_mma_kernel"]["us"], 6) == 39.0 + 46.0
    assert "over 3 replays" in capsys.readouterr().out


def test_attn_side_prints_the_means_of_session_65s_profile(monkeypatch, capsys):
    """attn_side.py on a --timeline-replays profile (session 65, run 5, 12 layers on an H200) prints the one replay's
    sides and then the means over the 12 replays, as the record quotes them (layer 0's FFN side 51.0 +- 2.8 us)."""
    m = load_script("attn_side")
    prof = Path(__file__).resolve().parents[1] / "experiments" / "s65" / "run5" / "prof12_1_base.json"
    monkeypatch.setattr("sys.argv", ["attn_side.py", str(prof)])
    m.main()
    out = capsys.readouterr().out
    assert "mean +- sd over 12 replays" in out
    assert "layer 0: attention side 54.9 +- 1.3 us, FFN side 51.0 +- 2.8 us" in out
    assert out.count("layer 11:") == 2
