"""Spec checks of the torch reference that need no transformers: sizes, decode/prefill
consistency in both numerics modes, no host synchronisation inside a decode step, MTP."""
from __future__ import annotations


from types import MappingProxyType

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ds4.model.args import tiny, v4_flash
from ds4.model.rope import inv_freq
from ds4.model.transformer import Transformer
from ds4.ops.hc_torch import sinkhorn
from ds4.registry import torch_reference_ops
from ds4.runtime.generate import Generator
from ds4.weights.schema import expected_tensors
from ds4.weights.synthetic import random_weights


def build(args, numerics="plain", seed=0, mtp=False):
    m = Transformer(args, torch_reference_ops(), numerics, torch.float32)
    m.load_weights(random_weights(args, seed=seed, include_mtp=mtp))
    return m


def test_v4_flash_sizes_on_meta():
    """Spec §13: 284,332,240,471 parameters; 11,217,580,396 weight bytes per decoded token."""
    a = v4_flash()
    m = Transformer(a, torch_reference_ops(), device="meta")
    m.load_weights({n: torch.empty(s.shape, dtype=s.dtype, device="meta")
                    for n, s in expected_tensors(a, include_mtp=False).items()})
    assert m.param_count() == 284_332_240_471
    # the reference holds tid2eid as int32: 3 rows of 6 x 4 bytes instead of 6 x 8
    assert m.weight_bytes_per_token() == 11_217_580_396 - 3 * 24
    # KV at 8K context adds ~29 MB (spec §9, BF16 caches)
    kv = m.kv_bytes_per_token(8192)
    assert 28e6 < kv < 30e6, kv
    # at the bench's default context (32 + 128 // 2 tokens) every CSA layer's top-k takes all of its 24 entries: a
    # step needs neither the indexer's query rows and head weights nor its key scan
    idx = 21 * (8192 * 1024 + 64 * 8 + 64 * 4096 * 2)
    window, selected = 43 * 128 * 512 * 2, 21 * 24 * 512 * 2
    assert m.bytes_per_token(96) == 11_217_580_396 - 3 * 24 - idx + window + selected
    assert m.bytes_per_token(8192) == m.weight_bytes_per_token() + kv  # 2048 entries > 512: the indexer scores


def test_yarn_ramp_matches_spec():
    """Spec §5.3: for base 160000 pairs 0..15 keep f_i, 25..31 use f_i/16, 16..24 interpolate."""
    a = v4_flash()
    f = inv_freq(a, 2)
    base = 1.0 / (160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    ratio = f / base
    assert torch.allclose(ratio[:16], torch.ones(16))
    assert torch.allclose(ratio[25:], torch.full((7,), 1 / 16))
    expect = [0.906, 0.8125, 0.719, 0.625, 0.531, 0.4375, 0.344, 0.25, 0.156]
    assert torch.allclose(ratio[16:25], torch.tensor(expect), atol=2e-3)
    swa = inv_freq(a, 0)  # theta 10000, no YaRN
    assert torch.allclose(swa, 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)))


def test_sinkhorn_doubly_stochastic():
    c = sinkhorn(torch.randn(5, 4, 4), 20, 1e-6)
    assert torch.allclose(c.sum(-2), torch.ones(5, 4), atol=1e-5)
    assert torch.allclose(c.sum(-1), torch.ones(5, 4), atol=2e-2)  # 20 iterations: approximate
    assert not torch.allclose(c, c.transpose(-1, -2))  # not symmetric


