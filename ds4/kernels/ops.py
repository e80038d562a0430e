"""Thin typed wrappers over torch.ops.ds4.* (the extension is loaded on first use).

fmt codes: "bf16" -> 0, "fp8" -> 1 (E4M3 + E8M0 128x128), "fp4" -> 2 (E2M1 pairs + E8M0 per 32),
"fp4p" -> 3 (fp4 with the permuted words of ds4.quant.pack_fp4_mma; the MoE kernels only), "fp4t" -> 4
(fp4p in the tensor-core kernels' fragment order, ds4.quant.tile_fp4_mma; the MoE kernels only), "fp8t" -> 5
(fp8 in that fragment order with permuted words, ds4.quant.tile_fp8_mma: the dense GEMVs and the MoE kernels, the
shared expert's).
All kernels take BF16 activations and accumulate in fp32; they handle 1..8 tokens per launch and
loop over token chunks beyond that (callers send prefill-sized batches elsewhere).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ds4.quant.formats import fp4t_ok

FMT = {"bf16": 0, "fp8": 1, "fp4": 2, "fp4p": 3, "fp4t": 4, "fp8t": 5}
DENSE = ("bf16", "fp8", "fp8t", "fp4")  # the dense GEMVs' formats (the MoE kernels take every format)
# "auto": tensor-core kernels for one-token FP4 products and one-token FP8 products with K >= 2048 or
# with K >= 1024 and >= 16384 rows (csrc/ds4_launch.h; DS4_MMA=0 / all / k2048 overrides), FMA kernels
# otherwise; "fma" / "mma" force one (an "mma" request it cannot serve raises). "dp4a" (moe_gate_up only): the
# routed experts' one-token gate+up on the integer pipe (csrc/moe_dp4a.cu; moe=fp4_dp4a), checked by dp4a_ok here.
KERNEL = {"auto": 0, "fma": 1, "mma": 2, "dp4a": 3}
# the split-K pair's launches (moe_splitk_up / moe_splitk_down; csrc/moe_splitk.cu), its w2 in fp4t or in fp4k
KERNEL_SPLITK = {"fp4t": 4, "fp4k": 5}
DP4A_MAX_DIM = 4096  # csrc/moe_dp4a.cu: up to 4 chunks of 16 bytes per lane and row


def dp4a_ok(fmt: str, n_tok: int, dim: int) -> bool:
    """Whether moe_gate_up's kernel "dp4a" takes this call (csrc/ds4_launch.h moe_dp4a_ok, less what the
    wrapper checks itself): one token, the routed experts in the stored FP4 layout, dim a multiple of 32 up to
    DP4A_MAX_DIM."""
    return fmt == "fp4" and n_tok == 1 and dim % 32 == 0 and 32 <= dim <= DP4A_MAX_DIM


def _fmt(fmt: str, dense: bool = False) -> int:
    """The kernels' fmt code; fp4p / fp4t (the routed experts' layouts) only for the MoE kernels."""
    allowed = DENSE if dense else tuple(FMT)
    if fmt not in allowed:
        why = f" ({fmt} is the routed experts' layout: the MoE kernels only)" if fmt in ("fp4p", "fp4t") else ""
        raise ValueError(f"ds4.kernels: fmt must be one of {list(allowed)}, got {fmt!r}{why}")
    return FMT[fmt]


def _kernel(name: str, dp4a: bool = False) -> int:
    allowed = sorted(KERNEL) if dp4a else sorted(set(KERNEL) - {"dp4a"})
    if name not in allowed:
        why = " (dp4a is a gate+up kernel: moe_gate_up only)" if name == "dp4a" else ""
        raise ValueError(f"ds4.kernels: kernel must be one of {allowed}, got {name!r}{why}")
    return KERNEL[name]


def _ops():
    from ds4 import kernels
    kernels.load()
    return torch.ops.ds4


def gemv(x: Tensor, weight: Tensor, scale: Tensor | None, fmt: str, groups: int = 1,
         kernel: str = "auto", out_f32: bool = False, act_quant: bool = False) -> Tensor:
    """y[N, O] = x[N, groups*I] @ W^T (group g of the rows reads x columns g*I..(g+1)*I).

    x bf16 contiguous; weight [O, I] (fp8/bf16) or [O, I/2] (fp4) as stored; scale E8M0.
    act_quant (numerics=qat): x's values act_quant_sim(x, 128)'s, simulated in the kernel's activation staging; only
    where act_quant_staged_ok(fmt, O, I) holds and x is one row with kernel "auto" (else the op raises)."""
    k, f = _kernel(kernel), _fmt(fmt, dense=True)
    _tiled_check(fmt, weight)
    return _ops().gemv(x, weight, scale, f, groups, k, out_f32, bool(act_quant))


def gemv_rmsnorm(x: Tensor, weight: Tensor, scale: Tensor | None, fmt: str, norm_weight: Tensor,
                 eps: float, skip: tuple[Tensor, int, int, int] | None = None, act_quant: bool = False) -> Tensor:
    """y[1, O] bf16 = rms_norm(x, norm_weight, eps) @ W^T for one row x [1, I]: the RMSNorm (rounded as
    ds4.kernels_attn.rms_norm rounds it) inside the tensor-core GEMV's activation staging, one launch.
    Only where gemv_rmsnorm_ok(fmt, O, I) holds (FP8 / FP4, the row lengths gemv's auto sends to tensor cores).
    skip = (pos int64 [1], ratio, k, rows): where (pos + 1) // ratio <= k (decided on the device), y[:, rows:] is
    zeros instead of its products and the whole grid computes y[:, :rows] (rows % 16 == 0).
    act_quant (numerics=qat; where act_quant_staged_ok(fmt, O, I)): the normed values are FP8-simulated
    (act_quant_sim(., 128)) in the same staging: q_norm, the simulation and wq_b in one launch."""
    f = _fmt(fmt, dense=True)
    _tiled_check(fmt, weight)
    if skip is None:
        return _ops().gemv_rmsnorm(x, weight, scale, f, norm_weight, float(eps), act_quant=bool(act_quant))
    pos, ratio, k, rows = skip
    if not (ratio >= 1 and k >= 1 and 16 <= rows < weight.shape[0] and rows % 16 == 0):
        raise ValueError(f"gemv_rmsnorm skip: need ratio >= 1, k >= 1 and 16 <= rows < {weight.shape[0]}, a multiple "
                         f"of 16 (got ratio={ratio}, k={k}, rows={rows})")
    return _ops().gemv_rmsnorm(x, weight, scale, f, norm_weight, float(eps), pos, int(ratio), int(k), int(rows),
                               bool(act_quant))


GEMV_SMEM_CAP = 100 * 1024  # shared memory one GEMV block may use (SMEM_CAP in csrc/gemv.cu)
# How the GEMV launch stages an activation row in shared memory (csrc/ds4_common.cuh Smem<FMT>): K / VALS chunks of
# VALS + pad fp32 words each (the pad spreads the lanes' reads over the banks), by format: (VALS, VALS + pad).
GEMV_STAGE_CHUNK = {"bf16": (8, 10), "fp8": (16, 20), "fp8t": (16, 20), "fp4": (32, 36), "fp4p": (32, 36),
                    "fp4t": (32, 36)}
GEMV_MAX_STAGED_ROWS = 8  # gemv_max_tokens' cap (csrc/gemv.cu)


def gemv_max_tokens(fmt: str, K: int) -> int:
    """The activation rows of K values one gemv launch stages (host-only; csrc/gemv.cu's gemv_max_tokens, which the
    op checks before any kernel is chosen): as many as fit GEMV_SMEM_CAP, at most 8; 0 where one row does not fit
    and the op raises - a BF16 row past 20480 values (attn=fused_cuda_wo_bf16's merged wo_b.wo_a reads 32768), an
    FP8 one past 20480, an FP4 one past 22752."""
    vals, words = GEMV_STAGE_CHUNK[fmt]
    return min(GEMV_MAX_STAGED_ROWS, GEMV_SMEM_CAP // max(1, K // vals * words * 4))


def gemv_deferred_ok(every: int, K: int) -> bool:
    """Whether gemv_deferred takes a ring of `every` tokens of K values (host-only; launch_gemv_deferred's rule):
    2 <= every <= 8, K a multiple of 8, and the ring's tokens (every rounded up to 2, 4 or 8) in bf16 within a block's
    shared memory (8 tokens: K <= 6400)."""
    slots = 2 if every <= 2 else 4 if every <= 4 else 8
    return 2 <= every <= 8 and K >= 8 and K % 8 == 0 and slots * K * 2 <= GEMV_SMEM_CAP


def gemv_deferred(x: Tensor, ring: Tensor, weight: Tensor, pos: Tensor) -> Tensor:
    """The compressors' BF16 projection at decode, formed once per `every` = ring.shape[0] tokens.

    x bf16 [1, K] (this step's token), ring bf16 [every, K] (in place), weight bf16 [O, K], pos int64 [1] (device).
    With p = pos[0] (read on the device): where (p + 1) % every != 0, x is copied to ring[p % every] and the returned
    fp32 [every, O] is not written; else it is [ring[0 .. every - 2]; x] @ weight^T (positions p - every + 1 .. p),
    one weight read for the `every` tokens. Only where gemv_deferred_ok(every, K) holds."""
    every, K = ring.shape[0] if ring.dim() == 2 else 0, weight.shape[-1]
    if not (gemv_deferred_ok(every, K) and x.shape == (1, K) and ring.shape == (every, K) and weight.dim() == 2
            and pos.numel() == 1):
        raise ValueError(f"gemv_deferred: need x [1, K], ring [every, K] with gemv_deferred_ok(every, K) (2 <= every "
                         f"<= 8, K % 8 == 0, the ring within shared memory), weight [O, K] and one position (got x "
                         f"{tuple(x.shape)}, ring {tuple(ring.shape)}, weight {tuple(weight.shape)}, pos "
                         f"{tuple(pos.shape)})")
    return _ops().gemv_deferred(x.contiguous(), ring, weight.contiguous(), pos.reshape(1).contiguous())


def act_quant_staged_ok(fmt: str, rows: int, cols: int) -> bool:
    """Whether the one-row gemv / gemv_rmsnorm / gemv_fold of an [rows, cols] weight of `fmt` take act_quant=True
    (numerics=qat's FP8 activation simulation in their staging; host-only: the tensor-core kernel at the shapes
    csrc/gemv.cu's aq_shape_ok names: the plain launch's depth 8 or 2, cols % 128 == 0; reads DS4_MMA and the depth
    knobs like gemv's auto)."""
    return fmt in ("fp8", "fp8t", "fp4") and bool(_ops().gemv_act_quant_ok(FMT[fmt], rows, cols))


def gemv_rmsnorm_ok(fmt: str, rows: int, cols: int) -> bool:
    """Whether gemv_rmsnorm serves an [rows, cols] weight of `fmt` (host-only; reads DS4_MMA like gemv's auto)."""
    return fmt in ("fp8", "fp8t", "fp4") and bool(_ops().gemv_rmsnorm_ok(FMT[fmt], rows, cols))


def gemv_fold(x: Tensor, weight: Tensor, scale: Tensor | None, fmt: str, fold, act_quant: bool = False) -> Tensor:
    """y[1, O] bf16 = x[1, I] @ W^T on the tensor cores, and the hc fold's streams and partials (fold: an
    ds4.ops.base.HcFold with D = O) from the kernel's epilogue. Only where hc_fold_ok("gemv", fmt, O, I) holds:
    checked here, before the op (a rejection raised inside this op took the process down in session 14, run 3).
    act_quant: as gemv's (act_quant_staged_ok)."""
    rows, cols = weight.shape[0], weight.shape[1] * (2 if fmt == "fp4" else 1)
    if fold.out.shape[-1] != rows or not hc_fold_ok("gemv", fmt, rows, cols, 1, fold.out.shape[-2]):
        raise ValueError(f"gemv_fold: no fold of a {fmt} [{rows}, {cols}] weight into streams "
                         f"{tuple(fold.out.shape)} (hc_fold_ok; DS4_MMA=0 turns the tensor cores off)")
    return _ops().gemv_fold(x, weight, scale, _fmt(fmt, dense=True), *fold.args(), bool(act_quant))


def join_programmatic(side: torch.cuda.Stream, main: torch.cuda.Stream) -> bool:
    """While a graph is captured: join the side stream's branch into `main` by programmatic edges (csrc/capture.cu),
    so main's next kernel may launch before the branch's last kernels drain (it must be a ds4 kernel: it waits for
    them before reading their outputs). False where it cannot (no PDL, not capturing, a non-kernel last node):
    then nothing changed and the caller joins by an event."""
    return bool(_ops().join_programmatic(side.cuda_stream, main.cuda_stream))


def fork_programmatic(main: torch.cuda.Stream, side: torch.cuda.Stream) -> bool:
    """While a graph is captured, right after `side` was made to wait for `main` (a fork): side's next launch depends on
    main's last kernels by programmatic edges instead (csrc/capture.cu), so it may launch once they have let their
    successors launch (it must be a ds4 kernel: it waits for them before reading their outputs). False where it cannot
    (no PDL, not capturing, a non-kernel last node): then the fork stays a full edge."""
    return bool(_ops().fork_programmatic(main.cuda_stream, side.cuda_stream))


def hc_fold_ok(kind: str, fmt: str, rows: int, cols: int, topk: int = 1, n: int = 4) -> bool:
    """Whether a launch can fold the next mHC site's partials (host-only; reads DS4_MMA like gemv's auto):
    kind "gemv" (an [rows, cols] weight) or "moe_down" (dim = rows, inter = cols, topk)."""
    kinds = {"gemv": 0, "moe_down": 1}
    if fmt not in FMT or (kind == "gemv" and fmt not in ("fp8", "fp8t", "fp4")):
        return False
    return bool(_ops().hc_fold_ok(kinds[kind], FMT[fmt], rows, cols, topk, n))


class InKernelRoute(NamedTuple):
    """Routing done inside the one-token MoE kernels (moe_route_ok): the router GEMV's logits f32 [1, E],
    and the router's bias f32 [E] (learned layers) or tid2eid + token_ids (hash layers)."""
    logits: Tensor
    bias: Tensor | None
    tid2eid: Tensor | None
    token_ids: Tensor | None
    route_scale: float


def _tiled_check(fmt: str, *ws: Tensor) -> None:
    """fp4t / fp8t matrices are whole 16-row tiles and rounds of their row bytes (ds4.quant.fp4t_ok / fp8t_ok, the
    same rule; tile_fp4_mma / tile_fp8_mma make no others): any other shape is refused here, before the op."""
    if fmt in ("fp4t", "fp8t") and not all(fp4t_ok(w.shape[-2], w.shape[-1]) for w in ws):
        raise ValueError(f"ds4.kernels: {fmt} matrices must be whole 16-row tiles and rounds (ds4.quant.{fmt}_ok); "
                         f"got {[tuple(w.shape) for w in ws]}")


def moe_gate_up(x: Tensor, ids: Tensor | None, route_w: Tensor | None, w1: Tensor, s1: Tensor | None,
                w3: Tensor, s3: Tensor | None, fmt: str, expert_offset: int = 0, n_local: int | None = None,
                limit: float = 10.0, ptrs: Tensor | None = None, kernel: str = "auto",
                route: InKernelRoute | None = None, act_quant: bool = False) -> Tensor:
    """h [N*k, inter] bf16 = silu(min(x@w1[e]^T, lim)) * clamp(x@w3[e]^T, +-lim) * route_w, per slot.

    ids int64 [N, k] (global expert ids; slots outside [offset, offset+n_local) are skipped and
    their h rows left unwritten), or None for one (shared) expert. ptrs: int64 [n_local, 3] device
    addresses of bf16 (w1, w3, w2) per expert (then w1/w3 only give the shapes). route (one token):
    the kernel routes from the router's logits itself and writes ids [1, k] and route_w [1, k].
    act_quant (numerics=qat; one token where moe_act_quant_ok(..., gate_up=True)): x FP8-simulated in the kernel's
    staging (act_quant_sim(x, 128)'s bits)."""
    if n_local is None:
        n_local = w1.shape[0] if w1.dim() == 3 else 1
    k, f = _kernel(kernel, dp4a=True), _fmt(fmt)
    if kernel == "dp4a" and not (dp4a_ok(fmt, x.shape[0], x.shape[-1]) and ids is not None and ptrs is None
                                 and route is None and not act_quant and s1 is not None and s3 is not None):
        raise ValueError(f"ds4.kernels.moe_gate_up: kernel 'dp4a' takes one token of routed experts in the stored fp4 "
                         f"layout with scales and ids, dim a multiple of 32 up to {DP4A_MAX_DIM}, no in-kernel routing "
                         f"or act_quant; got fmt {fmt}, x {tuple(x.shape)}, ids {ids is not None}, "
                         f"route {route is not None}, act_quant {act_quant}")
    _tiled_check(fmt, w1, w3)
    r = route or InKernelRoute(None, None, None, None, 1.0)
    return _ops().moe_gate_up(x, ids, route_w, w1, s1, w3, s3, ptrs, f, expert_offset, n_local, limit, k,
                              r.logits, r.bias, r.tid2eid, r.token_ids, float(r.route_scale), bool(act_quant))


def moe_down(h: Tensor, ids: Tensor | None, topk: int, w2: Tensor, s2: Tensor | None, fmt: str,
             expert_offset: int = 0, n_local: int | None = None, add: Tensor | None = None,
             out_f32: bool = True, ptrs: Tensor | None = None, kernel: str = "auto",
             route: InKernelRoute | None = None, fold=None, act_quant: bool = False) -> Tensor:
    """y [N, dim] = add + sum over local slots (t, j) of h[t*k+j] @ w2[ids[t, j]]^T, fp32 accumulation.
    `add` fp32: with a bf16 output (out_f32=False) the sum is rounded to bf16 before `add` is added (the
    reference's shared-expert output added to the fp32 routed sum). `add` bf16 (the finished shared
    expert's output): bf16(sum + add), the fp32 sum not rounded first — the same block output.
    route (one token): the kernel routes from the router's logits itself (ids only gives the shape).
    fold (one token, bf16 out, hc_fold_ok("moe_down", ...)): an ds4.ops.base.HcFold the epilogue fills.
    act_quant (numerics=qat; one token where moe_act_quant_ok(..., gate_up=False)): h FP8-simulated in the kernel's
    staging."""
    if n_local is None:
        n_local = w2.shape[0] if w2.dim() == 3 else 1
    k, f = _kernel(kernel), _fmt(fmt)
    _tiled_check(fmt, w2)
    r = route or InKernelRoute(None, None, None, None, 1.0)
    if fold is not None and (out_f32 or h.shape[0] != topk or fold.out.shape[-1] != w2.shape[-2] or not hc_fold_ok(
            "moe_down", fmt, w2.shape[-2], h.shape[-1], topk, fold.out.shape[-2])):
        raise ValueError("moe_down: no fold at this shape / format (one token, bf16 out, hc_fold_ok)")
    fa = fold.args() if fold is not None else (None,) * 6
    return _ops().moe_down(h, ids, topk, w2, s2, ptrs, f, expert_offset, n_local, add, out_f32, k,
                           r.logits, r.bias, r.tid2eid, r.token_ids, float(r.route_scale), *fa, bool(act_quant))


def moe_splitk_rows(fmt: str, topk: int, dim: int, inter: int) -> int:
    """The split-K pair's partial rows at this shape on the current device (its gate+up launch's grid: one resident
    wave), or -1 where it does not take it (csrc/moe_splitk.cu: fp4t, dim % 64 == 0, inter % 32 == 0, topk <= 32)."""
    return int(_ops().moe_splitk_rows(FMT[fmt], topk, dim, inter)) if fmt in FMT else -1


def moe_splitk_up(x: Tensor, ids: Tensor, route_w: Tensor, w1: Tensor, s1: Tensor, w3: Tensor, s3: Tensor,
                  w2: Tensor, s2: Tensor, fmt: str, expert_offset: int = 0, n_local: int | None = None,
                  limit: float = 10.0, w2_layout: str = "fp4t") -> Tensor:
    """The split-K pair's first launch (csrc/moe_splitk.cu; one token of routed experts, ids and route weights given):
    parts fp32 [moe_splitk_rows(...), dim], each row one block's partial sums of the routed output — the h of its
    (w1, w3) tile pairs (moe_gate_up's values, route weight applied) times the matching columns of w2.
    moe_splitk_down(parts, ...) finishes it: together moe_down(moe_gate_up(...)) to fp32 rounding. w2_layout "fp4k":
    w2 and s2 as ds4.quant.chunk_fp4_splitk lays them out from fp4t (an experiment: each block's w2 one run)."""
    if n_local is None:
        n_local = w1.shape[0] if w1.dim() == 3 else 1
    if w2_layout not in KERNEL_SPLITK:
        raise ValueError(f"moe_splitk_up: w2_layout must be one of {sorted(KERNEL_SPLITK)}, got {w2_layout!r}")
    _tiled_check(fmt, w1, w3, w2)
    return _ops().moe_gate_up(x, ids, route_w, w1, s1, w3, s3, None, _fmt(fmt), expert_offset, n_local, limit,
                              KERNEL_SPLITK[w2_layout], None, None, None, None, 1.0, False, w2, s2)


def moe_splitk_down(parts: Tensor, ids: Tensor, w2: Tensor, s2: Tensor, fmt: str, expert_offset: int = 0,
                    n_local: int | None = None, add: Tensor | None = None, out_f32: bool = True, fold=None) -> Tensor:
    """The split-K pair's second launch: y [1, dim] = the sum of moe_splitk_up's partial rows (in a fixed order) with
    moe_down's epilogue (add, out_f32 and fold as there)."""
    if n_local is None:
        n_local = w2.shape[0] if w2.dim() == 3 else 1
    _tiled_check(fmt, w2)
    topk = ids.shape[1]
    if fold is not None and (out_f32 or fold.out.shape[-1] != w2.shape[-2] or not hc_fold_ok(
            "moe_down", fmt, w2.shape[-2], w2.shape[-1] * 2, topk, fold.out.shape[-2])):
        raise ValueError("moe_splitk_down: no fold at this shape / format (bf16 out, hc_fold_ok)")
    fa = fold.args() if fold is not None else (None,) * 6
    return _ops().moe_down(parts, ids, topk, w2, s2, None, _fmt(fmt), expert_offset, n_local, add, out_f32,
                           KERNEL_SPLITK["fp4t"], None, None, None, None, 1.0, *fa, False)


def moe_ffn(x: Tensor, ids: Tensor, route_w: Tensor, w1, w3, w2, shared_w1, shared_w3, shared_w2,
            expert_offset: int, limit: float, fold=None, shared_h: Tensor | None = None) -> Tensor:
    """The whole one-token MoE FFN in one launch (csrc/moe_ffn.cu): bf16 [1, dim] = bf16(bf16(shared(x)) + sum over
    the slots of route_w * routed(x)) — the block output of moe_gate_up / moe_down with the shared expert's output
    added in the down epilogue — plus the hc fold's streams and partials with fold (an ds4.ops.base.HcFold).
    w1 / w3 / w2: the routed experts' QWeights in fp4t (stacked by local expert); shared_*: the shared expert's fp8
    QWeights. ids int64 [1, k], route_w f32 [1, k]. shared_h (bf16 [1, shared inter]): the shared expert's h row
    from its own gate+up launch (moe_gate_up), so this launch runs only its down. Only where moe_ffn_ok holds
    (checked here, before the op)."""
    inter, dim = w1.weight.shape[-2], x.shape[-1]
    fold_n = 0 if fold is None else fold.out.shape[-2]
    if (w1.fmt != "fp4t" or shared_w1.fmt != "fp8" or x.shape[0] != 1
            or (fold is not None and fold.out.shape[-1] != dim)
            or not moe_ffn_ok(ids.shape[-1], dim, inter, shared_w1.weight.shape[0], fold_n)):
        raise ValueError(f"ds4.kernels.moe_ffn: no one-launch FFN for routed {w1.fmt} {tuple(w1.weight.shape)}, shared "
                         f"{shared_w1.fmt} {tuple(shared_w1.weight.shape)}, x {tuple(x.shape)} (moe_ffn_ok)")
    fa = fold.args() if fold is not None else (None,) * 6
    return _ops().moe_ffn(x, ids, route_w, w1.weight, w1.scale, w3.weight, w3.scale, w2.weight, w2.scale,
                          int(expert_offset), float(limit), shared_w1.weight, shared_w1.scale, shared_w3.weight,
                          shared_w3.scale, shared_w2.weight, shared_w2.scale, *fa, shared_h)


def moe_ffn_ok(topk: int, dim: int, inter: int, shared_inter: int, fold_n: int = 0) -> bool:
    """Whether moe_ffn takes these shapes (host-only; fp4t routed experts of [inter, dim], an fp8 shared expert of
    [shared_inter, dim], topk slots, the hc fold over fold_n streams or none)."""
    return bool(_ops().moe_ffn_ok(int(topk), int(dim), int(inter), int(shared_inter), int(fold_n)))


def bulk_stage_site(site: str) -> bool:
    """Whether the one-token tensor-core launches of a kind — "g" GEMVs, "d" MoE downs, "u" MoE gate+ups — now stage
    their activations by bulk copies on the TMA unit (DS4_BULK_STAGE names the kind, or "all"; sm_90+)."""
    return bool(_ops().bulk_stage_site(site))


# The one-token tensor-core kernel kinds by letter (csrc/ds4_launch.h): "g" GEMVs, "d" MoE downs, "u" MoE gate+ups,
# and the switches that name them, each with the words it takes besides. The launches look for their letter in the
# value, so a value with other letters ("1", "on") turns nothing on and one like "dual" turns on d and u:
# kind_switch_problems names such values before a run starts.
KERNEL_KINDS = "gdu"
KIND_SWITCHES = {"DS4_SPACER": (), "DS4_BULK_STAGE": ("all",)}


def kind_switch_problems(env: dict[str, str]) -> list[str]:
    """One line per kind switch set in env (os.environ's form) whose value is neither letters of KERNEL_KINDS nor one
    of its words; empty values are unset. Host-only, no extension."""
    out = []
    for name, words in KIND_SWITCHES.items():
        v = env.get(name, "")
        if v == "" or v in words or set(v) <= set(KERNEL_KINDS):
            continue
        takes = ", ".join(KERNEL_KINDS) + "".join(f' or "{w}"' for w in words)
        out.append(f"{name}={v!r}: takes letters of {takes} (the kernel kinds it applies to)")
    return out


def moe_route_ok(fmt: str, topk: int, dim: int, inter: int, n_experts: int) -> bool:
    """Whether the one-token MoE kernels can route for themselves (InKernelRoute) at this shape (host-only)."""
    return fmt in FMT and bool(_ops().moe_route_ok(FMT[fmt], topk, dim, inter, n_experts))


def moe_act_quant_ok(fmt: str, topk: int, dim: int, inter: int, gate_up: bool) -> bool:
    """Whether one token's moe_gate_up (gate_up) / moe_down takes act_quant=True (numerics=qat's FP8 simulation in
    its staging; host-only): the tensor-core kernels, the tiled layouts, rows of a multiple of 128, a down at depth 2
    (DS4_DOWN_DEPTH and its rule read like the launch's)."""
    return fmt in FMT and bool(_ops().moe_act_quant_ok(FMT[fmt], topk, dim, inter, bool(gate_up)))


ROUTER_MAX_K = 16          # experts a token's top-k selects at most (ROUTER_MAX_K in csrc/route_dev.cuh)
ROUTER_MAX_EXPERTS = 1024  # experts the router's tail scores, one thread each (RT_MAX_THREADS in csrc/router.cu)


def router(x: Tensor, gate: Tensor, bias: Tensor | None, tid2eid: Tensor | None, token_ids: Tensor | None,
           topk: int, route_scale: float, logits: Tensor | None = None, ride=None) -> tuple[Tensor, Tensor]:
    """(weights f32 [N, k], ids int64 [N, k]): gate GEMV, sqrt(softplus), top-k of score+bias (or
    tid2eid[token_ids]), renormalised x route_scale. Given logits (fp32 [N, E], contiguous) the GEMV is
    skipped (the tail kernel alone). ride (ds4.ops.base.SinkhornRide, comb [N, n, n]): the router's last launch
    also finishes each token's mHC Sinkhorn in place. topk <= ROUTER_MAX_K, E <= ROUTER_MAX_EXPERTS (the registry
    refuses the MoE options over them before the weights load)."""
    return _ops().router(x, gate, bias, tid2eid, token_ids, topk, route_scale, logits,
                         *(ride.args() if ride is not None else (None, 0, 0.0)))


def act_quant_sim(x: Tensor, block: int = 128) -> Tensor:
    """numerics=qat's FP8 activation simulation in one launch: the bits of ds4.quant.act_quant_sim(x, block) for
    contiguous bf16 x whose last dim block (64 or 128) divides."""
    return _ops().act_quant_sim(x, block)


ARGMAX_MAX_ROWS = 64  # rows one argmax launch takes (ARGMAX_MAX_ROWS in ds4_launch.h)


def argmax(x: Tensor) -> Tensor:
    """int64 [B]: the first index of each row's maximum of contiguous fp32 x [B, V] (NaN largest), as
    torch.argmax(-1); one launch, B <= ARGMAX_MAX_ROWS."""
    return _ops().argmax(x)


DEQUANT_FMTS = ("fp8", "fp8t", "fp4", "fp4p", "fp4t")  # the stored layouts ds4.dequant takes


def dequant_ok(fmt: str, rows: int, cols: int) -> bool:
    """Whether dequant takes a [rows, cols] matrix stored in fmt (csrc/dequant.cu's dequant_ok): rows of whole
    16-byte chunks, and for fp8t / fp4t whole 16-row tiles of whole rounds (the only shapes those layouts have)."""
    if fmt not in DEQUANT_FMTS:
        return False
    vals = 16 if fmt in ("fp8", "fp8t") else 32  # values per 16-byte chunk
    if rows < 1 or cols < vals or cols % vals:
        return False
    return fmt not in ("fp8t", "fp4t") or fp4t_ok(rows, cols * 16 // vals)  # the row's bytes


def dequant(weight: Tensor, scale: Tensor, fmt: str, dtype: torch.dtype = torch.bfloat16,
            out: Tensor | None = None) -> Tensor:
    """weight [..., O, Kb] stored in fmt (leading dims stack experts) -> dense [..., O, K] in dtype (bf16 or fp32):
    the values QWeight(fmt, weight, scale).dequant(dtype) gives, in one launch (prefill's weights for cuBLAS).
    out (that shape and dtype; contiguous, or [E, O, K] with contiguous matrices, e.g. a slice of a wider buffer)
    receives them when given."""
    k = weight.shape[-1] * (2 if fmt in ("fp4", "fp4p", "fp4t") else 1)
    if weight.dim() < 2 or not dequant_ok(fmt, weight.shape[-2], k):
        raise ValueError(f"ds4.kernels.dequant: a {fmt} matrix of {tuple(weight.shape[-2:])} stored bytes is not a "
                         f"shape it takes (rows of whole 16-byte chunks; fp8t / fp4t whole tiles)")
    o = weight.shape[-2]
    fp8 = fmt in ("fp8", "fp8t")
    want = (*weight.shape[:-2], *((-(-o // 128), -(-k // 128)) if fp8 else (o, k // 32)))
    if tuple(scale.shape) != want:
        raise ValueError(f"ds4.kernels.dequant: scale shape {tuple(scale.shape)}, expected {want} for a {fmt} weight "
                         f"{tuple(weight.shape)}")
    if out is None:
        out = torch.empty(*weight.shape[:-1], k, dtype=dtype, device=weight.device)
    _ops().dequant(weight, scale, _fmt(fmt), out)
    return out


PREFETCH_MAX_TENSORS = 4  # tensors one l2_prefetch launch takes (PF_MAX_RANGES in ds4_launch.h)


def l2_prefetch(tensors: list[Tensor], ids: Tensor | None = None, id_offset: int = 0) -> None:
    """Prefetch into L2 on the current stream (a hint: nothing is written or waited for). Without ids each
    tensor whole (contiguous: never copied, <= 4 tensors); with ids (int64 on the device) the experts ids - id_offset of
    tensors stacked by local expert [E_local, ...] (ids outside [0, E_local) are skipped)."""
    ts = list(tensors)
    if not 1 <= len(ts) <= PREFETCH_MAX_TENSORS:
        raise ValueError(f"ds4.kernels.l2_prefetch: 1..{PREFETCH_MAX_TENSORS} tensors, got {len(ts)}")
    ts += [None] * (PREFETCH_MAX_TENSORS - len(ts))
    _ops().l2_prefetch(*ts, None if ids is None else ids.reshape(-1), int(id_offset))


AR_CHUNK = 512  # elements per block of all_reduce_ll (AR_CHUNK in ds4_launch.h): its counters cover cap / AR_CHUNK
AR_MAX_WORLD = 8
AR_FOLD_ROWS = 32  # elements per block of all_reduce_ll_fold (16 AR_FOLD_TILES in ds4_launch.h): one counter each


def all_reduce_ll(x: Tensor, peers: list[int], counters: Tensor, rank: int, cap: int, round_bf16: bool,
                  out_dtype: torch.dtype) -> Tensor:
    """One-shot all-reduce of contiguous fp32 / bf16 x over the ranks' peer-mapped buffers (csrc/allreduce.cu):
    the partials (rounded to bf16 first with round_bf16) summed in rank order, the sum rounded to bf16 with
    round_bf16, in out_dtype (fp32 or bf16). peers: each rank's buffer address in this process
    ([2][W][cap] 8-byte words, zeroed before the first call); counters: int32 [ceil(cap / AR_CHUNK)], zeroed,
    this rank's. Every rank must make the same calls in the same order (a rank left waiting traps)."""
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"ds4.kernels.all_reduce_ll: out_dtype fp32 or bf16, got {out_dtype}")
    return _ops().all_reduce_ll(x, [int(p) for p in peers], counters, int(rank), int(cap), bool(round_bf16),
                                out_dtype == torch.float32)


def all_reduce_ll_fold(x: Tensor, peers: list[int], counters: Tensor, rank: int, cap: int, round_bf16: bool,
                       fold) -> Tensor:
    """all_reduce_ll of one block output x ([1, D] or [D], D % 16 == 0) into bf16, with the hc fold (fold: an
    ds4.ops.base.HcFold with D = x's length) formed in the same launch: the fold's new streams and its per-tile
    partials, as gemv_fold forms them from its y. peers: each rank's fold region (its own, not all_reduce_ll's);
    counters: int32 [ceil(cap / AR_FOLD_ROWS)], zeroed, used by these calls only. Same-calls rule as all_reduce_ll."""
    if fold.out.shape[-1] != x.numel():
        raise ValueError(f"ds4.kernels.all_reduce_ll_fold: streams {tuple(fold.out.shape)} for {x.numel()} values")
    return _ops().all_reduce_ll_fold(x, [int(p) for p in peers], counters, int(rank), int(cap), bool(round_bf16),
                                     *fold.args())
