"""End-to-end GPU checks: implementation options against the torch reference on `small`, the
whole-step CUDA graph against eager decode, and tensor parallel on two GPUs."""
from __future__ import annotations

import contextlib
import os
import socket

import pytest
import torch

from ds4.model.args import small, tiny
from ds4.model.transformer import Transformer
from ds4.ops import side_stream
from ds4.registry import Impls, ImplUnavailable, build_ops, torch_reference_ops
from ds4.runtime.generate import Generator
from ds4.weights.synthetic import random_weights

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
from gpu_common import require_extension  # noqa: E402

# with CUDA here, an extension that cannot build fails this module (its rows would otherwise read as skips)
require_extension("ds4.kernels")
require_extension("ds4.kernels_attn")

DEV = torch.device("cuda")


@pytest.fixture(scope="module")
def small_weights():
    return random_weights(small(), seed=0, device=DEV, include_mtp=False)


def _model(args, weights, impls=Impls(), numerics="plain", **kw):
    m = Transformer(args, build_ops(impls, DEV), numerics, torch.bfloat16, DEV, **kw)
    m.load_weights(weights)
    return m


def _options():
    combos = [dict(linear="gemv_cuda"), dict(moe="fp4_topk"), dict(linear="gemv_cuda", moe="fp4_topk"),
              dict(attn="fused_cuda", indexer="fused_cuda", hc="fused_cuda"),
              dict(linear="gemv_cuda", moe="fp4_topk", attn="fused_cuda", indexer="fused_cuda", hc="fused_cuda")]
    params = [pytest.param(c, {}, id=",".join(f"{k}={v}" for k, v in c.items())) for c in combos]
    # small's FP8 projections are short enough for the FMA kernels; DS4_MMA=all puts every one-token
    # product on the tensor cores, which is also what folds q_norm into wq_b (attn.q_up) at these shapes
    return params + [pytest.param(combos[-1], {"DS4_MMA": "all"}, id="all-fused,DS4_MMA=all"),
                     # without the router fold (the default: the FFN's hc launch also forms the router's logits)
                     pytest.param(combos[-1], {"DS4_HC_ROUTER": "0"}, id="all-fused,DS4_HC_ROUTER=0"),
                     # the hc fold (the default): small's eager steps request folds that no kernel forms (wo_b's and
                     # the shared expert's FP8 rows take the FMA kernels: every site falls back, as in the plain row);
                     # with DS4_MMA=all every one folds; DS4_HC_FOLD=0 requests none
                     pytest.param(combos[-1], {"DS4_HC_FOLD": "0"}, id="all-fused,DS4_HC_FOLD=0"),
                     pytest.param(combos[-1], {"DS4_HC_FOLD": "1", "DS4_MMA": "all"}, id="all-fused,DS4_HC_FOLD=1,MMA=all"),
                     # with the projection fold (opt-in: the attention site's finish also forms wq_a + wkv's rows
                     # wherever a fold was formed)
                     # (its hc kernel reads the stored fp8 rows: DS4_FP8_TILE=0)
                     pytest.param(combos[-1], {"DS4_HC_FOLD": "1", "DS4_MMA": "all", "DS4_HC_QKV": "1",
                                               "DS4_FP8_TILE": "0"},
                                  id="all-fused,DS4_HC_FOLD=1,MMA=all,DS4_HC_QKV=1"),
                     # the routed experts in fp4p (small's take the default fp4t layout in the other rows)
                     pytest.param(combos[-1], {"DS4_FP4_TILE": "0"}, id="all-fused,DS4_FP4_TILE=0"),
                     # the routed and shared experts in one launch (opt-in), with and without the hc fold
                     pytest.param(combos[-1], {"DS4_MOE_FFN": "1"}, id="all-fused,DS4_MOE_FFN=1"),
                     pytest.param(combos[-1], {"DS4_MOE_FFN": "1", "DS4_HC_FOLD": "1", "DS4_MMA": "all"},
                                  id="all-fused,DS4_MOE_FFN=1,HC_FOLD=1,MMA=all"),
                     # the routed experts' split-K pair (opt-in), with the hc fold on every site
                     pytest.param(combos[-1], {"DS4_MOE_SPLITK": "1", "DS4_HC_FOLD": "1", "DS4_MMA": "all"},
                                  id="all-fused,DS4_MOE_SPLITK=1,HC_FOLD=1,MMA=all"),
                     # the routed gate+up on the integer pipe (w1 / w3 stored, w2 fp4t)
                     pytest.param({**combos[-1], "moe": "fp4_dp4a"}, {}, id="all-fused,moe=fp4_dp4a")]


# A step is "confident" when the reference's top-2 logit gap exceeds this. At 1.0, one step in ~100
# still flipped on `small` (an MoE routing near-tie moves a whole layer's output); 2.0 is the stated bar.
MARGIN = 2.0


