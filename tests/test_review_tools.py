"""A review of the profiling tools (ds4.timeline, scripts/profile_step.py, scripts/attn_side.py) on hand-made traces:
kernel labels in anonymous namespaces, replays that are not alike, and a critical path that lost an hc site."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_loader import load_script

from ds4.timeline import Kernel, critical_path, one_step, replays

SCRIPTS = str(Path(__file__).resolve().parents[1] / "scripts")


def _profile_step(monkeypatch):
    monkeypatch.syspath_prepend(SCRIPTS)  # its sibling imports (attn_side, bench_decode)
    return load_script("profile_step")


def test_labels_skip_anonymous_namespaces(monkeypatch):
    """csrc/moe_dp4a.cu's kernel sits in ds4::(anonymous namespace): session 65's profiles labelled it "ds4" (and
    torch's at::native::(anonymous namespace):: kernels "native"), which would merge any two such kernels in a row."""
    label = _profile_step(monkeypatch).label
    assert label("ds4::(anonymous namespace)::moe_gate_up_dp4a_kernel(ds4::MoEArgs, int)") == "moe_gate_up_dp4a_kernel"
    assert label("void at::native::(anonymous namespace)::distribution_kernel<float, 4>(int)") == "distribution_kernel"
    assert label("void ds4::gemv_mma_kernel<4, 2>(ds4::Args)") == "gemv_mma_kernel"
    assert label("nvjet_sm90_tss_128x8_64x12_2x1_v_bz_TNT") == "nvjet_sm90_tss_128x8_64x12_2x1_v_bz_TNT"
    assert label("Memcpy DtoD (Device -> Device)") == "Memcpy"


def _chain(names, t0):
    ks, t = [], t0
    for n in names:
        ks.append(Kernel(n, 1, t, t + 1.0))
        t += 1.0
    return ks


def test_replays_that_are_not_alike_are_refused():
    """Three replays of 3, 5 and 4 kernels total 12 = 3 x 4: the split by count alone cut them at the wrong places."""
    ks = _chain(["a", "b", "c"], 0) + _chain(["a", "b", "c", "d", "e"], 100) + _chain(["a", "b", "c", "d"], 200)
    with pytest.raises(ValueError, match="not alike"):
        replays(ks, 4, alike=True)
    same = _chain(["a", "b"], 0) + _chain(["b", "a"], 100)  # the same kernels, started in another order: alike
    assert [[k.name for k in r] for r in replays(same, 2, alike=True)] == [["a", "b"], ["b", "a"]]


def test_replays_split_by_start_whatever_the_input_order():
    a = _chain(["A0", "A1"], 0) + _chain(["B0", "B1"], 100)
    shuffled = [a[2], a[0], a[3], a[1]]
    assert [[k.name for k in r] for r in replays(shuffled, 2)] == [["A0", "A1"], ["B0", "B1"]]
    assert [k.name for k in one_step(shuffled, 2, 0)] == ["A0", "A1"]


def _layers_with_a_lost_site(n, lose_in=0):
    """n layers of one chain (hc attention site, GEMV, wo_b, hc FFN site, MoE down: attention side 50, FFN side 40 us)
    after a 3-us input kernel; in layer lose_in a side kernel starts before the FFN site's hc finish and ends after it,
    so that the next kernel's predecessor is the side kernel and the hc site falls off the path."""
    ks, t = [Kernel("native", 1, 0.0, 3.0)], 3.0
    for i in range(n):
        ks += [Kernel("hc_finish_norm_kernel", 1, t, t + 2), Kernel("gemv_mma_kernel", 1, t + 2, t + 40),
               Kernel("gemv_mma_kernel", 1, t + 40, t + 50), Kernel("hc_finish_norm_kernel", 1, t + 50, t + 52),
               Kernel("moe_down_mma_kernel", 1, t + 52, t + 90)]
        if i == lose_in:
            ks.append(Kernel("compress_step_kernel", 2, t + 45, t + 53))
        t += 90
    return ks


def test_sides_refuse_a_path_that_lost_an_hc_site(monkeypatch, capsys):
    """Before: 3 layers of (50, 40) us came out as 2 layers, (90, 50) and (40, 50), without a word."""
    ps = _profile_step(monkeypatch)
    m = load_script("attn_side")
    ks = _layers_with_a_lost_site(3)
    cpath = critical_path(ks)
    assert sum(1 for k, _, _ in cpath if k.name == "hc_finish_norm_kernel") == 5  # one of six fell off
    timeline = {"path": ps.path_rows(cpath, 0.0), "span_us": 273.0}
    with pytest.raises(ValueError, match="not two per layer"):
        m.sides(timeline)
    whole = {"path": ps.path_rows(critical_path(_layers_with_a_lost_site(3, lose_in=-1)), 0.0), "span_us": 273.0}
    assert [(round(a, 6), round(f, 6)) for a, f in m.sides(whole, 3)] == [(50.0, 40.0)] * 3
    with pytest.raises(ValueError, match=r"6 hc_finish_norm sites .* \(4 layers\)"):
        m.sides(whole, 4)  # an even count that is not the profile's layers: refused too
    # every replay lost the same site: the counts agree, so only the check per path keeps the means from pairing
    # the wrong sites
    steps = [ks, [Kernel(k.name, k.stream, k.start + 1000, k.end + 1000) for k in ks]]
    got = ps.over_replays(steps, layers=3, pdl=True)
    assert got["layers"] == []
    assert "per-layer sides skipped" in capsys.readouterr().out


def test_attn_side_says_why_it_skips_a_profile(monkeypatch, capsys, tmp_path):
    ps = _profile_step(monkeypatch)
    m = load_script("attn_side")
    cpath = critical_path(_layers_with_a_lost_site(3))
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"layers": 3, "timeline": {"path": ps.path_rows(cpath, 0.0), "span_us": 273.0}}))
    monkeypatch.setattr("sys.argv", ["attn_side.py", str(prof)])
    m.main()
    out = capsys.readouterr().out
    assert "sides skipped: 5 hc_finish_norm sites" in out and "layer 0:" not in out
