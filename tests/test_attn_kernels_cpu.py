"""CPU-side checks of the ds4_attn options (attn/indexer/hc = fused_cuda): registered with the right
priority and alias, an explicit choice without CUDA fails clearly through ds4.registry.build_ops,
`auto` falls back and says so, the objects construct without compiling anything (the nvcc compile
of csrc/attn/*.cu is in test_kernels_cpu.py)."""
from __future__ import annotations


import pytest
import torch

from ds4 import registry
from ds4.registry import ImplUnavailable

NO_CUDA = not torch.cuda.is_available()
FUSED = [("attn", "fused_cuda"), ("attn", "fused"), ("attn", "fused_cuda_wo_bf16"), ("indexer", "fused_cuda"),
         ("hc", "fused_cuda")]


def test_registered_with_priority_and_alias():
    for comp in ("attn", "indexer", "hc"):
        e = registry.entry(comp, "fused_cuda")
        assert e.priority == 10 and e.priority > registry.entry(comp, "torch").priority
    assert registry.aliases("attn").get("fused") == "fused_cuda"
    assert registry.entry("attn", "fused").name == "fused_cuda"


@pytest.mark.parametrize("component,name", FUSED)
def test_explicit_choice_on_cpu_device_fails_clearly(component, name):
    with pytest.raises(ImplUnavailable, match=rf"{component}={name} cannot run here: needs a CUDA device"):
        registry.build_ops(registry.Impls(**{component: name}), "cpu")


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
@pytest.mark.parametrize("component,name", FUSED)
def test_explicit_choice_without_cuda_fails_clearly(component, name):
    with pytest.raises(ImplUnavailable, match=rf"{component}={name} cannot run here: CUDA is not available"):
        registry.build_ops(registry.Impls(**{component: name}), "cuda")


@pytest.mark.parametrize("component", ["attn", "indexer", "hc"])
def test_auto_falls_back_and_says_so(component):
    e, note = registry.resolve(component, "auto", torch.device("cpu"))
    assert e.name == "torch"
    assert "fused_cuda: needs a CUDA device" in note


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_unavailable_reason_without_cuda():
    from ds4 import kernels_attn
    why = kernels_attn.unavailable_reason()
    assert why is not None and ("CPU-only" in why or "CUDA is not available" in why)


def test_objects_construct_without_extension():
    from ds4.ops.attn_cuda import FusedCudaAttention, FusedCudaIndexer
    from ds4.ops.hc_cuda import FusedCudaHC
    assert FusedCudaAttention().name == FusedCudaIndexer().name == FusedCudaHC().name == "fused_cuda"


def test_cpu_tensors_go_to_the_reference():
    """Documented dispatch: non-CUDA / non-bf16 / prefill inputs use the torch twin (same results)."""
    from ds4.ops.attn_cuda import FusedCudaAttention, FusedCudaIndexer
    from ds4.ops.attn_torch import TorchAttention, TorchIndexer
    from ds4.ops.hc_cuda import FusedCudaHC
    from ds4.ops.hc_torch import TorchHC
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(2, 3, 4, 64, generator=g), torch.randn(2, 10, 64, generator=g)
    valid = torch.rand(2, 3, 10, generator=g) > 0.3
    sink = torch.randn(4, generator=g)
    a = FusedCudaAttention().sparse(q, kv, valid, None, None, sink, 0.125)
    assert torch.equal(a, TorchAttention().sparse(q, kv, valid, None, None, sink, 0.125))
    qi, w, keys = torch.randn(1, 2, 4, 32, generator=g), torch.rand(1, 2, 4, generator=g), torch.randn(1, 9, 32, generator=g)
    assert torch.equal(FusedCudaIndexer().scores(qi, w, keys), TorchIndexer().scores(qi, w, keys))
    h = torch.randn(3, 4, 16, generator=g)
    fn, sc, base = torch.randn(24, 64, generator=g) * 0.1, torch.ones(3), torch.zeros(24)
    for x, y in zip(FusedCudaHC().pre(h, fn, sc, base, 20, 1e-6, 1e-6), TorchHC().pre(h, fn, sc, base, 20, 1e-6, 1e-6)):
        assert torch.equal(x, y)



