"""GPU tests of numerics=qat on the CUDA implementations: the act_quant_sim kernel and the indexer's Hadamard + FP4
simulation (its own launch, and inside the scores kernel's query staging) against their torch twins bit for bit, and
qat decode on every fused kernel with them (the same logits as with the twin; the captured graph's tokens as
eager's). Marker gpu; skipped without CUDA."""
from __future__ import annotations

import pytest
import torch
from gpu_common import BF16, DEV, TOL, cuda_kernels, gen, poison, rand_qweight, randn, rel, require_extension

pytestmark = pytest.mark.gpu
kernels = require_extension("ds4.kernels")  # skips this module without CUDA
kernels_attn = require_extension("ds4.kernels_attn")

from ds4.model.args import small, tiny, v4_flash  # noqa: E402
from ds4.model.rope import inv_freq  # noqa: E402
from ds4.model.transformer import Transformer  # noqa: E402
from ds4.ops.attn_cuda import FusedCudaAttention, FusedCudaIndexer  # noqa: E402
from ds4.ops.attn_torch import TorchIndexer  # noqa: E402
from ds4.ops.qat_cuda import act_quant_sim, kernel_takes  # noqa: E402
from ds4.quant import act_quant_sim as act_quant_sim_torch  # noqa: E402
from ds4.quant import fp4_act_quant_sim, hadamard  # noqa: E402
from ds4.registry import Impls, build_ops  # noqa: E402
from ds4.runtime.generate import Generator  # noqa: E402
from ds4.weights.synthetic import random_weights  # noqa: E402

_FUSED = dict(linear="gemv_cuda", moe="fp4_topk", attn="fused_cuda", indexer="fused_cuda", hc="fused_cuda")


def _wide_range(rows: int, K: int, block: int, seed: int) -> torch.Tensor:
    """bf16 [rows, K]: normal values with a power-of-two scale per block from 2^-40 to 2^20, a few outliers, an
    all-zero block and one whose amax is below act_quant's 1e-4 floor."""
    g = gen(seed)
    nb = K // block
    x = torch.randn(rows, nb, block, device=DEV, generator=g)
    x = x * torch.exp2(torch.randint(-40, 21, (rows, nb, 1), device=DEV, generator=g).float())
    x[:, :, 7] *= 300.0
    x[0, 0] = 0.0
    if nb > 1:
        x[-1, 1] = torch.randn(block, device=DEV, generator=g) * 1e-6
    return x.reshape(rows, K).to(BF16)


@pytest.mark.parametrize("rows,K,block", [(1, 4096, 128), (1, 2048, 128), (3, 7168, 128), (8, 512, 64),
                                          (2, 448, 64), (1, 128, 128), (130, 1024, 128)])
def test_act_quant_sim_kernel_is_the_torch_twin(rows, K, block):
    x = _wide_range(rows, K, block, seed=rows * K + block)
    poison()
    got = kernels.act_quant_sim(x, block)
    want = act_quant_sim_torch(x, block)
    assert got.dtype == BF16 and got.shape == x.shape
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (got - want).abs().max()
    # a leading batch dim and the dispatcher (ds4.ops.qat_cuda) give the same bits
    assert torch.equal(act_quant_sim(x.view(1, rows, K), block).view(rows, K), want)


def test_act_quant_sim_dispatch_and_errors(monkeypatch):
    x = _wide_range(2, 4096, 128, seed=1)
    assert kernel_takes(x, 128) and not kernel_takes(x.float(), 128) and not kernel_takes(x[:, :100], 128)
    assert not kernel_takes(x, 32)
    # what the kernel does not take runs the twin: fp32, a last dim the block does not divide
    assert torch.equal(act_quant_sim(x.float(), 128), act_quant_sim_torch(x.float(), 128))
    assert torch.equal(act_quant_sim(x[:, :200], 128), act_quant_sim_torch(x[:, :200], 128))
    monkeypatch.setenv("DS4_ACT_QUANT", "torch")
    assert torch.equal(act_quant_sim(x, 128), act_quant_sim_torch(x, 128))
    with pytest.raises(RuntimeError, match="block must be 64 or 128"):
        kernels.act_quant_sim(x, 32)
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        kernels.act_quant_sim(x.float(), 128)


def _hadamard_fp4_twin(x: torch.Tensor) -> torch.Tensor:
    return fp4_act_quant_sim(hadamard(x), 32)


