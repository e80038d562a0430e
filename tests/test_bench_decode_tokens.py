"""scripts/bench_decode.py's variant tokens that are plain functions (no GPU needed)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch


def _bench_decode():
    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_decode.py"
    spec = importlib.util.spec_from_file_location("bench_decode_for_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("tokens,expected", [
    ({"kernels", "graph"}, "0"), ({"kernels", "pf"}, "1"), ({"pfqd"}, "d,q"), ({"pfo", "pfb"}, "b,o"),
    ({"pfx"}, "0"),  # not a site: not a prefetch token
])
def test_bench_tokens_choose_the_sites(tokens, expected):
    assert _bench_decode()._prefetch_sites(tokens) == expected


def test_xshared_diagnostic_launches_no_shared_expert():
    """bench_decode's xshared (timing only): the MoE implementation's shared_up returns zeros in line."""
    from ds4.ops.moe_cuda import Fp4TopkMoE
    moe = Fp4TopkMoE()
    _bench_decode().skip_shared_expert(moe)
    x = torch.randn(1, 8)
    up = moe.shared_up(x, None)
    assert up.branch.side is None and torch.equal(up.out, torch.zeros_like(x))
    assert moe.shared_up(torch.randn(32, 8), None) is None  # a prompt: the shared expert runs as usual
    # (session 13's run 4 returned zeros for the prompt too, and routed() rejected them)
    assert Fp4TopkMoE().shared_up(x, None) is None  # the untouched implementation: a CPU input stays in line
