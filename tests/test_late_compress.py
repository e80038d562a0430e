"""Compressor branches joined after the attention at steps where no row's window ends (Attention.decode's
late_compress, Transformer.decode's window_ends, a captured graph per phase in ds4.runtime.cuda_graph), and the
host's count of positions the Generator keeps for it. CPU: branches in line, recorded."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ds4.model.args import tiny
from ds4.model.attention import Attention
from ds4.model.transformer import Transformer
from ds4.ops.attn_torch import TorchAttention
from ds4.registry import torch_reference_ops
from ds4.runtime.cuda_graph import late_compress_enabled, step_phases
from ds4.runtime.generate import Generator
from ds4.weights.synthetic import random_weights
from test_side_stream import _RecordingBranch

F = frozenset


def test_step_phases_are_the_window_ends_any_batch_can_meet():
    assert step_phases([4, 128]) == [F(), F({4}), F({4, 128})]
    assert step_phases([128, 4, 4]) == [F(), F({4}), F({4, 128})]
    assert step_phases([4, 16]) == [F(), F({4}), F({4, 16})]
    # co-prime ratios: a row can meet either alone, two rows both (and one row both at 11 mod 12)
    assert step_phases([3, 4]) == [F(), F({3}), F({4}), F({3, 4})]
    assert step_phases([]) == [F()]


def test_window_ends_of_a_step():
    m = Transformer(tiny(), torch_reference_ops(), "plain", torch.float32)  # ratios 4 (CSA) and 16 (HCA)
    assert m.window_ends([0]) == F()
    assert m.window_ends([3]) == F({4})
    assert m.window_ends([15]) == F({4, 16})
    assert m.window_ends([4, 5]) == F()
    assert m.window_ends([2, 31]) == F({4, 16})
    assert m.window_ends([7, 8]) == F({4})


def test_late_compress_is_opt_in(monkeypatch):
    monkeypatch.delenv("DS4_LATE_COMPRESS", raising=False)
    assert not late_compress_enabled()
    monkeypatch.setenv("DS4_LATE_COMPRESS", "1")
    assert late_compress_enabled()


@pytest.mark.parametrize("hw_branch", [True, False])
def test_late_branches_join_after_the_output_projection(hw_branch):
    """At a step where a layer's window does not end, its compressor branches (and the indexer compressor's, unless
    it also forms the head weights the scores read) are still open when the attention core and the indexer scores
    run, and joined before the layer's attention returns; where it ends, every branch joins before the core. The
    logits are the in-line ones either way."""
    a = tiny().replace(index_topk=16)  # a 256-token state holds 64 entries > 16: the indexer selects
    w = random_weights(a, seed=4, include_mtp=False)
    log, made = [], []

    class RecordingAttention(TorchAttention):
        def branch(self, x, name):
            super().branch(x, name)
            b = _RecordingBranch(name, log)
            made.append(b)
            return b

        def decode(self, *args, **kw):
            log.append(("core", tuple(b.name for b in made if not b.joined)))
            return super().decode(*args, **kw)

        def out_proj(self, *args, **kw):
            out = super().out_proj(*args, **kw)
            log.append(("out", None))
            return out

    ref_ops = torch_reference_ops()
    rec_ops = dataclasses.replace(ref_ops, attn=RecordingAttention())
    prompt = [(7 * i + 3) % a.vocab_size for i in range(21)]  # decode positions 21 ... 27: ends of 4 at 23 and 27
    logits = {}
    for name, ops, ends in (("ref", ref_ops, None), ("late", rec_ops, True)):
        m = Transformer(a, ops, "plain", torch.float32)
        m.load_weights(w)
        for mod in m.modules():
            if isinstance(mod, Attention):
                mod.head_weights_branch = hw_branch
        g = Generator(m, 1, 256)
        g.prefill([prompt])
        out = []
        for t in (5, 9, 11, 2, 8, 4, 6):
            pos = g.host_pos[0]
            log.clear()
            made.clear()
            out.append(m.decode(torch.tensor([t]), g.state, window_ends=m.window_ends([pos]) if ends else None)[0])
            g.host_pos[0] += 1
            if ends:
                assert all(b.joined for b in made)  # nothing left open at the step's end
                cores = [names for e, names in log if e == "core"]
                assert len(cores) == len(m.layers)
                for open_, mod in zip(cores, [blk.attn for blk in m.layers]):
                    late = mod.compressor is not None and (pos + 1) % mod.m != 0
                    expect = set()
                    if late:
                        expect.add("compress")
                        if mod.indexer is not None and hw_branch:
                            expect.add("icompress")
                    assert set(open_) == expect, (pos, mod.m, open_)
        logits[name] = torch.stack(out)
        g.check_positions()
    assert torch.equal(logits["ref"], logits["late"])


def test_generator_counts_positions_and_check_catches_a_changed_state():
    a = tiny()
    m = Transformer(a, torch_reference_ops(), "plain", torch.float32)
    m.load_weights(random_weights(a, seed=1, include_mtp=False))
    g = Generator(m, 2, 64)
    out = g.generate([[1, 2, 3], [4, 5, 6, 7, 8]], 6, stop_at_eos=False)
    assert len(out.tokens[0]) == 6
    assert g.host_pos[:2] == [3 + 5, 5 + 5] == g.state.pos[:2].tolist()  # the first token comes from prefill
    g.check_positions()
    g.state.pos[1] += 1
    with pytest.raises(RuntimeError, match="decode positions"):
        g.check_positions()
