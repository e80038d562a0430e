"""The stage profiler's table (ds4.profile) on the CPU: the prefill's rows apart, and no region inside another."""
from __future__ import annotations

import contextlib

import torch

from ds4.model.args import preset
from ds4.model.transformer import Transformer
from ds4.profile import Profiler
from ds4.registry import Impls, build_ops
from ds4.runtime.generate import Generator
from ds4.weights.synthetic import random_weights


def test_phase_rows_come_after_the_plain_ones():
    p = Profiler(True, "cpu")
    with p.phase("prefill"):
        with p("moe.routed"):
            pass
    for name in ("zzz", "moe.routed", "embed"):
        with p(name):
            pass
    assert [r["stage"] for r in p.summary()] == ["embed", "moe.routed", "zzz", "prefill:moe.routed"]
    assert Profiler(False).summary() == []


class _Nesting(Profiler):
    def __init__(self):
        super().__init__(True, "cpu")
        self.stack, self.nested = [], []

    @contextlib.contextmanager
    def _host_region(self, name):
        if self.stack:
            self.nested.append((self.stack[-1], name))
        self.stack.append(name)
        try:
            with super()._host_region(name):
                yield
        finally:
            self.stack.pop()


def test_generate_table_splits_prefill_and_nests_nothing():
    args, prof = preset("tiny"), _Nesting()
    m = Transformer(args, build_ops(Impls(), "cpu"), "plain", torch.float32, profiler=prof)
    m.load_weights(random_weights(args, seed=0, include_mtp=False))
    Generator(m, 1, 64).generate([[5, 6, 7, 8]], 4, stop_at_eos=False)  # one prefill, 3 decode steps
    rows = {r["stage"]: r["calls"] for r in prof.summary()}
    assert prof.nested == []  # a region's time is in one row only (comm.attn was inside attn.out)
    assert rows["attn.out"] == 3 * args.n_layers and rows["prefill:attn.out"] == args.n_layers
    assert not [s for s in rows if "comm." in s]  # one rank communicates nothing: no comm.* rows timing an identity
    assert rows["embed"] == 3 and rows["prefill:embed"] == 1


def test_comm_rows_only_where_ranks_communicate():
    from ds4.dist import SingleProcess, TensorParallel
    p = Profiler(True, "cpu")
    with p(SingleProcess().stage("attn")):
        pass
    assert p.summary() == []
    assert TensorParallel.stage("moe") == "comm.moe"


def test_every_region_the_model_opens_has_its_place_in_the_table():
    """STAGES orders the table: a region missing from it sorts after the listed ones, alphabetically (session 60:
    moe.shared_up and moe.ffn printed after head). Every literal region name in ds4/, and every comm site, is listed."""
    import re
    from pathlib import Path

    import ds4
    from ds4.dist import TensorParallel
    from ds4.profile import STAGES
    src = "".join(p.read_text() for p in Path(ds4.__file__).parent.rglob("*.py"))
    names = set(re.findall(r'\bprof\("([a-z_.]+)"\)', src))
    sites = set(re.findall(r'comm\.stage\("([a-z]+)"\)', src))
    assert {"attn.q", "moe.shared_up"} <= names and sites == {"attn", "moe", "head"}
    assert names | {TensorParallel.stage(s) for s in sites} == set(STAGES)