def _agreement(got_top1: torch.Tensor, ref_logits: torch.Tensor) -> tuple[float, float, int]:
    """(overall top-1 agreement, agreement on confident steps, number of confident steps).

    Synthetic weights give flat distributions: BF16 rounding in another order legitimately flips
    near-ties (and, through MoE routing, moves later logits), so the strict bar is set on the
    steps where the reference is confident (BENCHMARKING.md, fidelity)."""
    ref_logits = ref_logits.float().cpu()
    top2 = ref_logits.topk(2, -1).values
    conf = (top2[:, 0] - top2[:, 1]) > MARGIN
    agree = got_top1.cpu() == ref_logits.argmax(-1)
    gaps = (top2[:, 0] - top2[:, 1])[~agree]
    print(f"agreement {agree.float().mean():.4f} overall, {agree[conf].float().mean():.4f} on {int(conf.sum())} "
          f"steps with margin > {MARGIN}; reference gaps at the misses: {sorted(gaps.tolist())[-5:]}")
    return agree.float().mean().item(), agree[conf].float().mean().item(), int(conf.sum())


# How far below the rounding floor (_rounding_floor) a run's overall agreement may sit: another bf16 rounding order
# flips another set of near-ties, of about the same size (session 59, H100: the fused qat rows 0.7266 and 0.6953,
# the plain all-fused 0.9375, against floors of 0.7266 and 0.9531 on CPU for the same model and prompts).
FLOOR_SLACK = 0.05


def _rounding_floor(args, weights, prompt, toks, ref_logits, numerics="plain") -> float:
    """Overall top-1 agreement of the torch reference in fp32 activations with the bf16 reference (ref_logits),
    teacher-forced on the same tokens: how many greedy picks bf16 rounding alone moves on this model. Synthetic
    weights' next-token distributions are flat, so it is far from 1 (session 59, CPU, small's weights of seed 0 and
    these tests' prompts: 0.7266 under qat, 0.9531 plain; experiments/decode_session59_h100.md)."""
    m = Transformer(args, build_ops(Impls(), DEV), numerics, torch.float32, DEV)
    m.load_weights(weights)
    return _agreement(Generator(m, 1, 512).teacher_forced_logits(prompt, toks).argmax(-1), ref_logits)[0]


@pytest.mark.parametrize("limit", [None, "256"])
def test_long_prompt_prefill_agrees_with_reference_on_small(limit, small_weights, monkeypatch):
    """A 200-token prompt: every option fused, the MoE's prefill in the grouped expert loop on device-dequantised
    weights (past the default limit, ds4.ops.moe_cuda.CHUNKED_TOKENS) or in decode-kernel chunks
    (DS4_MOE_CHUNKED_TOKENS=256); the prompt's state then feeds 128 teacher-forced decode steps on the reference's
    greedy tokens: the bar of the options test below."""
    if limit is None:
        monkeypatch.delenv("DS4_MOE_CHUNKED_TOKENS", raising=False)
    else:
        monkeypatch.setenv("DS4_MOE_CHUNKED_TOKENS", limit)
    args = small()
    prompt = [(29 * i + 3) % args.vocab_size for i in range(200)]
    ref = Generator(_model(args, small_weights), 1, 512)
    toks = ref.generate([prompt], 128, stop_at_eos=False).tokens[0]
    ref_logits = ref.teacher_forced_logits(prompt, toks)
    fused = dict(linear="gemv_cuda", moe="fp4_topk", attn="fused_cuda", indexer="fused_cuda", hc="fused_cuda")
    lf = Generator(_model(args, small_weights, Impls(**fused)), 1, 512).teacher_forced_logits(prompt, toks)
    overall, confident, n = _agreement(lf.argmax(-1), ref_logits)
    assert n >= 8 and confident >= 0.99 and overall >= 0.9, (overall, confident, n)


