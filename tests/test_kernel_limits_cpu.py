"""The contract between the Python wrappers / registry and the CUDA kernels' fixed limits, checked on CPU: what a
wrapper hands a launch stays within what the launcher takes (rows per grid axis, aligned staging, the model's
settings in the kernels' meaning), the registry and ModelArgs refuse what a kernel with no fallback cannot take before
any weights load, and the Python mirrors of the kernels' constants are the constants. The kernels are replaced by
recording fakes, and tensors that say they are on CUDA (_Cuda) reach the dispatch that CUDA tensors reach."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ds4 import kernels, kernels_attn, registry
from ds4.registry import ImplUnavailable

CSRC = Path(__file__).resolve().parents[1] / "csrc"
GRID_ROWS = 65535  # the rows (grid y) launch_hc_finish and launch_head_rope take: N > 65535 is refused


class _Cuda(torch.Tensor):
    """A CPU tensor that reports is_cuda (so is everything computed from it): the wrappers' shape / dtype dispatch
    without a GPU. Only for paths whose kernels are replaced by fakes."""

    @property
    def is_cuda(self):
        return True


def _cuda(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(_Cuda)


def _fake_ops(monkeypatch, **fns) -> list:
    """kernels_attn's ops replaced by fns (each recording its call's first tensor's rows); returns the record."""
    rows = []

    def recording(fn):
        def op(*a):
            rows.append(a[0].shape[0])
            return fn(*a)
        return op
    ns = SimpleNamespace(**{k: recording(f) for k, f in fns.items()})
    monkeypatch.setattr(kernels_attn, "_ops", lambda: ns)
    return rows


# ---- a prompt longer than a launch's grid rows -----------------------------------------------------------------
def _pre(h, fn, scale, base, iters, hc_eps, norm_eps, norm):  # stand-in arithmetic, row by row
    return h.sum(1), h[:, :, 0].float(), h[:, :, :1].float() * h[:, None, :, 1].float()


def _post_pre(x, res, post, comb, fn, scale, base, iters, hc_eps, norm_eps, norm):
    h = res + x[:, None] * post[..., None] + comb.sum(-1, keepdim=True)
    return (h, *_pre(h, fn, scale, base, iters, hc_eps, norm_eps, norm))


def test_prompt_rows_past_the_grid_limit_go_in_chunks(monkeypatch):
    # hc=fused_cuda's finish and attn / indexer=fused_cuda's head_rope run a block row per token on the grid's y axis
    # (launch_hc_finish, launch_head_rope refuse N > 65535): a 70000-token prompt's prefill used to fail mid-run
    n_tok = 70000
    rows = _fake_ops(monkeypatch, hc_pre=_pre, hc_post_pre=_post_pre,
                     hc_head=lambda h, fn, scale, base, hc_eps, norm_eps, norm: h.sum(1),
                     head_rope=lambda x, pos, freqs, norm, eps: x * 2 + pos[:, None, None])
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n_tok, 2, 4, generator=g)
    x, post, comb = torch.randn(n_tok, 4, generator=g), torch.rand(n_tok, 2, generator=g), torch.rand(n_tok, 2, 2)
    fn, sc, base = torch.zeros(8, 8), torch.ones(3), torch.zeros(8)
    for got, want in ((kernels_attn.hc_pre(h, fn, sc, base, 20, 1e-6, 1e-6), _pre(h, fn, sc, base, 0, 0, 0, None)),
                      (kernels_attn.hc_post_pre(x, h, post, comb, fn, sc, base, 20, 1e-6, 1e-6),
                       _post_pre(x, h, post, comb, fn, sc, base, 0, 0, 0, None)),
                      ((kernels_attn.hc_head(h, fn[:2], sc, base[:2], 1e-6, 1e-6),), (h.sum(1),))):
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert rows and max(rows) <= GRID_ROWS and sum(rows) == 3 * n_tok
    rows.clear()
    q, pos = torch.randn(n_tok, 1, 4, generator=g).bfloat16(), torch.arange(n_tok)
    assert torch.equal(kernels_attn.head_rope(q, pos, torch.ones(2), True, 1e-6), q * 2 + pos[:, None, None])
    assert max(rows) <= GRID_ROWS and sum(rows) == n_tok
    rows.clear()
    kernels_attn.hc_pre(h[:100], fn, sc, base, 20, 1e-6, 1e-6)  # what fits stays one launch
    assert rows == [100]