@pytest.mark.parametrize("numerics,gemm_act_quant,tol", [("plain", True, 1e-4), ("qat", False, 1e-4), ("qat", True, 0.25)])
def test_decode_matches_prefill(numerics, gemm_act_quant, tol, monkeypatch):
    """Logits at position L-1 from one prefill of L tokens equal those from a shorter prefill
    followed by token-by-token decode (window wraps, compressors emit, indexer selects).

    Under qat the FP8 activation quantisation before each GEMM turns last-ulp differences
    between the batched and the one-token paths into whole FP8 steps, so the tight check
    runs with that one simulation off (KV FP8, indexer Hadamard/FP4 and BF16 scores stay on)
    and the full qat mode gets a loose bound. How loose depends on the CPU's float kernels: 0.186 at split 1 on
    session 17's AMD EPYC host (below 0.1 on the machine where the bound was first set); the tight check above
    is the one that holds the paths to last-ulp agreement."""
    if not gemm_act_quant:
        import ds4.ops.linear_torch
        import ds4.ops.moe_torch
        for mod in (ds4.ops.linear_torch, ds4.ops.moe_torch):
            monkeypatch.setattr(mod, "act_quant_sim", lambda x, block=128: x)
    a = tiny()
    m = build(a, numerics, seed=3)
    seq = [(11 * i + 5) % a.vocab_size for i in range(90)]
    g = Generator(m, 2, 128)
    full = g.prefill([seq])[0]  # predicts the token after seq
    for split in (1, 5, 37):
        g.prefill([seq[:split]])
        for t in seq[split:]:
            step = g.decode(torch.tensor([t]))[0]
        err = (step - full).abs().max() / full.abs().max()
        assert err < tol, (numerics, split, float(err))
    if numerics == "qat" and gemm_act_quant:
        # The loose bound is set by the worst position: one FP8 step flip moves the logits after it (0.18 at one
        # position of 85 on a 2-core review host). It does not tell a decode that leaves out qat's activation
        # simulation altogether (0.18 at position 89 there; plain and qat differ by 0.15). Flips are rare, so the
        # typical position agrees closely: the median, over every 4th prefix, of teacher-forced decode against a
        # prefill of that prefix (0.009 there; 0.14 with the simulation dropped for one-row GEMMs).
        dec = g.teacher_forced_logits(seq[:5], seq[5:])  # row i predicts the token after seq[:5 + i]
        ns = list(range(5, 90, 4))
        ref = torch.stack([g.prefill([seq[:n]])[0] for n in ns])
        rel = (dec[[n - 5 for n in ns]] - ref).abs().amax(-1) / ref.abs().amax(-1)
        assert rel.median() < 0.05, [round(float(r), 4) for r in rel]


def test_deferred_compressor_projection_matches_per_token():
    """With Attention.defer_compress = 4, batch-1 decode projects the compressors' tokens four at a time (a ring of x
    in the state; the step that completes a group writes their slots): the same logits as the per-token projection
    (the default, 0), from prefills that leave the ring empty, partly filled, or nearly full, over steps that complete
    CSA (ratio 4) and HCA (ratio 16) windows. And the state really holds the rings only where deferral is on."""
    from ds4.model.attention import Attention
    a = tiny()
    m = build(a, seed=5)
    attns = [mod for mod in m.modules() if isinstance(mod, Attention)]
    seq = [(13 * i + 1) % a.vocab_size for i in range(70)]
    for split in (8, 21, 35):
        out = {}
        for defer in (4, 0):
            for at in attns:
                at.defer_compress = defer
            g = Generator(m, 1, 96)
            rings = [k for st in g.state.layers for k in st if k.endswith("_x")]
            # two CSA layers (comp, icomp) and two HCA layers (comp)
            assert bool(rings) == bool(defer) and (not defer or len(rings) == 4 + 2), rings
            g.prefill([seq[:split]])
            out[defer] = torch.stack([g.decode(torch.tensor([t]))[0] for t in seq[split:]])
        err = (out[4] - out[0]).abs().max() / out[0].abs().max()
        assert err <= 1e-5, (split, float(err))


def test_small_cache_attends_to_all_entries_like_topk():
    """A state whose compressed cache holds <= index_topk entries skips the indexer at decode (top-k
    would select every entry): same logits as a larger state where the indexer runs, up to summation order."""
    a = tiny().replace(index_topk=16)                      # ratio 4: a 64-token state holds 16 entries
    m = build(a, seed=4)
    seq = [(7 * i + 3) % a.vocab_size for i in range(60)]
    out = []
    for max_len in (64, 256):                              # 16 entries (skipped) vs 64 (> 16: indexer runs)
        g = Generator(m, 1, max_len)
        g.prefill([seq[:20]])
        out.append(torch.stack([g.decode(torch.tensor([t]))[0] for t in seq[20:]]))
    assert (out[0] - out[1]).abs().max() <= 1e-4 * out[1].abs().max()


