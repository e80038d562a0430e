"""Batch-1 decode benchmark of whole models, several implementation variants on ONE set of weights.

    python scripts/bench_decode.py --layers 4,12 --variants ref,kernels,kernels+graph
    torchrun --nproc-per-node 2 scripts/bench_decode.py --layers 43 --variants kernels+graph,kernels+graph+bf16

Per variant: TPOT median/p90/mean (CUDA events per decode step, after warm-up), decode and end-to-end
tok/s, bytes/token per GPU from the actual tensors, achieved GB/s and the ratio to the copy
bandwidth measured in this process, peak memory per GPU, CUDA-graph warm-up/capture time. With
two --layers values the per-layer time is the TPOT slope (and the mean's, printed beside it since session 38).
Writes JSON (rank 0) to --out. --experts ep,tp
loads the weights once per routed-expert layout over the ranks (parallel.experts, default tp) and names the
rows of a layout other than tp VARIANT@LAYOUT (session 16's run 3 printed the opposite: its suffix was @tp).
--shared replicate,tp does the same for the shared expert's layout (parallel.shared_expert; rows of tp named
VARIANT@shtp). After each model load an untimed pass of the first variant runs first (since session 62;
--no-warm-pass: none, as before; planned_passes says why).

Variants are '+'-joined tokens: ref (torch/dequant everywhere), kernels (linear=gemv_cuda,
moe=fp4_topk), fused (attn/indexer/hc=fused_cuda), graph (runtime=cuda_graph), bf16 (reduce=bf16),
symm (comm=symm_mem), ll (comm=ll: ds4's all-reduce kernel), nopdl (DS4_PDL=0: no programmatic
dependent launch on sm_90), fma (DS4_MMA=0: the FMA kernels for the FP4 MoE too, instead of the
tensor-core ones), mma8 (DS4_MMA=all: the tensor-core kernels for one-token FP8 products too), w1 / w2 /
w4 (DS4_MMA_W: the widest run of 16-B chunks a lane of the tensor-core kernels reads per row; without them the library default, 2), d8 / d4 /
d2 (DS4_MMA_DEPTH: the chunks per lane and row those kernels keep in flight; without them the per-shape
default), smem
(DS4_MMA_LOAD=smem: those kernels stream the weights through shared memory with cp.async), noovl
(DS4_SHARED_OVERLAP=0: the shared expert in line instead of on a side stream), nocovl
(DS4_COMPRESS_OVERLAP=0: the compressor steps in line instead of on side streams), noaovl
(DS4_ATTN_OVERLAP=0: the window write and the indexer in line instead of on side streams), rtr1
(DS4_ROUTER_FUSED=1: the router in one fused launch instead of the BF16 GEMV + tail kernel), shlate
(DS4_SHARED_FORK=late: the side-stream shared expert forks after the router, not before), k2048
(DS4_MMA=k2048: wq_b on the FMA kernel, the rule before session 9), noqf (DS4_QNORM_FUSED=0: q_norm in
its own launch before wq_b instead of inside wq_b's GEMV), kroute (DS4_ROUTE_IN_MOE=1: the router's top-k
inside the routed kernels instead of its own launch), notile (DS4_FP4_TILE=0: the routed experts in the fp4p
layout instead of the default fp4t (the fp4p words in the tensor-core kernels' fragment order)), tile (DS4_FP4_TILE=1:
fp4t required), notile8 (DS4_FP8_TILE=0: the dense FP8 projections and the shared expert in the stored layout
instead of the default fp8t (the same fragment order)), tile8 (DS4_FP8_TILE=1: fp8t required), shnotile8
(DS4_SHARED_TILE=0: the shared expert alone in the stored fp8 layout), nopack (the
routed experts in the checkpoint's FP4
layout instead of moe=fp4_topk's fp4p word layout, as DS4_FP4_PACK=0), noidxm (CSA layers: the indexer's
query from its own GEMV in a side branch, not from the merged wq_b + indexer wq_b GEMV), hwin (CSA layers
with the merged query: the indexer's head weights after the indexer compressor's step in its branch, not in
a branch of their own), sprio
(DS4_SIDE_PRIORITY=high: the side-stream branches above the main stream's priority), shwNN
(DS4_SHARED_WAVE=NN: the shared expert's tensor-core launches take NN % of a resident wave, leaving SM
slots to the router's kernels beside them), rwNN (DS4_ROUTED_WAVE=NN: the routed experts' tensor-core gate+up
takes NN % of a resident wave, so the down kernel's blocks can be resident beside it under PDL), rdN
(DS4_ROUTED_DEPTH=N, N of 8 / 4 / 2: the routed experts' tensor-core gate+up keeps N chunks per lane and row in
flight, the other kernels their defaults; the library's default at V4's dim is 4 since session 33, rd8 the one
before), lrdN (DS4_LONG_ROW_DEPTH=N: the same for the kernels whose per-shape rule says 8 — wq_a + wkv, wo_b and
the shared expert's gate+up at V4's shapes), dnN (DS4_DOWN_DEPTH=N: the routed and shared experts' down kernels),
shdN (DS4_SHARED_DEPTH=N: the shared expert's gate+up alone),
capN (the state's caches sized for N positions, e.g. cap8192 as `python -m ds4` at V4-Flash's default
max_seq_len, instead of this run's prompt + new tokens + 8), wobf16 (attn=fused_cuda_wo_bf16), dp4a (moe=fp4_dp4a:
the routed experts' one-token gate+up on the integer pipe, w1 / w3 in the checkpoint's layout), pf (DS4_L2_PREFETCH=1:
L2 prefetch of the next GEMV's weights in captured steps at the default sites; measured slower, off without it), pfSITES
(those prefetch sites, letters of q o b d, e.g. pfqodb; ds4.ops.prefetch), nohcr (DS4_HC_ROUTER=0: without
the router fold, the library default since session 25 — the FFN's hc launch also forms the router's logits, so
the router GEMV launch leaves the step), hcq (DS4_HC_QKV=1: the projection fold, opt-in — the attention site's
hc finish also forms wq_a + wkv's rows, so their GEMV launch leaves the step; measured no faster in session 27;
with the FP8 projections in the stored layout, as notile8),
pj (DS4_PJOIN=moe: the shared expert's branch joins the routed down kernel by programmatic edges, so that kernel
may launch and start its weight loads before the shared down drains; ds4.ops.side_stream.Branch.join), pja
(DS4_PJOIN=attn: the attention branches — window write, compressors, indexer — join the attention core's chunk
kernel by programmatic edges too, so that it may launch while wq_b runs; with pj both sites), nopfsh (DS4_PFORK=none:
the shared expert's branch forks from the main stream by a full edge, the form before session 76; the default forks it
by programmatic edges, so its gate+up launches at the hc finish's start and loads its first weight rounds before its
PDL wait; ds4.ops.side_stream.fork), noctrig
(DS4_COMBINE_TRIGGER=wait: the attention combine lets the next launch, wo_a's GEMV, launch only after its own PDL
wait, the form before session 74; the default lets it launch at the combine's start, so wo_a's blocks load their
first weights while the chunk kernel runs; csrc/attn/sparse_attn.cu), nohtrig (DS4_HC_TRIGGER=wait: the same for
the one-token hc finishes, whose next launch is wq_a + wkv's GEMV or the router's top-k; csrc/attn/hc.cu), rtrig
(DS4_ROUTER_TRIGGER=early: the router's top-k lets the routed gate+up launch at its start; opt-in; csrc/router.cu),
early
(DS4_ATTN_EARLY=1: the chunk kernel takes the position, its RoPE table and the first chunk's rows that no launch of
the step writes before its PDL wait; opt-in, meant with pja),
late (DS4_LATE_COMPRESS=1: a captured graph per compressor phase, where layers whose window does not end at the
step join their compressor branches after the output projection instead of before the attention core; opt-in,
measured no faster in session 28; ds4.runtime.cuda_graph),
noride (DS4_SINKHORN_RIDE=0: each hc finish runs its own Sinkhorn, the default before session 30; the default
leaves it to the site's attention combine / router top-k launch), rideattn (DS4_SINKHORN_RIDE=attn: at the attention
sites only),
nohcf (DS4_HC_FOLD=0:
without the hc fold, the library default since session 14 — the next mHC site's first launch done by wo_b's
and the MoE down's epilogues — so each site is its own 2 launches again; with arf the all-reduce's fold too),
arf (DS4_AR_FOLD=1, tp > 1 with ll: the all-reduce also forms the hc fold, so the next site's first launch
leaves the step; opt-in), arfnp (DS4_AR_FOLD_PDL=0: that fold kernel launched without PDL), arfpack
(DS4_AR_FOLD_SPREAD=0: its blocks sized by their buffers alone, so several share an SM), ffn (DS4_MOE_FFN=1:
one GPU, the routed and shared experts, gate+up and down, in one launch; opt-in), ffn2 (DS4_MOE_FFN=2: the same
with the shared expert's gate+up a side-stream launch beside the router), ffnreg (DS4_FFN_SH_DOWN=reg: that
launch's shared-expert down on the register stream), splitk (DS4_MOE_SPLITK=1: the routed experts' gate+up and down
as a split-K pair, each gate+up block also multiplying its h by w2's matching columns, a reduction launch after;
opt-in, measured slower in session 84; csrc/moe_splitk.cu), xshared / xrouter /
xrouted / xattn / xcombine (diagnostics, wrong outputs: no shared-expert / router / routed-expert / attention-core /
attention-combine kernels, to time what each costs the step; xcombine: a launch of the combine's grid that only
writes zeros in its place, with noride only), noidxskip (DS4_INDEXER_SKIP=0: the indexer's scores kernel also
scores rows whose visible entries the top-k takes all of, as before session 37; the same indices), noqskip
(Attention.skip_index_query off: the merged wq_b + indexer wq_b GEMV also computes the index queries there),
deferN (Attention.defer_compress = N: the compressors project up to N tokens at once, the largest divisor of the
ratio, on every N-th step, instead of every token at its own step; session 38, opt-in), deferhN (the same for the HCA
layers' compressor alone),
preN / dpreN (DS4_PREFETCH / DS4_PREFETCH_DOWN=N: the tensor-core GEMVs / the MoE down kernels load only N weight
rounds before their PDL wait, the rest after it; default all), spLETTERS
(DS4_SPACER, letters of g d u: an empty PDL launch in front of every tensor-core GEMV / MoE down / MoE gate+up
launch; a diagnostic, outputs unchanged), bsLETTERS (DS4_BULK_STAGE, letters of g d u: those kernels stage their
activations — and the MoE downs the shared expert's output they add — by bulk copies on the TMA unit, sm_90; opt-in,
the same bits), qat (numerics=qat: the official reference's FP8 / FP4 activation
simulations; plain without it), aqtorch (DS4_ACT_QUANT=torch: with qat, the FP8 activation simulation by its torch
twin, about a dozen launches, instead of the staging; the same bits), aqstaged (DS4_ACT_QUANT=staged: with
qat, the simulation inside the activation staging of the one-row tensor-core GEMVs that take it (wq_a + wkv, q_norm +
wq_b, wo_b) and the MoE kernels; the library's default since session 71, so the token names it explicitly; the same
bits), aqlaunch (DS4_ACT_QUANT=kernel: with qat, the simulation's own launch before every FP8 / FP4 GEMV, the default
before session 71; the same bits), ixqtorch (DS4_INDEXER_QAT=torch: with qat, the indexer's Hadamard + FP4
simulation of its keys and decode query by the torch twin instead of inside the compressor step and scores kernels,
the default since session 53).
On a machine without CUDA it runs on the CPU (a dry run of the script).
This is a benchmark command, not the product entry point (that is `python -m ds4 task=bench`);
it exists so a short device lease measures many variants without regenerating 145 GB of weights.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import time

import torch

from ds4 import dist as ddist
from ds4.kernels.ops import KERNEL_KINDS
from ds4.model.args import preset
from ds4.model.attention import Attention
from ds4.model.transformer import Transformer
from ds4.ops import prefetch, side_stream
from ds4.ops.base import MoEWeights
from ds4.ops.moe_cuda import lay_fp4
from ds4.registry import Impls, ImplUnavailable, build_ops
from ds4.runtime.generate import Generator
from ds4.tasks.common import copy_bandwidth, decode_figures, graph_figures
from ds4.weights.synthetic import random_weights


def impls_of(tokens: set[str]) -> Impls:
    kw = {}
    if "kernels" in tokens:
        kw.update(linear="gemv_cuda", moe="fp4_topk")
    if "fused" in tokens:
        kw.update(attn="fused_cuda", indexer="fused_cuda", hc="fused_cuda")
    if "wobf16" in tokens:  # the seed's phase-6 output projection (wo_b.wo_a precomputed in BF16)
        kw.update(attn="fused_cuda_wo_bf16")
    if "dp4a" in tokens:  # the routed experts' one-token gate+up on the integer pipe
        kw.update(moe="fp4_dp4a")
    return Impls(**kw)


def stored_fp4_layout(model) -> None:
    """Undo moe=fp4_topk's (or fp4_dp4a's) fp4p / fp4t layouts in place (every MoE layer), back to the checkpoint's."""
    for mod in model.modules():
        mw = getattr(mod, "mw", None)
        if isinstance(mw, MoEWeights) and any(q.fmt in ("fp4p", "fp4t") for q in (mw.w1, mw.w2, mw.w3)):
            plain = {n: lay_fp4(getattr(mw, n), "fp4") for n in ("w1", "w2", "w3")}
            mod.mw = dataclasses.replace(mw, **plain)
            for n, q in plain.items():
                setattr(mod, n, q)


