"""ds4.ops.side_stream outside a CUDA-graph capture: every branch stays in line (no stream switch)."""
from __future__ import annotations

import torch

from ds4.ops import side_stream
from ds4.ops.attn_torch import BRANCHES, TorchAttention


def test_cpu_device_never_forks():
    assert side_stream.fork(torch.device("cpu"), "DS4_COMPRESS_OVERLAP") is None


def test_inline_branch_runs_its_body_in_order_and_join_is_a_no_op():
    x = torch.zeros(3)
    branch = TorchAttention().branch(x, "compress")
    assert isinstance(branch, side_stream.Branch) and branch.side is None
    with branch:
        x.add_(1)
    branch.join()
    with branch:  # reusable
        x.mul_(3)
    assert torch.equal(x, torch.full((3,), 3.0))


def test_every_named_branch_is_in_line_on_cpu_and_unknown_names_fail():
    from ds4.ops.attn_cuda import FusedCudaAttention
    x = torch.zeros(1, 8)
    for impl in (TorchAttention(), FusedCudaAttention()):
        for name in BRANCHES:
            assert impl.branch(x, name).side is None
        try:
            impl.branch(x, "attn")
        except ValueError as e:
            assert "unknown decode branch" in str(e)
        else:
            raise AssertionError("an unknown branch name was accepted")


def test_live_branches_have_distinct_slots():
    slots = [slot for _, slot in BRANCHES.values()]
    assert len(set(slots)) == len(slots)


def test_branch_propagates_exceptions():
    branch = side_stream.Branch(None, torch.device("cpu"))
    try:
        with branch:
            raise ValueError("inside")
    except ValueError as e:
        assert str(e) == "inside"
    else:
        raise AssertionError("the exception was swallowed")