def test_decode_glue_cpu_tensors_go_to_the_twin():
    """The decode-glue methods of the fused implementations on CPU tensors run the torch twins."""
    from ds4.ops.attn_cuda import FusedCudaAttention, FusedCudaIndexer
    from ds4.ops.attn_torch import TorchAttention, TorchIndexer
    from ds4.ops.hc_cuda import FusedCudaHC
    from ds4.ops.hc_torch import TorchHC
    g = torch.Generator().manual_seed(1)
    fa, ta = FusedCudaAttention(), TorchAttention()
    f = torch.rand(8, generator=g)
    pos = torch.tensor([3, 40])
    x, w = torch.randn(2, 4, 64, generator=g).bfloat16(), 1 + torch.rand(64, generator=g)
    assert torch.equal(fa.rms_norm(x, w, 1e-6), ta.rms_norm(x, w, 1e-6))
    from ds4.ops.base import QWeight
    from ds4.ops.linear_torch import DequantLinear
    qa, wq = x[:1, 0], QWeight("bf16", torch.randn(96, 64, generator=g).bfloat16())
    want = DequantLinear()(ta.rms_norm(qa, w, 1e-6), wq)  # q_up: q_norm, then wq_b through `linear`
    assert torch.equal(ta.q_up(qa, w, 1e-6, wq, DequantLinear(), False), want)
    assert torch.equal(fa.q_up(qa, w, 1e-6, wq, DequantLinear(), False), want)
    # a RowSkip: columns [rows:] zero where (pos + 1) // ratio <= k, the rest unchanged
    from ds4.ops.base import RowSkip
    for p, zero in ((3, True), (8, True), (11, False)):  # (p + 1) // 4 visible entries: 1, 2, 3 against k = 2
        for impl in (ta, fa):
            got = impl.q_up(qa, w, 1e-6, wq, DequantLinear(), False, RowSkip(torch.tensor([p]), 4, 2, 64))
            assert torch.equal(got[:, :64], want[:, :64])
            assert torch.equal(got[:, 64:], torch.zeros_like(want[:, 64:]) if zero else want[:, 64:]), (p, impl)
    assert torch.equal(fa.head_rope(x, pos, f, True, 1e-6), ta.head_rope(x, pos, f, True, 1e-6))
    assert torch.equal(FusedCudaIndexer().rope(x, pos, f), TorchIndexer().rope(x, pos, f))
    wins = [torch.zeros(2, 8, 64, dtype=torch.bfloat16) for _ in range(2)]
    for impl, win in zip((fa, ta), wins):
        impl.kv_store(win, x[:, 0], w, pos, f, 1e-6, True)
    assert torch.equal(*wins) and wins[0].abs().sum() > 0
    states = [(torch.zeros(2, 8, 128), torch.full((2, 8, 128), float("-inf")), torch.zeros(2, 16, 64, dtype=torch.bfloat16))
              for _ in range(2)]
    kvz, ape = torch.randn(2, 256, generator=g), torch.randn(4, 128, generator=g)
    for impl, (skv, ssc, cache) in zip((fa, ta), states):
        impl.compress_step(kvz, ape, w, pos, f, skv, ssc, cache, 4, True, 1e-6, "fp8")
    assert all(torch.equal(a, b) for a, b in zip(*states))
    wc = torch.randn(32, 64, generator=g).bfloat16()
    assert torch.equal(fa.compress_project(x[:, 0], wc), ta.compress_project(x[:, 0], wc))
    q, win, ext = x.float(), torch.randn(2, 8, 64, generator=g), torch.randn(2, 16, 64, generator=g)
    sink, idx = torch.randn(4, generator=g), torch.tensor([[0, 5, 9], [2, 3, 1]])
    for e, i, r in ((None, None, 1), (ext, None, 16), (ext, idx, 4)):
        assert torch.equal(fa.decode(q, win, pos, e, i, r, sink, 0.125, f), ta.decode(q, win, pos, e, i, r, sink, 0.125, f))
        assert torch.equal(fa.decode(q, win, pos, e, i, r, sink, 0.125, f, 1e-6),
                           ta.decode(q, win, pos, e, i, r, sink, 0.125, f, 1e-6))
    h = torch.randn(3, 4, 16, generator=g)
    fn, sc, base, nw = torch.randn(24, 64, generator=g) * 0.1, torch.ones(3), torch.zeros(24), torch.rand(16, generator=g)
    for a, b in zip(FusedCudaHC().pre(h, fn, sc, base, 20, 1e-6, 1e-6, nw), TorchHC().pre(h, fn, sc, base, 20, 1e-6, 1e-6, nw)):
        assert torch.equal(a, b)
    xo, post, comb = torch.randn(3, 16, generator=g), torch.rand(3, 4, generator=g), torch.rand(3, 4, 4, generator=g)
    got = FusedCudaHC().post_pre(xo, h, post, comb, fn, sc, base, 20, 1e-6, 1e-6, nw)
    want = TorchHC().post_pre(xo, h, post, comb, fn, sc, base, 20, 1e-6, 1e-6, nw)
    assert len(got) == 4 and all(torch.equal(a, b) for a, b in zip(got, want))