@pytest.mark.parametrize("impls,env", _options())
def test_options_agree_with_reference_on_small(impls, env, small_weights, monkeypatch):
    """Teacher-forced on the reference's 256 greedy tokens: >= 99% top-1 agreement on confident
    steps, >= 90% overall."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        ops = build_ops(Impls(**impls), DEV)
    except ImplUnavailable as e:
        pytest.skip(str(e))
    args = small()
    prompt = [(13 * i + 7) % args.vocab_size for i in range(32)]
    ref = Generator(_model(args, small_weights), 1, 512)
    toks = ref.generate([prompt], 256, stop_at_eos=False).tokens[0]
    ref_logits = ref.teacher_forced_logits(prompt, toks)
    fast = Transformer(args, ops, "plain", torch.bfloat16, DEV)
    fast.load_weights(small_weights)
    folds = _record_folds(ops.hc)
    ffn_calls = _count_calls(ops.moe, "ffn")
    dp4a_calls = _count_dp4a(ops.moe)
    lf = Generator(fast, 1, 512).teacher_forced_logits(prompt, toks)
    overall, confident, n = _agreement(lf.argmax(-1), ref_logits)
    assert n >= 16 and confident >= 0.99 and overall >= 0.9, (overall, confident, n)
    if impls.get("moe") == "fp4_dp4a":  # every decode step's routed gate+ups took the integer pipe
        assert dp4a_calls[0] >= 255 * (args.n_layers - args.n_hash_layers), dp4a_calls
    if env.get("DS4_HC_FOLD") == "1":  # the option ran as described at _options (DS4_MMA=all: every request folds)
        assert folds and all(f.fused for f in folds), (len(folds), sum(f.fused for f in folds))
    if env.get("DS4_HC_FOLD") == "0":
        assert not folds
    if env.get("DS4_MOE_FFN") == "1":  # every decode step's FFNs took the one launch
        assert ffn_calls[0] >= 255 * args.n_layers, ffn_calls


@pytest.mark.parametrize("impls", [dict(attn="fused_cuda", indexer="fused_cuda", hc="fused_cuda"),
                                   dict(linear="gemv_cuda", moe="fp4_topk", attn="fused_cuda", indexer="fused_cuda",
                                        hc="fused_cuda")], ids=["attn,indexer,hc", "all-fused"])
def test_qat_options_agree_with_reference_on_small(impls, small_weights):
    """numerics=qat (issue #5's second numerics mode) end to end: the fused options against the torch reference under
    qat, teacher-forced on its 256 greedy tokens: >= 99 % on confident steps, as in plain, and overall no more than
    FLOOR_SLACK below the qat reference's own rounding floor (_rounding_floor). qat's FP8 simulations turn a one-ulp
    difference before a quantisation into a whole FP8 step, so that floor is low: session 58 wrote an overall bar of
    80 % without a GPU; session 59's H100 printed 0.7266 / 0.6953 for the two rows, and the fp32 qat reference
    agreed with the bf16 one on 0.7266 (CPU). The floor is measured here, on the GPU, each time: session 60's H200
    printed 0.6719 for it, and the rows' 0.7266 / 0.6953 passed."""
    args = small()
    prompt = [(13 * i + 7) % args.vocab_size for i in range(32)]
    ref = Generator(_model(args, small_weights, numerics="qat"), 1, 512)
    toks = ref.generate([prompt], 256, stop_at_eos=False).tokens[0]
    ref_logits = ref.teacher_forced_logits(prompt, toks)
    lf = Generator(_model(args, small_weights, Impls(**impls), numerics="qat"), 1, 512).teacher_forced_logits(prompt,
                                                                                                           toks)
    overall, confident, n = _agreement(lf.argmax(-1), ref_logits)
    floor = _rounding_floor(args, small_weights, prompt, toks, ref_logits, "qat")
    assert n >= 16 and confident >= 0.99 and overall >= floor - FLOOR_SLACK, (overall, confident, n, floor)


def test_all_fused_agree_as_well_as_rounding_allows(small_weights):
    """Issue #5 asks for >= 99 % greedy agreement over 256 tokens on `small`: a bar for peaked next-token
    distributions. Synthetic weights' are flat, and the reference's own bf16 rounding moves many picks: its fp32 form
    agrees with it on only part of the steps (_rounding_floor). So every option fused, teacher-forced on the bf16
    reference's 256 greedy tokens, must agree with it overall no more than FLOOR_SLACK below that floor, and on
    >= 99 % of the confident steps. (Session 58's form scaled the LM head by 8 to make the reference confident: a
    power of two scales the logits' rounding differences with their margins, so it changed which steps count as
    confident, not one pick; session 59's H100 printed 0.9375 overall.) Session 60's H200: 0.9375 against a floor
    of 0.9492, every confident step agreeing."""
    args = small()
    prompt = [(17 * i + 3) % args.vocab_size for i in range(32)]
    ref = Generator(_model(args, small_weights), 1, 512)
    toks = ref.generate([prompt], 256, stop_at_eos=False).tokens[0]
    ref_logits = ref.teacher_forced_logits(prompt, toks)
    lf = Generator(_model(args, small_weights, Impls(**_FUSED)), 1, 512).teacher_forced_logits(prompt, toks)
    overall, confident, n = _agreement(lf.argmax(-1), ref_logits)
    floor = _rounding_floor(args, small_weights, prompt, toks, ref_logits)
    assert len(toks) == 256 and n >= 8 and confident >= 0.99 and overall >= floor - FLOOR_SLACK, \
        (overall, confident, n, floor)


def test_bf16_dense_weights_agree_with_reference_on_small(monkeypatch):
    """weight_dtype=bf16 (BF16 dense projections, FP4 experts): every option fused, the dense GEMVs in the GEMV
    launch's BF16 form; the bar of the options test above, and linear=gemv_cuda really launched it at decode."""
    import dataclasses

    from ds4.ops import linear_cuda

    class Spy:  # linear=gemv_cuda's view of ds4.kernels, counting its BF16 GEMV launches
        def __init__(self, real):
            self.real, self.bf16 = real, 0

        def __getattr__(self, name):
            return getattr(self.real, name)

        def gemv(self, x, w, scale, fmt, *a, **kw):
            self.bf16 += fmt == "bf16"
            return self.real.gemv(x, w, scale, fmt, *a, **kw)

    args = dataclasses.replace(small(), weight_dtype="bf16")
    weights = random_weights(args, seed=1, device=DEV, include_mtp=False)
    prompt = [(11 * i + 5) % args.vocab_size for i in range(32)]
    ref = Generator(_model(args, weights), 1, 512)
    toks = ref.generate([prompt], 256, stop_at_eos=False).tokens[0]
    ref_logits = ref.teacher_forced_logits(prompt, toks)
    fast = _model(args, weights, Impls(**_FUSED))
    spy = Spy(linear_cuda.kernels)
    monkeypatch.setattr(linear_cuda, "kernels", spy)
    lf = Generator(fast, 1, 512).teacher_forced_logits(prompt, toks)
    overall, confident, n = _agreement(lf.argmax(-1), ref_logits)
    assert n >= 16 and confident >= 0.99 and overall >= 0.9, (overall, confident, n)
    assert spy.bf16 >= 255 * args.n_layers, spy.bf16  # at least wo_b's, every layer of every decode step


def _count_calls(obj, name: str) -> list[int]:
    """[calls] of obj.name from now on (0 and never counted where obj has no such method)."""
    calls, fn = [0], getattr(obj, name, None)
    if fn is not None:
        def counting(*args, **kw):
            calls[0] += 1
            return fn(*args, **kw)
        setattr(obj, name, counting)
    return calls


def _count_dp4a(moe) -> list[int]:
    """[routed gate+up launches that chose kernel "dp4a"] from now on (moe=fp4_dp4a's _gate_up_kernel)."""
    calls, fn = [0], getattr(moe, "_gate_up_kernel", None)
    if fn is not None:
        def counting(*args, **kw):
            k = fn(*args, **kw)
            calls[0] += k == "dp4a"
            return k
        moe._gate_up_kernel = counting
    return calls


def _record_folds(hc) -> list:
    """The hc fold requests an hc implementation hands out from now on (recorded on the instance)."""
    made, fold = [], getattr(hc, "fold", None)
    if fold is not None:
        def recording(*args):
            f = fold(*args)
            if f is not None:
                made.append(f)
            return f
        hc.fold = recording
    return made


_FUSED = dict(linear="gemv_cuda", moe="fp4_topk", attn="fused_cuda", indexer="fused_cuda", hc="fused_cuda")


def _tiny_weights_for(impls: Impls, seed: int, vocab: int | None = None):
    """(tiny's args, its random weights on the GPU); skips the test where these implementations cannot be built.
    vocab: another vocabulary width (tiny's is 512)."""
    try:
        build_ops(impls, DEV)
    except ImplUnavailable as e:
        pytest.skip(str(e))
    args = tiny() if vocab is None else tiny().replace(vocab_size=vocab)
    return args, random_weights(args, seed=seed, device=DEV, include_mtp=False)


@pytest.mark.parametrize("impls,graph_env,env", [
    pytest.param(Impls(), {}, {}, id="torch"),
    pytest.param(Impls(linear="gemv_cuda", moe="fp4_topk"), {}, {}, id="kernels"),
    # every option fused, the library's defaults in both runtimes
    pytest.param(Impls(**_FUSED), {}, {}, id="fused"),
    # the opt-in launch orders, in the graph only: eager (plain PDL order) is the reference
    pytest.param(Impls(**_FUSED), {"DS4_SHARED_FORK": "late", "DS4_ROUTE_IN_MOE": "1", "DS4_SIDE_PRIORITY": "high",
                                    "DS4_L2_PREFETCH": "all"}, {}, id="fused-optins"),
    # without the router fold in both runtimes (the default fused rows fold: its logits are its own rounding of
    # x . gate^T)
    pytest.param(Impls(**_FUSED), {}, {"DS4_HC_ROUTER": "0"}, id="fused-no_router_fold"),
    # the hc fold in both runtimes, at both sites (DS4_MMA=all: tiny's wo_b on the tensor cores); one row
    pytest.param(Impls(**_FUSED), {}, {"DS4_HC_FOLD": "1", "DS4_MMA": "all"}, id="fused-hc_fold"),
    # the same with the projection fold (opt-in: the attention site's finish forms wq_a + wkv's rows)
    pytest.param(Impls(**_FUSED), {}, {"DS4_HC_FOLD": "1", "DS4_MMA": "all", "DS4_HC_QKV": "1", "DS4_FP8_TILE": "0"},
                 id="fused-hc_fold-proj_fold"),
    # the one-token tensor-core kernels staging their activations by bulk copies (opt-in, sm_90; graph only: eager's
    # register staging is the reference), one decode row as the hc fold rows take
    pytest.param(Impls(**_FUSED), {"DS4_BULK_STAGE": "all"}, {"DS4_HC_FOLD": "1", "DS4_MMA": "all"},
                 id="fused-hc_fold-bulk_stage"),
    # the shared expert's branch joined to the routed down by programmatic edges (opt-in; graph only)
    pytest.param(Impls(**_FUSED), {"DS4_PJOIN": "all"}, {}, id="fused-programmatic_join"),
    # a captured graph per compressor phase, the compressor branches joined late where no window ends (opt-in)
    pytest.param(Impls(**_FUSED), {"DS4_LATE_COMPRESS": "1"}, {}, id="fused-late_compress"),
    # the attention combine letting wo_a launch only after its own PDL wait (the form before session 74; graph only)
    pytest.param(Impls(**_FUSED), {"DS4_COMBINE_TRIGGER": "wait"}, {}, id="fused-combine_trigger_wait"),
    # the hc finishes letting the next launch start only after their own PDL wait (the form before session 74)
    pytest.param(Impls(**_FUSED), {"DS4_HC_TRIGGER": "wait"}, {}, id="fused-hc_trigger_wait"),
    # the router's top-k letting the routed gate+up launch at its start (opt-in; graph only)
    pytest.param(Impls(**_FUSED), {"DS4_ROUTER_TRIGGER": "early"}, {}, id="fused-router_trigger_early"),
    # the shared expert's branch forked by a full edge (DS4_PFORK=none: the form before session 76; graph only)
    pytest.param(Impls(**_FUSED), {"DS4_PFORK": "none"}, {}, id="fused-fork_full_edge"),
    # the shared expert's branch forked by programmatic edges (the default; graph only), its gate+up on the tensor cores
    # (DS4_MMA=all: tiny's shapes), which load their first weight rounds before their PDL wait, in both runtimes
    pytest.param(Impls(**_FUSED), {"DS4_PFORK": "shared"}, {"DS4_MMA": "all"}, id="fused-programmatic_fork_shared"),
    # the routed gate+up on the integer pipe (moe=fp4_dp4a) in both runtimes
    pytest.param(Impls(**{**_FUSED, "moe": "fp4_dp4a"}), {}, {}, id="fused-dp4a")])
def test_cuda_graph_matches_eager_1000_steps(impls, graph_env, env, monkeypatch):
    """tiny crosses 60+ window wraps, 250 CSA and 60 HCA emissions in 1000 steps. graph_env: set for the
    captured run only; env: for both runs. With DS4_LATE_COMPRESS=1 the two prompts put the rows in different
    compressor phases, so the step replays each of its graphs (one per phase: {}, {4}, {4, 16})."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    args, w = _tiny_weights_for(impls, seed=2)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [300, 2, 9]]
    if env.get("DS4_HC_FOLD") == "1":
        prompts = prompts[:1]  # the hc fold takes one decode row
    outs = []
    forks = side_stream.programmatic_fork_count()
    for runtime in ("eager", "cuda_graph"):
        for k, v in graph_env.items():
            if runtime == "cuda_graph":
                monkeypatch.setenv(k, v)
        g = Generator(_model(args, w, impls), 2, 1100, runtime=runtime)
        outs.append(g.generate(prompts, 1000, stop_at_eos=False).tokens)
    assert outs[0] == outs[1]
    made = side_stream.programmatic_fork_count() - forks  # forks by programmatic edges while capturing
    if graph_env.get("DS4_PFORK") == "none":
        assert made == 0
    elif graph_env.get("DS4_PFORK"):
        assert made > 0


@pytest.mark.parametrize("late", [None, "1"], ids=["one_graph", "late_compress"])
def test_cuda_graph_matches_eager_1000_steps_on_small(late, small_weights, monkeypatch):
    """tiny's window (16) and ratios (4, 16) are not V4's: on `small` (window 128, ratios 4 and 128) two rows decode
    1000 steps, crossing 8 window wraps, about 250 CSA and 8 HCA emissions, every option fused; the captured graph
    (one, or one per compressor phase: DS4_LATE_COMPRESS=1) gives the eager tokens. (Written in session 58 without a
    GPU.)"""
    if late is None:
        monkeypatch.delenv("DS4_LATE_COMPRESS", raising=False)
    else:
        monkeypatch.setenv("DS4_LATE_COMPRESS", late)
    args = small()
    prompts = [[(13 * i + 7) % args.vocab_size for i in range(32)], [300, 2, 9]]
    assert args.window_size == 128 and set(args.compress_ratios) >= {4, 128}
    outs = []
    for runtime in ("eager", "cuda_graph"):
        g = Generator(_model(args, small_weights, Impls(**_FUSED)), 2, 1100, runtime=runtime)
        outs.append(g.generate(prompts, 1001, stop_at_eos=False).tokens)
    for row in range(2):
        first = next((i for i, (a, b) in enumerate(zip(outs[0][row], outs[1][row])) if a != b), None)
        assert first is None, f"row {row}: graph and eager tokens part at step {first}"


@pytest.mark.parametrize("defer", [0, 4], ids=["per_token", "deferred"])
def test_batch1_graph_matches_eager(defer):
    """Batch-1 decode, 1000 steps of tiny (250 CSA windows, 60 HCA ones), every fused kernel: the captured graph
    gives the eager tokens, with each token's compressor projection at its own step, and deferred to groups of 4
    (Attention.defer_compress: rings in the state; the projections and steps in the compressor branches). Batch 1
    is where the hc fold (the default) runs: before session 40 an eager step formed the FFN's block output in the
    shared expert's down kernel, which does not fold at tiny's shapes, and the tokens parted at step 152."""
    impls = Impls(**_FUSED)
    args, w = _tiny_weights_for(impls, seed=3)
    outs = []
    for runtime in ("eager", "cuda_graph"):
        m = _model(args, w, impls)
        for blk in m.layers:
            blk.attn.defer_compress = defer
        g = Generator(m, 1, 1100, runtime=runtime)
        rings = sum(k.endswith("_x") for st in g.state.layers for k in st)
        assert rings == (6 if defer else 0)  # 2 CSA x (comp, icomp), 2 HCA
        outs.append(g.generate([[5, 6, 7, 8, 9, 10, 11]], 1000, stop_at_eos=False).tokens[0])
    first = next((i for i, (a, b) in enumerate(zip(*outs)) if a != b), None)
    assert first is None, f"graph and eager tokens part at step {first} of {len(outs[0])}"


def test_teacher_forced_logits_replay_the_captured_step():
    """Fidelity under runtime=cuda_graph measures the captured step (Generator.teacher_forced_logits replays the
    'logits' graph): its logits agree with eager decode's over 300 teacher-forced steps of tiny (window wraps and
    compressor emissions), and the positions it leaves are the device's."""
    impls = Impls(**_FUSED)
    args, w = _tiny_weights_for(impls, seed=4)
    prompt, cont = [5, 6, 7, 8, 9], [(37 * i + 11) % args.vocab_size for i in range(300)]
    got = {}
    for runtime in ("eager", "cuda_graph"):
        g = Generator(_model(args, w, impls), 1, 400, runtime=runtime)
        got[runtime] = g.teacher_forced_logits(prompt, cont).float()
        assert list(g.graphs) == ([(1, "logits")] if runtime == "cuda_graph" else [])
    assert got["eager"].shape == got["cuda_graph"].shape == (300, args.vocab_size)
    assert torch.equal(got["eager"].argmax(-1), got["cuda_graph"].argmax(-1))
    assert (got["eager"] - got["cuda_graph"]).abs().max().item() < 0.05


