"""MoE on the CUDA kernels (spec §6).

moe=fp4_topk
  route:  device router (BF16 gate GEMV -> sqrt(softplus) -> bias-corrected top-k or tid2eid hash
          lookup -> renormalise x route_scale); no host sync.
  routed: all top-k experts of the layer in two launches reading the expert ids from the device
          tensor: gate+up (+clamp, SiLU, route weight, BF16 h) and down (fp32 accumulation over the
          experts in registers, no atomics). Slots whose expert is not held locally add 0.
  shared: the FP8 shared expert through the same two kernels (one expert, no route weight); in line,
          the routed sum is added in its down kernel's epilogue (no separate add / casts). While a CUDA
          graph is being captured (decode sizes), shared_up runs both its launches on a side stream that
          forks from the current one before routing, overlapping the router and the routed experts, so
          the shared expert leaves the critical path (H200, 1 GPU, 4 -> 12 layers: 146.0 -> 137.0 us per
          layer against in line; session 6 ran only its gate+up there: 143.0). Its bf16 output is added
          by the routed down kernel's epilogue with one rank (routed(shared=)), or after the all-reduce
          in one elementwise launch (shared(up=)): the same sum and rounding either way. Eager steps run
          the same launches in line (a fork and join would only add host work to a host-bound step), so
          they form the block output, and the hc fold, with the same kernels as a captured step.
          DS4_SHARED_OVERLAP=0 in the environment keeps it in line in graphs too (the ablation);
          DS4_SHARED_FORK=late forks it after the router instead (overlapping only the routed experts;
          measured slower: H200, 1 GPU, 142.1 against 131.5 us per layer).
          DS4_ROUTE_IN_MOE=1 (opt-in; measured slower): captured decode steps (one token, tensor-core
          kernels) leave the router's tail (scores, top-k or hash lookup, weights) to the two routed
          kernels: route() launches only the gate GEMV and every block of gate+up / down routes from its
          logits (the same arithmetic as the top-k kernel); gate+up writes the (weights, ids) route()
          returned. One launch fewer, but each block's serial top-k delays its weight loads: H200, 1 GPU,
          151.5 against 133.3 us per layer; full model tp=2 6.599 against 6.222 ms
          (experiments/decode_session9_h200.md, run 6).
  ffn:    DS4_MOE_FFN=1 (opt-in, read per call): a one-token call on one GPU runs the routed and the shared
          expert, gate+up and down, in one launch (kernels.moe_ffn, csrc/moe_ffn.cu: one resident wave, a grid
          barrier between the phases, the down weights loaded before it) instead of the four launches above,
          with the same block output (to fp32 summation order) and the hc fold. Needs the routed experts in fp4t
          and the shared expert in fp8 (moe_ffn_ok; prepare keeps it fp8 when DS4_MOE_FFN is set at load or
          configure); other calls keep the launches above. Faster than the four
          launches alone, slower in the decode step, where those overlap the router (H200, 1 GPU: 139.1 against
          126.7 us per layer; experiments/decode_session20_h200.md).
          DS4_MOE_FFN=2: the same, except that the shared expert's gate+up stays a launch of its own (in a captured
          step on the side stream, beside the router: ffn_shared_up) and the one launch takes its h row.
  splitk: DS4_MOE_SPLITK=1 (opt-in, read per call): a one-token call with both routed matrices in fp4t runs the
          routed gate+up and down as a split-K pair (kernels.moe_splitk_up / moe_splitk_down, csrc/moe_splitk.cu):
          each gate+up block multiplies its own pairs' h by the matching columns of w2 into a partial row of the
          output, and a second launch sums the rows in a fixed order and runs the down's epilogue (shared expert's
          output, hc fold). The same block output to fp32 summation order. Not with qat, in-kernel routing or
          moe=fp4_dp4a: such a one-token call keeps the launches above and warns why (splitk_refusal); prompts keep
          them too. Measured slower (H100, 1 GPU: 121.4 against 114.0 us
          per layer; experiments/session84.md).
  prefetch: with DS4_L2_PREFETCH naming site "d" (opt-in: measured slower, ds4.ops.prefetch), a captured
          decode step brings the chosen experts' w2 (and scales) into L2 on a side stream while gate+up
          streams w1 / w3.
  Layout: at load (prepare), the routed experts' FP4 bytes are permuted inside each 4-byte word
          (QWeight fmt "fp4p", ds4.quant.pack_fp4_mma, in place: no extra memory) so the kernels decode
          a weight word in ~9 integer instructions instead of ~17; every other reader dequantises through
          QWeight, which undoes it. DS4_FP4_PACK=0 at load keeps the stored layout (the ablation).
          By default the words are also placed in the tensor-core kernels' fragment order (fmt "fp4t",
          ds4.quant.tile_fp4_mma: every warp load of the one-token kernels' MmaStream is 512 contiguous
          bytes; the FMA kernels for several tokens find their chunks by address arithmetic) wherever
          the shapes allow (whole 16-row tiles and rounds; V4's do), fp4p elsewhere: H200, 1 GPU, 126.3
          against 127.9 us per layer (experiments/decode_session15_h200.md, run 2). DS4_FP4_TILE=0 keeps fp4p;
          DS4_FP4_TILE=1 requires fp4t and fails at load where it cannot be laid out (shapes,
          moe=bf16_cache).
          The shared expert's FP8 matrices take fp8t the same way (the dense projections' layout under
          linear=gemv_cuda, ds4.quant.tile_fp8_mma) where the shapes allow: DS4_SHARED_TILE (0 / 1 / auto) where
          set, else DS4_FP8_TILE, says which; fp8 under DS4_MOE_FFN.
  Decode sizes (<= PREFILL_TOKENS tokens) use the kernels; prompts up to CHUNKED_TOKENS run them in
  chunks of PREFILL_TOKENS; longer ones the grouped loop (grouped_routed: the experts' dense weights formed on the
  device a group at a time, one grouped GEMM per matrix and group), and the shared expert on its device-dequantised
  weights — chosen by shape only. A prompt's router logits are one fp32 GEMM (the reference's).
  qat (act_quant=True): x and h FP8-simulated inside the one-token tensor-core kernels' staging where they take
  it (DS4_ACT_QUANT=staged, the default since session 71; kernels.moe_act_quant_ok: the tiled layouts), else by a
  launch before each kernel (ds4.ops.qat_cuda: one launch each, the torch twin's bits; DS4_ACT_QUANT=kernel there
  too; the one-launch FFN is the plain-numerics one).

moe=fp4_dp4a: fp4_topk with the one-token routed gate+up on the integer pipe (Fp4Dp4aMoE; csrc/moe_dp4a.cu), w1 / w3
  in the checkpoint's layout; the decode step measured slower (an ablation option).

moe=bf16_cache (seed phase 5, an ablation): like fp4_topk, but experts that were selected keep a
  dequantised BF16 copy (LRU, size cap, free-memory guard, frozen after warm-up); cached experts run
  through the BF16 variants of the same kernels, the rest through the FP4 ones. Cache bookkeeping
  needs the ids on the host: one device->host sync per layer call (that is the point of comparison).
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from collections import OrderedDict
from typing import NamedTuple

import torch
from torch import Tensor

from ds4 import kernels
from ds4.ops import prefetch as l2
from ds4.ops import side_stream
from ds4.ops.base import HcFold, MoEWeights, QWeight
from ds4.ops.dequant_cuda import dense
from ds4.ops.linear_cuda import fp8_tile_mode, lay_fp8
from ds4.ops.moe_torch import pairs_by_expert, shared_block, swiglu
from ds4.ops.qat_cuda import act_quant_sim, staging_on
from ds4.quant import TILE_W, fp4t_ok, pack_fp4_mma, tile_fp4_mma, unpack_fp4_mma, untile_fp4_mma

PREFILL_TOKENS = 8
# Up to this many tokens prefill runs the decode kernels chunk by chunk (PREFILL_TOKENS a chunk), each chunk reading
# its selected experts once; beyond it, the grouped loop (grouped_routed): each expert's weights dequantised on the
# device once, its tokens in one GEMM. The chunks' time grows with the prompt (0.6 ms a token on 8 layers), the loop's
# hardly. DS4_MOE_CHUNKED_TOKENS (read per call; the measurement's knob) replaces it.
# Session 48 (H200, ds4_best on 8 layers, prefill tok/s, experiments/decode_session48_h200.md): at 64 / 128 / 256 /
# 512 / 2048 prompt tokens the chunks 1457.5 / 1585.2 / 1652.6 / 1688.2 / 1697.7, the grouped loop 514.6 / 1024.4 /
# 1948.0 / 3647.5 / 11434.0 — they cross between 128 and 256 (run 3; with the dequantisation's staged stores, run 7,
# the loop's 256 / 2048 became 2514.1 / 14313.2). The limit was 4096 before (the torch expert loop, which dequantised
# expert by expert, was slower still).
CHUNKED_TOKENS = 128


def chunked_tokens() -> int:
    """The longest prompt whose MoE prefill runs the decode kernels chunk by chunk (CHUNKED_TOKENS or
    DS4_MOE_CHUNKED_TOKENS)."""
    v = os.environ.get("DS4_MOE_CHUNKED_TOKENS")
    if not v:
        return CHUNKED_TOKENS
    if not v.isdigit():
        raise ValueError(f"DS4_MOE_CHUNKED_TOKENS must be a number of tokens (0 or more), got {v!r}")
    return int(v)


def _act_quant_sim(t: Tensor) -> Tensor:
    return act_quant_sim(t, 128)


def _stages(n_tok: int, t: Tensor, fmt: str, topk: int, dim: int, inter: int, gate_up: bool) -> bool:
    """qat with DS4_ACT_QUANT=staged (the default): whether this one-token launch (gate_up: of x [1, dim], else the down
    of h [topk, inter]; t that input) FP8-simulates its input in its staging (kernels.moe_act_quant_ok) instead of a
    launch before. A bf16 input only: the staging simulates the bf16 values the kernel reads, the launch the input's."""
    return (n_tok == 1 and t.dtype == torch.bfloat16 and staging_on()
            and kernels.moe_act_quant_ok(fmt, topk, dim, inter, gate_up))