def test_indexer_scores_with_positions_mask_invisible_entries():
    """Decode form: entry t scores -inf iff t >= (pos + 1) // ratio; visible scores unchanged."""
    from ds4.ops.attn_torch import TorchIndexer
    g = torch.Generator().manual_seed(2)
    q, w, keys = torch.randn(2, 1, 4, 32, generator=g), torch.rand(2, 1, 4, generator=g), torch.randn(2, 9, 32, generator=g)
    pos = torch.tensor([6, 100])
    got = TorchIndexer().scores(q, w, keys, pos=pos, ratio=4)
    plain = TorchIndexer().scores(q, w, keys)
    assert torch.isinf(got[0, 0, 1:]).all() and torch.equal(got[0, 0, :1], plain[0, 0, :1])
    assert torch.equal(got[1], plain[1])


def test_indexer_scores_scale_and_deferred_rope():
    """The scores op's w_scale multiplies fp32(w) (bf16 head weights as weights_proj gives them), and
    rope_freqs rotates q at pos first: the same numbers as scaling / rotating before the call."""
    from ds4.ops.attn_torch import TorchIndexer
    ix = TorchIndexer()
    g = torch.Generator().manual_seed(4)
    q, keys = torch.randn(2, 1, 4, 32, generator=g), torch.randn(2, 9, 32, generator=g)
    w = torch.randn(2, 1, 4, generator=g).bfloat16()
    pos, f, c = torch.tensor([30, 100]), 1.0 / 10000 ** (torch.arange(8) / 8), 0.125
    assert torch.equal(ix.scores(q, w, keys, pos=pos, ratio=4, w_scale=c),
                       ix.scores(q, w.float() * c, keys, pos=pos, ratio=4))
    roped = ix.rope(q[:, 0], pos, f)[:, None]
    assert torch.equal(ix.scores(q, w, keys, pos=pos, ratio=4, w_scale=c, rope_freqs=f),
                       ix.scores(roped, w, keys, pos=pos, ratio=4, w_scale=c))
    with pytest.raises(ValueError, match="rope_freqs needs decode positions"):
        ix.scores(q, w, keys, rope_freqs=f)


def test_indexer_q_fp4_applies_the_qat_query_simulation_after_the_rope():
    """q_fp4 (numerics=qat's decode query): the scores op rotates q, then applies the reference's Hadamard + FP4
    (fp4_act_quant_sim(hadamard(q), 32), hadamard_fp4); it needs rope_freqs. On CPU tensors the fused indexer gives
    the twin's numbers; hadamard_fp4_ok names the widths its kernels take."""
    from ds4 import kernels_attn
    from ds4.ops.attn_cuda import FusedCudaIndexer
    from ds4.ops.attn_torch import TorchIndexer
    from ds4.quant import fp4_act_quant_sim, hadamard
    ix = TorchIndexer()
    g = torch.Generator().manual_seed(5)
    q, keys = torch.randn(2, 1, 4, 64, generator=g).bfloat16(), torch.randn(2, 9, 64, generator=g).bfloat16()
    w = torch.randn(2, 1, 4, generator=g).bfloat16()
    pos, f = torch.tensor([30, 100]), 1.0 / 10000 ** (torch.arange(8) / 8)
    sim = fp4_act_quant_sim(hadamard(ix.rope(q[:, 0], pos, f)), 32)[:, None]
    assert torch.equal(ix.hadamard_fp4(q), fp4_act_quant_sim(hadamard(q), 32))
    want = ix.scores(sim, w, keys, bf16=True, pos=pos, ratio=4)
    got = ix.scores(q, w, keys, bf16=True, pos=pos, ratio=4, rope_freqs=f, q_fp4=True)
    assert torch.equal(got, want)
    assert not torch.equal(ix.scores(q, w, keys, bf16=True, pos=pos, ratio=4, rope_freqs=f), want)
    assert torch.equal(FusedCudaIndexer().scores(q, w, keys, True, pos, 4, 1.0, f, q_fp4=True), want)
    assert torch.equal(FusedCudaIndexer().hadamard_fp4(q), ix.hadamard_fp4(q))
    sel = ix.select(q, w, keys, 3, pos, 4, bf16=True, rope_freqs=f, q_fp4=True)
    assert torch.equal(sel, want[:, 0].float().topk(3, dim=-1).indices)
    with pytest.raises(ValueError, match="q_fp4 applies after the query's RoPE"):
        ix.scores(q, w, keys, bf16=True, pos=pos, ratio=4, q_fp4=True)
    assert [d for d in range(1, 600) if kernels_attn.hadamard_fp4_ok(d)] == [32, 64, 128, 256]

