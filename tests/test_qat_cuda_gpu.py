"""GPU tests of numerics=qat on the CUDA implementations: the act_quant_sim kernel against its torch twin bit for bit,
and qat decode on every fused kernel with it (the same logits as with the twin; the captured graph's tokens as
eager's). Marker gpu; skipped without CUDA."""
from __future__ import annotations

import pytest
import torch
from gpu_common import BF16, DEV, gen, poison, require_extension

pytestmark = pytest.mark.gpu
kernels = require_extension("ds4.kernels")  # skips this module without CUDA

from ds4.model.args import small, tiny  # noqa: E402
from ds4.model.transformer import Transformer  # noqa: E402
from ds4.ops.qat_cuda import act_quant_sim, kernel_takes  # noqa: E402
from ds4.quant import act_quant_sim as act_quant_sim_torch  # noqa: E402
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


def test_qat_decode_on_the_kernel_gives_the_twins_logits(monkeypatch):
    """small, every fused kernel, numerics=qat: teacher-forced logits over a prompt and 24 steps with the kernel
    and with DS4_ACT_QUANT=torch (the twin) are the same bits."""
    args = small()
    model = Transformer(args, build_ops(Impls(**_FUSED), DEV), "qat", BF16, DEV)
    model.load_weights(random_weights(args, seed=4, device=DEV, include_mtp=False))
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, args.vocab_size, (40,), generator=g).tolist()
    cont = torch.randint(0, args.vocab_size, (24,), generator=g).tolist()
    got = Generator(model, 1, 80).teacher_forced_logits(prompt, cont)
    monkeypatch.setenv("DS4_ACT_QUANT", "torch")
    want = Generator(model, 1, 80).teacher_forced_logits(prompt, cont)
    assert torch.equal(got, want), (got - want).abs().max()


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