def numerics_of(toks: set[str]) -> str:
    """The numerics mode of a variant: qat with the qat token, else plain (the same model serves both)."""
    return "qat" if "qat" in toks else "plain"


def tp_comm(toks: set[str], device: torch.device) -> ddist.TensorParallel:
    """A variant's communicator at tp > 1: reduce=bf16 with the bf16 token (else fp32); comm=ll, symm (symm_mem)
    or neither (nccl)."""
    comm = "ll" if "ll" in toks else ("symm_mem" if "symm" in toks else "nccl")
    return ddist.TensorParallel("bf16" if "bf16" in toks else "fp32", comm, device=device)


def repeat_names(variants: list[str]) -> list[str]:
    """Row names of a variant list: a variant listed again is named VARIANT#2, #3, ... so that repeats in one
    process (the same configuration measured before and after another, for the noise) keep rows and per-layer
    lines of their own."""
    seen: dict[str, int] = {}
    out = []
    for v in variants:
        seen[v] = seen.get(v, 0) + 1
        out.append(v if seen[v] == 1 else f"{v}#{seen[v]}")
    return out


def planned_passes(variants: list[str], warm: bool) -> list[tuple[str, str | None]]:
    """(variant, row name) of each pass after a model load, in order: with warm, first an untimed pass of the first
    variant (row name None: printed, not recorded). Why: on an H100 (session 62, four processes) the first pass after
    the 12-layer load ran 0.010-0.011 ms slower than later passes of the same variant (about 1.3 us per layer of
    slope), so whichever variant was listed first carried that; on an H200 (session 60) the first pass was not
    slower."""
    return ([(variants[0], None)] if warm else []) + list(zip(variants, repeat_names(variants)))