def test_decode_attention_twin_masks_by_position():
    """TorchAttention.decode: a window slot beyond pos and a not-yet-visible entry do not change the output."""
    from ds4.ops.attn_torch import TorchAttention
    g = torch.Generator().manual_seed(3)
    q, win, ext = torch.randn(1, 4, 64, generator=g), torch.randn(1, 8, 64, generator=g), torch.randn(1, 5, 64, generator=g)
    sink, f, pos = torch.randn(4, generator=g), torch.rand(8, generator=g), torch.tensor([5])
    out = TorchAttention().decode(q, win, pos, ext, None, 4, sink, 0.125, f)      # slots 0..5 and entry 0 visible
    win2, ext2 = win.clone(), ext.clone()
    win2[0, 6:] = 100.0
    ext2[0, 1:] = -100.0
    assert torch.equal(out, TorchAttention().decode(q, win2, pos, ext2, None, 4, sink, 0.125, f))
    ext2[0, 0] = 3.0
    assert not torch.equal(out, TorchAttention().decode(q, win2, pos, ext2, None, 4, sink, 0.125, f))


def test_decode_attention_twin_applies_head_rope_to_raw_q():
    """decode(q_raw, ..., q_norm_eps=eps) is decode(head_rope(q_raw, pos, freqs, True, eps), ...): the
    model hands attention the wq_b output and the fused kernel does the per-head RMS and RoPE itself."""
    from ds4.ops.attn_torch import TorchAttention
    g = torch.Generator().manual_seed(4)
    ta = TorchAttention()
    q = (torch.randn(2, 4, 64, generator=g) * 3).bfloat16()
    win, ext = torch.randn(2, 8, 64, generator=g).bfloat16(), torch.randn(2, 5, 64, generator=g).bfloat16()
    sink, f, pos = torch.randn(4, generator=g), torch.rand(8, generator=g), torch.tensor([5, 30])
    got = ta.decode(q, win, pos, ext, None, 4, sink, 0.125, f, 1e-6)
    want = ta.decode(ta.head_rope(q, pos, f, True, 1e-6), win, pos, ext, None, 4, sink, 0.125, f)
    assert torch.equal(got, want)
    assert not torch.equal(got, ta.decode(q, win, pos, ext, None, 4, sink, 0.125, f))


def test_merged_wo_bf16_output_projection():
    """attn=fused_cuda_wo_bf16: one BF16 matrix wo_b.blockdiag(wo_a), built once per layer, gives the
    grouped two-step projection up to BF16 rounding of the merged weight."""
    from ds4.model.args import tiny
    from ds4.model.transformer import Transformer
    from ds4.ops.attn_cuda import MergedWoAttention
    from ds4.ops.attn_torch import TorchAttention
    from ds4.ops.linear_torch import DequantLinear
    from ds4.registry import torch_reference_ops
    from ds4.weights.synthetic import random_weights
    a = tiny()
    m = Transformer(a, torch_reference_ops(), "plain", torch.float32)
    m.load_weights(random_weights(a, seed=1, include_mtp=False))
    at = m.layers[1].attn
    o = torch.randn(3, at.n_heads * a.head_dim, generator=torch.Generator().manual_seed(4))
    impl = MergedWoAttention()
    got = impl.out_proj(o, at.wo_a, at.wo_b, at.groups, DequantLinear(), False)
    ref = TorchAttention().out_proj(o, at.wo_a, at.wo_b, at.groups, DequantLinear(), False)
    assert got.shape == ref.shape == (3, a.dim)
    assert ((got - ref).norm() / ref.norm()).item() < 2e-2
    merged = impl.merged(at.wo_a, at.wo_b, at.groups)
    assert merged.fmt == "bf16" and merged.weight.shape == (a.dim, at.n_heads * a.head_dim)
    assert impl.merged(at.wo_a, at.wo_b, at.groups) is merged   # built once per layer