def _tie_rows(d: int) -> torch.Tensor:
    """bf16 [16, d] rows x whose Hadamard transform is exactly a chosen y (d = 64 or 256, where d^-0.5 is a power of
    two): each of y's first two blocks of 32 values holds 6 (its amax: the FP4 scale 1) and two of the E2M1 rounding
    ties (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5), the rest zeros (small sums, so x is exact in bf16); the kernel's
    ties are checked, not only random values."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    g = torch.Generator().manual_seed(d)
    y = torch.zeros(16, d, dtype=torch.float64)
    for r in range(16):
        for b in range(2):
            idx = torch.randperm(32, generator=g)[:3] + 32 * b
            y[r, idx[0]] = 6.0
            for j in idx[1:]:
                y[r, j] = ties[int(torch.randint(0, 7, (1,), generator=g))] * (1 if torch.rand(1, generator=g) < .5
                                                                                 else -1)
    x = hadamard(y)  # H y d^-0.5 in float64: exact for these few multiples of 0.25, and H / sqrt(d) is its own inverse
    assert torch.equal(x.to(BF16).double(), x), "the crafted rows must be exact in bf16"
    return x.to(BF16).to(DEV)


@pytest.mark.parametrize("shape", [(1, 64, 128), (3, 64, 128), (5, 32), (2, 7, 64), (4, 256), (1, 16, 128)])
def test_hadamard_fp4_kernel_is_the_torch_twin(shape):
    """The indexer's qat simulation of its query and keys in one launch: the twin's bits over rows scaled from 2^-130
    (bf16 subnormals, below FP4's amax floor) to 2^100, a zero row, and (d 64 and 256) rows of exact rounding ties."""
    d = shape[-1]
    g = gen(sum(shape) + d)
    x = torch.randn(*shape, device=DEV, generator=g)
    x = x * torch.exp2(torch.randint(-130, 101, (*shape[:-1], 1), device=DEV, generator=g).float())
    x = x.to(BF16)
    x.view(-1, d)[0] = 0.0
    rows = [x.view(-1, d)] + ([_tie_rows(d)] if d in (64, 256) else [])
    for xr in rows:
        xr = xr.contiguous()
        poison()
        got = kernels_attn.hadamard_fp4(xr)
        want = _hadamard_fp4_twin(xr)
        assert got.dtype == BF16 and got.shape == xr.shape
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (got.float() - want.float()).abs().max()
    assert torch.equal(FusedCudaIndexer().hadamard_fp4(x), _hadamard_fp4_twin(x))


def test_hadamard_fp4_dispatch_and_errors(monkeypatch):
    wide = torch.randn(2, 4, 512, device=DEV).to(BF16)  # a width the kernel does not take: the twin
    assert torch.equal(FusedCudaIndexer().hadamard_fp4(wide), _hadamard_fp4_twin(wide))
    x = torch.randn(2, 4, 48, device=DEV).to(BF16)
    with pytest.raises(RuntimeError, match="power of two in"):
        torch.ops.ds4_attn.hadamard_fp4(x)
    with pytest.raises(ValueError, match="power of two in"):
        kernels_attn.hadamard_fp4(x)
    y = torch.randn(3, 128, device=DEV).to(BF16)
    monkeypatch.setenv("DS4_INDEXER_QAT", "torch")  # the ablation: the twin
    assert torch.equal(FusedCudaIndexer().hadamard_fp4(y), _hadamard_fp4_twin(y))
    q = torch.randn(1, 1, 64, 128, device=DEV).to(BF16)
    w = torch.randn(1, 1, 64, device=DEV)
    keys = torch.randn(1, 600, 128, device=DEV).to(BF16)
    with pytest.raises(RuntimeError, match="q_fp4 needs rope_freqs"):
        torch.ops.ds4_attn.indexer_scores(q, w, keys, True, torch.tensor([2000], device=DEV), 4, 1.0, None, True)


def _freqs4() -> torch.Tensor:
    a = v4_flash()
    return inv_freq(a, next(i for i in range(a.n_layers) if a.ratio(i) == 4), DEV)


@pytest.mark.parametrize("B,T", [(1, 4000), (2, 70000)])  # 70000: each block stages (and simulates) q once per chunk loop
def test_indexer_scores_simulate_the_query_in_its_staging(B, T):
    """q_fp4: the scores kernel stages q with its RoPE, then the Hadamard + FP4. With zero frequencies (the RoPE an
    exact identity) its scores are bit for bit those of the kernel on hadamard_fp4(q) staged as is; with a CSA
    layer's frequencies they agree with the twin (RoPE, Hadamard + FP4, BF16 scores) within TOL."""
    g = gen(7 + B)
    H, d = 64, 128
    q = randn(B, 1, H, d, g=g, dtype=BF16, scale=2.0)
    w = randn(B, 1, H, g=g, dtype=BF16)
    keys = randn(B, T, d, g=g, dtype=BF16)
    p = torch.tensor([3000 + 7777 * i for i in range(B)] if T == 4000 else [4 * T - 1, 4 * 30000 + 5], device=DEV)
    c = d ** -0.5 * H ** -0.5
    fi, ti = FusedCudaIndexer(), TorchIndexer()
    zero = torch.zeros(32, device=DEV)
    poison()
    got = fi.scores(q, w, keys, True, p, 4, c, zero, q_fp4=True)
    pre = fi.scores(kernels_attn.hadamard_fp4(q), w, keys, True, p, 4, c)
    assert torch.equal(got.view(torch.int16), pre.view(torch.int16))
    f = _freqs4()
    got = fi.scores(q, w, keys, True, p, 4, c, f, q_fp4=True).float()
    ref = ti.scores(q, w, keys, True, p, 4, c, f, q_fp4=True).float()
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isinf(got), torch.isinf(ref)) and rel(got[fin], ref[fin]) <= TOL
    unsimulated = fi.scores(q, w, keys, True, p, 4, c, f, q_fp4=False).float()  # q_fp4 changes the scores
    assert rel(unsimulated[fin], ref[fin]) > 10 * rel(got[fin], ref[fin])