# ---- staging alignment --------------------------------------------------------------------------------------------
def test_attention_query_reaches_the_kernel_16_byte_aligned(monkeypatch):
    # the chunk kernel copies q in 16-byte cp.async copies; the binding checks the key rows' alignment, not q's
    seen = []

    def op(q, *a):
        seen.append(q.data_ptr() % 16)
        return q.clone()
    monkeypatch.setattr(kernels_attn, "_ops", lambda: SimpleNamespace(sparse_decode=op, sparse_attn=op))
    buf = torch.randn(1 + 2 * 4 * 64).bfloat16()
    q = buf[1:].view(2, 4, 64)  # contiguous, 2 bytes past an aligned address
    assert q.is_contiguous() and q.data_ptr() % 16
    win, pos, sink = torch.randn(2, 8, 64).bfloat16(), torch.tensor([3, 5]), torch.zeros(4)
    assert torch.equal(kernels_attn.sparse_decode(q, win, pos, None, None, 1, sink, 0.1, None), q)
    valid = torch.ones(1, 2, 8, dtype=torch.bool)
    assert torch.equal(kernels_attn.sparse_attn(q[None], win[:1], valid, None, None, sink, 0.1), q[None])
    assert seen == [0, 0]


# ---- hc_sinkhorn_iters = 0 ----------------------------------------------------------------------------------------
def test_zero_sinkhorn_iters_reach_the_kernels_as_one(monkeypatch):
    # ModelArgs takes hc_sinkhorn_iters = 0, which the reference computes as 1 (its loop runs iters - 1 times); to the
    # finishing kernels 0 means "deferred" (comb left holding the logits) and a ride refuses it
    from ds4.model.args import tiny
    from ds4.ops.base import SinkhornRide
    from ds4.ops.hc_cuda import FusedCudaHC
    from ds4.ops.hc_torch import sinkhorn
    assert tiny().replace(hc_sinkhorn_iters=0).hc_sinkhorn_iters == 0
    logits = torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sinkhorn(logits, 0, 1e-6), sinkhorn(logits, 1, 1e-6))
    seen = []
    monkeypatch.setattr(kernels_attn, "hc_pre", lambda h, fn, scale, base, iters, *a: seen.append(iters))
    h, fn, sc, base = _cuda(torch.randn(1, 4, 16).bfloat16()), torch.zeros(24, 64), torch.ones(3), torch.zeros(24)
    FusedCudaHC().pre(h, fn, sc, base, 0, 1e-6, 1e-6)
    FusedCudaHC().pre(h, fn, sc, base, 0, 1e-6, 1e-6, defer_sinkhorn=True)  # deferred: 0 is the kernels' own signal
    FusedCudaHC().pre(h, fn, sc, base, 20, 1e-6, 1e-6)
    assert seen == [1, 0, 20]
    assert SinkhornRide(logits, 0, 1e-6).args()[1] == 1 and SinkhornRide(logits, 20, 1e-6).args()[1] == 20


# ---- a model without RoPE dims ------------------------------------------------------------------------------------
def test_a_model_without_rope_dims_is_refused_before_loading():
    # rope_head_dim = 0 was accepted, yet the model rotates x[..., -0:] (the whole head: the torch reference fails in
    # its first prefill) and the indexer's scores kernel refuses an empty RoPE table (2 len(rope_freqs) >= 2)
    from ds4.model.args import tiny
    with pytest.raises(ValueError, match="rope_head_dim must be >= 1"):
        tiny().replace(rope_head_dim=0)
    assert tiny().replace(rope_head_dim=2).rope_head_dim == 2


# ---- the deferred compressor projection ---------------------------------------------------------------------------
@pytest.mark.parametrize("every,K,ok", [(8, 6400, True), (8, 6408, False), (5, 6400, True), (4, 12800, True),
                                        (4, 12808, False), (2, 25600, True), (2, 25608, False), (9, 64, False),
                                        (1, 64, False), (2, 12, False)])
def test_deferred_projection_rule_is_the_launchers(every, K, ok):
    # launch_gemv_deferred: the ring's tokens (every rounded up to 2, 4, 8) in bf16 within SMEM_CAP, K % 8 == 0
    assert kernels.gemv_deferred_ok(every, K) is ok


