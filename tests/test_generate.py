"""Generation loop and sampling: batching of different lengths, seeds, top-k/top-p, EOS, limits."""
from __future__ import annotations

import pytest
import torch

from ds4.model.args import tiny
from ds4.model.transformer import Transformer
from ds4.registry import torch_reference_ops
from ds4.runtime.generate import Generator
from ds4.runtime.sampling import Sampling, argmax, sample
from ds4.weights.synthetic import random_weights


@pytest.fixture(scope="module")
def weights():
    return random_weights(tiny(), seed=0, include_mtp=False)


def model(weights, **over):
    a = tiny().replace(**over)
    m = Transformer(a, torch_reference_ops(), "plain", torch.float32)
    m.load_weights(weights)
    return m


def test_batch_equals_single_rows(weights):
    m = model(weights)
    p1, p2 = [5, 6, 7, 8, 9, 10, 11], [100, 3]
    both = Generator(m, 2, 96).generate([p1, p2], 30, stop_at_eos=False).tokens
    assert both[0] == Generator(m, 1, 96).generate([p1], 30, stop_at_eos=False).tokens[0]
    assert both[1] == Generator(m, 1, 96).generate([p2], 30, stop_at_eos=False).tokens[0]


def test_sampling_seeded_and_filters():
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    s = Sampling(temperature=0.8, top_k=5, top_p=0.9, seed=1)
    a = sample(logits, s, torch.Generator().manual_seed(1))
    b = sample(logits, s, torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    top5 = logits.topk(5, -1).indices
    draws = torch.stack([sample(logits, Sampling(1.0, top_k=5), torch.Generator().manual_seed(i)) for i in range(200)])
    assert all(int(d) in top5[r].tolist() for r in range(3) for d in draws[:, r])
    assert len(set(draws[:, 0].tolist())) > 1   # really samples
    greedy = logits.argmax(-1)
    assert torch.equal(sample(logits, Sampling(1.0, top_p=1e-6), torch.Generator().manual_seed(3)), greedy)
    assert torch.equal(sample(logits, Sampling(1.0, top_k=1), torch.Generator().manual_seed(3)), greedy)
    # distribution: a two-token logit gap of log(3) gives ~3:1 frequencies
    two = torch.tensor([[0.0, float(torch.log(torch.tensor(3.0)))]])
    n1 = sum(int(sample(two, Sampling(1.0), torch.Generator().manual_seed(i))) for i in range(2000))
    assert 1350 < n1 < 1650


def test_sampling_edges():
    # top-p keeps the smallest prefix whose mass reaches top_p: [.5, .25, .25] at 0.5 is token 0 alone
    half = torch.tensor([[0.5, 0.25, 0.25]]).log()
    draws = [int(sample(half, Sampling(1.0, top_p=0.5), torch.Generator().manual_seed(i))) for i in range(200)]
    assert set(draws) == {0}
    # a tiny temperature is greedy, not NaN
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert int(sample(logits, Sampling(1e-45), torch.Generator().manual_seed(0))) == 1
    with pytest.raises(ValueError, match="top_k -1"):
        Sampling(top_k=-1)
    with pytest.raises(ValueError, match=r"top_p 0.0 \(in \(0, 1\]"):
        Sampling(1.0, top_p=0.0)


def test_two_stage_argmax_is_torch_argmax():
    """The chunked argmax returns the first maximal index, like torch.argmax: random rows, rows whose
    maximum repeats across and inside chunks, bf16 ties, shapes not divisible by the chunk."""
    g = torch.Generator().manual_seed(0)
    for shape in [(1, 129280), (3, 64640), (2, 1024), (1, 1000), (5, 100)]:
        x = torch.randn(*shape, generator=g)
        assert torch.equal(argmax(x), x.argmax(-1)), shape
        t = x.clone()
        t[:, -3] = t[:, 5] = t[:, 7] = t.max() + 1  # the maximum three times, first at 5
        assert torch.equal(argmax(t), torch.full((shape[0],), 5)), shape
        q = torch.round(x * 2).to(torch.bfloat16)  # many ties
        assert torch.equal(argmax(q), q.argmax(-1)), shape


def test_generate_with_seed_is_reproducible(weights):
    m = model(weights)
    s = Sampling(temperature=1.0, top_p=0.95, seed=7)
    a = Generator(m, 1, 96).generate([[1, 2, 3]], 20, s).tokens
    b = Generator(m, 1, 96).generate([[1, 2, 3]], 20, s).tokens
    c = Generator(m, 1, 96).generate([[1, 2, 3]], 20, Sampling(temperature=1.0, top_p=0.95, seed=8)).tokens
    assert a == b and a != c


def test_stops_at_eos(weights):
    base = Generator(model(weights), 1, 96).generate([[9, 9, 9]], 30, stop_at_eos=False).tokens[0]
    eos = base[5]
    first = base.index(eos)
    out = Generator(model(weights, eos_token_id=eos), 1, 96).generate([[9, 9, 9]], 30, eos_check_every=1)
    assert out.tokens[0] == base[: first + 1]
    assert len(out.step_s) <= first + 1


def test_limits(weights):
    m = model(weights)
    g = Generator(m, 1, 16)
    with pytest.raises(ValueError, match="max_batch"):
        g.generate([[1], [2]], 4)
    with pytest.raises(ValueError, match="max_seq_len"):
        g.generate([list(range(2, 20))], 4)
    out = g.generate([list(range(2, 12))], 50, stop_at_eos=False)
    assert out.truncated and len(out.tokens[0]) == 16 - 10


def test_captured_step_refuses_another_batch():
    """A step captured at batch 2 fed one token would broadcast it over both rows (copy_), and the host's count of
    positions would leave the device's; it is refused before any replay."""
    from ds4.runtime.cuda_graph import CudaGraphStep
    step = object.__new__(CudaGraphStep)  # (capturing needs a GPU; the check comes before anything captured)
    step.batch = 2
    with pytest.raises(ValueError, match=r"\(1,\) tokens for a step captured at batch 2"):
        step(torch.tensor([9]))



def test_greedy_argmax_kernel_is_the_runs_choice(weights, monkeypatch):
    """The decode loop asks for the extension's argmax kernel exactly when the model's implementations use the
    extension (Ops.ds4_ext), eager and under tensor parallelism's distributed argmax alike."""
    import dataclasses

    import ds4.runtime.generate as gen_mod
    m = model(weights)
    asked = []

    def spy(logits, s, gen=None, kernel=False):
        asked.append(kernel)
        return sample(logits, s, gen)
    monkeypatch.setattr(gen_mod, "sample", spy)
    Generator(m, 1, 96).generate([[1, 2, 3]], 3, stop_at_eos=False)
    assert asked and not any(asked)
    m.ops = dataclasses.replace(m.ops, ds4_ext=True)
    asked.clear()
    Generator(m, 1, 96).generate([[1, 2, 3]], 3, stop_at_eos=False)
    assert asked and all(asked)
    seen = []
    m.comm = type("TwoRanks", (), {"world": 2, "argmax": lambda self, x, kernel=False: seen.append(kernel) or argmax(x)})()
    Generator(m, 1, 96).next_token(torch.randn(1, 50), Sampling(), None)
    assert seen == [True]


def test_prefill_out_of_memory_names_the_prompt(weights, monkeypatch):
    """The memory check before loading counts weights and decode state only: a prompt's prefill that runs out of
    memory says so, with the prompt's length, as one clean error (torch.OutOfMemoryError is one of app's)."""
    m = model(weights)

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore lines")
    monkeypatch.setattr(m, "prefill", oom)
    with pytest.raises(torch.OutOfMemoryError, match=r"prefill of a 5-token prompt .*Tried to allocate 2.00 GiB\)$"):
        Generator(m, 1, 64).prefill([[1, 2, 3, 4, 5]])