@pytest.mark.parametrize("attn", ["torch", "fused_cuda"])
def test_capture_after_a_sequence_at_max_seq_len(attn):
    """A generate runs row 0 to max_seq_len - 1; a capture of another (batch, mode)
    then warms up at positions 0, 1 (it warmed up from max_seq_len - 1, and the torch compressor step's
    cache[pos // m] at max_seq_len is out of bounds: a device-side assert); the new graph decodes as eager. (Passed
    on an H100, session 59.)"""
    impls = Impls(attn=attn) if attn == "torch" else Impls(**_FUSED)
    args, w = _tiny_weights_for(impls, seed=6)
    outs = []
    for runtime in ("eager", "cuda_graph"):
        g = Generator(_model(args, w, impls), 2, 64, runtime=runtime)
        assert g.generate([[1, 2, 3]], 100, stop_at_eos=False).truncated
        outs.append(g.generate([[5, 6, 7], [9, 10]], 40, stop_at_eos=False).tokens)
        g.check_positions()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("vocab", [None, 129280], ids=["tiny_vocab", "v4_vocab"])
def test_sampled_generate_graph_matches_eager(vocab):
    """Seeded sampling inside the graph ('sample' mode: temperature, top-k, top-p and the exponential draw captured,
    from the step's registered generator) draws the eager run's tokens, two rows at different positions; a second
    call with the same seed draws them again, and other settings recapture. At tiny's 512-token vocabulary (passed,
    session 59, one H100) and at V4's 129280-wide rows (the sort and draw the real model captures)."""
    from ds4.runtime.sampling import Sampling
    impls = Impls(**_FUSED)
    args, w = _tiny_weights_for(impls, seed=7, vocab=vocab)
    s = Sampling(temperature=0.8, top_k=40, top_p=0.95, seed=11)
    hot = Sampling(temperature=1.5, seed=11)  # no top-k / top-p: another capture
    prompts = [[5, 6, 7, 8, 9, 10, 11], [300, 2, 9]]
    outs = []
    for runtime in ("eager", "cuda_graph"):
        g = Generator(_model(args, w, impls), 2, 300, runtime=runtime)
        first = g.generate(prompts, 200, s, stop_at_eos=False).tokens
        assert g.generate(prompts, 200, s, stop_at_eos=False).tokens == first
        outs.append((first, g.generate(prompts, 50, hot, stop_at_eos=False).tokens))
        g.check_positions()
        if runtime == "cuda_graph":
            assert list(g.graphs) == [(2, "sample")] and g.graphs[(2, "sample")].sampling.temperature == 1.5
    assert outs[0] == outs[1]