def test_qat_differs_from_plain():
    a = tiny()
    seq = [[(5 * i + 1) % a.vocab_size for i in range(40)]]
    lp = Generator(build(a, "plain"), 1, 64).prefill(seq)
    lq = Generator(build(a, "qat"), 1, 64).prefill(seq)
    rel = (lp - lq).abs().max() / lp.abs().max()
    assert 1e-5 < rel < 0.2, float(rel)


class _SyncDetector(TorchDispatchMode):
    FORBIDDEN = {"_local_scalar_dense", "nonzero", "item", "is_nonzero", "equal", "unique", "masked_select"}

    def __init__(self):
        super().__init__()
        self.hits = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.FORBIDDEN:
            self.hits.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _decode_syncs(monkeypatch, batch: int, numerics: str = "plain") -> list[str]:
    """The host reads of 6 decode steps of tiny at `batch` rows: ops that sync (the dispatcher sees them) and the
    calls that do not reach the dispatcher: Tensor.tolist / numpy / cpu (device -> host copies on a GPU) and
    torch.cuda.synchronize."""
    a = tiny()
    g = Generator(build(a, numerics), batch, 96)
    g.prefill([[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]] * (batch // 2) + [[5, 4]] * (batch % 2))
    tok = torch.arange(batch) + 3
    reads = []
    with monkeypatch.context() as mp:
        for owner, name in ((torch.Tensor, "tolist"), (torch.Tensor, "numpy"), (torch.Tensor, "cpu"),
                            (torch.cuda, "synchronize")):
            real = getattr(owner, name)
            mp.setattr(owner, name, lambda *a, _n=name, _f=real, **k: reads.append(_n) or _f(*a, **k))
        with _SyncDetector() as d:
            for _ in range(6):  # crosses a CSA emission
                tok = g.decode(tok).argmax(-1)
    return d.hits + reads


def test_decode_step_has_no_host_sync(monkeypatch):
    assert _decode_syncs(monkeypatch, 2) == []
    assert _decode_syncs(monkeypatch, 1, "qat") == []  # one row (the CUDA hc fold's size) and qat's simulations
    # the torch reference's MoE past 64 (row, expert) pairs groups its experts by counts read on the host (said in
    # its note, refused by runtime=cuda_graph: tests/test_registry.py)
    assert _decode_syncs(monkeypatch, 16) == []
    assert "tolist" in _decode_syncs(monkeypatch, 17)


def test_sampler_has_no_host_sync():
    """runtime=cuda_graph captures the sampler with the step (ds4.runtime.cuda_graph's 'sample' mode)."""
    from ds4.runtime.sampling import Sampling, sample
    g = torch.Generator().manual_seed(0)
    with _SyncDetector() as d:
        for s in (Sampling(temperature=0.7, top_k=20, top_p=0.9), Sampling(temperature=1.2), Sampling()):
            sample(torch.randn(3, 1000), s, g)
    assert d.hits == []


def test_sync_detector_catches_item():
    with _SyncDetector() as d:
        torch.ones(2).sum().item()
    assert d.hits


def test_mtp_forward():
    a = tiny()
    m = build(a, mtp=True)
    assert m.has_mtp
    seq = torch.tensor([4, 8, 15, 16, 23, 42, 7, 9])
    g = Generator(m, 1, 32)
    g.state.reset_row(0)
    _, h = m.prefill(seq[:-1], g.state, 0, return_hidden=True)
    blk, seen = m.mtp[0], []
    real_forward = blk.forward
    blk.forward = lambda x, *rest, **kw: seen.append(x) or real_forward(x, *rest, **kw)
    out = m.mtp_logits(h, seq[1:])
    assert out.shape == (7, a.vocab_size) and torch.isfinite(out).all()
    # transformers has no MTP head to compare with, so the part that is MTP's own is written out here (spec §8): the
    # block's input is e_proj(enorm-RMSNorm(embed(t_{i+1}))) + h_proj(hnorm-RMSNorm(h_i)), e added to every stream.
    # (The block itself is a Block, held to transformers by test_hf_parity.) Without this check the test passed with
    # enorm and hnorm swapped in mtp_logits.
    def rms(v, w):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + a.norm_eps) * w
    e = torch.nn.functional.linear(rms(m.embed[seq[1:]].float(), blk.enorm), blk.e_proj.dequant(torch.float32))
    hh = torch.nn.functional.linear(rms(h.float(), blk.hnorm), blk.h_proj.dequant(torch.float32))
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], e.unsqueeze(1) + hh, rtol=1e-5, atol=1e-5)
    blk.forward = real_forward
    m.mtp[0].e_proj_weight.zero_()  # the MTP weights are really used
    assert not torch.allclose(out, m.mtp_logits(h, seq[1:]))