def _set_or_unset(name: str, value: str | None) -> None:
    """Set an environment variable the kernels read, or remove it (None) so the library's default applies."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def launch_order_env(toks: set[str]) -> dict[str, str | None]:
    """The variables of the launch-order ablations (None: unset, the library default). preN / dpreN: the tensor-core
    GEMVs / the MoE down kernels load only N weight rounds before their PDL wait (DS4_PREFETCH / DS4_PREFETCH_DOWN;
    default all of their depth). spLETTERS (letters of g d u): an empty PDL launch before every tensor-core GEMV /
    MoE down / MoE gate+up launch (DS4_SPACER; timing only, outputs unchanged). bsLETTERS (letters of g d u): those
    kernels stage their activations by bulk copies on the TMA unit instead of their threads' loads (DS4_BULK_STAGE,
    sm_90; csrc/bulk_stage.cuh; the same bits)."""
    def rounds(prefix):
        n = _number_token(toks, prefix, -1)
        return str(n) if n >= 0 else None
    def letters(prefix):
        return "".join(sorted(t[2:] for t in toks if _is_letters_token(t, prefix))) or None
    return {"DS4_PREFETCH": rounds("pre"), "DS4_PREFETCH_DOWN": rounds("dpre"), "DS4_SPACER": letters("sp"),
            "DS4_BULK_STAGE": letters("bs")}


def _is_letters_token(t: str, prefix: str) -> bool:
    """A spLETTERS / bsLETTERS token: the prefix, then letters of g d u (the kernel kinds)."""
    return t.startswith(prefix) and t[len(prefix):] != "" and set(t[len(prefix):]) <= set(KERNEL_KINDS)


def depth_env(toks: set[str]) -> dict[str, str | None]:
    """The per-kernel depth knobs (None: unset, the library's rule). rdN: the routed experts' gate+up
    (DS4_ROUTED_DEPTH); lrdN: the kernels whose per-shape rule says 8 (DS4_LONG_ROW_DEPTH); dnN: the MoE downs
    (DS4_DOWN_DEPTH); shdN: the shared expert's gate+up (DS4_SHARED_DEPTH). N of 8 / 4 / 2 (the library rounds
    others down to one of them)."""
    def depth(prefix):
        n = _number_token(toks, prefix, 0)
        return str(n) if n else None
    return {"DS4_ROUTED_DEPTH": depth("rd"), "DS4_LONG_ROW_DEPTH": depth("lrd"), "DS4_DOWN_DEPTH": depth("dn"),
            "DS4_SHARED_DEPTH": depth("shd")}


# Every token run_variant and the helpers here read; the families below take a number or letters.
PLAIN_TOKENS = frozenset({
    "ref", "kernels", "fused", "wobf16", "dp4a", "graph", "qat", "aqtorch", "aqstaged", "aqlaunch", "ixqtorch",
    "nopack", "notile", "tile", "notile8", "tile8", "shnotile8", "ffn", "ffn2", "ffnreg", "nopdl", "fma", "mma8",
    "k2048", "w1", "w2", "w4", "smem", "d8", "d4", "d2", "noovl", "nocovl", "noaovl", "rtr1", "shlate", "noqf",
    "kroute", "nohcr", "hcq", "pj", "nopfsh", "late", "pja", "early", "noctrig", "nohtrig", "rtrig", "nohcf", "noride",
    "rideattn", "xcombine", "noidxskip", "splitk",
    "noidxm", "hwin", "noqskip", "arf", "arfnp", "arfpack", "sprio", "pf", "bf16", "ll", "symm", "xar", "xshared",
    "xrouter", "xrouted", "xattn"})
NUMBERED_TOKENS = ("cap", "defer", "deferh", "rw", "shw", "rd", "lrd", "dn", "shd", "pre", "dpre")
# qat's FP8 activation simulation modes (DS4_ACT_QUANT) by token: one per variant at most
ACT_QUANT_TOKENS = {"aqtorch": "torch", "aqstaged": "staged", "aqlaunch": "kernel"}
TP_ONLY_TOKENS = frozenset({"bf16", "ll", "symm", "arf", "arfnp", "arfpack", "xar"})  # nothing to reduce at world 1


def unknown_tokens(toks: set[str]) -> list[str]:
    """The tokens no code here reads (a misspelt or retired one would time the variant without it, under its name)."""
    def known(t: str) -> bool:
        return (t in PLAIN_TOKENS or any(t.startswith(p) and t[len(p):].isdigit() for p in NUMBERED_TOKENS)
                or _is_letters_token(t, "sp") or _is_letters_token(t, "bs")
                or (t.startswith("pf") and t[2:] != "" and set(t[2:]) <= set(prefetch.SITES)))
    return sorted(t for t in toks if not known(t))


# Numbered tokens whose number leaves the step as it is (the library's default): rd0 / lrd0 / dn0 / shd0 unset the depth
# knob, cap0 sizes nothing, defer0 / deferh0 defer nothing, rw / shw at 0 or from 100 take the whole wave. A variant
# named with one would time the default under another name.
_IDLE_AT_ZERO = ("rd", "lrd", "dn", "shd", "cap", "defer", "deferh")
_WAVE_SHARES = ("rw", "shw")


def idle_number_tokens(toks: set[str]) -> list[str]:
    """The numbered tokens whose number changes nothing (above)."""
    def idle(t: str) -> bool:
        for p in _IDLE_AT_ZERO + _WAVE_SHARES:
            if t.startswith(p) and t[len(p):].isdigit():
                n = int(t[len(p):])
                return n == 0 or (p in _WAVE_SHARES and n >= 100)
        return False
    return sorted(t for t in toks if idle(t))


def check_variants(variants: list[str], world: int) -> list[str]:
    """Errors that stop the run before anything loads: unknown tokens, numbered tokens that change nothing
    (idle_number_tokens), and a variant without `kernels` after one with it (the torch ops have no weight layout of their own: they would read the kernels' fp4t / fp8t bytes,
    dequantised through the layout on every call, slower than the reference). Prints the tokens that do nothing at
    one rank."""
    errors, seen_kernels = [], False
    for v in variants:
        toks = set(v.split("+"))
        bad = unknown_tokens(toks)
        if bad:
            errors.append(f"variant {v}: unknown token(s) {', '.join(bad)}")
        aq = sorted(toks & ACT_QUANT_TOKENS.keys())
        if len(aq) > 1:
            errors.append(f"variant {v}: {', '.join(aq)} each set DS4_ACT_QUANT: name one")
        idle_n = idle_number_tokens(toks)
        if idle_n:
            errors.append(f"variant {v}: {', '.join(idle_n)} change(s) nothing (the library's default): leave it out")
        if "kernels" in toks:
            seen_kernels = True
        elif seen_kernels:
            errors.append(f"variant {v}: without kernels after a variant with them (list it first)")
        idle = sorted(toks & TP_ONLY_TOKENS) if world == 1 else []
        if idle:
            print(f"note: variant {v}: {', '.join(idle)} change nothing at one rank", flush=True)
    return errors


def _number_token(toks: set[str], prefix: str, default: int) -> int:
    """N of a variant token prefix + digits (e.g. cap8192, shw50), the largest if several; else default."""
    return max([int(t[len(prefix):]) for t in toks if t.startswith(prefix) and t[len(prefix):].isdigit()] or [default])


# Removal diagnostics (timing only, WRONG outputs): each token takes one piece of the step out of this
# variant's implementations; the step's time against the same variant without the token is what that
# piece costs the step, side effects on its neighbours included (an attribution by removal, which the
# critical-path reading of ds4.timeline cannot make with certainty).
#   xshared  no shared-expert kernels (zeros in its place)
#   xrouter  no router kernels (a fixed device (weights, ids): experts 0..k-1 of this rank, weights 1/k)
#   xrouted  no routed-expert kernels (the routed sum is zero)
#   xattn    no attention-core kernels (the attention output is zero)
#   xcombine the attention combine's loads and arithmetic (DS4_X_COMBINE=1: a launch of its grid writes zeros in
#            its place; with noride only, as that launch takes the attention site's Sinkhorn along). Session 31's
#            forms left the output unwritten: the state went NaN, the tokens all 0, and the router's ids degenerate,
#            so their timings measured another MoE workload (withdrawn, experiments/decode_session32_h200.md)
#   xar      tp > 1: no all-reduce (each rank keeps its partial sums; the ranks no longer wait for each other)
def skip_shared_expert(moe) -> None:
    """xshared: this MoE implementation launches no shared-expert kernel in decode steps; the routed sum
    gets zeros in its place (one memset)."""
    from ds4.ops.moe_cuda import PREFILL_TOKENS, SharedUp
    from ds4.ops.side_stream import Branch

    def shared_up(x, mw, act_quant=False):  # decode sizes only, like the implementation's (prefill: None)
        return SharedUp(torch.zeros_like(x), Branch(None, x.device)) if x.shape[0] <= PREFILL_TOKENS else None
    moe.shared_up = shared_up


def skip_router(moe) -> None:
    """xrouter: decode-sized route() calls return fixed device tensors instead of launching the router."""
    from ds4.ops.moe_cuda import PREFILL_TOKENS
    route = moe.route

    def fixed_route(x, token_ids, mw, logits=None, ride=None):
        n = x.reshape(-1, x.shape[-1]).shape[0]
        if n > PREFILL_TOKENS:
            return route(x, token_ids, mw, logits, **({} if ride is None else {"ride": ride}))
        if ride is not None:  # the mHC Sinkhorn the router's launch would have finished stays in the step
            ride.run()
        ids = (torch.arange(mw.topk, device=x.device) + mw.expert_offset).expand(n, -1).contiguous()
        return torch.full((n, mw.topk), 1.0 / mw.topk, device=x.device), ids
    moe.route = fixed_route


def skip_routed_experts(moe) -> None:
    """xrouted: decode-sized routed() calls launch no routed-expert kernel (a zero routed sum)."""
    from ds4.ops.moe_cuda import PREFILL_TOKENS
    routed = moe.routed

    def no_routed(x, weights, ids, mw, act_quant=False, shared=None, fold=None, partial=False):  # (never folds)
        if x.shape[0] > PREFILL_TOKENS:
            return routed(x, weights, ids, mw, act_quant, shared, fold, partial)
        if shared is not None:  # routed(shared=) returns routed + shared in x's dtype (partial: fp32)
            shared.branch.join()
            return shared.out.float() if partial else shared.out.clone()
        return torch.zeros(x.shape, device=x.device, dtype=torch.float32)
    moe.routed = no_routed


def skip_attention_core(attn) -> None:
    """xattn: the decode attention core (attn.decode) launches nothing and returns zeros (an mHC Sinkhorn it was
    to take along runs as a launch of its own)."""
    def no_core(q, *args, ride=None, **kw):
        if ride is not None:
            ride.run()
        return torch.zeros_like(q)
    attn.decode = no_core


def _apply_removals(ops, toks: set[str]) -> None:
    for tok, fn, part in (("xshared", skip_shared_expert, "moe"), ("xrouter", skip_router, "moe"),
                          ("xrouted", skip_routed_experts, "moe"), ("xattn", skip_attention_core, "attn")):
        if tok in toks:
            fn(getattr(ops, part))


def _prefetch_sites(toks: set[str]) -> str:
    """DS4_L2_PREFETCH for a variant: the sites of pfSITES tokens (comma list), "1" (the default sites) for pf,
    else "0" (none, the library default)."""
    pf = [t[2:] for t in toks if t.startswith("pf") and t[2:] and set(t[2:]) <= set(prefetch.SITES)]
    if pf:
        return ",".join(sorted(set("".join(pf))))
    return "1" if "pf" in toks else "0"


def attention_options(model, toks: set[str]) -> None:
    """The Attention modules' decode options of this variant (before the Generator allocates the state)."""
    for mod in model.modules():
        if isinstance(mod, Attention):
            # noidxm: CSA layers compute the indexer's query with its own GEMV in the indexer's side branch instead
            # of inside the merged wq_bi GEMV (Attention.merged_indexer_q; matters where the indexer selects: capN)
            mod.merged_indexer_q = "noidxm" not in toks
            # hwin: the indexer head weights after the indexer compressor in its branch, not in a branch of their own
            mod.head_weights_branch = "hwin" not in toks
            # noqskip: the merged GEMV computes the index queries also where the selection takes every visible entry
            mod.skip_index_query = "noqskip" not in toks
            # deferN: the compressors' projection deferred, up to N tokens at once (read when the Generator
            # allocates the state); deferhN: the HCA layers' alone (ratio 128; the CSA layers' ratio-4 compressors
            # keep their per-token step); neither: every token's at its own step
            hca = mod.compressor is not None and mod.indexer is None
            defer, defer_hca = _number_token(toks, "defer", 0), _number_token(toks, "deferh", 0)
            mod.defer_compress = defer_hca if hca and defer_hca else defer