def test_graph_pool_figure_and_release():
    """pool_bytes is the reserved size of the graphs' private pools (the segments
    torch's allocator holds for them), not the memory_allocated delta (the live outputs and whatever warm-up left
    allocated); and nothing of a captured step stays allocated once its Generator is gone. (Passed on an H100,
    session 59.)"""
    import gc

    from ds4.runtime.cuda_graph import pool_bytes
    impls = Impls(**_FUSED)
    args, w = _tiny_weights_for(impls, seed=8)
    m = _model(args, w, impls)
    Generator(m, 1, 256).generate([[5, 6, 7]], 4, stop_at_eos=False)  # eager: the default stream's cuBLAS workspace
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(DEV)
    g = Generator(m, 1, 256, runtime="cuda_graph")
    g.generate([[5, 6, 7]], 8, stop_at_eos=False)
    step = g.graphs[(1, "argmax")]
    pools = [pool_bytes(gr, DEV) for gr in step.graphs.values()]
    assert step.pool_bytes == sum(pools) and all(p > 0 for p in pools)
    del g, step
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated(DEV) - base < 1 << 20


def test_fp8t_layout_decodes_as_fp8(monkeypatch):
    """linear=gemv_cuda lays tiny's dense FP8 projections out as fp8t at load (DS4_FP8_TILE unset: auto), and
    moe=fp4_topk its shared experts; the merged weights' row views in the same storage and format, the indexer reading
    its rows of the merged wq_bi; a graph decode of 300 steps gives the tokens of the stored layout (DS4_FP8_TILE=0),
    whose kernels form the same bits. Configuring the loaded model again re-lays the same storage (the bench's
    notile8)."""
    impls = Impls(**_FUSED)
    args, w = _tiny_weights_for(impls, seed=5)
    outs = []
    for mode in ("auto", "0"):
        monkeypatch.setenv("DS4_FP8_TILE", mode)
        m = _model(args, w, impls)
        fmt = "fp8t" if mode == "auto" else "fp8"
        for blk in m.layers:
            a = blk.attn
            parts = [a.wqkv_a, a.wq_a, a.wkv, a.wq_b, a.wo_a, a.wo_b] + ([a.wq_bi, a.idx_wq_b] if a.wq_bi else [])
            assert {q.fmt for q in parts} == {fmt}
            assert a.wq_a.weight.data_ptr() == a.wqkv_a.weight.data_ptr()
            if a.indexer is not None:
                assert a.indexer.wq_b is a.idx_wq_b
            f = blk.ffn  # the shared expert (moe=fp4_topk's prepare), its buffers the laid-out tensors
            assert {f.shared_w1.fmt, f.shared_w2.fmt, f.shared_w3.fmt, f.mw.shared_w2.fmt} == {fmt}
            assert f.shared_w2_weight is f.shared_w2.weight is f.mw.shared_w2.weight
        outs.append(Generator(m, 1, 400, runtime="cuda_graph").generate([[5, 6, 7, 8, 9]], 300,
                                                                         stop_at_eos=False).tokens[0])
    assert outs[0] == outs[1]
    monkeypatch.setenv("DS4_FP8_TILE", "auto")
    m.configure(ops=build_ops(impls, DEV))
    assert m.layers[0].attn.wo_b.fmt == m.layers[0].ffn.shared_w1.fmt == "fp8t"