@pytest.mark.parametrize("fmt,o,i", [("fp8t", 4096, 4096), ("fp8t", 32768, 1024), ("fp8", 4096, 4096),
                                     ("fp8", 16384, 1024), ("fp8t", 7168, 8192), ("fp4", 2048, 4096)])
def test_gemv_stages_the_fp8_simulation(fmt, o, i, monkeypatch):
    """act_quant=True: the one-row tensor-core GEMV (and the q_norm-fused one) FP8-simulates x in its activation
    staging — the same bits as the act_quant_sim launch followed by the plain kernel; GemvCudaLinear takes it with
    DS4_ACT_QUANT=staged (the default) and the launch with DS4_ACT_QUANT=kernel: the same output."""
    from ds4.ops.linear_cuda import GemvCudaLinear
    g = gen(o + i)
    qw = rand_qweight(fmt, o, i, g)
    x = _wide_range(1, i, 128, seed=o * 7 + i)
    assert kernels.act_quant_staged_ok(qw.fmt, o, i)
    poison()
    got = kernels.gemv(x, qw.weight, qw.scale, qw.fmt, act_quant=True)
    want = kernels.gemv(kernels.act_quant_sim(x, 128), qw.weight, qw.scale, qw.fmt)
    assert torch.isfinite(got).all() and torch.equal(got, want)
    lin = GemvCudaLinear()
    for m in ("kernel", "staged"):
        monkeypatch.setenv("DS4_ACT_QUANT", m)
        assert torch.equal(lin(x, qw, act_quant=True), want), m
    monkeypatch.delenv("DS4_ACT_QUANT")
    assert torch.equal(lin(x, qw, act_quant=True), want)
    if kernels.gemv_rmsnorm_ok(qw.fmt, o, i):  # q_norm, the simulation and the GEMV in one launch
        nw = (1 + 0.1 * randn(i, g=g)).to(BF16)
        xn = randn(1, i, g=g, dtype=BF16, scale=3.0)
        got = kernels.gemv_rmsnorm(xn, qw.weight, qw.scale, qw.fmt, nw, 1e-6, act_quant=True)
        normed = kernels_attn.rms_norm(xn, nw, 1e-6)
        want = kernels.gemv(kernels.act_quant_sim(normed, 128), qw.weight, qw.scale, qw.fmt, kernel="mma")
        assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="act_quant needs one row"):
        kernels.gemv(torch.cat([x, x]), qw.weight, qw.scale, qw.fmt, act_quant=True)
    # depth 4 (a knob): no staged instance at the plain launch's depth, so not staged (it would sum in another order);
    # GemvCudaLinear then takes the launch even with DS4_ACT_QUANT=staged
    monkeypatch.setenv("DS4_MMA_DEPTH", "4")
    assert not kernels.act_quant_staged_ok(qw.fmt, o, i)
    want4 = kernels.gemv(kernels.act_quant_sim(x, 128), qw.weight, qw.scale, qw.fmt)
    monkeypatch.setenv("DS4_ACT_QUANT", "staged")
    assert torch.equal(lin(x, qw, act_quant=True), want4)
    with pytest.raises(RuntimeError, match="act_quant needs one row"):
        kernels.gemv(x, qw.weight, qw.scale, qw.fmt, act_quant=True)


