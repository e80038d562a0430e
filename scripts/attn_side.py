#!/usr/bin/env python
"""Per-layer attention and FFN sides of a decode step's critical path, from scripts/profile_step.py --timeline JSON.

    python scripts/attn_side.py experiments/s51/profile_step_8l_run7.json

Issue #5's attention side: from the end of the previous layer's FFN (the kernel before the layer's first
hc_finish_norm, the attention site's) to the end of wo_b (the kernel before the second, the FFN site's). The FFN side
runs from there to the next layer's start; the last layer's includes the head and sampling. Session 45's profile
(experiments/s45/profile_step_8l_pdl_run3.json) gives 55.6 us (HCA, layer 3) and 62.4 us (CSA, layer 4) this way.
A profile taken with --timeline-replays N also prints each layer's sides as mean +- sd over those N replays.
"""
from __future__ import annotations

import json
import sys


def sides(timeline: dict, layers: int | None = None) -> list[tuple[float, float]]:
    """(attention side, FFN side) in us per layer of one replay's critical path (ds4.timeline's "path"). The path must
    hold two hc_finish_norm sites per layer (`layers` of them where given): where one fell off the path (a side kernel
    spanning it is taken as the next kernel's predecessor), every later site would pair with the wrong one, so that
    raises ValueError instead."""
    path = timeline["path"]
    sites = [i for i, r in enumerate(path) if r["kernel"] == "hc_finish_norm_kernel"]  # attention, FFN, attention, ...
    if len(sites) % 2 or (layers is not None and len(sites) != 2 * layers):
        raise ValueError(f"{len(sites)} hc_finish_norm sites on the critical path, not two per layer"
                         + (f" ({layers} layers)" if layers is not None else ""))
    out = []
    for a, f in zip(sites[0::2], sites[1::2]):
        start = path[a - 1]["end_us"] if a > 0 else 0.0
        wo_b_end = path[f - 1]["end_us"]
        later = [i for i in sites if i > f]
        ffn_end = path[later[0] - 1]["end_us"] if later else timeline["span_us"]
        out.append((wo_b_end - start, ffn_end - wo_b_end))
    return out


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        raise SystemExit(f"usage: python scripts/attn_side.py PROFILE.json (scripts/profile_step.py --timeline --out)\n"
                         f"{__doc__ or ''}".rstrip())
    profile = json.load(open(sys.argv[1]))
    for name in ("timeline", "timeline_long_context"):
        if profile.get(name):
            print(f"{name} (span {profile[name]['span_us']:.1f} us):")
            try:
                split = sides(profile[name], profile.get("layers"))
            except ValueError as e:
                print(f"  sides skipped: {e}")
                split = []
            for layer, (attn, ffn) in enumerate(split):
                print(f"  layer {layer}: attention side {attn:.1f} us, FFN side {ffn:.1f} us")
            over = profile[name].get("over_replays")  # profile_step.py --timeline-replays N
            if over and over.get("layers"):
                print(f"{name}, mean +- sd over {over['replays']} replays (span {over['span_us']:.1f} +- "
                      f"{over['span_sd']:.1f} us):")
                for layer, r in enumerate(over["layers"]):
                    print(f"  layer {layer}: attention side {r['attention_us']:.1f} +- {r['attention_sd']:.1f} us, "
                          f"FFN side {r['ffn_us']:.1f} +- {r['ffn_sd']:.1f} us")


if __name__ == "__main__":
    main()