@pytest.mark.parametrize("mode", ["1", "2"])
def test_moe_ffn_graph_matches_eager_on_small(mode, small_weights, monkeypatch):
    """The one-launch FFN (DS4_MOE_FFN=1; tiny's dims are below its run widths, small's are not) captured in the
    decode graph, its grid barrier replayed every layer of 400 steps, with the hc fold: the same tokens as eager.
    Mode 2: in the graph the shared expert's gate+up is a side-stream launch and the one launch takes its h row."""
    for k, v in {"DS4_MOE_FFN": mode, "DS4_HC_FOLD": "1", "DS4_MMA": "all"}.items():
        monkeypatch.setenv(k, v)
    args = small()
    prompt = [(13 * i + 7) % args.vocab_size for i in range(32)]
    outs = []
    for runtime in ("eager", "cuda_graph"):
        m = _model(args, small_weights, Impls(**_FUSED))
        calls = _count_calls(m.ops.moe, "ffn")
        outs.append(Generator(m, 1, 512, runtime=runtime).generate([prompt], 400, stop_at_eos=False).tokens)
        assert calls[0] >= args.n_layers, calls  # eager: every step; graph: the capture (replays run no Python)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("env", [{}, {"DS4_HC_FOLD": "1", "DS4_MMA": "all"}], ids=["plain", "hc_fold"])
