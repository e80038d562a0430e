"""attn=fused_cuda (alias fused) and indexer=fused_cuda: CUDA kernels of the ds4_attn extension.

Decode glue, one launch each: rms_norm (q_norm; in decode q_up folds it into wq_b's GEMV), head_rope
(per-head norm + RoPE of q in prefill — in decode the attention kernel does it; RoPE of the indexer
q in prefill — in decode the indexer's scores kernel does it), kv_store (kv_norm + RoPE + (qat) FP8
nope + ring write), compress_step (state write, and on the completing step the pooled entry's norm +
RoPE + (qat) FP8 + cache write, both decided per row on the device), compress_project (the
compressor's BF16 [wkv; wgate] GEMV with fp32 output, through the ds4 GEMV kernel, so attn=fused_cuda
needs both extensions). While a decode graph is captured, `branch`
puts the compressors' steps, the window write and the indexer's head weights (and, unless its query
is merged into wq_b's GEMV, the indexer) on side streams.
Under numerics=qat the indexer's Hadamard + FP4 simulation of its keys (compress_step) and of its decode query
(the scores kernel's q staging, after the RoPE) happens inside those kernels, with the twin's bits, for widths that
kernels_attn.hadamard_fp4_ok takes (DS4_INDEXER_QAT=torch: the twin, the ablation). Inputs these kernels do not take
(CPU, non-bf16, other widths) run the TorchAttention twin: chosen by dtype / shape / flag, never by values.

FusedCudaAttention.decode — the decode form: validity from the row's position (window ring,
visible compressed entries), CSA entries gathered by the top-k index inside the kernel, output RoPE
dims de-rotated in the combine; given q_norm_eps, q arrives straight from wq_b and each block applies
head_rope's per-head RMS and RoPE to its heads as it loads them. Same kernels as .sparse below.

FusedCudaAttention.sparse — decode (S = 1 query per row, any B): MQA flash-decoding. Each block
loads 32 key rows once (window/HCA keys, then the row's selected keys) and serves all H heads with
BF16 tensor-core MMAs; online-softmax partials per chunk; a combine kernel adds the sink to the
denominator only. Probabilities are rounded to bf16 before P.V like the reference. Needs bf16 q / kv
/ sel_kv and D % 64 == 0. A prompt's chunk of queries (S > 1) runs the same kernels with per-query masks, its
splits capped so the partial outputs stay small (csrc/attn/attn_bindings.cpp); DS4_PREFILL_ATTN=torch takes
TorchAttention.sparse there instead. Other dtypes or shapes call TorchAttention.sparse: that dispatch (by
shape/dtype only, never by values) is part of this implementation.

FusedCudaIndexer.scores — decode (B*S <= 16 query rows): keys split over blocks of 64 (the whole GPU
works on a long cache), all heads per block on BF16 tensor cores, ReLU-weighted head sum fused; the head
weights' scale (w_scale) and, given rope_freqs, the query's RoPE applied inside (the decode step hands it
weights_proj's bf16 output and the unrotated query). bf16=True reproduces the reference's BF16
einsum/ReLU/product. Prefill-sized calls, fp32 q / keys and index dims not a multiple of 16 call
TorchIndexer.scores (part of this implementation). On a long cache each block loops over several chunks of keys,
staging q once. head_weights: decode rows on the BF16 GEMV kernel.
Top-k is a radix select (ds4_attn topk): one block per row up to 32768 entries, longer rows (contexts past 128K
tokens at ratio 4, up to TOPK_MAX_LEN entries) one block per 8192 entries meeting at grid barriers, where
kernels_attn.topk_ok says the rows' blocks fit on the GPU at once (else torch.topk). FusedCudaIndexer.select
(the decode selection) runs both as one op: while a row has at most k visible entries (contexts below
k * ratio tokens) its top-k selects all of them unread, and the scores kernel skips the row.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from ds4 import kernels, kernels_attn
from ds4.ops import side_stream
from ds4.ops.attn_torch import TorchAttention, TorchIndexer, apply_row_skip, branch_env_slot
from ds4.ops.base import QWeight, RowSkip
from ds4.ops.qat_cuda import staged as qat_staged

BF16 = torch.bfloat16
INDEXER_MAX_ROWS = 16
INDEXER_MAX_ROPE = 256  # RoPE dims the indexer kernel's q staging takes (IX_MAX_ROPE in indexer.cu)
GEMV_MAX_ROWS = 8  # the compressor projection's decode sizes (ds4.kernels.gemv, one launch)
QPREP_MAX_ROPE = 512  # RoPE dims the attention kernel's q table holds (SP_MAX_ROPE in sparse_attn.cu)


def _cuda_bf16(*ts: Tensor) -> bool:
    return all(t.is_cuda and t.dtype == BF16 for t in ts)


def _fp4_kernels(d: int) -> bool:
    """Whether numerics=qat's Hadamard + FP4 simulation of rows of d values runs inside the kernels (the indexer's
    query staging, the compressor step, hadamard_fp4); DS4_INDEXER_QAT=torch (read per call, the ablation) keeps
    the torch twin there (its ~40 launches per call)."""
    return kernels_attn.hadamard_fp4_ok(d) and os.environ.get("DS4_INDEXER_QAT") != "torch"


class FusedCudaAttention:
    name = "fused_cuda"
    rides_sinkhorn = True  # decode takes the site's deferred mHC Sinkhorn along (ds4.ops.base.SinkhornRide)

    def __init__(self):
        self._ref = TorchAttention()

    # ---- query / window KV path (one launch each) --------------------------------------------------
    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if not _cuda_bf16(x):
            return self._ref.rms_norm(x, weight, eps)
        return kernels_attn.rms_norm(x, weight, eps)

    def q_up(self, qa: Tensor, weight: Tensor, eps: float, wq_b: QWeight, linear, act_quant: bool,
             skip: RowSkip | None = None) -> Tensor:
        # One token with linear=gemv_cuda: q_norm inside wq_b's tensor-core GEMV (its activation staging
        # computes rms_norm exactly as the rms_norm launch does), one launch fewer on the step's critical
        # path; under qat (DS4_ACT_QUANT=staged, the default) the FP8 simulation in the same staging (qat_cuda.staged).
        # Other shapes, formats, or another linear: rms_norm, then `linear` (the twin's order).
        # DS4_QNORM_FUSED=0 in the environment keeps the two launches (the ablation; read per call).
        use = (getattr(linear, "name", None) == "gemv_cuda" and _cuda_bf16(qa) and qa.dim() == 2
               and os.environ.get("DS4_QNORM_FUSED") != "0"
               and qa.shape[0] == 1 and weight.dtype in (torch.float32, BF16)
               and kernels.gemv_rmsnorm_ok(wq_b.fmt, wq_b.out_features, qa.shape[1])
               and (not act_quant or qat_staged(qa, wq_b.fmt, wq_b.out_features, qa.shape[1])))
        if not use:  # (this class's rms_norm: one launch, where the twin's torch ops are several)
            return apply_row_skip(linear(self.rms_norm(qa, weight, eps), wq_b, act_quant=act_quant), skip)
        # skip: the kernel decides on the device and spreads the kept rows' tiles over the skipped rows' blocks (not
        # where its tiles are not 16 rows). Under qat too (staged): where the skip applies, the spread sums the kept
        # rows' rounds in another order than the launch path (act_quant_sim, the GEMV, then the zeros: within TOL, not
        # its bits), as under plain; elsewhere the same bits. Before session 72 staged qat took the launch path's
        # order here, and the zeros cost five torch launches on a CSA layer's critical path (12 us on an H100).
        if skip is not None and skip.rows % 16:
            return apply_row_skip(self.q_up(qa, weight, eps, wq_b, linear, act_quant), skip)
        ks = None if skip is None else (skip.pos, skip.ratio, skip.k, skip.rows)
        return kernels.gemv_rmsnorm(qa.contiguous(), wq_b.weight, wq_b.scale, wq_b.fmt, weight.contiguous(), eps, ks,
                                    act_quant=act_quant)

    def head_rope(self, x: Tensor, positions: Tensor, freqs: Tensor, norm: bool, eps: float) -> Tensor:
        if not (_cuda_bf16(x) and x.dim() == 3 and x.shape[0] == positions.numel()):
            return self._ref.head_rope(x, positions, freqs, norm, eps)
        return kernels_attn.head_rope(x, positions, freqs, norm, eps)

    def kv_store(self, win: Tensor, kv: Tensor, weight: Tensor, pos: Tensor, freqs: Tensor, eps: float,
                 fp8_nope: bool) -> None:
        if not _cuda_bf16(win, kv):
            return self._ref.kv_store(win, kv, weight, pos, freqs, eps, fp8_nope)
        kernels_attn.kv_store(win, kv, weight, pos, freqs, eps, fp8_nope)

    def branch(self, x: Tensor, name: str) -> side_stream.Branch:
        # While a decode graph is captured, each independent piece of the step (the two compressors' steps,
        # the window write, the indexer's head weights, and without the merged query its query / scores /
        # top-k) runs on its own side stream beside the q path and joins before its output is read, so its
        # chain of small kernels leaves the critical path. DS4_COMPRESS_OVERLAP=0 / DS4_ATTN_OVERLAP=0 keep
        # them in line (the ablations); eager steps keep them in line (ds4.ops.side_stream).
        env, slot = branch_env_slot(name)
        side = None
        if x.is_cuda and x.shape[0] <= GEMV_MAX_ROWS:
            side = side_stream.fork(x.device, env, slot)
        return side_stream.Branch(side, x.device)

    def compress_project(self, x: Tensor, w: Tensor) -> Tensor:
        # one launch of the BF16 GEMV kernel (fp32 out; its weight loads start before the PDL wait) where
        # cuBLAS ran a split-K GEMV and a reduce kernel; prefill-sized inputs keep the torch twin
        if not (_cuda_bf16(x, w) and x.dim() == 2 and 1 <= x.shape[0] <= GEMV_MAX_ROWS):
            return self._ref.compress_project(x, w)
        return kernels.gemv(x.contiguous(), w, None, "bf16", out_f32=True)

    def compress_step(self, kvz: Tensor, ape: Tensor, norm: Tensor, pos: Tensor, freqs: Tensor, skv: Tensor,
                      ssc: Tensor, cache: Tensor, m: int, overlap: bool, eps: float, quant: str | None) -> None:
        # the indexer compressor's qat form (Hadamard + FP4 of the entry) inside the kernel where its width allows
        if not (_cuda_bf16(cache) and kvz.is_cuda and self._quant_ok(quant, cache.shape[-1])):
            return self._ref.compress_step(kvz, ape, norm, pos, freqs, skv, ssc, cache, m, overlap, eps, quant)
        kernels_attn.compress_step(kvz, ape, norm, pos, freqs, skv, ssc, cache, m, overlap, eps, quant == "fp8",
                                   fp4=quant == "fp4")

    @staticmethod
    def _quant_ok(quant: str | None, w: int) -> bool:
        """Whether the compressor step kernel takes this entry simulation (ds4.model.compressor.finish_entry)."""
        return quant in (None, "fp8") or (quant == "fp4" and _fp4_kernels(w))

    def compress_deferred(self, x: Tensor, ring: Tensor, w: Tensor, ape: Tensor, norm: Tensor, pos: Tensor,
                          freqs: Tensor, skv: Tensor, ssc: Tensor, cache: Tensor, m: int, overlap: bool, eps: float,
                          quant: str | None) -> None:
        # one row: two launches, both deciding on the device. The GEMV either copies x into the ring and exits
        # (no weight read) or, on the step that completes the ring, projects its n tokens; the step then writes
        # their slots (and, where the window completes, the entry) or does nothing. (A ring whose n does not divide
        # m is an error, raised by compress_step, not a fallback.)
        n = ring.shape[1]
        if not (_cuda_bf16(x, ring, w, cache) and x.shape[0] == 1 and kernels.gemv_deferred_ok(n, x.shape[1])
                and self._quant_ok(quant, cache.shape[-1])):
            return self._ref.compress_deferred(x, ring, w, ape, norm, pos, freqs, skv, ssc, cache, m, overlap, eps,
                                               quant)
        kvz = kernels.gemv_deferred(x, ring[0], w, pos)
        kernels_attn.compress_step(kvz, ape, norm, pos, freqs, skv, ssc, cache, m, overlap, eps, quant == "fp8",
                                   tokens=n, fp4=quant == "fp4")

    def out_proj(self, o: Tensor, wo_a: QWeight, wo_b: QWeight, groups: int, linear, act_quant: bool,
                 fold=None) -> Tensor:
        return self._ref.out_proj(o, wo_a, wo_b, groups, linear, act_quant, fold)  # the FP8 GEMVs come from `linear`

    # ---- attention core --------------------------------------------------------------------------
    def sparse(self, q: Tensor, kv: Tensor, valid: Tensor, sel_kv: Tensor | None, sel_valid: Tensor | None,
               sink: Tensor, scale: float) -> Tensor:
        # a prompt's chunk of queries (q.shape[1] > 1) too, unless DS4_PREFILL_ATTN=torch (read per call: the A/B;
        # H200, 256 queries of V4-Flash: 893 us a call on the reference's fp32 einsums, 295 us here; session 48)
        use = (q.is_cuda and q.dtype == BF16 and kv.dtype == BF16 and (sel_kv is None or sel_kv.dtype == BF16)
               and q.shape[-1] % 64 == 0 and (q.shape[1] == 1 or os.environ.get("DS4_PREFILL_ATTN") != "torch"))
        if not use:
            return self._ref.sparse(q, kv, valid, sel_kv, sel_valid, sink, scale)
        return kernels_attn.sparse_attn(q, kv, valid, sel_kv, sel_valid, sink, scale)

    @staticmethod
    def _decode_on_kernels(q: Tensor, win: Tensor, ext: Tensor | None, freqs: Tensor, q_norm_eps: float | None) -> bool:
        """Whether decode runs the ds4 kernels (else the twin): by dtype and shape only."""
        return (_cuda_bf16(q, win) and (ext is None or ext.dtype == BF16) and q.shape[-1] % 64 == 0
                and (2 * freqs.numel()) % 4 == 0 and (q_norm_eps is None or 2 * freqs.numel() <= QPREP_MAX_ROPE))

    def decode_join_site(self, q: Tensor, win: Tensor, pos: Tensor, ext: Tensor | None, ext_idx: Tensor | None,
                         sink: Tensor, freqs: Tensor, q_norm_eps: float | None) -> str | None:
        """The join site of the branches joined right before decode (ds4.ops.side_stream; DS4_PJOIN=attn makes it
        programmatic): "attn" where decode's first launch is the ds4 chunk kernel, which waits (PDL) before it reads
        what the branches wrote; None where the twin runs or an input would be copied first (torch launches)."""
        ok = (self._decode_on_kernels(q, win, ext, freqs, q_norm_eps)
              and kernels_attn.sparse_decode_reads_in_place(q, win, pos, ext, ext_idx, sink, freqs))
        return "attn" if ok else None

    def decode(self, q: Tensor, win: Tensor, pos: Tensor, ext: Tensor | None, ext_idx: Tensor | None, ratio: int,
               sink: Tensor, scale: float, freqs: Tensor, q_norm_eps: float | None = None, ride=None) -> Tensor:
        # ride (a SinkhornRide): the combine launch finishes the mHC Sinkhorn along the way, before its PDL wait
        if not self._decode_on_kernels(q, win, ext, freqs, q_norm_eps):
            o = self._ref.decode(q, win, pos, ext, ext_idx, ratio, sink, scale, freqs, q_norm_eps)
            if ride is not None:
                ride.run()
            return o
        # with q_norm_eps the chunk kernel applies head_rope to q as it loads it (one launch fewer)
        return kernels_attn.sparse_decode(q, win, pos, ext, ext_idx, ratio, sink, scale, freqs, q_norm_eps, ride)


class MergedWoAttention(FusedCudaAttention):
    """attn=fused_cuda_wo_bf16: the seed's phase-6 output projection, an ablation option (not the default).

    wo_b . blockdiag(wo_a) is precomputed once per layer in BF16 ([dim, H*D], fp32 product of the
    dequantised weights) on the layer's first call, and the output projection is one BF16 GEMV
    through `linear`. It reads 4x the bytes of the two FP8 projections (268 MB vs 67 MB per V4-Flash
    layer, not counted in bytes/token, which counts the stored weights) and skips the rounding of the
    wo_a output to BF16 (and its qat FP8 simulation): the ablation shows both effects."""
    name = "fused_cuda_wo_bf16"

    def __init__(self):
        super().__init__()
        self._merged: dict[int, QWeight] = {}   # keyed by the layer's wo_b storage

    def merged(self, wo_a: QWeight, wo_b: QWeight, groups: int) -> QWeight:
        key = wo_b.weight.data_ptr()
        if key not in self._merged:
            a = wo_a.dequant(torch.float32).view(groups, -1, wo_a.in_features)        # [G, R, I]
            b = wo_b.dequant(torch.float32).view(wo_b.out_features, groups, -1)      # [dim, G, R]
            w = torch.einsum("dgr,gri->dgi", b, a).flatten(1).to(torch.bfloat16)     # [dim, G*I]
            self._merged[key] = QWeight("bf16", w.contiguous())
        return self._merged[key]

    def out_proj(self, o: Tensor, wo_a: QWeight, wo_b: QWeight, groups: int, linear, act_quant: bool,
                 fold=None) -> Tensor:
        return linear(o, self.merged(wo_a, wo_b, groups), fold=fold)


class FusedCudaIndexer:
    name = "fused_cuda"

    def __init__(self):
        self._ref = TorchIndexer()

    def rope(self, q: Tensor, positions: Tensor, freqs: Tensor) -> Tensor:
        if not (_cuda_bf16(q) and q.dim() == 3 and q.shape[0] == positions.numel()):
            return self._ref.rope(q, positions, freqs)
        return kernels_attn.head_rope(q, positions, freqs, False, 0.0)

    def hadamard_fp4(self, q: Tensor) -> Tensor:
        # numerics=qat's query simulation in one launch (the twin's bits) where the kernel takes q
        if not (_cuda_bf16(q) and q.numel() and _fp4_kernels(q.shape[-1])):
            return self._ref.hadamard_fp4(q)
        return kernels_attn.hadamard_fp4(q)

    def topk(self, scores: Tensor, k: int, pos: Tensor | None = None, ratio: int = 1) -> Tensor:
        if not (scores.is_cuda and scores.dim() == 2 and k <= scores.shape[-1]
                and kernels_attn.topk_ok(scores.shape[0], scores.shape[-1])):
            return self._ref.topk(scores, k, pos, ratio)
        return kernels_attn.topk(scores, k, pos, ratio)

    def head_weights(self, x: Tensor, weight: Tensor) -> Tensor:
        # decode rows: one launch of the BF16 GEMV kernel (one row per warp), bf16 out like F.linear; its
        # scale is applied inside the scores kernel (w_scale) — cuBLAS ran a split-K GEMV + reduce here,
        # and the fp32 cast and scale two more launches
        if not (_cuda_bf16(x, weight) and x.dim() == 2 and 1 <= x.shape[0] <= GEMV_MAX_ROWS):
            return self._ref.head_weights(x, weight)
        return kernels.gemv(x.contiguous(), weight, None, "bf16")

    def scores(self, q: Tensor, w: Tensor, keys: Tensor, bf16: bool = False, pos: Tensor | None = None,
               ratio: int = 1, w_scale: float = 1.0, rope_freqs: Tensor | None = None,
               q_fp4: bool = False) -> Tensor:
        # rope_freqs: the kernel stages q with its RoPE applied (head_rope's arithmetic), one launch fewer; q_fp4
        # (qat): and the Hadamard + FP4 after it, where its width allows (else rope and hadamard_fp4 before)
        if q_fp4 and rope_freqs is not None and not _fp4_kernels(q.shape[-1]):
            q, rope_freqs, q_fp4 = self._q_fp4_before(q, pos, rope_freqs)
        use = (q.is_cuda and q.dtype == BF16 and keys.dtype == BF16 and q.shape[-1] % 16 == 0
               and q.shape[0] * q.shape[1] <= INDEXER_MAX_ROWS
               and (rope_freqs is None or (pos is not None and q.shape[1] == 1
                                           and 2 * rope_freqs.numel() <= min(q.shape[-1], INDEXER_MAX_ROPE))))
        if not use:
            return self._ref.scores(q, w, keys, bf16, pos, ratio, w_scale, rope_freqs, q_fp4)
        return kernels_attn.indexer_scores(q, w, keys, bf16, pos, ratio, w_scale, rope_freqs, q_fp4)

    def _q_fp4_before(self, q: Tensor, pos: Tensor | None, rope_freqs: Tensor) -> tuple[Tensor, None, bool]:
        """(q rotated and Hadamard + FP4 simulated ahead of the scores, no rope_freqs, no q_fp4): the twin's order,
        for query widths the kernels' simulation does not take and for DS4_INDEXER_QAT=torch."""
        if pos is None or q.shape[1] != 1:
            raise ValueError("indexer scores: rope_freqs needs decode positions and one query per row")
        return self.hadamard_fp4(self.rope(q[:, 0], pos, rope_freqs))[:, None], None, False

    def select(self, q: Tensor, w: Tensor, keys: Tensor, k: int, pos: Tensor, ratio: int = 1, bf16: bool = False,
               w_scale: float = 1.0, rope_freqs: Tensor | None = None, q_fp4: bool = False) -> Tensor:
        # the scores and top-k kernels in one op (their contract lets the scores skip rows the top-k will not
        # read); where either kernel does not take the inputs, scores() then topk() as separate steps
        if q_fp4 and rope_freqs is not None and not _fp4_kernels(q.shape[-1]):
            q, rope_freqs, q_fp4 = self._q_fp4_before(q, pos, rope_freqs)
        use = (q.is_cuda and q.dtype == BF16 and keys.dtype == BF16 and q.shape[-1] % 16 == 0 and q.shape[1] == 1
               and q.shape[0] <= INDEXER_MAX_ROWS and k <= keys.shape[1]
               and kernels_attn.topk_ok(q.shape[0], keys.shape[1])
               and (rope_freqs is None or 2 * rope_freqs.numel() <= min(q.shape[-1], INDEXER_MAX_ROPE)))
        if not use:
            return self.topk(self.scores(q, w, keys, bf16, pos, ratio, w_scale, rope_freqs, q_fp4)[:, 0], k, pos,
                             ratio)
        return kernels_attn.indexer_select(q, w, keys, k, pos, ratio, bf16, w_scale, rope_freqs, q_fp4)