def test_deferred_projection_past_shared_memory_runs_the_twin(monkeypatch):
    # a model of dim 8192 with an 8-token ring: the launch refuses its 128 KB ring; the twin's deferred step instead
    from ds4.ops.attn_cuda import FusedCudaAttention
    a, seen = FusedCudaAttention(), []
    monkeypatch.setattr(kernels, "gemv_deferred", lambda *x: pytest.fail("launch past its shared memory"))
    monkeypatch.setattr(a._ref, "compress_deferred", lambda *x: seen.append("twin"))
    bf = lambda *s: _cuda(torch.zeros(*s, dtype=torch.bfloat16))  # noqa: E731
    a.compress_deferred(bf(1, 8192), bf(1, 8, 8192), bf(16, 8192), None, None, None, None, None, None,
                        bf(1, 4, 8), 8, False, 1e-6, None)
    assert seen == ["twin"]
    from ds4.kernels.ops import gemv_deferred  # (the wrapper itself refuses it before the op)
    with pytest.raises(ValueError, match="gemv_deferred_ok"):
        gemv_deferred(torch.zeros(1, 8192), torch.zeros(8, 8192), torch.zeros(16, 8192), torch.zeros(1))


# ---- a GEMV row past the launch's shared-memory staging ------------------------------------------------------------
@pytest.mark.parametrize("fmt,K,rows", [("bf16", 4096, 5), ("bf16", 20480, 1), ("bf16", 20488, 0), ("bf16", 32768, 0),
                                        ("fp8", 8192, 2), ("fp8t", 20480, 1), ("fp8", 20496, 0), ("fp4", 22752, 1),
                                        ("fp4t", 22784, 0), ("fp4p", 1024, 8)])
def test_gemv_staged_rows_rule_is_the_launchers(fmt, K, rows):
    # gemv_max_tokens: fp32 rows of K / VALS chunks of VALS + pad words within SMEM_CAP, at most 8 (worked by hand)
    assert kernels.gemv_max_tokens(fmt, K) == rows


def test_gemv_staging_mirror_is_the_kernels_layout():
    from ds4.kernels import ops
    common, gemv = (CSRC / "ds4_common.cuh").read_text(), (CSRC / "gemv.cu").read_text()
    info = re.findall(r"FmtInfo<FMT_(\w+)>\s*{\s*static constexpr int VALS = (\d+)", common)
    vals = {f.lower(): int(v) for f, v in info}
    bf16_pad, other_pad = map(int, re.search(r"CS = VALS \+ \(FMT == FMT_BF16 \? (\d+) : (\d+)\)", common).groups())
    assert {f: (v, v + (bf16_pad if f == "bf16" else other_pad)) for f, v in vals.items()} == ops.GEMV_STAGE_CHUNK
    cap = re.search(r"int gemv_max_tokens\(int fmt, int K\) {.*?return \(int\)\(n > (\d+) \? (\d+) : n\);", gemv, re.S)
    assert cap and int(cap[1]) == int(cap[2]) == ops.GEMV_MAX_STAGED_ROWS


def test_bf16_row_past_the_gemv_staging_takes_the_matmul(monkeypatch):
    # attn=fused_cuda_wo_bf16's merged wo_b.wo_a reads V4-Flash's 64 x 512 = 32768 values a row, past the BF16
    # launch's staging (20480): the op raised "too large for the shared-memory activation tile" in session 69's seed
    # sweep. linear=gemv_cuda multiplies such rows by the weight with the matmul; rows that fit still take the launch.
    from ds4.ops.base import QWeight
    from ds4.ops.linear_cuda import GemvCudaLinear
    launched = []
    monkeypatch.setattr(kernels, "gemv", lambda x, w, *a, **k: launched.append(w.shape) or x[:, :w.shape[0]] * 0)
    g = torch.Generator().manual_seed(0)
    for K in (32768, 20480):
        w = _cuda((torch.randn(16, K, generator=g) * 0.02).to(torch.bfloat16))
        x = _cuda(torch.randn(1, K, generator=g).to(torch.bfloat16))
        y = GemvCudaLinear()(x, QWeight("bf16", w))
        if K == 32768:
            assert launched == [] and torch.equal(y, torch.nn.functional.linear(x, w))
    assert launched == [(16, 20480)]


# ---- the MoE options' router ---------------------------------------------------------------------------------------
def _runnable(monkeypatch, component: str, name: str):
    e = registry.entry(component, name)
    monkeypatch.setitem(registry._ENTRIES[component], e.name, dataclasses.replace(e, check=lambda _device: None))