def test_decode_skips_refuse_bad_arguments_before_any_kernel():
    """indexer_select, topk, gemv_rmsnorm's skip, gemv_deferred and compress_step's tokens check their arguments in
    Python (a ValueError, no extension needed): a binding's own check that formats numbers crashed the process on the
    GPU in sessions 37 and 44."""
    from ds4 import kernels, kernels_attn
    q, w, keys = torch.zeros(1, 1, 4, 16), torch.zeros(1, 1, 4), torch.zeros(1, 8, 16)
    with pytest.raises(ValueError, match="1 <= k <= T"):
        kernels_attn.indexer_select(q, w, keys, 9, torch.zeros(1, dtype=torch.long), 4)
    with pytest.raises(ValueError, match=r"q \[B, 1, H, d\]"):
        kernels_attn.indexer_select(q[:, :, 0], w, keys, 4, torch.zeros(1, dtype=torch.long), 4)
    for scores, k in ((torch.zeros(2, 8), 9), (torch.zeros(2, 8), 0), (torch.zeros(8), 4)):  # topk (session 44)
        with pytest.raises(ValueError, match="1 <= k <= T"):
            kernels_attn.topk(scores, k)
    x, wt, nw = torch.zeros(1, 64), torch.zeros(64, 64, dtype=torch.uint8), torch.ones(64)
    for ratio, k, rows in ((0, 4, 32), (4, 0, 32), (4, 4, 24), (4, 4, 64), (4, 4, 0)):
        with pytest.raises(ValueError, match="a multiple of 16"):
            kernels.gemv_rmsnorm(x, wt, None, "fp8", nw, 1e-6, (torch.zeros(1, dtype=torch.long), ratio, k, rows))
    # the deferred projection and its step (session 38): the ring's row count, the token count dividing m
    ring = torch.zeros(4, 64, dtype=torch.bfloat16)
    for bad_ring, bad_x in ((ring[:1], x), (torch.zeros(9, 64, dtype=torch.bfloat16), x), (ring, torch.zeros(2, 64))):
        with pytest.raises(ValueError, match="2 <= every <= 8"):
            kernels.gemv_deferred(bad_x, bad_ring, torch.zeros(32, 64), torch.zeros(1, dtype=torch.long))
    cache = torch.zeros(1, 8, 16)
    for tokens, rows in ((3, 3), (4, 1), (0, 0)):
        with pytest.raises(ValueError, match="must divide m"):
            kernels_attn.compress_step(torch.zeros(rows, 64), torch.zeros(4, 32), torch.ones(16), torch.zeros(1),
                                       torch.zeros(4), torch.zeros(1, 8, 32), torch.zeros(1, 8, 32), cache, 4, True,
                                       1e-6, False, tokens)


def test_reads_in_place_predicate_copies_nothing(monkeypatch):
    """sparse_decode_reads_in_place only answers: it used to make the copy it asks about (a strided window or
    compressed cache through .contiguous()), which a captured step would have recorded as a launch (session 66)."""
    from ds4 import kernels_attn
    q, pos, sink = torch.zeros(1, 4, 64, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int64), torch.zeros(4)
    win = torch.zeros(1, 64, 16, dtype=torch.bfloat16).transpose(1, 2)  # [1, 16, 64], unit stride not last
    copies = []
    real = torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous", lambda t, *a, **k: copies.append(t.shape) or real(t, *a, **k))
    assert not kernels_attn.sparse_decode_reads_in_place(q, win, pos, None, None, sink, None)
    assert not kernels_attn.sparse_decode_reads_in_place(q, real(win), pos, win, None, sink, None)  # ext strided
    assert copies == []
