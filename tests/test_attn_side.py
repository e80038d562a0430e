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