def test_staged_q_up_with_a_row_skip(monkeypatch):
    """The merged wq_b + indexer wq_b at V4's shape under qat with DS4_ACT_QUANT=staged and a RowSkip: one launch
    (norm, simulation, GEMV and the skip; no torch ops after it). Where the skip applies the index rows are zeros and
    the kept rows, spread over the whole grid, are the launch path's (act_quant_sim, the GEMV, the zeros after) and
    the staged GEMV's without the skip within TOL (another split of their rounds over warps, as under plain);
    elsewhere the launch path's bits."""
    from ds4.ops.base import RowSkip
    from ds4.ops.linear_cuda import GemvCudaLinear
    g = gen(41)
    o, i, rows = 40960, 1024, 32768
    qw = rand_qweight("fp8t", o, i, g)
    nw = (1 + 0.1 * randn(i, g=g)).to(BF16)
    lin, attn = GemvCudaLinear(), FusedCudaAttention()
    for p in (100, 2047, 2051):  # (p + 1) // 4 visible entries: the top-k of 512 takes all of them at 100 and 2047
        qa = randn(1, i, g=g, dtype=BF16, scale=3.0)
        skip = RowSkip(torch.tensor([p], device=DEV), 4, 512, rows)
        monkeypatch.setenv("DS4_ACT_QUANT", "kernel")
        want = attn.q_up(qa, nw, 1e-6, qw, lin, True, skip)
        monkeypatch.setenv("DS4_ACT_QUANT", "staged")
        whole = attn.q_up(qa, nw, 1e-6, qw, lin, True)
        poison()
        got, launched = cuda_kernels(lambda: attn.q_up(qa, nw, 1e-6, qw, lin, True, skip))
        assert len(launched) == 1 and "gemv_mma_kernel" in launched[0], (p, launched)
        if (p + 1) // 4 <= 512:
            assert torch.equal(got[:, rows:], torch.zeros_like(got[:, rows:])), p
            assert rel(got[:, :rows], want[:, :rows]) <= TOL and rel(got[:, :rows], whole[:, :rows]) <= TOL, p
            assert torch.equal(want[:, rows:], torch.zeros_like(want[:, rows:])), p
        else:
            assert torch.equal(got, want) and torch.equal(got, whole), p


