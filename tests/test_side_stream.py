"""ds4.ops.side_stream outside a CUDA-graph capture (every branch stays in line), and the decode step's branch
discipline (each branch joined before its output is read) with recording branches."""
from __future__ import annotations

import pytest
import torch

from ds4.ops import side_stream
from ds4.ops.attn_torch import BRANCHES, TorchAttention


def test_cpu_device_never_forks():
    assert side_stream.fork(torch.device("cpu"), "DS4_COMPRESS_OVERLAP") is None


@pytest.mark.parametrize("value,expected", [(None, {"shared"}), ("", set()), ("none", set()),
                                                  ("shared", {"shared"})])
def test_programmatic_fork_sites_follow_the_environment(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("DS4_PFORK", raising=False)
    else:
        monkeypatch.setenv("DS4_PFORK", value)
    assert side_stream.programmatic_fork_sites() == expected


def test_programmatic_fork_sites_reject_unknown_names(monkeypatch):
    monkeypatch.setenv("DS4_PFORK", "shared,compress")  # (session 74's compressor fork is not in the tree)
    with pytest.raises(ValueError, match="DS4_PFORK.*compress"):
        side_stream.programmatic_fork_sites()


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


def test_programmatic_join_sites_are_opt_in(monkeypatch):
    """DS4_PJOIN names the sites whose captured branches join by programmatic edges ("all": every one); an unknown
    name is refused (session 66's review: a misspelt site timed the event joins under the option's name); an in-line
    branch's join is a no-op whatever the site."""
    monkeypatch.delenv("DS4_PJOIN", raising=False)
    assert side_stream.programmatic_sites() == set()
    monkeypatch.setenv("DS4_PJOIN", "moe")
    assert side_stream.programmatic_sites() == {"moe"}
    monkeypatch.setenv("DS4_PJOIN", "all")
    assert side_stream.programmatic_sites() == set(side_stream.PJOIN_SITES)
    monkeypatch.setenv("DS4_PJOIN", "nope,moe")
    with pytest.raises(ValueError, match="unknown join site"):
        side_stream.programmatic_sites()
    monkeypatch.setenv("DS4_PJOIN", "")
    assert side_stream.programmatic_sites() == set()
    monkeypatch.setenv("DS4_PJOIN", "attn,moe")
    assert side_stream.programmatic_sites() == {"moe", "attn"} == set(side_stream.PJOIN_SITES)
    side_stream.Branch(None, torch.device("cpu")).join("moe")


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


class _RecordingBranch(side_stream.Branch):
    """An in-line branch that records what ran inside it and whether it was joined."""

    def __init__(self, name, log):
        super().__init__(None, torch.device("cpu"))
        self.name, self.log, self.joined = name, log, False

    def __enter__(self):
        self.log.append(("enter", self.name))
        return super().__enter__()

    def __exit__(self, *exc):
        self.log.append(("exit", self.name))
        return super().__exit__(*exc)

    def join(self, site=None):
        self.joined = True
        self.log.append(("join", self.name))


@pytest.mark.parametrize("merged,hw_branch", [(True, True), (True, False), (False, True)])
def test_decode_joins_every_branch_before_its_output_is_read(merged, hw_branch):
    """The decode step's branch discipline (what makes the side streams of a captured graph safe):
    the indexer scores run only after the indexer-compressor branch (the cache entry of this step) and
    the head weights' branch are joined, and the attention kernel only after every branch is; same
    logits as plain in-line ops. merged: the indexer's query from the merged wq_bi GEMV in line (the
    default), else its own branch; hw_branch: with the merged query, the head weights in the free
    "indexer" branch (the default), else after the indexer compressor in its branch."""
    import dataclasses

    from ds4.model.args import tiny
    from ds4.model.attention import Attention
    from ds4.model.transformer import Transformer
    from ds4.registry import torch_reference_ops
    from ds4.runtime.generate import Generator
    from ds4.weights.synthetic import random_weights

    log, made = [], []

    class RecordingAttention(TorchAttention):
        def branch(self, x, name):
            super().branch(x, name)  # the name check
            b = _RecordingBranch(name, log)
            made.append(b)
            return b

        def decode(self, *args, **kw):
            assert made and all(b.joined for b in made), [(b.name, b.joined) for b in made]
            log.append(("decode", None))
            made.clear()
            return super().decode(*args, **kw)

    ref_ops = torch_reference_ops()

    class RecordingIndexer(type(ref_ops.indexer)):
        def scores(self, *args, **kw):
            if kw.get("pos") is not None:  # decode (prefill has no branches)
                icomp = [b for b in made if b.name == "icompress"]
                assert icomp and icomp[-1].joined, "indexer scores before the indexer cache entry was joined"
                assert all(b.joined for b in made if b.name == "indexer" and merged), "scores before head weights"
                log.append(("scores", None))
            return super().scores(*args, **kw)

    a = tiny().replace(index_topk=16)           # a 256-token state holds 64 entries > 16: the indexer runs
    w = random_weights(a, seed=4, include_mtp=False)
    rec_ops = dataclasses.replace(ref_ops, attn=RecordingAttention(), indexer=RecordingIndexer())
    logits = []
    for ops in (ref_ops, rec_ops):
        m = Transformer(a, ops, "plain", torch.float32)
        m.load_weights(w)
        for mod in m.modules():
            if isinstance(mod, Attention):
                assert mod.indexer is None or mod.wq_bi is not None  # tiny's CSA layers merge the two wq_b
                mod.merged_indexer_q = merged
                mod.head_weights_branch = hw_branch
        g = Generator(m, 1, 256)
        g.prefill([[(7 * i + 3) % a.vocab_size for i in range(20)]])
        logits.append(torch.stack([g.decode(torch.tensor([t]))[0] for t in (5, 9, 11, 2, 8)]))
    assert torch.equal(logits[0], logits[1])
    names = {n for e, n in log if e == "enter"}
    # tiny has SWA, CSA and HCA layers: every branch is used ("indexer": the query's branch when it is not
    # merged, the head weights' when it is, unless they stay in the indexer compressor's branch)
    assert names == set(BRANCHES) - ({"indexer"} if merged and not hw_branch else set()), names
    assert ("scores", None) in log and log.count(("decode", None)) == 5 * a.n_layers


def test_merged_indexer_query_matches_its_own_gemv():
    """A CSA layer's indexer query from the merged wq_b + indexer wq_b GEMV (decode's default) gives the
    logits of its own GEMV in the indexer branch (the same rows of the same product), and the merged
    weight holds both as row views (no second copy)."""
    from ds4.model.args import tiny
    from ds4.model.attention import Attention
    from ds4.model.transformer import Transformer
    from ds4.registry import torch_reference_ops
    from ds4.runtime.generate import Generator
    from ds4.weights.synthetic import random_weights

    a = tiny().replace(index_topk=16)
    m = Transformer(a, torch_reference_ops(), "plain", torch.float32)
    m.load_weights(random_weights(a, seed=5, include_mtp=False))
    csa = [mod for mod in m.modules() if isinstance(mod, Attention) and mod.indexer is not None]
    assert csa
    for mod in csa:
        w = mod.wq_bi.weight
        assert mod.wq_b.weight.data_ptr() == w.data_ptr()
        assert mod.indexer.wq_b.weight.data_ptr() == w[mod.wq_b.out_features:].data_ptr()
    out = []
    for merged in (True, False):
        for mod in csa:
            mod.merged_indexer_q = merged
        g = Generator(m, 1, 256)
        g.prefill([[(5 * i + 1) % a.vocab_size for i in range(24)]])
        out.append(torch.stack([g.decode(torch.tensor([t]))[0] for t in (3, 8, 13, 21)]))
    torch.testing.assert_close(out[0], out[1], rtol=1e-4, atol=1e-4)


def test_side_priority_from_the_environment(monkeypatch):
    """DS4_SIDE_PRIORITY=high asks for side streams above the main stream's priority (0); else the default."""
    monkeypatch.delenv("DS4_SIDE_PRIORITY", raising=False)
    assert side_stream.side_priority() == 0
    monkeypatch.setenv("DS4_SIDE_PRIORITY", "high")
    assert side_stream.side_priority() == -1