def test_sinkhorn_ride_decodes_as_the_finish(env, small_weights, monkeypatch):
    """The Sinkhorn ride (the default) against DS4_SINKHORN_RIDE=0 on small: the same logits bit for bit over 48
    eager decode steps, and the same 200 tokens from the captured graph; the ride reached both sites' launches in
    every layer of every eager step."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    args = small()
    prompt = [(11 * i + 5) % args.vocab_size for i in range(20)]
    logits, tokens, rides = [], [], []
    for mode in ("0", "1"):
        monkeypatch.setenv("DS4_SINKHORN_RIDE", mode)
        m = _model(args, small_weights, Impls(**_FUSED))
        rides.append([_count_ride(m.ops.attn, "decode"), _count_ride(m.ops.moe, "route")])
        g = Generator(m, 1, 512)
        g.prefill([prompt])
        logits.append(torch.stack([g.decode(torch.tensor([(7 * t + 3) % args.vocab_size], device=DEV))[0]
                                   for t in range(48)]))
        tokens.append(Generator(m, 1, 512, runtime="cuda_graph").generate([prompt], 200, stop_at_eos=False).tokens)
    assert torch.equal(logits[0], logits[1]) and tokens[0] == tokens[1]
    assert rides[0] == [[0], [0]] and rides[1][0][0] >= 48 * args.n_layers and rides[1][1][0] >= 48 * args.n_layers


def _count_ride(obj, name: str) -> list[int]:
    """[calls of obj.name that took a SinkhornRide] from now on."""
    calls, fn = [0], getattr(obj, name)

    def counting(*args, **kw):
        calls[0] += kw.get("ride") is not None
        return fn(*args, **kw)
    setattr(obj, name, counting)
    return calls


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _rank_group(rank, world, port):
    """One spawned rank of a CUDA process group on this host: yields its device, tears the group down."""
    import torch.distributed as dist
    from ds4 import dist as ddist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    ddist.init("cuda", world)
    try:
        yield torch.device("cuda", rank)
    finally:
        dist.destroy_process_group()


def _tp_worker(rank, world, port, comm, experts, shared, ar_fold, mma, path):
    import json
    from ds4 import dist as ddist
    os.environ["DS4_AR_FOLD"] = "1" if ar_fold else "0"
    if mma:
        os.environ["DS4_MMA"] = mma
    with _rank_group(rank, world, port) as dev:
        args = small()
        job = json.load(open(path))
        w = random_weights(args, seed=0, device=dev, rank=rank, world=world, include_mtp=False, experts=experts,
                           shared=shared)
        # experts=tp runs the kernels (each rank's MoE launches then take every expert, 1/W of its rows)
        ops = torch_reference_ops() if experts == "ep" else build_ops(Impls(**_FUSED), dev)
        m = Transformer(args, ops, "plain", torch.bfloat16, dev, rank=rank, world=world,
                        comm=ddist.TensorParallel("fp32", comm, device=dev))
        m.load_weights(w)
        tf = Generator(m, 1, 512).teacher_forced_logits(job["prompt"], job["ref"]).argmax(-1).tolist()
        eager = Generator(m, 1, 512).generate([job["prompt"]], 128, stop_at_eos=False).tokens[0]
        graph = Generator(m, 1, 512, runtime="cuda_graph").generate([job["prompt"]], 128, stop_at_eos=False).tokens[0]
        if rank == 0:
            json.dump({**job, "tf": tf, "eager": eager, "graph": graph}, open(path, "w"))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("comm,experts,shared,ar_fold,mma", [
    ("nccl", "ep", "replicate", False, None), ("symm_mem", "ep", "replicate", False, None),
    ("symm_mem", "tp", "replicate", False, None), ("ll", "tp", "replicate", False, None),
    ("ll", "tp", "tp", False, None), ("ll", "tp", "replicate", True, None), ("ll", "tp", "tp", True, None),
    ("ll", "tp", "tp", False, "all")],
    ids=["nccl-experts_ep", "symm_mem-experts_ep", "symm_mem-experts_tp", "ll-experts_tp", "ll-experts_tp-shared_tp",
         "ll-experts_tp-arfold", "ll-experts_tp-shared_tp-arfold", "ll-experts_tp-shared_tp-mma_all"])
def test_tp2_agrees_with_tp1_on_small(comm, experts, shared, ar_fold, mma, small_weights, tmp_path):
    """tp=2 teacher-forced on tp=1's 128 greedy tokens agrees >= 99% on confident steps; the CUDA-graph step
    (collectives captured) gives the same tokens as eager tp=2. experts=tp: the routed experts sliced along
    their intermediate dim (parallel.experts=tp), through the kernels; shared=tp: the shared expert too
    (parallel.shared_expert=tp); comm=ll: ds4's all-reduce kernel; ar_fold: with the hc fold formed by it after the
    sum (DS4_AR_FOLD=1); mma=all (DS4_MMA=all, the ranks only): small's one-token FP8 products on the tensor cores, as
    the full model's take them (small's shapes alone would leave wq_b, wo_b and the shared expert on the FMA kernels)."""
    import json
    import torch.multiprocessing as mp
    args = small()
    prompt = [(13 * i + 7) % args.vocab_size for i in range(32)]
    rg = Generator(_model(args, small_weights), 1, 512)
    ref = rg.generate([prompt], 128, stop_at_eos=False).tokens[0]
    ref_logits = rg.teacher_forced_logits(prompt, ref)
    path = str(tmp_path / "job.json")
    json.dump({"prompt": prompt, "ref": ref}, open(path, "w"))
    mp.start_processes(_tp_worker, args=(2, _free_port(), comm, experts, shared, ar_fold, mma, path), nprocs=2,
                       start_method="spawn")
    res = json.load(open(path))
    overall, confident, n = _agreement(torch.tensor(res["tf"]), ref_logits)
    assert n >= 16 and confident >= 0.99 and overall >= 0.9, (overall, confident, n)
    assert res["graph"] == res["eager"]


def _tp_graph_worker(rank, world, port, experts, comm, batch, path):
    import json
    from ds4 import dist as ddist
    if comm == "ll" and batch == 1:  # the all-reduces also form the hc fold (one row; opt-in)
        os.environ["DS4_AR_FOLD"] = "1"
    with _rank_group(rank, world, port) as dev:
        args = tiny()
        w = random_weights(args, seed=2, device=dev, rank=rank, world=world, include_mtp=False, experts=experts)
        m = Transformer(args, build_ops(Impls(**_FUSED), dev), "plain", torch.bfloat16, dev, rank=rank, world=world,
                        comm=ddist.TensorParallel("fp32", comm, device=dev))
        m.load_weights(w)
        prompts = [[5, 6, 7, 8, 9, 10, 11], [300, 2, 9]][:batch]
        outs = {rt: Generator(m, batch, 1100, runtime=rt).generate(prompts, 1000, stop_at_eos=False).tokens
                for rt in ("eager", "cuda_graph")}
        if rank == 0:
            json.dump(outs, open(path, "w"))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("experts,comm,batch", [("ep", "nccl", 2), ("tp", "nccl", 2), ("tp", "ll", 2), ("tp", "ll", 1)],
                         ids=["experts_ep", "experts_tp", "experts_tp-ll", "experts_tp-ll-b1"])
def test_tp2_cuda_graph_matches_eager_1000_steps(experts, comm, batch, tmp_path):
    """tp=2 with every kernel option: the captured step (NCCL or ds4's ll all-reduces and the distributed argmax
    inside the graph) gives eager's tokens over 1000 steps of tiny (window wraps, CSA/HCA emissions); at batch 1
    with ll the all-reduces also form the hc fold (DS4_AR_FOLD=1: csrc/allreduce.cu's fold kernel)."""
    import json
    import torch.multiprocessing as mp
    path = str(tmp_path / "tokens.json")
    mp.start_processes(_tp_graph_worker, args=(2, _free_port(), experts, comm, batch, path), nprocs=2,
                       start_method="spawn")
    res = json.load(open(path))
    assert len(res["eager"][0]) == 1000 and res["cuda_graph"] == res["eager"]