def test_qat_simulates_activations_only_before_quantised_weights(monkeypatch):
    """Spec §2: under qat an FP8 / FP4 GEMM sees FP8-simulated activations, a BF16 weight the plain product: a
    dense checkpoint's routed experts take none; the MTP block's FP8 e_proj / h_proj take it."""
    import ds4.ops.moe_torch as moe_torch
    a = tiny()
    seen = []

    def spy(x, block, *rest, **kw):
        seen.append(tuple(x.shape))
        return real(x, block, *rest, **kw)

    real = moe_torch.act_quant_sim
    monkeypatch.setattr(moe_torch, "act_quant_sim", spy)
    seq = [[(5 * i + 1) % a.vocab_size for i in range(12)]]
    Generator(build(a.replace(weight_dtype="bf16", expert_dtype="bf16"), "qat"), 1, 32).prefill(seq)
    assert seen == []  # BF16 experts: no simulation before their GEMMs
    Generator(build(a, "qat"), 1, 32).prefill(seq)
    assert seen  # FP4 experts: x and h simulated
    m = build(a, "qat", mtp=True)
    seq = torch.tensor([4, 8, 15, 16, 23, 42, 7, 9])
    g = Generator(m, 1, 32)
    g.state.reset_row(0)
    _, h = m.prefill(seq[:-1], g.state, 0, return_hidden=True)
    lin = m.ops.linear

    class Spy:  # records each product's weight format and act_quant; everything else is the implementation's
        calls = []

        def __call__(self, x, w, act_quant=False, **kw):
            self.calls.append((w.fmt, act_quant))
            return lin(x, w, act_quant, **kw)

        def __getattr__(self, name):
            return getattr(lin, name)

    m.ops.linear = spy_lin = Spy()
    try:
        m.mtp_logits(h, seq[1:])
    finally:
        m.ops.linear = lin
    assert spy_lin.calls[:2] == [("fp8", True), ("fp8", True)]  # e_proj, h_proj


def test_state_reset_between_sequences():
    """A new sequence must not see the previous one's compressor state (spec §14.17)."""
    a = tiny()
    m = build(a)
    g = Generator(m, 1, 64)
    g.prefill([[(3 * i) % 500 + 2 for i in range(37)]])
    for _ in range(5):
        g.decode(torch.tensor([7]))
    after = g.prefill([[5, 6]])
    fresh = Generator(m, 1, 64).prefill([[5, 6]])
    assert torch.equal(after, fresh)


def test_official_config_json_gives_v4_flash():
    """The HF root config.json of the release (spec §1.1, every field) reads as the v4_flash preset."""
    from ds4.model.args import ModelArgs
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
        "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
        "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
        "sliding_window": 128, "compress_ratios": [0, 0, 4] + [128, 4] * 20 + [0], "compress_rope_theta": 160000,
        "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                                             "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1048576, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 2048,
        "num_hash_layers": 3, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1, "hidden_act": "silu", "attention_bias": False,
        "attention_dropout": 0.0, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
        "expert_dtype": "fp4", "torch_dtype": "bfloat16", "transformers_version": "4.57.1",
        "initializer_range": 0.02, "use_cache": True,
    }
    assert ModelArgs.from_hf_config(cfg) == v4_flash()
    a = v4_flash()
    assert [a.layer_type(i) for i in (0, 1, 2, 3, 4, 41, 42)] == ["swa", "swa", "csa", "hca", "csa", "hca", "csa"]
    assert a.layer_type(43) == "swa" and not a.is_hash(3) and a.is_hash(2)