def run_variant(model, name, prompt, new_tokens, bw, world):
    toks = set(name.split("+"))
    ops = build_ops(impls_of(toks), model.device)
    comm = None
    if world > 1:
        comm = tp_comm(toks, model.device)
        if "xar" in toks:  # a removal diagnostic (timing only): one process's identity (casts kept)
            comm.all_reduce = ddist.SingleProcess().all_reduce
    # nopack: the routed experts in the stored FP4 layout (as DS4_FP4_PACK=0 at load); other variants
    # re-lay them as fp4p through configure() (moe=fp4_topk's prepare)
    os.environ["DS4_FP4_PACK"] = "0" if "nopack" in toks else "1"
    # fp4t by default where the shapes allow; notile: fp4p (configure re-lays fp4p <-> fp4t)
    os.environ["DS4_FP4_TILE"] = "0" if "notile" in toks else ("1" if "tile" in toks else "auto")
    # the dense FP8 projections: fp8t by default where the shapes allow (linear=gemv_cuda's prepare, at configure);
    # notile8: the stored fp8 layout, which the projection fold (hcq: its hc kernel reads fp8 rows) also needs
    os.environ["DS4_FP8_TILE"] = "0" if toks & {"notile8", "hcq"} else ("1" if "tile8" in toks else "auto")
    # the shared expert: as DS4_FP8_TILE unless shnotile8 (moe=fp4_topk's prepare, at configure; it keeps fp8 under
    # DS4_MOE_FFN, whose one launch reads fp8 rows, so that is set before configure)
    _set_or_unset("DS4_SHARED_TILE", "0" if "shnotile8" in toks else None)
    os.environ["DS4_MOE_FFN"] = "2" if "ffn2" in toks else ("1" if "ffn" in toks else "0")
    os.environ["DS4_MOE_SPLITK"] = "1" if "splitk" in toks else "0"
    if "nopack" in toks:
        stored_fp4_layout(model)
    # qat: numerics=qat (the official reference's FP8 activation simulation before every FP8 / FP4 GEMM, the FP8 KV
    # simulation and the indexer's Hadamard + FP4 simulation); plain otherwise
    model.configure(ops=ops, comm=comm, numerics=numerics_of(toks))
    _apply_removals(ops, toks)  # the x* diagnostics (timing only)
    # nopdl: the ds4 kernels launched without programmatic dependent launch (read at each launch)
    os.environ["DS4_PDL"] = "0" if "nopdl" in toks else "1"
    os.environ["DS4_MMA"] = "0" if "fma" in toks else ("all" if "mma8" in toks else ("k2048" if "k2048" in toks else "1"))
    # w1 / w2 / w4: the tensor-core kernels' widest run of 16-B chunks per lane and row; without one of
    # them the library's default applies (the variable is removed)
    _set_or_unset("DS4_MMA_W", next((t[1:] for t in ("w1", "w2", "w4") if t in toks), None))
    os.environ["DS4_MMA_LOAD"] = "smem" if "smem" in toks else "reg"
    _set_or_unset("DS4_MMA_DEPTH", next((t[1:] for t in ("d8", "d4", "d2") if t in toks), None))
    os.environ["DS4_SHARED_OVERLAP"] = "0" if "noovl" in toks else "1"
    os.environ["DS4_COMPRESS_OVERLAP"] = "0" if "nocovl" in toks else "1"
    os.environ["DS4_ATTN_OVERLAP"] = "0" if "noaovl" in toks else "1"
    os.environ["DS4_ROUTER_FUSED"] = "1" if "rtr1" in toks else "0"
    os.environ["DS4_SHARED_FORK"] = "late" if "shlate" in toks else "early"
    os.environ["DS4_QNORM_FUSED"] = "0" if "noqf" in toks else "1"
    os.environ["DS4_ROUTE_IN_MOE"] = "1" if "kroute" in toks else "0"
    os.environ["DS4_HC_ROUTER"] = "0" if "nohcr" in toks else "1"
    os.environ["DS4_HC_QKV"] = "1" if "hcq" in toks else "0"
    os.environ["DS4_PJOIN"] = ",".join(site for site, tok in (("moe", "pj"), ("attn", "pja")) if tok in toks)
    os.environ["DS4_PFORK"] = "none" if "nopfsh" in toks else "shared"
    # noctrig / nohtrig: the attention combine / the one-token hc finishes let the next launch (wo_a's GEMV; wq_a +
    # wkv's or the router's top-k) launch only after their own PDL wait (the defaults since session 74 let it launch
    # at their start); rtrig: the router's top-k lets the routed gate+up launch at its start (opt-in)
    os.environ["DS4_COMBINE_TRIGGER"] = "wait" if "noctrig" in toks else "early"
    os.environ["DS4_HC_TRIGGER"] = "wait" if "nohtrig" in toks else "early"
    os.environ["DS4_ROUTER_TRIGGER"] = "early" if "rtrig" in toks else "wait"
    os.environ["DS4_ATTN_EARLY"] = "1" if "early" in toks else "0"
    os.environ["DS4_LATE_COMPRESS"] = "1" if "late" in toks else "0"
    os.environ["DS4_HC_FOLD"] = "0" if "nohcf" in toks else "1"
    os.environ["DS4_SINKHORN_RIDE"] = "0" if "noride" in toks else ("attn" if "rideattn" in toks else "1")
    os.environ["DS4_X_COMBINE"] = "1" if "xcombine" in toks else "0"
    # aqtorch: qat's FP8 activation simulation by its torch twin (about a dozen launches; ds4.ops.qat_cuda; the same
    # bits). aqstaged: inside the one-row tensor-core GEMVs' and MoE kernels' activation staging where they take it
    # (DS4_ACT_QUANT=staged, the default since session 71). aqlaunch: the one-launch kernel before every GEMV
    # (DS4_ACT_QUANT=kernel, the default before it). None of them: the library's default.
    # (check_variants refuses two of them in one variant)
    _set_or_unset("DS4_ACT_QUANT", next((m for t, m in ACT_QUANT_TOKENS.items() if t in toks), None))
    # ixqtorch: qat's indexer Hadamard + FP4 simulation (its keys in the compressor step, its decode query) by the
    # torch twin (about 40 launches a call) instead of inside the compressor step and scores kernels (the same bits)
    os.environ["DS4_INDEXER_QAT"] = "torch" if "ixqtorch" in toks else "kernel"
    # noidxskip: the indexer's scores computed for every row, also where the top-k selects all visible entries
    # unread (DS4_INDEXER_SKIP=0; the same indices)
    os.environ["DS4_INDEXER_SKIP"] = "0" if "noidxskip" in toks else "1"
    for var, value in launch_order_env(toks).items():
        _set_or_unset(var, value)
    os.environ["DS4_AR_FOLD"] = "1" if "arf" in toks else "0"
    os.environ["DS4_AR_FOLD_PDL"] = "0" if "arfnp" in toks else "1"
    os.environ["DS4_AR_FOLD_SPREAD"] = "0" if "arfpack" in toks else "1"
    os.environ["DS4_FFN_SH_DOWN"] = "reg" if "ffnreg" in toks else "smem"
    os.environ["DS4_SIDE_PRIORITY"] = "high" if "sprio" in toks else "default"
    # shwNN: the side-stream shared expert's launches take NN % of a resident wave (DS4_SHARED_WAVE)
    os.environ["DS4_SHARED_WAVE"] = str(_number_token(toks, "shw", 100))
    # rwNN: the routed experts' tensor-core gate+up takes NN % of a resident wave (DS4_ROUTED_WAVE)
    os.environ["DS4_ROUTED_WAVE"] = str(_number_token(toks, "rw", 100))
    for var, value in depth_env(toks).items():  # rdN, lrdN, dnN, shdN: per-kernel depths; else the library's rules
        _set_or_unset(var, value)
    # pf: the L2 prefetch's default sites; pfSITES (letters of ds4.ops.prefetch.SITES, e.g. pfqodb): those
    # sites; neither: no prefetch (DS4_L2_PREFETCH)
    os.environ["DS4_L2_PREFETCH"] = _prefetch_sites(toks)
    attention_options(model, toks)
    runtime = "cuda_graph" if "graph" in toks else "eager"
    # capN: caches sized for N positions (the app's max_seq_len; V4-Flash's default is 8192) instead of
    # just this run's; launch shapes that follow the capacity then show in the step
    cap = _number_token(toks, "cap", 0)
    g = Generator(model, 1, max(len(prompt) + new_tokens + 8, cap), runtime=runtime)
    pjoins, pforks = side_stream.programmatic_joins(), side_stream.programmatic_fork_count()
    t0 = time.perf_counter()
    g.generate([prompt], 4, stop_at_eos=False)  # warm-up (and graph capture)
    warm = time.perf_counter() - t0
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(model.device)
    out = g.generate([prompt], new_tokens, stop_at_eos=False)
    f = decode_figures(out, batch=1, warmup=2)  # first steps still warm caches
    f.update(graph_figures(g))
    bpt = model.bytes_per_token(len(prompt) + new_tokens // 2)
    gbs = bpt / (f["tpot_ms"] / 1e3) / 1e9
    return {
        "variant": name, "impls": ops.chosen, "runtime": runtime, "tpot_ms": f["tpot_ms"],
        "tpot_p90_ms": f["tpot_ms_p90"], "tpot_mean_ms": f["tpot_mean_ms"], "decode_tok_s": f["decode_tok_s"],
        "e2e_tok_s": f["e2e_tok_s"],
        "ttft_ms": f["ttft_ms"], "bytes_per_token": bpt, "achieved_gb_s": gbs, "bw_ratio": gbs / bw,
        "peak_mem_gib": torch.cuda.max_memory_allocated(model.device) / 2**30 if cuda else 0.0,
        "warmup_s": warm, "graph_capture_s": f.get("graph_capture_s"), "graph_pool_mib": f.get("graph_pool_mib"),
        "graphs": f.get("graphs"),  # captured steps: one per compressor phase (DS4_LATE_COMPRESS)
        "programmatic_joins": side_stream.programmatic_joins() - pjoins,  # pj: made while capturing (DS4_PJOIN)
        "programmatic_forks": side_stream.programmatic_fork_count() - pforks,  # the same (DS4_PFORK; 0 with nopfsh)
        "tokens": out.tokens[0][:16],
        # every token after the first the same: the state has likely gone NaN (greedy argmax of NaN logits is 0), and
        # the router's ids with it, so the step ran another MoE workload and its time compares with nothing
        "degenerate": len(out.tokens[0][1:16]) > 1 and len(set(out.tokens[0][1:16])) == 1,
    }


def _write_rows(out: str | None, dev: torch.device, kind: str, world: int, bw: float, rows: list[dict]) -> None:
    if out:
        gpu = torch.cuda.get_device_name(dev) if kind == "cuda" else "cpu"
        with open(out, "w") as f:
            json.dump({"gpu": gpu, "world": world, "copy_gb_s": bw, "rows": rows}, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="v4_flash")
    ap.add_argument("--layers", default="4,12", help="comma list of n_layers (per-layer slope from two)")
    ap.add_argument("--variants", default="ref,kernels,kernels+graph",
                    help="comma list of variants (tokens joined by +); one listed again runs again, named VARIANT#2, ...")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    ap.add_argument("--experts", default="tp",
                    help="comma list of routed-expert layouts over the ranks (parallel.experts: tp, the default, "
                         "or ep); each loads the weights once more, its rows named VARIANT@LAYOUT (tp: no suffix)")
    ap.add_argument("--warm-pass", action=argparse.BooleanOptionalAction, default=True,
                    help="an untimed pass of the first variant after each model load, before the recorded ones "
                         "(planned_passes says why)")
    ap.add_argument("--shared", default="replicate",
                    help="comma list of shared-expert layouts (parallel.shared_expert: replicate, the default, or tp); "
                         "each loads the weights once more, rows of tp named VARIANT@shtp")
    a = ap.parse_args()
    errors = check_variants(a.variants.split(","), int(os.environ.get("WORLD_SIZE", 1)))
    n_model = preset(a.model).n_layers
    errors += [f"--layers {n}: {a.model} has {n_model} layers" for n in (int(x) for x in a.layers.split(","))
               if not 1 <= n <= n_model]
    if errors:
        ap.error("; ".join(errors))
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    e = ddist.init(kind, int(os.environ.get("WORLD_SIZE", 1)))
    dev = torch.device("cuda", e.local_rank) if kind == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    bw = copy_bandwidth(dev, 1 << 31)
    rows = []
    for n in [int(x) for x in a.layers.split(",")]:
        args = preset(a.model)
        args = args.with_layers(n) if n < args.n_layers else args  # (n <= the model's: checked above)
        for lay, sh in itertools.product(a.experts.split(","), a.shared.split(",")):
            t0 = time.perf_counter()
            model = Transformer(args, build_ops(Impls(), dev), "plain", dtype, dev, e.rank, e.world)
            model.load_weights(random_weights(args, seed=0, device=dev, rank=e.rank, world=e.world,
                                              include_mtp=False, experts=lay, shared=sh))
            load_s = time.perf_counter() - t0
            prompt = [(13 * i + 7) % args.vocab_size for i in range(a.prompt_len)]
            for v, vname in planned_passes(a.variants.split(","), a.warm_pass):
                try:
                    r = run_variant(model, v, prompt, a.new_tokens, bw, e.world)
                except (ImplUnavailable, RuntimeError, ValueError) as err:
                    r = {"variant": v, "error": f"{type(err).__name__}: {err}"}
                if vname is None:  # the warm pass: said, not recorded
                    if e.rank == 0:
                        print(f"warm pass ({n} layers, not recorded): {v} " +
                              (f"TPOT {r['tpot_ms']:.3f} ms" if "tpot_ms" in r else r.get("error", "")), flush=True)
                    continue
                name = vname + ("" if lay == "tp" else f"@{lay}") + ("" if sh == "replicate" else f"@sh{sh}")
                r.update(variant=name, experts=lay, shared_expert=sh, n_layers=n, world=e.world, weights_s=load_s)
                rows.append(r)
                if e.rank == 0:
                    print(json.dumps(r), flush=True)
                    _write_rows(a.out, dev, kind, e.world, bw, rows)  # after every row: a cut run keeps its rows
            del model
            if kind == "cuda":
                torch.cuda.empty_cache()
    if e.rank == 0:
        gpu = torch.cuda.get_device_name(dev) if kind == "cuda" else "cpu"
        print(f"\n{gpu} x{e.world}, copy bandwidth {bw:.0f} GB/s")
        print(f"{'layers':>6} {'variant':<24}{'TPOT ms':>9}{'p90':>8}{'mean':>8}{'tok/s':>8}{'e2e':>7}{'GB/tok':>8}"
              f"{'GB/s':>7}{'bw%':>6}{'memGiB':>8}")
        for r in rows:
            if "error" in r:
                print(f"{r['n_layers']:>6} {r['variant']:<24} {r['error'][:90]}")
                continue
            print(f"{r['n_layers']:>6} {r['variant']:<24}{r['tpot_ms']:>9.3f}{r['tpot_p90_ms']:>8.3f}"
                  f"{r['tpot_mean_ms']:>8.3f}{r['decode_tok_s']:>8.1f}{r['e2e_tok_s']:>7.1f}"
                  f"{r['bytes_per_token'] / 1e9:>8.3f}{r['achieved_gb_s']:>7.0f}"
                  f"{100 * r['bw_ratio']:>6.1f}{r['peak_mem_gib']:>8.1f}")
        ns = sorted({r["n_layers"] for r in rows})
        if len(ns) == 2:
            for v in dict.fromkeys(r["variant"] for r in rows):  # in order, with the layout suffix
                t = {r["n_layers"]: r for r in rows if r["variant"] == v and "tpot_ms" in r}
                if len(t) < 2:  # said, not left out: a variant that failed at one layer count has no slope
                    failed = [str(n) for n in ns if n not in t]
                    print(f"per-layer {v}: n/a (no TPOT at {', '.join(failed)} layers)")
                    continue
                bad = any(r.get("degenerate") for r in rows if r["variant"] == v)
                # the median's slope (the TPOT of BENCHMARKING.md), and the mean's (throughput, where steps differ)
                med, mean = ((t[ns[1]][k] - t[ns[0]][k]) * 1e3 / (ns[1] - ns[0])
                             for k in ("tpot_ms", "tpot_mean_ms"))
                print(f"per-layer {v}: {med:.1f} us/layer (mean: {mean:.1f})"
                      + ("  [DEGENERATE TOKENS: a NaN state? not comparable]" if bad else ""))
    if e.world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