@pytest.mark.parametrize("dims", [(4096, 2048), (512, 256)])  # the routed gate+up at depth 4 / 2
def test_moe_kernels_stage_the_fp8_simulation(dims, monkeypatch):
    """act_quant=True on the one-token tensor-core MoE kernels (fp4t routed top-6, an fp8t shared expert): x (gate+up)
    and h (down) FP8-simulated in the staging, the same bits as the act_quant_sim launch before the plain kernels; a
    down at a depth with no staged instance (DS4_DOWN_DEPTH=4) is not staged."""
    from test_kernels_gpu import make_experts, rand_fp8_weight
    from ds4.quant import tile_fp8_mma
    dim, inter = dims
    g = gen(dim + inter)
    (w1, s1, w3, s3, w2, s2), _ = make_experts(16, dim, inter, g, "fp4t")
    ids = torch.tensor([[33, 40, 47, 32, 35, 44]], device=DEV)
    rw = torch.rand(1, 6, device=DEV, generator=g) + 0.1
    x = _wide_range(1, dim, 128, seed=dim + 1)
    assert kernels.moe_act_quant_ok("fp4t", 6, dim, inter, True) and kernels.moe_act_quant_ok("fp4t", 6, dim, inter,
                                                                                                False)
    poison()
    h = kernels.moe_gate_up(x, ids, rw, w1, s1, w3, s3, "fp4t", 32, 16, 10.0, act_quant=True)
    want = kernels.moe_gate_up(kernels.act_quant_sim(x, 128), ids, rw, w1, s1, w3, s3, "fp4t", 32, 16, 10.0)
    assert torch.equal(h, want)
    y = kernels.moe_down(h, ids, 6, w2, s2, "fp4t", 32, 16, None, True, act_quant=True)
    want = kernels.moe_down(kernels.act_quant_sim(h, 128), ids, 6, w2, s2, "fp4t", 32, 16, None, True)
    assert torch.isfinite(y).all() and torch.equal(y, want)
    if dim < 4096:
        return
    (a1, t1), (a3, t3), (a2, t2) = (rand_fp8_weight(o, i, g) for o, i in ((inter, dim), (inter, dim), (dim, inter)))
    a1, a3, a2 = (tile_fp8_mma(a) for a in (a1, a3, a2))
    assert kernels.moe_act_quant_ok("fp8t", 1, dim, inter, True)
    hs = kernels.moe_gate_up(x, None, None, a1, t1, a3, t3, "fp8t", 0, 1, 10.0, act_quant=True)
    assert torch.equal(hs, kernels.moe_gate_up(kernels.act_quant_sim(x, 128), None, None, a1, t1, a3, t3, "fp8t", 0, 1,
                                               10.0))
    ys = kernels.moe_down(hs, None, 1, a2, t2, "fp8t", 0, 1, None, True, act_quant=True)
    assert torch.equal(ys, kernels.moe_down(kernels.act_quant_sim(hs, 128), None, 1, a2, t2, "fp8t", 0, 1, None, True))
    with pytest.raises(RuntimeError, match="act_quant needs one token"):
        kernels.moe_gate_up(torch.cat([x, x]), ids.repeat(2, 1), rw.repeat(2, 1), w1, s1, w3, s3, "fp4t", 32, 16, 10.0,
                            act_quant=True)
    monkeypatch.setenv("DS4_DOWN_DEPTH", "4")
    assert not kernels.moe_act_quant_ok("fp4t", 6, dim, inter, False)
    with pytest.raises(RuntimeError, match="act_quant needs one token"):
        kernels.moe_down(h, ids, 6, w2, s2, "fp4t", 32, 16, None, True, act_quant=True)


@pytest.mark.parametrize("mma", ["1", "all"])  # all: every FP8 GEMV on the tensor cores, so small's stage the simulation
def test_qat_decode_on_the_kernel_gives_the_twins_logits(monkeypatch, mma):
    """small, every fused kernel, numerics=qat: teacher-forced logits over a prompt and 24 steps with the simulation's
    own launch (DS4_ACT_QUANT=kernel), in the GEMVs' staging (unset: the default, staged) and by the torch twin
    (DS4_ACT_QUANT=torch) are the same bits."""
    monkeypatch.setenv("DS4_MMA", mma)
    args = small()
    model = Transformer(args, build_ops(Impls(**_FUSED), DEV), "qat", BF16, DEV)
    model.load_weights(random_weights(args, seed=4, device=DEV, include_mtp=False))
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, args.vocab_size, (40,), generator=g).tolist()
    cont = torch.randint(0, args.vocab_size, (24,), generator=g).tolist()
    monkeypatch.setenv("DS4_ACT_QUANT", "torch")
    want = Generator(model, 1, 80).teacher_forced_logits(prompt, cont)
    for m in ("kernel", None):
        if m is None:
            monkeypatch.delenv("DS4_ACT_QUANT")
        else:
            monkeypatch.setenv("DS4_ACT_QUANT", m)
        got = Generator(model, 1, 80).teacher_forced_logits(prompt, cont)
        assert torch.equal(got, want), (m, (got - want).abs().max())


def test_qat_cuda_graph_matches_eager():
    """tiny, every fused kernel, numerics=qat, batch 1: 400 captured steps (100 CSA windows, 24 HCA ones) give the
    eager tokens."""
    args = tiny()
    w = random_weights(args, seed=5, device=DEV, include_mtp=False)
    outs = []
    for runtime in ("eager", "cuda_graph"):
        m = Transformer(args, build_ops(Impls(**_FUSED), DEV), "qat", BF16, DEV)
        m.load_weights(w)
        outs.append(Generator(m, 1, 450, runtime=runtime).generate([[5, 6, 7, 8, 9]], 400, stop_at_eos=False)
                    .tokens[0])
    first = next((i for i, (a, b) in enumerate(zip(*outs)) if a != b), None)
    assert first is None, f"graph and eager tokens part at step {first} of {len(outs[0])}"