@pytest.mark.parametrize("name", ["fp4_topk", "bf16_cache"])
def test_moe_cuda_options_refuse_a_router_past_their_kernels_before_loading(monkeypatch, name):
    # the router's tail kernel (moe.route, every call, prompts too) selects at most ROUTER_MAX_K experts out of at most
    # ROUTER_MAX_EXPERTS; past them its launch failed at the first forward, after the weights had loaded
    _runnable(monkeypatch, "moe", name)
    cuda = torch.device("cuda")
    assert registry.resolve("moe", name, cuda, registry.Setup(topk=16, n_experts=1024))[0].name == name
    with pytest.raises(ImplUnavailable, match=rf"moe={name} cannot run here: its router kernels select at most 16"):
        registry.resolve("moe", name, cuda, registry.Setup(topk=17, n_experts=256))
    with pytest.raises(ImplUnavailable, match="score at most 1024 experts"):
        registry.resolve("moe", name, cuda, registry.Setup(topk=6, n_experts=2048))
    e, note = registry.resolve("moe", "auto", cuda, registry.Setup(topk=17))
    assert e.name != name and f"{name}: its router kernels select at most 16" in note


# ---- the Python mirrors of the kernels' constants ------------------------------------------------------------------
def _constants(path: Path) -> dict[str, int]:
    """constexpr int / long NAME = <integer expression of earlier names>; of one source."""
    out: dict[str, int] = {}
    for name, expr in re.findall(r"constexpr\s+(?:int|long)\s+(\w+)\s*=\s*([^;]+);", path.read_text()):
        try:
            out[name] = int(eval(expr.replace("/", "//"), {"__builtins__": {}}, dict(out)))  # noqa: S307
        except Exception:  # noqa: BLE001  (not a plain integer expression)
            pass
    return out


def test_python_limits_are_the_kernels_constants():
    from ds4.kernels import ops
    from ds4.ops import attn_cuda
    launch, topk = _constants(CSRC / "ds4_launch.h"), _constants(CSRC / "attn" / "topk.cu")
    pairs = [
        (ops.ARGMAX_MAX_ROWS, launch["ARGMAX_MAX_ROWS"]), (ops.PREFETCH_MAX_TENSORS, launch["PF_MAX_RANGES"]),
        (ops.AR_CHUNK, launch["AR_CHUNK"]), (ops.AR_MAX_WORLD, launch["AR_MAX_WORLD"]),
        (ops.AR_FOLD_ROWS, 16 * launch["AR_FOLD_TILES"]),
        (ops.ROUTER_MAX_K, _constants(CSRC / "route_dev.cuh")["ROUTER_MAX_K"]),
        (ops.ROUTER_MAX_EXPERTS, _constants(CSRC / "router.cu")["RT_MAX_THREADS"]),
        (ops.GEMV_SMEM_CAP, _constants(CSRC / "gemv.cu")["SMEM_CAP"]),
        (attn_cuda.INDEXER_MAX_ROPE, _constants(CSRC / "attn" / "indexer.cu")["IX_MAX_ROPE"]),
        (attn_cuda.QPREP_MAX_ROPE, _constants(CSRC / "attn" / "sparse_attn.cu")["SP_MAX_ROPE"]),
        (kernels_attn.ONE_BLOCK_TOPK_LEN, topk["TOPK_ONE_BLOCK_LEN"]),
        (kernels_attn.TOPK_MAX_LEN, topk["TOPK_WIDE_LEN"] * topk["TOPK_WIDE_MAX_BLOCKS"]),
        (attn_cuda.INDEXER_MAX_ROWS, topk["TOPK_WIDE_MAX_ROWS"]),
    ]
    assert [p for p in pairs if p[0] != p[1]] == []
    # the launchers that refuse more rows than MAX_GRID_ROWS, and the binding's cuBLAS slice HC_CHUNK_ROWS keeps whole
    hc, glue = (CSRC / "attn" / "hc.cu").read_text(), (CSRC / "attn" / "decode_glue.cu").read_text()
    assert f"N > {GRID_ROWS}" in hc and f"N > {GRID_ROWS}" in glue and kernels_attn.MAX_GRID_ROWS == GRID_ROWS
    slice_ = int(re.search(r"HC_GEMM_SLICE = (\d+)", (CSRC / "attn" / "attn_bindings.cpp").read_text())[1])
    assert kernels_attn.HC_CHUNK_ROWS % slice_ == 0 and kernels_attn.HC_CHUNK_ROWS <= GRID_ROWS