def test_load_weights_consume_frees_the_stacked_expert_originals():
    """consume=True (the app's load): the caller's dict loses the per-expert tensors once they are stacked,
    so the full model's experts are never held twice; the default leaves the dict as it was."""
    args = tiny()
    w = random_weights(args, seed=0, include_mtp=False)
    n0 = len(w)
    kept = Transformer(args, torch_reference_ops(), "plain", torch.float32)
    kept.load_weights(w)
    assert len(w) == n0
    consumed = Transformer(args, torch_reference_ops(), "plain", torch.float32)
    consumed.load_weights(w, consume=True)
    routed = [k for k in w if ".experts." in k and ".shared_experts." not in k]
    assert routed == [] and 0 < len(w) < n0
    # and each layer's other originals (merged or re-laid into new tensors the model holds) once it is loaded
    assert not [k for k in w if k.startswith("layers.")]
    for a, b in zip(kept.layers, consumed.layers):
        assert torch.equal(a.ffn.mw.w1.weight, b.ffn.mw.w1.weight)
    with pytest.raises(TypeError, match="needs a dict"):
        Transformer(args, torch_reference_ops(), "plain", torch.float32).load_weights(MappingProxyType(w), consume=True)


def test_moe_implementation_lays_out_its_experts_at_load_and_on_configure():
    """An MoE implementation with prepare() (moe=fp4_topk: the fp4p word layout, on CUDA) re-lays the routed
    experts when the model loads and when configure() switches to it; the MoE module's attributes follow,
    and readers that dequantise (here the reference itself) give the same logits."""
    import dataclasses

    from ds4.ops.base import QWeight
    from ds4.ops.moe_torch import DequantMoE
    from ds4.quant import pack_fp4_mma

    class PackingMoE(DequantMoE):
        calls = 0

        def prepare(self, mw):
            PackingMoE.calls += 1
            if mw.w1.fmt != "fp4":
                return mw
            return dataclasses.replace(mw, **{n: QWeight("fp4p", pack_fp4_mma(getattr(mw, n).weight),
                                                         getattr(mw, n).scale) for n in ("w1", "w2", "w3")})

    a = tiny()
    assert a.expert_dtype == "fp4"
    seq = [(7 * i + 3) % a.vocab_size for i in range(20)]
    ref = build(a, seed=5)
    want = Generator(ref, 1, 32).prefill([seq])[0]
    packing = dataclasses.replace(torch_reference_ops(), moe=PackingMoE())
    m = Transformer(a, packing, "plain", torch.float32)
    m.load_weights(random_weights(a, seed=5, include_mtp=False))
    ffn = m.layers[0].ffn
    assert ffn.mw.w1.fmt == "fp4p" and ffn.w1 is ffn.mw.w1 and PackingMoE.calls == a.n_layers
    assert torch.equal(Generator(m, 1, 32).prefill([seq])[0], want)
    ref.configure(ops=packing)
    assert ref.layers[-1].ffn.mw.w2.fmt == "fp4p"
    assert torch.equal(Generator(ref, 1, 32).prefill([seq])[0], want)


@pytest.mark.parametrize("batch,max_seq_len", [(1, 64), (3, 1000)])
def test_state_bytes_is_what_alloc_state_allocates(batch, max_seq_len):
    """The memory check's count of the decode state (before any model exists) equals what alloc_state allocates."""
    args = tiny()
    m = Transformer(args, torch_reference_ops(), "plain", torch.float32)
    m.load_weights(random_weights(args, seed=0, include_mtp=False))
    st = m.alloc_state(batch, max_seq_len)
    held = sum(v.nbytes for layer in st.layers for v in layer.values()) + st.pos.nbytes
    assert Transformer.state_bytes(args, batch, max_seq_len, torch.float32) == held
