"""The ds4_attn CUDA extension (mHC pre/post/head, sparse MQA decode attention, indexer scores, and
the decode glue: RMSNorm, per-head norm + RoPE, window KV write, compressor step).

Kept apart from ``ds4.kernels`` (the GEMV/MoE extension) so the two build and load independently.
Sources: ``csrc/attn/*.cu`` (launchers over raw pointers, CUDA headers only) + one binding file
``csrc/attn/attn_bindings.cpp`` registering ``torch.ops.ds4_attn.*`` with TORCH_LIBRARY. Built with
ninja through ``torch.utils.cpp_extension.load`` into ``<repo>/.ext_build/attn`` (``$DS4_EXT_BUILD_DIR/attn``
where that is set; override with ``DS4_ATTN_EXT_BUILD_DIR``) for ``TORCH_CUDA_ARCH_LIST`` (default "8.0;9.0").
Nothing here is needed or imported on a CPU machine unless a CUDA option is chosen; ``unavailable_reason()``
says why not.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
from torch import Tensor

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc" / "attn"
SOURCES = ("attn_bindings.cpp", "hc.cu", "sparse_attn.cu", "indexer.cu", "decode_glue.cu", "topk.cu")
TOPK_MAX_LEN = 524288  # topk.cu: one block per row up to 32768 entries, then up to 64 blocks of 8192 (topk_ok)
ONE_BLOCK_TOPK_LEN = 32768  # topk.cu's TOPK_ONE_BLOCK_LEN
EXT_NAME = "ds4_attn_ext"
# Tokens one hc finish / head_rope launch takes: they run a block row per token on the grid's y axis, whose limit is
# 65535 (launch_hc_finish, launch_head_rope refuse more). A longer prompt's prefill (contexts up to 1M tokens) calls
# them per chunk of rows (each row's outputs depend on its own inputs only): HC_CHUNK_ROWS for the mHC ops, a multiple
# of the binding's 4096-row cuBLAS slices (HC_GEMM_SLICE), so a chunk's slices are the ones one launch would take.
MAX_GRID_ROWS = 65535
HC_CHUNK_ROWS = 15 * 4096


def build_dir() -> Path:
    """$DS4_ATTN_EXT_BUILD_DIR, else attn/ under the GEMV/MoE extension's folder ($DS4_EXT_BUILD_DIR or
    <repo>/.ext_build): a build of other flags or archs given a folder of its own keeps off the default build."""
    from ds4.kernels import build_dir as ext_build_dir
    return Path(os.environ.get("DS4_ATTN_EXT_BUILD_DIR", ext_build_dir() / "attn"))


@functools.lru_cache(maxsize=None)
def load(verbose: bool = False) -> None:
    """Build (if needed) and load the extension; registers the ops and their fake implementations."""
    from ds4.kernels import build_and_load
    build_and_load(EXT_NAME, CSRC, SOURCES, build_dir(), verbose, flags_env="DS4_ATTN_NVCC_FLAGS")
    from ds4.kernels_attn import _fake  # noqa: F401  fake impls once the schemas exist


def unavailable_reason() -> str | None:
    """None when the attention/indexer/mHC kernels can run here, else why not."""
    from ds4.kernels import extension_reason
    return extension_reason("ds4_attn", build_dir() / f"{EXT_NAME}.so", load)


def _ops():
    load()
    return torch.ops.ds4_attn


# ---- typed wrappers -----------------------------------------------------------------------------------
def _by_rows(op, rows: int, *row_args: Tensor, chunk: int = HC_CHUNK_ROWS):
    """op(*row_args) over all `rows` rows (dim 0 of every row_arg), in launches of at most `chunk` rows whose
    outputs (a tensor or a tuple of them, each with the rows on dim 0) are concatenated: one call where it fits."""
    if rows <= MAX_GRID_ROWS:
        return op(*row_args)
    parts = [op(*(t[r0:r0 + chunk] for t in row_args)) for r0 in range(0, rows, chunk)]
    if isinstance(parts[0], Tensor):
        return torch.cat(parts)
    return tuple(torch.cat(p) for p in zip(*parts))


def hc_pre(h: Tensor, fn: Tensor, scale: Tensor, base: Tensor, iters: int, hc_eps: float,
           norm_eps: float, norm: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """h [N, hc, D] bf16|f32 -> (x [N, D] h.dtype, post [N, hc] f32, comb [N, hc, hc] f32). Two launches (per
    HC_CHUNK_ROWS tokens past MAX_GRID_ROWS).
    norm [D] (bf16|f32): x comes back RMS-normed with it (the block's attn_norm / ffn_norm)."""
    fn, scale, base = fn.float().contiguous(), scale.float().contiguous(), base.float().contiguous()
    norm = None if norm is None else norm.contiguous()
    return _by_rows(lambda hh: _ops().hc_pre(hh.contiguous(), fn, scale, base, int(iters), float(hc_eps),
                                             float(norm_eps), norm), h.shape[0], h)


def hc_head(h: Tensor, fn: Tensor, scale: Tensor, base: Tensor, hc_eps: float, norm_eps: float,
            norm: Tensor | None = None) -> Tensor:
    """hc_head(h) [N, D]; with norm (fp32 / bf16 [D], D * 4 <= 48 KB) RMS-normalised with it in the same launch."""
    fn, scale, base = fn.float().contiguous(), scale.float().contiguous(), base.float().contiguous()
    norm = None if norm is None else norm.contiguous()
    return _by_rows(lambda hh: _ops().hc_head(hh.contiguous(), fn, scale, base, float(hc_eps), float(norm_eps), norm),
                    h.shape[0], h)


def hc_sinkhorn(comb: Tensor, iters: int, hc_eps: float) -> None:
    """comb fp32 contiguous [N, n, n] (n = 1, 2, 4) as a finish called with iters = 0 left it (the Sinkhorn's
    input logits; every finish above takes iters = 0 for 1, 2 or 4 streams) -> its Sinkhorn, in place: the same
    values the finish computes with iters. One launch of its own (ds4.ops.base.SinkhornRide.run: where no launch
    of the step takes the Sinkhorn along)."""
    _ops().hc_sinkhorn(comb, int(iters), float(hc_eps))


def hc_post(x: Tensor, res: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    return _ops().hc_post(x.contiguous(), res.contiguous(), post.float().contiguous(), comb.float().contiguous())


def hc_post_pre(x: Tensor, res: Tensor, post: Tensor, comb: Tensor, fn: Tensor, scale: Tensor, base: Tensor,
                iters: int, hc_eps: float, norm_eps: float,
                norm: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """hc_post(x, res, post, comb) -> h, then hc_pre(h, fn, scale, base, ..., norm), in two launches (the
    post's elements are formed inside the pre's matvec; per HC_CHUNK_ROWS tokens past MAX_GRID_ROWS):
    -> (h, x_next, post_next, comb_next)."""
    fn, scale, base = fn.float().contiguous(), scale.float().contiguous(), base.float().contiguous()
    norm = None if norm is None else norm.contiguous()
    return _by_rows(lambda xx, rr, pp, cc: _ops().hc_post_pre(xx.contiguous(), rr.contiguous(), pp.float().contiguous(),
                                                              cc.float().contiguous(), fn, scale, base, int(iters),
                                                              float(hc_eps), float(norm_eps), norm),
                    res.shape[0], x, res, post, comb)


def hc_post_pre_router(x: Tensor, res: Tensor, post: Tensor, comb: Tensor, fn: Tensor, scale: Tensor, base: Tensor,
                       iters: int, hc_eps: float, norm_eps: float, norm: Tensor,
                       gate: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """hc_post_pre with the block norm whose finishing launch also returns the router's logits: -> (h, x_next,
    post_next, comb_next, logits fp32 [N, E] = x_next . gate^T). bf16 res with 1, 2 or 4 streams; gate bf16 [E, D]."""
    return _ops().hc_post_pre_router(x.contiguous(), res.contiguous(), post.float().contiguous(),
                                     comb.float().contiguous(), fn.float().contiguous(), scale.float().contiguous(),
                                     base.float().contiguous(), int(iters), float(hc_eps), float(norm_eps),
                                     norm.contiguous(), gate.contiguous())


def hc_fold_finish(h: Tensor, part: Tensor, scale: Tensor, base: Tensor, iters: int, hc_eps: float, norm_eps: float,
                   norm: Tensor | None = None, gate: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The finishing launch of an mHC site whose partials the hc fold formed (ds4.kernels.gemv_fold / moe_down's
    fold): h [N, n, D] bf16 the new streams, part fp32 [N, mix + 1, nsplit] -> (x, post, comb, logits). With gate
    (bf16 [E, D], norm required) the router fold's finish: logits fp32 [N, E] = x . gate^T; else logits None."""
    x, post, comb, logits = _ops().hc_fold_finish(h, part, scale.float().contiguous(), base.float().contiguous(),
                                                  int(iters), float(hc_eps), float(norm_eps),
                                                  None if norm is None else norm.contiguous(),
                                                  None if gate is None else gate.contiguous())
    return x, post, comb, (logits if gate is not None else None)


def hc_fold_finish_proj(h: Tensor, part: Tensor, scale: Tensor, base: Tensor, iters: int, hc_eps: float,
                        norm_eps: float, norm: Tensor, w: Tensor, ws: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """hc_fold_finish with the block norm whose launch also forms y = x . W^T for an FP8 weight (the projection
    fold): w E4M3 [O, D] with E8M0 scales ws [ceil(O/128), D/128] -> (x, post, comb, y bf16 [N, O]). bf16 h with 1, 2
    or 4 streams, D a multiple of 128 up to 4096."""
    return _ops().hc_fold_finish_proj(h, part, scale.float().contiguous(), base.float().contiguous(), int(iters),
                                      float(hc_eps), float(norm_eps), norm.contiguous(), w.contiguous(),
                                      ws.contiguous())


def _aligned(t: Tensor) -> Tensor:
    """t contiguous at a 16-byte aligned address: the kernels stage it in 16-byte copies (cp.async), and their
    bindings check the key rows' alignment but not the query's."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _rows_fit(t: Tensor) -> bool:
    """Whether the kernels read t's rows where they are (unit last stride, 16-byte rows and base)."""
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(
        t.stride(i) % 8 == 0 or t.shape[i] == 1 for i in range(t.dim() - 1))


def _rows_ok(t: Tensor) -> Tensor:
    return t if _rows_fit(t) else t.contiguous()


def sparse_attn(q: Tensor, kv: Tensor, valid: Tensor, sel_kv: Tensor | None, sel_valid: Tensor | None,
                sink: Tensor, scale: float) -> Tensor:
    """bf16 q [B, S, H, D], kv [B, K, D], valid bool [B, S, K], sel_kv [B, S, P, D], sel_valid [B, S, P],
    sink f32 [H] -> bf16 [B, S, H, D]. Two launches (chunks, combine)."""
    if valid.stride(-1) != 1:
        valid = valid.contiguous()
    if sel_valid is not None and sel_valid.stride(-1) != 1:
        sel_valid = sel_valid.contiguous()
    return _ops().sparse_attn(_aligned(q), _rows_ok(kv), valid, None if sel_kv is None else _rows_ok(sel_kv),
                              sel_valid, sink.float().contiguous(), float(scale))


def indexer_scores(q: Tensor, w: Tensor, keys: Tensor, bf16: bool = False, pos: Tensor | None = None,
                   ratio: int = 1, w_scale: float = 1.0, rope_freqs: Tensor | None = None,
                   q_fp4: bool = False) -> Tensor:
    """bf16 q [B, S, H, d], head weights w [B, S, H] (f32 or bf16; the kernel takes w_scale * fp32(w)),
    bf16 keys [B, T, d] -> [B, S, T] (f32, or bf16 when bf16).
    pos int64 [B] (S = 1): entries t >= (pos+1)//ratio score -inf and are not read.
    rope_freqs f32 [R/2] (with pos): q is taken before head_rope(q, pos, rope_freqs, False), applied in the kernel;
    q_fp4 (with rope_freqs, numerics=qat, hadamard_fp4_ok(d)): and before hadamard_fp4, applied after the RoPE."""
    q, w, keys, rope_freqs = _indexer_inputs(q, w, keys, rope_freqs)
    return _ops().indexer_scores(q, w, keys, bool(bf16), None if pos is None else pos.contiguous(), int(ratio),
                                 float(w_scale), rope_freqs, bool(q_fp4))


def _indexer_inputs(q: Tensor, w: Tensor, keys: Tensor, rope_freqs: Tensor | None):
    """(q, w, keys, rope_freqs) as the scores kernel reads them."""
    if w.dtype not in (torch.float32, torch.bfloat16):
        w = w.float()
    q = q.contiguous() if rope_freqs is None else _aligned(q)  # the rotating staging reads q in 16-byte chunks
    return q, w.contiguous(), _rows_ok(keys), None if rope_freqs is None else rope_freqs.float().contiguous()


def indexer_select(q: Tensor, w: Tensor, keys: Tensor, k: int, pos: Tensor, ratio: int = 1, bf16: bool = False,
                   w_scale: float = 1.0, rope_freqs: Tensor | None = None, q_fp4: bool = False) -> Tensor:
    """The decode selection, topk(indexer_scores(...)[:, 0], k, pos, ratio) in two launches: q [B, 1, H, d],
    pos int64 [B], k <= T <= TOPK_MAX_LEN -> int64 [B, k] (unsorted). A row with at most k visible entries
    selects all of them without reading a score, so its scores are not computed (the same indices)."""
    if not 1 <= k <= keys.shape[1] or q.dim() != 4 or q.shape[1] != 1:
        raise ValueError(f"indexer_select: need q [B, 1, H, d] and 1 <= k <= T (q {tuple(q.shape)}, k={k}, "
                         f"T={keys.shape[1]})")
    q, w, keys, rope_freqs = _indexer_inputs(q, w, keys, rope_freqs)
    return _ops().indexer_select(q, w, keys, int(k), bool(bf16), pos.contiguous(), int(ratio), float(w_scale),
                                 rope_freqs, bool(q_fp4))


def sparse_decode_reads_in_place(q: Tensor, win: Tensor, pos: Tensor, ext: Tensor | None, ext_idx: Tensor | None,
                                  sink: Tensor, freqs: Tensor | None) -> bool:
    """Whether sparse_decode takes its tensors where they are (none of its conversions below launches a copy before
    its kernels): then its first launch is the chunk kernel, which waits (PDL) before it reads anything, so the
    branches that wrote them may join it by programmatic edges (ds4.ops.side_stream.Branch.join). A copy in between
    would take those edges instead, and, launched without that wait, would not pass their wait on to the chunk kernel."""
    def f32(t: Tensor) -> bool:
        return t.dtype == torch.float32 and t.is_contiguous()
    return (q.is_contiguous() and q.data_ptr() % 16 == 0 and _rows_fit(win) and pos.is_contiguous()
            and (ext is None or _rows_fit(ext)) and (ext_idx is None or ext_idx.is_contiguous())
            and f32(sink) and (freqs is None or f32(freqs)))


def sparse_decode(q: Tensor, win: Tensor, pos: Tensor, ext: Tensor | None, ext_idx: Tensor | None, ratio: int,
                  sink: Tensor, scale: float, freqs: Tensor | None, q_norm_eps: float | None = None,
                  ride=None) -> Tensor:
    """bf16 q [B, H, D], window ring win [B, W, D], pos int64 [B], compressed entries ext [B, T, D] (all,
    or the ext_idx int64 [B, k] selected), sink f32 [H] -> bf16 [B, H, D], last 2*len(freqs) dims
    de-rotated at pos. q_norm_eps given: q is taken before head_rope(q, pos, freqs, True, q_norm_eps),
    which the kernel applies as it loads q. Two launches. ride (ds4.ops.base.SinkhornRide, comb [B, n, n]): the
    combine launch also finishes each row's mHC Sinkhorn in place, before its PDL wait."""
    return _ops().sparse_decode(_aligned(q), _rows_ok(win), pos.contiguous(),
                                None if ext is None else _rows_ok(ext),
                                None if ext_idx is None else ext_idx.contiguous(), int(ratio),
                                sink.float().contiguous(), float(scale),
                                None if freqs is None else freqs.float().contiguous(),
                                None if q_norm_eps is None else float(q_norm_eps),
                                *(ride.args() if ride is not None else (None, 0, 0.0)))


def topk_ok(rows: int, T: int) -> bool:
    """Whether topk takes `rows` rows of T entries on the current device: up to 32768 entries one block per row;
    longer rows (up to TOPK_MAX_LEN) one block per 8192 entries, all rows' blocks resident at once (at most 16 rows
    and one block per SM). DS4_TOPK_WIDE=0 (read per call; the ablation of session 44's wide form) says no past 32768
    entries, so the fused indexer takes torch.topk there as before."""
    if os.environ.get("DS4_TOPK_WIDE") == "0" and T > ONE_BLOCK_TOPK_LEN:
        return False
    return bool(_ops().topk_ok(int(rows), int(T)))  # (rows >= 1 and 1 <= T <= TOPK_MAX_LEN checked there too)


def topk(scores: Tensor, k: int, pos: Tensor | None = None, ratio: int = 1) -> Tensor:
    """fp32 scores [B, T] -> int64 [B, k]: indices of the k largest per row (unsorted; ties lowest index first).
    pos (int64 [B], decode): entries t >= (pos+1)//ratio must be -inf; then only the first
    max((pos+1)//ratio, k) are read (the same selection, without scanning the unwritten tail)."""
    rows, T = (scores.shape[0], scores.shape[1]) if scores.dim() == 2 else (0, 0)
    if scores.dim() != 2 or not 1 <= k <= T or (rows and not topk_ok(rows, T)):
        raise ValueError(f"topk: need scores [B, T] and 1 <= k <= T, with B rows of T entries that topk_ok takes "
                         f"(up to {ONE_BLOCK_TOPK_LEN} entries any rows; up to {TOPK_MAX_LEN}, one block per 8192 "
                         f"entries of every row resident at once) (scores {tuple(scores.shape)}, k={k})")
    return _ops().topk(scores.float().contiguous(), int(k), pos, int(ratio))


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """bf16 x [..., D] -> bf16(x * rsqrt(mean(x^2) + eps) * weight), fp32 math. One launch."""
    return _ops().rms_norm(x.contiguous(), weight.contiguous(), float(eps))


def head_rope(x: Tensor, pos: Tensor, freqs: Tensor, norm: bool, eps: float) -> Tensor:
    """bf16 x [N, H, D], pos int64 [N] -> (norm) per-head unweighted RMSNorm, RoPE of the last 2*len(freqs) dims.
    One launch per MAX_GRID_ROWS rows (a prompt's queries: one block per head and token)."""
    freqs = freqs.float().contiguous()
    return _by_rows(lambda xx, pp: _ops().head_rope(xx.contiguous(), pp.contiguous(), freqs, bool(norm), float(eps)),
                    x.shape[0], x, pos, chunk=MAX_GRID_ROWS)


def hadamard_fp4_ok(d: int) -> bool:
    """Whether the kernels take numerics=qat's Hadamard + FP4 simulation of rows of d values (a warp per row):
    d a power of two in [32, 256] (hadamard_fp4_ok in csrc/attn/attn_launch.h)."""
    return 32 <= d <= 256 and d & (d - 1) == 0


def hadamard_fp4(x: Tensor) -> Tensor:
    """bf16 x [..., d] -> fp4_act_quant_sim(hadamard(x), 32) (ds4.quant), the same bits, one launch (hadamard_fp4_ok)."""
    if not hadamard_fp4_ok(x.shape[-1]):
        raise ValueError(f"hadamard_fp4: the last dim must be a power of two in [32, 256], got {x.shape[-1]}")
    return _ops().hadamard_fp4(x.contiguous())


def kv_store(win: Tensor, kv: Tensor, weight: Tensor, pos: Tensor, freqs: Tensor, eps: float, fp8_nope: bool) -> None:
    """win[b, pos[b] % W] = RoPE(rms_norm(kv[b], weight)) (+ FP8 simulation of the nope dims). In place."""
    _ops().kv_store(win, kv.contiguous(), weight.contiguous(), pos.contiguous(), freqs.float().contiguous(),
                    float(eps), bool(fp8_nope))


def compress_step(kvz: Tensor, ape: Tensor, norm: Tensor, pos: Tensor, freqs: Tensor, skv: Tensor, ssc: Tensor,
                  cache: Tensor, m: int, overlap: bool, eps: float, fp8_nope: bool, tokens: int = 1,
                  fp4: bool = False) -> None:
    """Compressor decode step in place on skv / ssc (f32 [B, slots, cw]) and cache (bf16 [B, T, w]).
    The entry's qat simulation: fp8_nope (FP8 of the nope dims) or fp4 (hadamard_fp4 of the whole entry: the indexer
    compressor's; hadamard_fp4_ok(w)).

    tokens > 1 (the deferred projection, ds4.kernels.gemv_deferred): kvz [B * tokens, 2 cw] holds the projections
    of positions pos - tokens + 1 .. pos, present only where (pos + 1) % tokens == 0 (decided on the device); the
    step writes them all there and does nothing elsewhere. tokens must divide m (a group never spans two windows)."""
    if not (tokens >= 1 and m >= 1 and m % tokens == 0 and kvz.dim() == 2 and kvz.shape[0] == cache.shape[0] * tokens):
        raise ValueError(f"compress_step: tokens ({tokens}) must divide m ({m}) and kvz must have rows * tokens rows "
                         f"(got {tuple(kvz.shape)} for {cache.shape[0]} rows)")
    _ops().compress_step(kvz.contiguous(), ape.float().contiguous(), norm.contiguous(), pos.contiguous(),
                         freqs.float().contiguous(), skv, ssc, cache, int(m), bool(overlap), float(eps),
                         bool(fp8_nope), int(tokens), bool(fp4))


__all__ = ["load", "unavailable_reason", "build_dir", "hc_pre", "hc_head", "hc_post", "hc_post_pre", "sparse_attn",
           "indexer_scores", "indexer_select", "sparse_decode", "rms_norm", "head_rope", "kv_store", "compress_step",
           "topk", "topk_ok"]