def _bf16(x: Tensor) -> Tensor:
    return x if x.dtype == torch.bfloat16 and x.is_contiguous() else x.to(torch.bfloat16).contiguous()


def _down_folds(fold: HcFold | None, x: Tensor, fmt: str, dim: int, inter: int, topk: int) -> bool:
    """A down launch producing one row's block output can form the hc fold (shapes and formats only)."""
    return (fold is not None and x.shape[0] == 1 and fold.out.shape[-1] == dim
            and kernels.hc_fold_ok("moe_down", fmt, dim, inter, topk, fold.out.shape[-2]))


# The long-prompt loop forms the dense weights of this many bytes of experts at a time (DS4_PREFILL_GROUP_BYTES):
# V4-Flash's experts are 50 MB each in bf16, so 21 at a time.
GROUP_BYTES = 1 << 30


def _grouped_mm_ok(x: Tensor) -> bool:
    """Whether torch._grouped_mm (one cuBLAS-class grouped GEMM over experts with different row counts) serves x:
    bf16 on an sm_90+ GPU; DS4_GROUPED_MM=0 (read per call) takes one F.linear per expert instead."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device)[0] >= 9 and os.environ.get("DS4_GROUPED_MM") != "0")


def _expert_products(a: Tensor, w: Tensor, offs: Tensor, counts: list[int], grouped: bool) -> Tensor:
    """a [M, K] (rows sorted by expert, counts[i] rows for expert i, offs their int32 ends on the device) times each
    expert's w[i] [N, K]^T -> [M, N]."""
    if grouped:
        return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)
    out, start = torch.empty(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device), 0
    for i, c in enumerate(counts):
        if c:
            torch.matmul(a[start:start + c], w[i].t(), out=out[start:start + c])
            start += c
    return out


