"""What an implementation of a swappable component must provide.

The model math (ds4/model) calls these interfaces; `ds4.registry` maps config names to
objects implementing them. Every fast implementation has the torch reference as its twin
(vLLM's forward_native idea) and is tested against it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from torch import Tensor


@dataclass
class HcFold:
    """A pending mHC post + the next site's pre that the kernel producing a block's output y [1, D] may
    fold into its epilogue (hc=fused_cuda's `fold`, on unless DS4_HC_FOLD=0; one decode row). The streams
    res [1, n, D] bf16 are updated with post [1, n] / comb [1, n, n] into `out` and the next site's
    partials (fn [mix, n*D] fp32) land in `part` [1, mix + 1, D / 16]. An implementation that folds sets
    `fused`; otherwise the caller runs hc.post_pre on the returned y as usual (decided by shapes and
    implementations only)."""
    res: Tensor
    post: Tensor
    comb: Tensor
    fn: Tensor
    out: Tensor
    part: Tensor
    fused: bool = False

    def args(self) -> tuple[Tensor, ...]:
        """The six tensors in the kernels' order (res, post, comb, fn, out, part)."""
        return self.res, self.post, self.comb, self.fn, self.out, self.part


def sinkhorn_iters(iters: int) -> int:
    """The model's hc_sinkhorn_iters as the CUDA kernels take it: the reference runs iters - 1 rounds after the first
    normalisation, so 0 (which ModelArgs accepts) computes what 1 does, while to the kernels 0 means "deferred"
    (a finish) or is refused (a ride)."""
    return max(int(iters), 1)


@dataclass
class SinkhornRide:
    """An mHC Sinkhorn that a later launch of the decode step finishes (hc=fused_cuda's `defers_sinkhorn`): comb
    fp32 [N, n, n] (n = 1, 2, 4) holds the Sinkhorn's input logits, as the site's finish left them, and must hold
    Sinkhorn(logits) before it is read (hc.post / the hc fold, at the site's end). The attention core's combine
    launch (attn=fused_cuda) or the router's top-k launch (moe=fp4_topk) takes it along; where neither can, `run`
    finishes it as a launch of its own, with the same bits."""
    comb: Tensor
    iters: int
    eps: float

    def args(self) -> tuple[Tensor, int, float]:
        """(comb, iters, eps) in the kernels' order: comb is finished in place (never copied); iters as
        sinkhorn_iters gives it."""
        return self.comb, sinkhorn_iters(self.iters), float(self.eps)

    def run(self) -> None:
        from ds4 import kernels_attn  # (CUDA only: a ride exists only beside the CUDA hc kernels)
        kernels_attn.hc_sinkhorn(*self.args())


@dataclass(frozen=True)
class RowSkip:
    """Output columns a decode projection may leave out (attn.q_up's skip): for a row whose (pos + 1) // ratio <= k
    (decided on the device), columns [rows:] are zeros instead of their products. The merged wq_b + indexer wq_b
    passes the index queries' columns while the indexer's top-k of k would select every visible entry anyway: zero
    index queries score each visible entry 0, so any scores + top-k take all of them, and the fused kernel spends
    the whole grid on wq_b's rows instead."""
    pos: Tensor  # int64 [N] (device)
    ratio: int
    k: int
    rows: int

    def applies(self) -> Tensor:
        """bool [N] on the device: the rows whose columns [rows:] are zeros."""
        return (self.pos + 1) // self.ratio <= self.k


@dataclass
class QWeight:
    """One linear layer's weight in its storage format (spec §10.3).

    fmt "fp8":  weight float8_e4m3fn [..., O, I], scale float8_e8m0fnu [..., ceil(O/128), ceil(I/128)]
    fmt "fp4":  weight int8 [..., O, I/2] (low nibble = even element), scale e8m0 [..., O, I/32]
    fmt "fp4p": fp4 with the bits of each 4-byte word permuted (ds4.quant.formats.pack_fp4_mma): the
                routed experts' layout under moe=fp4_topk (its kernels decode it in fewer instructions)
    fmt "fp4t": fp4p words in the tensor-core kernels' fragment order (ds4.quant.tile_fp4_mma): moe=fp4_topk's
                default layout of the routed experts where the shapes allow (its kernels only)
    fmt "fp8t": fp8 bytes in the same fragment order, the bits of each 4-byte word permuted for the kernels' decode
                (ds4.quant.tile_fp8_mma), same shapes and scales:
                linear=gemv_cuda's layout of the dense FP8 projections and moe=fp4_topk's of the shared expert where
                the shapes allow (their CUDA kernels only)
    fmt "bf16": weight bfloat16 or float32 [..., O, I], scale None
    A leading dim, when present, stacks experts: [E, O, ...].
    """
    fmt: str
    weight: Tensor
    scale: Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.weight.shape[-2]

    @property
    def in_features(self) -> int:
        return self.weight.shape[-1] * (2 if self.fmt in ("fp4", "fp4p", "fp4t") else 1)

    def dequant(self, dtype: torch.dtype = torch.float32) -> Tensor:
        from ds4.quant import dequant_fp4, dequant_fp8, unpack_fp4_mma, untile_fp4_mma, untile_fp8_mma
        if self.fmt == "fp8":
            return dequant_fp8(self.weight, self.scale, dtype)
        if self.fmt == "fp8t":
            return dequant_fp8(untile_fp8_mma(self.weight.contiguous()), self.scale, dtype)
        if self.fmt == "fp4":
            return dequant_fp4(self.weight, self.scale, dtype)
        if self.fmt == "fp4p":
            return dequant_fp4(unpack_fp4_mma(self.weight.contiguous()), self.scale, dtype)
        if self.fmt == "fp4t":
            return dequant_fp4(unpack_fp4_mma(untile_fp4_mma(self.weight)), self.scale, dtype)
        return self.weight.to(dtype)

    def nbytes(self) -> int:
        return self.weight.nbytes + (self.scale.nbytes if self.scale is not None else 0)

    def __getitem__(self, idx) -> "QWeight":
        """Select experts along the leading dim (e.g. a device tensor of expert ids)."""
        return QWeight(self.fmt, self.weight[idx], None if self.scale is None else self.scale[idx])


class LinearImpl(Protocol):
    """Dense projection y = x @ W^T for one QWeight (no leading expert dim).

    `act_quant` is the `qat` numerics mode: FP8-quantise the activation per 128 input
    channels (power-of-two scale) before an FP8/FP4 GEMM, like the official reference."""
    name: str

    def __call__(self, x: Tensor, w: QWeight, act_quant: bool = False,
                 fold: HcFold | None = None) -> Tensor:  # [..., I] -> [..., O], x.dtype
        """`fold` (one decode row, y [1, D]): an implementation that can forms the hc fold's streams and partials
        with y and sets fold.fused; one that cannot leaves it (the caller then runs the mHC step itself)."""
        ...

    def grouped(self, x: Tensor, w: QWeight, groups: int) -> Tensor:
        """Block-diagonal projection (wo_a, spec §5.8): x [N, G, I], w [G*R, I] -> [N, G, R].
        No activation quant: the reference runs it in BF16 on the dequantised wo_a."""
        ...

    def prefetch(self, site: str, ws: Sequence[QWeight], x: Tensor) -> bool:
        """Start bringing ws into L2 ahead of the GEMV that reads them (a side branch of a captured decode
        step, ds4.ops.prefetch, joined at the end of the step), or nothing; returns whether it did."""
        ...


@dataclass
class MoEWeights:
    """One layer's MoE (spec §6). Routed experts are stacked: w1/w3 [E_local, inter, dim], w2 [E_local, dim, inter]."""
    gate: Tensor                 # bf16 [E, dim] (all experts: every rank routes the same way)
    bias: Tensor | None          # f32 [E] for learned layers
    tid2eid: Tensor | None       # int32 [vocab, topk] for hash layers
    w1: QWeight
    w2: QWeight
    w3: QWeight
    shared_w1: QWeight
    shared_w2: QWeight
    shared_w3: QWeight
    n_experts: int               # global number of routed experts
    expert_offset: int           # global id of local expert 0 (expert parallel)
    topk: int
    route_scale: float
    swiglu_limit: float


class MoEImpl(Protocol):
    name: str

    def route(self, x: Tensor, token_ids: Tensor, mw: MoEWeights,
              logits: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x [N, dim], token_ids [N] -> (weights f32 [N, k], global expert ids int64 [N, k]); logits: x . gate^T
        (fp32 [N, E]) when the caller formed them already (hc's router fold), else computed here."""
        ...

    def routed(self, x: Tensor, weights: Tensor, ids: Tensor, mw: MoEWeights, act_quant: bool = False,
               shared: object | None = None, fold: HcFold | None = None, partial: bool = False) -> Tensor:
        """Sum over the k selected experts held on this rank (others contribute 0): f32 [N, dim]. With
        `shared` (a shared_up result; only when nothing is summed over ranks after this) the block output
        instead: (sum + shared.float()).to(x.dtype); `fold` then as in LinearImpl.__call__. With `shared` and
        `partial` (a sliced shared expert, reduced over ranks after this): sum + shared.float() in f32."""
        ...

    def shared_up(self, x: Tensor, mw: MoEWeights, act_quant: bool = False) -> object | None:
        """Optionally start the shared expert before routing (e.g. on a side stream while a CUDA graph is
        captured, so it overlaps the router and the routed experts; after routing instead when the
        implementation has a true `shared_after_route` attribute); the result goes to routed(shared=)
        or shared(up=). None: nothing started."""
        ...

    def shared(self, x: Tensor, mw: MoEWeights, act_quant: bool = False, add: Tensor | None = None,
               up: object | None = None, fold: HcFold | None = None) -> Tensor:
        """Shared expert with the SwiGLU clamp: [N, dim] in x.dtype. With `add` (the routed sum, fp32
        [N, dim]) it returns the block output (add + shared.float()).to(x.dtype) in one step, and `fold`
        then as in LinearImpl.__call__. `up`: what shared_up returned for this x."""
        ...