def grouped_routed(x: Tensor, weights: Tensor, ids: Tensor, mw: MoEWeights, act_quant: bool = False) -> Tensor:
    """The routed sum (fp32 [N, dim]) of a long prompt. The (token, slot) pairs are grouped by expert (one sort; one
    host sync for the counts, as the reference's loop). The experts' dense weights are formed on the device a group at
    a time (ds4.kernels.dequant; w1 and w3 side by side, so gate and up are one product) and multiplied by one grouped
    GEMM per matrix and group (torch._grouped_mm; one matmul per expert where it cannot run). The reference's
    arithmetic (ds4.ops.moe_torch.DequantMoE.routed) to cuBLAS's summation order."""
    n, k = ids.shape
    e_local, inter, dim = mw.w1.weight.shape[0], mw.w1.out_features, x.shape[-1]
    perm, counts_dev = pairs_by_expert(ids, mw.expert_offset, e_local)
    ends = counts_dev.cumsum(0).to(torch.int32)                          # each expert's last pair + 1, on the device
    counts = counts_dev.tolist()
    rows = perm // k                                                     # each pair's token
    route_w = weights.float().flatten()[perm].unsqueeze(-1)             # [N k, 1]
    xq = _act_quant_sim(x) if act_quant else x
    grouped = _grouped_mm_ok(x)
    per_expert = 3 * inter * dim * x.element_size()
    size = max(1, min(e_local, int(os.environ.get("DS4_PREFILL_GROUP_BYTES") or GROUP_BYTES) // per_expert))
    w13 = torch.empty(size, 2 * inter, dim, dtype=x.dtype, device=x.device)  # gate and up of a group, reused
    w2 = torch.empty(size, dim, inter, dtype=x.dtype, device=x.device)
    y = torch.zeros(n, dim, dtype=torch.float32, device=x.device)
    r0 = 0
    for e0 in range(0, e_local, size):
        e1 = min(e0 + size, e_local)
        cnt = counts[e0:e1]
        r1 = r0 + sum(cnt)
        if r1 == r0:
            continue
        g = e1 - e0
        dense(mw.w1[e0:e1], x.dtype, out=w13[:g, :inter])
        dense(mw.w3[e0:e1], x.dtype, out=w13[:g, inter:])
        dense(mw.w2[e0:e1], x.dtype, out=w2[:g])
        r = rows[r0:r1]
        offs = ends[e0:e1] - r0
        gu = _expert_products(xq[r], w13[:g], offs, cnt, grouped)                # [pairs, 2 inter]
        a = (swiglu(gu[:, :inter], gu[:, inter:], mw.swiglu_limit) * route_w[r0:r1]).to(x.dtype)
        if act_quant:
            a = _act_quant_sim(a)
        y.index_add_(0, r, _expert_products(a, w2[:g], offs, cnt, grouped).float())
        r0 = r1
    return y


def lay_fp4(q: QWeight, fmt: str) -> QWeight:
    """A routed FP4 matrix re-laid in place as `fmt`: "fp4" (the checkpoint's), "fp4p" (pack_fp4_mma's permuted
    words) or "fp4t" (those in the tensor-core kernels' fragment order); the same storage and scales."""
    if fmt not in ("fp4", "fp4p", "fp4t") or q.fmt not in ("fp4", "fp4p", "fp4t"):
        raise ValueError(f"lay_fp4: from {q.fmt} to {fmt}: both must be fp4, fp4p or fp4t")
    w = q.weight
    if q.fmt == fmt:
        return q
    if q.fmt == "fp4t":
        untile_fp4_mma(w, out=w)  # -> fp4p
    if fmt == "fp4":
        unpack_fp4_mma(w, out=w)
    else:
        if q.fmt == "fp4":
            pack_fp4_mma(w, out=w)
        if fmt == "fp4t":
            tile_fp4_mma(w, out=w)
    return QWeight(fmt, w, q.scale)


class SharedUp(NamedTuple):
    """The shared expert issued on a side stream: its bf16 output, ready once `branch` is joined."""
    out: Tensor
    branch: side_stream.Branch


def add_shared(y: Tensor, up: SharedUp) -> Tensor:
    """bf16(y + shared) for the routed sum y (fp32, or bf16 after a bf16 reduction): one elementwise
    launch computing in fp32 and rounding once, the down kernel epilogue's sum and rounding."""
    up.branch.join()
    return torch.add(y, up.out, out=torch.empty_like(up.out))


def splitk_refusal(act_quant: bool, route, mw: MoEWeights, gate_up_kernel: str, topk: int, dim: int) -> str | None:
    """Why a one-token routed call asking for the split-K pair (DS4_MOE_SPLITK=1) cannot take it, or None."""
    if act_quant:
        return "numerics=qat (the pair has no FP8 activation staging)"
    if route is not None:
        return "the router's tail runs inside the MoE kernels (DS4_ROUTE_IN_MOE=1)"
    if mw.w1.fmt != "fp4t" or mw.w2.fmt != "fp4t" or mw.w1.weight.dim() != 3:
        return f"the routed experts are laid out {mw.w1.fmt} / {mw.w2.fmt}, not stacked fp4t"
    if gate_up_kernel != "auto":
        return f"the gate+up kernel is {gate_up_kernel!r} (moe=fp4_dp4a)"
    if kernels.moe_splitk_rows("fp4t", topk, dim, mw.w1.weight.shape[-2]) <= 0:
        return "shapes kernels.moe_splitk_rows does not take"
    return None


class Fp4TopkMoE:
    name = "fp4_topk"
    tiles = True  # prepare may lay the experts out as fp4t

    @property
    def shared_after_route(self) -> bool:
        """Fork the side-stream shared expert after the router (DS4_SHARED_FORK=late, read per call)."""
        return os.environ.get("DS4_SHARED_FORK") == "late"

    def _reference(self):
        from ds4.ops.moe_torch import DequantMoE
        return DequantMoE()

    def prepare(self, mw: MoEWeights) -> MoEWeights:
        """At load (and configure): the routed experts' and the shared expert's layouts (_prepare_routed,
        _prepare_shared)."""
        return self._prepare_shared(self._prepare_routed(mw))

    # The layout of the routed gate+up's w1 / w3 (None: w2's, fp4t or fp4p by the rule of _prepare_routed).
    gate_up_layout: str | None = None

    def _prepare_routed(self, mw: MoEWeights) -> MoEWeights:
        """CUDA FP4 routed experts -> the fp4t layout where it can lay them out, fp4p elsewhere, in
        place (DS4_FP4_PACK=0 keeps the stored layout; DS4_FP4_TILE=0 takes fp4p, =1 requires fp4t); w1 / w3 in
        gate_up_layout where a subclass names one. Every layout converts to every other in the same storage, so one
        loaded model can be configured with either."""
        if mw.w1.fmt not in ("fp4", "fp4p", "fp4t") or not mw.w1.weight.is_cuda:
            return mw
        qs = {name: getattr(mw, name) for name in ("w1", "w2", "w3")}
        if all(q.fmt == "fp4" for q in qs.values()) and os.environ.get("DS4_FP4_PACK", "1") == "0":
            return mw
        req = os.environ.get("DS4_FP4_TILE", "auto")
        if req not in ("auto", "0", "1"):
            raise ValueError(f"DS4_FP4_TILE must be 0, 1 or unset (auto), got {req!r}")
        can = self.tiles and all(fp4t_ok(q.weight.shape[-2], q.weight.shape[-1]) for q in qs.values())
        tile = can if req == "auto" else req == "1"
        if tile and not can:
            # an explicit request that cannot be served fails here, at load, rather than keeping fp4p silently
            raise ValueError(f"DS4_FP4_TILE=1: moe={self.name} cannot lay these experts out as fp4t (it needs "
                             f"moe=fp4_topk, rows in 16s and row bytes in {64 * TILE_W}s: "
                             f"{[tuple(q.weight.shape) for q in qs.values()]}); unset it")
        down = "fp4t" if tile else "fp4p"
        want = {"w1": self.gate_up_layout or down, "w2": down, "w3": self.gate_up_layout or down}
        if all(q.fmt == want[name] for name, q in qs.items()):
            return mw  # laid out already
        return dataclasses.replace(mw, **{name: lay_fp4(q, want[name]) for name, q in qs.items()})

    def _prepare_shared(self, mw: MoEWeights) -> MoEWeights:
        """The shared expert's CUDA FP8 matrices in fp8t (the dense projections' fragment order under
        linear=gemv_cuda) where the shapes allow, each a new tensor (ds4.ops.linear_cuda.lay_fp8; the caller files
        it). DS4_SHARED_TILE (0 / 1 / auto) where set, else DS4_FP8_TILE, says which. Kept fp8 under
        DS4_MOE_FFN=1 / 2 (moe_ffn reads fp8 rows)."""
        knob = "DS4_SHARED_TILE" if os.environ.get("DS4_SHARED_TILE") else "DS4_FP8_TILE"
        mode = fp8_tile_mode(knob)
        if os.environ.get("DS4_MOE_FFN") in ("1", "2"):
            if mode == "1":
                raise ValueError(f"{knob}=1 asks for the shared expert in fp8t, but DS4_MOE_FFN's one-launch FFN reads "
                                 f"fp8 rows: unset one of them")
            mode = "0"
        out = {name: lay_fp8(getattr(mw, name), mode, knob, f"moe={self.name} cannot lay the shared expert's {name}")
               for name in ("shared_w1", "shared_w2", "shared_w3")}
        if all(out[name] is getattr(mw, name) for name in out):
            return mw
        return dataclasses.replace(mw, **out)

    # Whether a captured decode step may leave the router's tail to the routed kernels (off in subclasses
    # that read the ids on the host).
    route_in_kernels = True
    rides_sinkhorn = True  # route takes the FFN site's deferred mHC Sinkhorn along (ds4.ops.base.SinkhornRide)
    _deferred: tuple[Tensor, kernels.InKernelRoute] | None = None

    def _defer_route(self, x2: Tensor, gate: Tensor, mw: MoEWeights) -> bool:
        """With DS4_ROUTE_IN_MOE=1 (read per call) while a decode graph is captured (one token, the
        tensor-core MoE kernels): route() runs only the router GEMV and the routed kernels run the router's
        tail themselves (one launch fewer; the same experts and weights, csrc/route_dev.cuh)."""
        return (self.route_in_kernels and x2.is_cuda and x2.shape[0] == 1 and torch.cuda.is_current_stream_capturing()
                and os.environ.get("DS4_ROUTE_IN_MOE") == "1"
                and kernels.moe_route_ok(mw.w1.fmt, mw.topk, x2.shape[1], mw.w1.weight.shape[-2], gate.shape[0]))

    def route(self, x: Tensor, token_ids: Tensor, mw: MoEWeights, logits: Tensor | None = None,
              ride=None) -> tuple[Tensor, Tensor]:
        # logits (fp32 [N, E]): x . gate^T formed already (hc's router fold): the GEMV is skipped. ride (a
        # SinkhornRide): the router's last launch finishes the mHC Sinkhorn in a warp of its own
        x2 = _bf16(x.reshape(-1, x.shape[-1]))
        if logits is not None:
            logits = logits.float().contiguous()
        gate = _bf16(mw.gate)
        hashed = mw.tid2eid is not None  # hash layers: tid2eid[token]; learned layers: top-k of score + bias
        bias = None if hashed else mw.bias.float().contiguous()
        tid = mw.tid2eid.contiguous() if hashed else None
        tok = token_ids.reshape(-1).to(torch.int64).contiguous() if hashed else None
        if self._defer_route(x2, gate, mw):
            # (weights, ids) are written by the gate+up launch of routed(), the only reader in a captured step
            if logits is None:
                logits = kernels.gemv(x2, gate, None, "bf16", out_f32=True)
            w = torch.empty(1, mw.topk, device=x2.device, dtype=torch.float32)
            ids = torch.empty(1, mw.topk, device=x2.device, dtype=torch.int64)
            self._deferred = (ids, kernels.InKernelRoute(logits, bias, tid, tok, mw.route_scale))
            if ride is not None:  # no router launch here to take it along
                ride.run()
            return w, ids
        if logits is None and x2.shape[0] > PREFILL_TOKENS:
            # a prompt: one fp32 GEMM (the reference's x.float() @ gate.float().T) instead of the BF16 GEMV kernel,
            # which takes PREFILL_TOKENS tokens a launch (256 launches a layer at 2048 tokens)
            logits = x2.float() @ gate.float().t()
        return kernels.router(x2, gate, bias, tid, tok, mw.topk, mw.route_scale, logits=logits, ride=ride)

    @property
    def ffn_capable(self) -> bool:
        """Whether the one-launch FFN may run: it takes the ids on the device, as the in-kernel routing does (off in
        subclasses that read the ids on the host)."""
        return self.route_in_kernels

    def ffn_ok(self, x: Tensor, mw: MoEWeights, act_quant: bool = False) -> bool:
        """Whether this call may take the one-launch FFN (ffn): DS4_MOE_FFN=1 or 2, one token on the GPU, plain
        numerics, the router's tail in its own kernel, fp4t routed and fp8 shared experts at shapes moe_ffn_ok takes."""
        return (self.ffn_capable and os.environ.get("DS4_MOE_FFN") in ("1", "2") and x.is_cuda and x.shape[0] == 1
                and not act_quant and os.environ.get("DS4_ROUTE_IN_MOE") != "1"
                and mw.w1.fmt == "fp4t" and mw.shared_w1.fmt == "fp8" and mw.w1.weight.dim() == 3
                and kernels.moe_ffn_ok(mw.topk, x.shape[-1], mw.w1.weight.shape[-2], mw.shared_w1.weight.shape[0]))

    def ffn_shared_up(self, x: Tensor, mw: MoEWeights) -> SharedUp | None:
        """DS4_MOE_FFN=2: the shared expert's gate+up (its h row) as a launch of its own — in a captured step on the
        side stream, forked before the router like shared_up, in eager steps in line (the same arithmetic in both
        runtimes); None otherwise (ffn's launch forms it)."""
        if os.environ.get("DS4_MOE_FFN") != "2":
            return None
        side = side_stream.fork(x.device, "DS4_SHARED_OVERLAP")
        with side_stream.Branch(side, x.device) as branch:
            h = self._shared_h(x, mw, False)
        return SharedUp(h, branch)

    def ffn(self, x: Tensor, weights: Tensor, ids: Tensor, mw: MoEWeights, fold: HcFold | None = None,
            shared: SharedUp | None = None) -> Tensor:
        """The block's FFN output (routed sum + shared expert, x's dtype [1, dim]) in one launch, where ffn_ok holds;
        with fold the launch also forms the hc fold when moe_ffn_ok takes it (then fold.fused is set); with shared
        (ffn_shared_up's) it takes the shared expert's h row from that launch."""
        dim, inter, s_inter = x.shape[-1], mw.w1.weight.shape[-2], mw.shared_w1.weight.shape[0]
        if fold is not None and not (fold.out.shape[-1] == dim
                                     and kernels.moe_ffn_ok(mw.topk, dim, inter, s_inter, fold.out.shape[-2])):
            fold = None
        if shared is not None:
            shared.branch.join()
        y = kernels.moe_ffn(_bf16(x), ids.to(torch.int64).contiguous(), weights.float().contiguous(), mw.w1, mw.w3,
                            mw.w2, mw.shared_w1, mw.shared_w3, mw.shared_w2, mw.expert_offset, mw.swiglu_limit, fold,
                            None if shared is None else shared.out)
        if fold is not None:
            fold.fused = True
        return y.to(x.dtype)

    def _gate_up_kernel(self, x: Tensor, fmt: str, act_quant: bool, route) -> str:
        """The kernel choice of the routed gate+up launch (kernels.moe_gate_up's `kernel`)."""
        return "auto"

    def _splitk_ok(self, x: Tensor, ids: Tensor, mw: MoEWeights, act_quant: bool, route) -> bool:
        """Whether the routed launches take the split-K pair (splitk): DS4_MOE_SPLITK=1 and a one-token call on the
        GPU that splitk_refusal finds nothing against. A one-token call it refuses runs the separate launches and
        says why (a warning, once per reason); prompts (several tokens) take the separate launches by design."""
        if os.environ.get("DS4_MOE_SPLITK") != "1" or not x.is_cuda or x.shape[0] != 1:
            return False
        why = splitk_refusal(act_quant, route, mw, self._gate_up_kernel(x, "fp4t", False, None), ids.shape[1],
                             x.shape[-1])
        if why is not None:
            warnings.warn(f"DS4_MOE_SPLITK=1: the separate gate+up and down launches run: {why}", stacklevel=2)
        return why is None

    def _splitk_launches(self, x: Tensor, weights: Tensor, ids: Tensor, mw: MoEWeights, shared: SharedUp | None,
                         fold: HcFold | None, partial: bool) -> Tensor:
        """_routed_launches' output by the split-K pair (kernels.moe_splitk_up / moe_splitk_down): the shared
        expert's branch joins between its two launches, where it joins the separate down."""
        dim, inter, k = x.shape[-1], mw.w1.weight.shape[-2], ids.shape[1]
        parts = kernels.moe_splitk_up(_bf16(x), ids, weights.float().contiguous(), mw.w1.weight, mw.w1.scale,
                                      mw.w3.weight, mw.w3.scale, mw.w2.weight, mw.w2.scale, "fp4t", mw.expert_offset,
                                      mw.w1.weight.shape[0], mw.swiglu_limit)
        add = None
        if shared is not None:
            shared.branch.join("moe")  # the reduction below is the next launch
            add = shared.out
        if partial or not (add is not None and _down_folds(fold, x, "fp4t", dim, inter, k)):
            fold = None
        y = kernels.moe_splitk_down(parts, ids, mw.w2.weight, mw.w2.scale, "fp4t", mw.expert_offset,
                                    mw.w2.weight.shape[0], add, add is None or partial, fold)
        if fold is not None:
            fold.fused = True
        return y

    def _routed_launches(self, x: Tensor, weights: Tensor, ids: Tensor, mw: MoEWeights, act_quant: bool,
                         shared: SharedUp | None = None, route: kernels.InKernelRoute | None = None,
                         fold: HcFold | None = None, partial: bool = False) -> Tensor:
        if self._splitk_ok(x, ids, mw, act_quant, route):
            return self._splitk_launches(x, weights, ids, mw, shared, fold, partial)
        fmt, fmt2 = mw.w1.fmt, mw.w2.fmt  # (the gate+up's and the down's: moe=fp4_dp4a lays them out apart)
        k = ids.shape[1]
        aqx = act_quant and _stages(x.shape[0], x, fmt, k, x.shape[-1], mw.w1.weight.shape[-2], True)
        xq = _act_quant_sim(x) if act_quant and not aqx else x
        # the chosen experts' down projections into L2 while gate+up streams (site "d"; ids are on the device
        # already unless the kernels route themselves)
        if route is None:
            l2.issue("d", [t for t in (mw.w2.weight, mw.w2.scale) if t is not None], x, ids, mw.expert_offset)
        h = kernels.moe_gate_up(_bf16(xq), ids, weights.float().contiguous(), mw.w1.weight, mw.w1.scale,
                                mw.w3.weight, mw.w3.scale, fmt, mw.expert_offset, mw.w1.weight.shape[0],
                                mw.swiglu_limit, route=route, act_quant=aqx,
                                kernel=self._gate_up_kernel(x, fmt, aqx, route))
        aqh = act_quant and _stages(x.shape[0], h, fmt2, k, mw.w2.weight.shape[-2], h.shape[-1], False)
        if act_quant and not aqh:
            h = _act_quant_sim(h)
        add = None
        if shared is not None:  # the finished shared expert (bf16) added in the epilogue: a bf16 block output
            shared.branch.join("moe")  # the down kernel below is the next launch (DS4_PJOIN: programmatic join)
            add = shared.out
        # the hc fold (one row, the block output in bf16): the down kernel's epilogue forms the next mHC site's
        # streams and partials
        if partial or not (add is not None and _down_folds(fold, x, fmt2, mw.w2.weight.shape[-2], h.shape[-1],
                                                           ids.shape[1])):
            fold = None
        # fp32 out: the routed sum, or with a sliced shared expert (partial) the routed + shared partial sum
        y = kernels.moe_down(h, ids, ids.shape[1], mw.w2.weight, mw.w2.scale, fmt2, mw.expert_offset,
                             mw.w2.weight.shape[0], add, add is None or partial, route=route, fold=fold,
                             act_quant=aqh)
        if fold is not None:
            fold.fused = True
        return y

    def routed(self, x: Tensor, weights: Tensor, ids: Tensor, mw: MoEWeights, act_quant: bool = False,
               shared: SharedUp | None = None, fold: HcFold | None = None, partial: bool = False) -> Tensor:
        n = x.shape[0]
        if self._deferred is not None:
            pending, route = self._deferred
            self._deferred = None
            if pending is ids:  # route() left the tail to these kernels: they write weights and ids
                return self._routed_launches(x, weights, ids, mw, act_quant, shared, route, fold, partial)
            raise RuntimeError("moe=fp4_topk: routed() must take the (weights, ids) of the route() call just before it")
        if shared is not None:
            if n > PREFILL_TOKENS:
                raise ValueError("routed(shared=...) takes the shared_up result of a decode-sized call")
            return self._routed_launches(x, weights, ids.to(torch.int64).contiguous(), mw, act_quant, shared,
                                         fold=fold, partial=partial)
        if n == 0:
            return self._reference().routed(x, weights, ids, mw, act_quant)
        if n > chunked_tokens():
            return grouped_routed(x, weights, ids, mw, act_quant)
        ids = ids.to(torch.int64).contiguous()
        # short prompts: the decode kernels over chunks of PREFILL_TOKENS tokens (static chunk shapes)
        return torch.cat([self._routed_launches(x[i:i + PREFILL_TOKENS], weights[i:i + PREFILL_TOKENS],
                                                ids[i:i + PREFILL_TOKENS], mw, act_quant)
                          for i in range(0, n, PREFILL_TOKENS)])

    def _shared_h(self, x: Tensor, mw: MoEWeights, act_quant: bool) -> Tensor:
        w1, w3 = mw.shared_w1, mw.shared_w3
        aq = act_quant and w1.fmt != "bf16" and _stages(x.shape[0], x, w1.fmt, 1, x.shape[-1], w1.weight.shape[-2],
                                                        True)
        xq = _act_quant_sim(x) if act_quant and w1.fmt != "bf16" and not aq else x
        return kernels.moe_gate_up(_bf16(xq), None, None, w1.weight, w1.scale, w3.weight, w3.scale, w1.fmt, 0, 1,
                                   mw.swiglu_limit, act_quant=aq)

    def _shared_down(self, h: Tensor, mw: MoEWeights, act_quant: bool, add: Tensor | None) -> Tensor:
        w2 = mw.shared_w2
        aq = act_quant and w2.fmt != "bf16" and _stages(h.shape[0], h, w2.fmt, 1, w2.weight.shape[-2], h.shape[-1],
                                                        False)
        if act_quant and w2.fmt != "bf16" and not aq:
            h = _act_quant_sim(h)
        # with `add`: bf16(add + bf16(shared)) in the down kernel's epilogue (the reference's rounding)
        add = None if add is None else add.float().contiguous()
        return kernels.moe_down(h, None, 1, w2.weight, w2.scale, w2.fmt, 0, 1, add, False, act_quant=aq)

    def shared_up(self, x: Tensor, mw: MoEWeights, act_quant: bool = False) -> SharedUp | None:
        if not (x.is_cuda and 1 <= x.shape[0] <= PREFILL_TOKENS):
            return None
        # The side stream waits for everything before it (x is ready, and any kernel still reading an
        # output of an earlier call is ordered before the next allocation on the side stream).
        # In line (eager steps, DS4_SHARED_OVERLAP=0) the same two launches run before the router, so the block
        # output is formed by the same kernel as in a captured step: the routed down's epilogue, which also forms
        # the hc fold where it can. (Eager steps used to add the routed sum in the shared down's epilogue instead:
        # the same sum and rounding, but where only the routed down folds — tiny's FP8 shared expert on the FMA
        # kernels — the next site's partials were summed in another order, and batch-1 graph and eager tokens
        # parted after 152 steps: H200, session 40.)
        # The branch's first launch is the gate+up kernel (x bf16, no qat simulation before it), which waits before it
        # reads x: only then may it fork by programmatic edges (DS4_PFORK=shared, the default)
        site = "shared" if x.dtype == torch.bfloat16 and not act_quant else None
        side = side_stream.fork(x.device, "DS4_SHARED_OVERLAP", site=site)
        with side_stream.Branch(side, x.device) as branch:
            out = self._shared_down(self._shared_h(x, mw, act_quant), mw, act_quant, None)
        return SharedUp(out, branch)

    def shared(self, x: Tensor, mw: MoEWeights, act_quant: bool = False, add: Tensor | None = None,
               up: SharedUp | None = None, fold: HcFold | None = None) -> Tensor:
        # never folds: a decode row's shared expert is started by shared_up (in line or on a side stream), and
        # routed(shared=) forms that row's block output and fold; what comes here forms no fold (fold.fused stays
        # False and the caller runs the next site's pre)
        n = x.shape[0]
        if n == 0:
            return self._reference().shared(x, mw, act_quant, add)
        if n > chunked_tokens():
            return shared_block(x, mw, act_quant, add, dense)
        if n > PREFILL_TOKENS:
            return torch.cat([self.shared(x[i:i + PREFILL_TOKENS], mw, act_quant,
                                          None if add is None else add[i:i + PREFILL_TOKENS])
                              for i in range(0, n, PREFILL_TOKENS)])
        if up is not None:
            return up.out if add is None else add_shared(add, up)
        return self._shared_down(self._shared_h(x, mw, act_quant), mw, act_quant, add).to(x.dtype)


class Fp4Dp4aMoE(Fp4TopkMoE):
    """moe=fp4_topk with the routed experts' one-token gate+up on the integer pipe (csrc/moe_dp4a.cu): the E2M1
    nibbles looked up as bytes by PRMT and multiplied by DP4A with x quantized per 32 values to 16 bits, never decoded
    to floats. w1 / w3 stay in the checkpoint's layout (the kernel reads it); w2 takes fp4_topk's (fp4t / fp4p), its
    down kernel unchanged. Calls of several tokens run fp4_topk's FMA kernels on the stored layout, prompts past
    chunked_tokens() the grouped loop. The router's tail stays its own launch (no in-kernel routing, no one-launch
    FFN: both read fp4t). An ablation option: on an H100 its gate+up is faster alone (21.82 against 23.32 us), but the
    decode step is slower (123.3 / 123.4 against 121.7 / 121.6 us per layer, experiments/session64.md); on an H200
    too (106.5 / 106.2 against 104.8 / 104.4), about 1 us per layer of it on the shared expert's down, which its
    register-filling blocks delay (experiments/session65.md). Under numerics=qat the gate+up's x is FP8-simulated by
    the launch before it, under DS4_ACT_QUANT=staged (the default) too: that staging is the tensor-core kernels' on
    the tiled layouts (kernels.moe_act_quant_ok says no to the stored fp4 layout), so the dp4a kernel still takes the
    launch."""
    name = "fp4_dp4a"
    gate_up_layout = "fp4"
    route_in_kernels = False

    def _gate_up_kernel(self, x: Tensor, fmt: str, act_quant: bool, route) -> str:
        if route is None and not act_quant and kernels.dp4a_ok(fmt, x.shape[0], x.shape[-1]):
            return "dp4a"
        return "auto"


class _LayerCache:
    def __init__(self) -> None:
        self.experts: OrderedDict[int, tuple[Tensor, Tensor, Tensor]] = OrderedDict()
        self.calls = 0
        self.frozen = False


class Bf16CacheMoE(Fp4TopkMoE):
    """Hot-expert BF16 cache (per layer, keyed by the layer's w1 storage)."""
    name = "bf16_cache"
    route_in_kernels = False  # its routed() reads the ids on the host (so no one-launch FFN either)
    tiles = False  # the seed-phase ablation keeps fp4p (its cache and cold path not tested with fp4t)

    def __init__(self, cap_bytes: int | None = None, min_free_bytes: int | None = None,
                 warmup_calls: int | None = None) -> None:
        env = os.environ.get
        self.cap_bytes = int(cap_bytes if cap_bytes is not None else env("DS4_BF16_CACHE_BYTES", 16 << 30))
        self.min_free_bytes = int(min_free_bytes if min_free_bytes is not None else env("DS4_BF16_CACHE_MIN_FREE", 4 << 30))
        self.warmup_calls = int(warmup_calls if warmup_calls is not None else env("DS4_BF16_CACHE_WARMUP", 64))
        self.layers: dict[int, _LayerCache] = {}
        self.bytes = 0

    def stats(self) -> dict:
        return {"bytes": self.bytes, "experts": sum(len(c.experts) for c in self.layers.values()),
                "frozen_layers": sum(c.frozen for c in self.layers.values())}

    def _insert(self, cache: _LayerCache, mw: MoEWeights, e: int) -> None:
        local = e - mw.expert_offset
        need = 3 * mw.w1.out_features * mw.w1.in_features * 2
        while self.bytes + need > self.cap_bytes and cache.experts:
            _, old = cache.experts.popitem(last=False)  # LRU eviction inside the layer
            self.bytes -= sum(t.nbytes for t in old)
        if self.bytes + need > self.cap_bytes:
            return
        if torch.cuda.mem_get_info(mw.w1.weight.device)[0] < self.min_free_bytes + need:
            return  # free-memory guard
        w1, w3, w2 = (q[local].dequant(torch.bfloat16).contiguous() for q in (mw.w1, mw.w3, mw.w2))
        cache.experts[e] = (w1, w3, w2)
        self.bytes += need

    def routed(self, x: Tensor, weights: Tensor, ids: Tensor, mw: MoEWeights, act_quant: bool = False,
               shared: SharedUp | None = None, fold: HcFold | None = None,
               partial: bool = False) -> Tensor:  # never folds
        if shared is not None:  # its routed sum ends in one of two down launches: the shared output added after
            y = self.routed(x, weights, ids, mw, act_quant)
            if partial:
                shared.branch.join()
                return y + shared.out.float()
            return add_shared(y, shared)
        if x.shape[0] > PREFILL_TOKENS or x.shape[0] == 0:
            return self._reference().routed(x, weights, ids, mw, act_quant)
        ids = ids.to(torch.int64).contiguous()
        key = mw.w1.weight.data_ptr()
        cache = self.layers.setdefault(key, _LayerCache())
        host = ids.tolist()  # the host sync this option pays for its cache bookkeeping
        e_local = mw.w1.weight.shape[0]
        selected = []
        for row in host:
            for e in row:
                if mw.expert_offset <= e < mw.expert_offset + e_local and e not in selected:
                    selected.append(e)
        for e in selected:
            if e in cache.experts:
                cache.experts.move_to_end(e)
            elif not cache.frozen:
                self._insert(cache, mw, e)
        cache.calls += 1
        if cache.calls >= self.warmup_calls:
            cache.frozen = True
        hot = [e for e in selected if e in cache.experts]
        if not hot:
            return self._routed_launches(x, weights, ids, mw, act_quant)
        slot_of = {e: i for i, e in enumerate(hot)}
        ids_q = torch.tensor([[(-1 if e in slot_of else e) for e in row] for row in host], dtype=torch.int64)
        ids_b = torch.tensor([[slot_of.get(e, -1) for e in row] for row in host], dtype=torch.int64)
        ptrs = torch.tensor([[t.data_ptr() for t in cache.experts[e]] for e in hot], dtype=torch.int64)
        dev = x.device
        ids_q, ids_b, ptrs = (t.to(dev, non_blocking=True) for t in (ids_q, ids_b, ptrs))
        xq = _bf16(_act_quant_sim(x) if act_quant else x)
        wts = weights.float().contiguous()
        w1b, w3b, w2b = cache.experts[hot[0]]
        k = ids.shape[1]
        y = None
        if len(hot) < len(selected):  # some selected experts are not cached: FP4 kernels for them
            h = kernels.moe_gate_up(xq, ids_q, wts, mw.w1.weight, mw.w1.scale, mw.w3.weight, mw.w3.scale,
                                    mw.w1.fmt, mw.expert_offset, e_local, mw.swiglu_limit)
            if act_quant:
                h = _act_quant_sim(h)
            y = kernels.moe_down(h, ids_q, k, mw.w2.weight, mw.w2.scale, mw.w2.fmt, mw.expert_offset, e_local,
                                 None, True)
        h = kernels.moe_gate_up(xq, ids_b, wts, w1b, None, w3b, None, "bf16", 0, len(hot), mw.swiglu_limit,
                                ptrs=ptrs)
        if act_quant:
            h = _act_quant_sim(h)
        return kernels.moe_down(h, ids_b, k, w2b, None, "bf16", 0, len(hot), y, True, ptrs=ptrs)
