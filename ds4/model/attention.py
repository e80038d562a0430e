"""Attention for all three layer types (spec §5): SWA, CSA (window + indexer-selected compressed
entries), HCA (window + all compressed entries). One shared K=V head, attention sink, one
softmax over window and compressed keys, output de-rotation and grouped o-projection.

Prefill handles one sequence (positions 0..S-1) in query chunks; decode handles one token
per row at device positions pos [B] against the preallocated state (spec §9).
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from ds4.model.args import CSA, HCA, SWA, ModelArgs
from ds4.model.compressor import Compressor, defer_tokens, finish_entry
from ds4.model.indexer import Indexer
from ds4.model.rope import inv_freq, rope_heads
from ds4.model.weights_module import WeightsModule, weight_format
from ds4.ops.base import QWeight, RowSkip
from ds4.profile import NULL_PROFILER

PREFILL_CHUNK = 256  # queries per prefill chunk (bounds the score matrices' memory)


class Attention(WeightsModule):
    def __init__(self, args: ModelArgs, layer: int, ops, qat: bool, comm, profiler=NULL_PROFILER):
        super().__init__()
        self.args, self.layer, self.ops, self.qat, self.comm, self.prof = args, layer, ops, qat, comm, profiler
        self.kind = args.layer_type(layer)
        self.m = args.ratio(layer)
        self.compressor = None if self.kind == SWA else Compressor(args, self.m, args.head_dim, self.kind == CSA, False)
        self.indexer = Indexer(args, layer, ops, qat) if self.kind == CSA else None
        self.scale = args.head_dim ** -0.5
        # decode of a CSA layer that selects: the indexer's query from the merged wq_bi GEMV in line (True),
        # or from its own GEMV in the indexer's side branch (False: the ablation, scripts/bench_decode.py)
        self.merged_indexer_q = True
        # with the merged query: the indexer's head weights (a GEMV of x) in the free "indexer" branch,
        # beside the indexer compressor's step, instead of after it in the "icompress" branch (False:
        # the ablation, bench token hwin)
        self.head_weights_branch = True
        # with the merged query: while every visible entry fits in the indexer's top-k (contexts below index_topk *
        # m tokens), the selection reads no score, so the index query may be zeros (RowSkip) and the fused GEMV
        # skips its rows (False: the ablation, bench token noqskip)
        self.skip_index_query = True
        # opt-in, batch-1 decode: the compressors project their tokens up to this many at a time (ds4.model.compressor,
        # deferred projection; n the largest divisor of the ratio up to it): a ring of x in the state (read by
        # alloc_state; bench token deferN). 0, the default: every token projected at its own step. Not the default:
        # the median step gained 3.3 us per layer, but the mean was not measured, and the p90 suggests that every
        # n-th step loses about what the other steps gain (experiments/decode_session38_h200.md).
        self.defer_compress = 0

    def load(self, t: Mapping[str, Tensor], p: str) -> None:
        fmt = weight_format(t[f"{p}.wq_a.weight"])
        # RoPE frequencies live where the weights live (fp32, computed, never loaded)
        self.register_buffer("freqs", inv_freq(self.args, self.layer, t[f"{p}.wq_a.weight"].device), persistent=False)
        # wq_a and wkv read the same input: one merged GEMV (wq_a / wkv stay available as row views)
        if self.mergeable(t, [f"{p}.wq_a", f"{p}.wkv"], fmt):
            self.take_merged_linear("wqkv_a", t, [f"{p}.wq_a", f"{p}.wkv"], fmt, ["wq_a", "wkv"])
        else:
            self.wqkv_a = None
            self.take_linear("wq_a", t, f"{p}.wq_a", fmt)
            self.take_linear("wkv", t, f"{p}.wkv", fmt)
        self.q_norm = self.take("q_norm", t, f"{p}.q_norm.weight")
        # CSA: wq_b and the indexer's wq_b read the same q_norm'ed latent: one merged GEMV in decode
        # (wq_bi; both stay available as row views, the indexer's handed to it below)
        self.wq_bi = None
        if self.indexer is not None and self.mergeable(t, [f"{p}.wq_b", f"{p}.indexer.wq_b"], fmt):
            self.take_merged_linear("wq_bi", t, [f"{p}.wq_b", f"{p}.indexer.wq_b"], fmt, ["wq_b", "idx_wq_b"])
        else:
            self.wq_b = self.take_linear("wq_b", t, f"{p}.wq_b", fmt)
        self.kv_norm = self.take("kv_norm", t, f"{p}.kv_norm.weight")
        self.wo_a = self.take_linear("wo_a", t, f"{p}.wo_a", fmt)
        self.wo_b = self.take_linear("wo_b", t, f"{p}.wo_b", fmt)
        self.sink = self.take("sink", t, f"{p}.attn_sink")
        self.n_heads = self.wq_b.out_features // self.args.head_dim   # local heads (tensor parallel)
        self.groups = self.wo_a.out_features // self.args.o_lora_rank  # local o-groups
        if self.compressor is not None:
            self.compressor.load(t, f"{p}.compressor")
        if self.indexer is not None:
            self.indexer.load(t, f"{p}.indexer", wq_b=self.idx_wq_b if self.wq_bi is not None else None)
        self.prepare_weights()

    def prepare_weights(self) -> None:
        """Let the linear implementation lay out the projections its own way (linear=gemv_cuda: the dense FP8 ones
        as fp8t, each a new tensor that replaces the buffer); every other reader dequantises through QWeight, which
        knows the layout. A merged weight is laid out whole and its row views (whole 16-row tiles of it) re-made in
        its format."""
        ops = getattr(self, "ops", None)
        prepare = getattr(ops.linear, "prepare", None) if ops is not None else None
        if prepare is None or not hasattr(self, "wo_b"):  # (configure() may run before load)
            return

        def lay(attr: str) -> QWeight:
            return self.refile_linear(attr, prepare(getattr(self, attr), attr))

        def views(merged: QWeight, parts: list[str]) -> None:  # the parts again, as rows of the new bytes
            self.set_row_views(merged, parts, [getattr(self, part).out_features for part in parts])

        if self.wqkv_a is not None:
            views(lay("wqkv_a"), ["wq_a", "wkv"])
        else:
            for attr in ("wq_a", "wkv"):
                lay(attr)
        if self.wq_bi is not None:
            views(lay("wq_bi"), ["wq_b", "idx_wq_b"])
            self.indexer.wq_b = self.idx_wq_b
        else:
            lay("wq_b")
        for attr in ("wo_a", "wo_b"):
            lay(attr)

    # ---- state --------------------------------------------------------------------------
    def alloc_state(self, batch: int, max_seq_len: int, dtype: torch.dtype, device) -> dict[str, Tensor]:
        a, D = self.args, self.args.head_dim
        st = {"win": torch.zeros(batch, a.window_size, D, dtype=dtype, device=device)}
        if self.compressor is not None:
            c = self.compressor
            st["ckv"] = torch.zeros(batch, -(-max_seq_len // self.m), D, dtype=dtype, device=device)
            st["comp_kv"] = torch.zeros(batch, c.coff * self.m, c.coff * D, device=device)
            st["comp_score"] = torch.full((batch, c.coff * self.m, c.coff * D), float("-inf"), device=device)
        if self.indexer is not None:
            d = a.index_head_dim
            st["ikv"] = torch.zeros(batch, -(-max_seq_len // self.m), d, dtype=dtype, device=device)
            st["icomp_kv"] = torch.zeros(batch, 2 * self.m, 2 * d, device=device)
            st["icomp_score"] = torch.full((batch, 2 * self.m, 2 * d), float("-inf"), device=device)
        # the deferred projection's rings (one per compressor: each branch writes its own); batch 1 only, where the
        # fused kernels take it (one row per launch), so a batched decode keeps the per-token projection
        n = defer_tokens(self.m, self.defer_compress) if self.compressor is not None else 1
        if batch == 1 and n >= 2:
            for name in ("comp", "icomp") if self.indexer is not None else ("comp",):
                st[f"{name}_x"] = torch.zeros(batch, n, a.dim, dtype=dtype, device=device)
        return st

    def prefetch_q(self, h: Tensor) -> bool:
        """Bring the query up-projection (wq_b, merged with the indexer's rows when it is) into L2 from a side
        branch forked at the block's start of a captured decode step (`linear.prefetch`, site "q"); h
        [N, hc, dim] the block's input streams."""
        return self.ops.linear.prefetch("q", [self.wq_bi if self.wq_bi is not None else self.wq_b], h)

    # ---- pieces shared by prefill and decode ----------------------------------------------
    def fold_proj(self) -> QWeight | None:
        """The weight the hc finish before this attention may multiply x by (hc.fold_pre's projection fold): the
        merged FP8 wq_a + wkv in the stored layout (not fp8t: DS4_FP8_TILE=0) when linear=gemv_cuda does the
        projections and no activation quantization is simulated; else None (the projection stays this attention's
        GEMV)."""
        ok = self.wqkv_a is not None and self.wqkv_a.fmt == "fp8" and not self.qat
        return self.wqkv_a if ok and self.ops.linear.name == "gemv_cuda" else None

    def _qkv_a(self, x: Tensor, qkv_a: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x [N, dim] -> (q-LoRA latent before q_norm [N, q_lora], raw window kv [N, D]); qkv_a: x . wqkv_a^T
        formed already (by the hc finish: fold_proj), split here."""
        lin = self.ops.linear
        if qkv_a is None:
            if self.wqkv_a is None:
                return lin(x, self.wq_a, act_quant=self.qat), lin(x, self.wkv, act_quant=self.qat)
            qkv_a = lin(x, self.wqkv_a, act_quant=self.qat)
        qa, kv = qkv_a.split((self.wq_a.out_features, self.wkv.out_features), -1)
        return qa, kv

    def _q(self, qa: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """qa [N, q_lora] (wq_a output) at positions [N] -> q [N, H, D] (per-head normed, rotated),
        qr [N, q_lora] (q_norm'ed, shared with the indexer)."""
        qr = self.ops.attn.rms_norm(qa, self.q_norm, self.args.norm_eps)
        return self._q_heads(qr, positions), qr

    def _q_heads(self, qr: Tensor, positions: Tensor) -> Tensor:
        """qr [N, q_lora] -> q [N, H, D]: wq_b, per-head RMS, RoPE."""
        return self.ops.attn.head_rope(self._wq_b(qr), positions, self.freqs, True, self.args.norm_eps)

    def _wq_b(self, qr: Tensor) -> Tensor:
        """qr [N, q_lora] -> q [N, H, D] before the per-head RMS and RoPE."""
        return self.ops.linear(qr, self.wq_b, act_quant=self.qat).unflatten(-1, (self.n_heads, self.args.head_dim))

    def _out(self, o: Tensor, fold=None, pos: Tensor | None = None) -> Tensor:
        """o [N, H, D] (de-rotated here at positions `pos` when given, else already) -> [N, dim]: grouped wo_a, wo_b
        (stage attn.out), all-reduce (stage comm.attn, outside attn.out). fold: the block's pending mHC step
        (ds4.ops.base.HcFold), which wo_b's kernel may form on one rank, the all-reduce under tensor parallelism
        (comm=ll, when the block asked for it: comm.folds_hc)."""
        one_rank = self.comm.world == 1
        with self.prof("attn.out"):
            if pos is not None:
                o = rope_heads(o, pos, self.freqs, inverse=True)
            y = self.ops.attn.out_proj(o.flatten(-2), self.wo_a, self.wo_b, self.groups, self.ops.linear, self.qat,
                                       fold if one_rank else None)
        with self.prof(self.comm.stage("attn")):
            return self.comm.all_reduce(y, "attn", fold=None if one_rank else fold)

    # ---- prefill: one sequence ----------------------------------------------------------
    def prefill(self, x: Tensor, st: dict[str, Tensor], row: int, fold=None, qkv_a: Tensor | None = None) -> Tensor:
        """x [S, dim] at positions 0..S-1 of batch row `row`; fills that row's state. -> [S, dim]. fold: see _out;
        qkv_a: see _qkv_a."""
        a, W, S = self.args, self.args.window_size, x.shape[0]
        pos = torch.arange(S, device=x.device)
        with self.prof("attn.q"):
            qa, kv = self._qkv_a(x, qkv_a)
            q, qr = self._q(qa, pos)
        with self.prof("attn.kv"):  # window key/value: norm, RoPE, (qat) FP8 simulation of the nope dims
            kv = finish_entry(kv, self.kv_norm, a.norm_eps, pos, self.freqs, "fp8" if self.qat else None)
            tail = pos[-min(S, W):]
            st["win"][row, tail % W] = kv[tail]
        entries = ikeys = qi = wi = None
        if self.compressor is not None:
            with self.prof("attn.compress"):
                entries = self.compressor.prefill(x, self.freqs, self.qat, _row_state(st, "comp", row))
                st["ckv"][row, : entries.shape[0]] = entries
        if self.indexer is not None:
            with self.prof("attn.indexer"):
                ikeys = self.indexer.compressor.prefill(x, self.freqs, self.qat, _row_state(st, "icomp", row))
                st["ikv"][row, : ikeys.shape[0]] = ikeys
                qi, wi = self.indexer.query(qr, x, pos, self.freqs)
        outs = []
        for a0 in range(0, S, PREFILL_CHUNK):
            e0 = min(S, a0 + PREFILL_CHUNK)
            t = pos[a0:e0].unsqueeze(-1)                                      # query positions [Sq, 1]
            lo = max(0, a0 - W + 1)
            keys, kpos = kv[lo:e0], pos[lo:e0].unsqueeze(0)
            valid = (kpos <= t) & (kpos > t - W)
            sel_kv = sel_valid = None
            if self.kind == HCA and entries.shape[0]:
                n = entries.shape[0]
                keys = torch.cat((keys, entries), 0)
                valid = torch.cat((valid, torch.arange(n, device=x.device).unsqueeze(0) < (t + 1) // self.m), 1)
            if self.kind == CSA and entries.shape[0]:
                n = entries.shape[0]
                with self.prof("attn.indexer"):
                    sc = self.indexer.scores(qi[None, a0:e0], wi[None, a0:e0], ikeys[None])  # all heads
                    visible = torch.arange(n, device=x.device).unsqueeze(0) < (t + 1) // self.m
                    idx, sel_valid = self.indexer.select(sc, visible.unsqueeze(0), min(a.index_topk, n))
                sel_kv = entries[idx]                                        # [1, Sq, k, D]
            with self.prof("attn.sparse"):
                outs.append(self.ops.attn.sparse(q[None, a0:e0], keys[None], valid[None], sel_kv, sel_valid,
                                                 self.sink, self.scale)[0])
        return self._out(torch.cat(outs, 0), fold, pos)

    # ---- decode: one token per row ------------------------------------------------------
    @property
    def rides_sinkhorn(self) -> bool:
        """Whether decode takes a SinkhornRide along (the attention implementation's combine launch runs it)."""
        return getattr(self.ops.attn, "rides_sinkhorn", False)

    def decode(self, x: Tensor, pos: Tensor, st: dict[str, Tensor], fold=None, qkv_a: Tensor | None = None,
               late_compress: bool = False, ride=None) -> Tensor:
        """x [B, dim], pos [B] (device) -> [B, dim]. No host synchronisation. fold: see _out; qkv_a: see _qkv_a.
        ride: the site's deferred mHC Sinkhorn (ds4.ops.base.SinkhornRide; only where rides_sinkhorn), which the
        attention core's launches finish.
        late_compress: the caller knows that no row's compressed window completes at this step ((pos + 1) % m != 0
        for every row; ds4.runtime.cuda_graph captures a step per phase). This step's attention then reads nothing
        its compressor steps write (the in-progress entry becomes visible at its window's last position only, and
        the attention and indexer kernels never load an invisible entry), so their branches join after the output
        projection instead of before the attention core: off the critical path, overlapping the attention core.

        Every step between the projections is an attention / indexer implementation op (window
        write, compressor step, masked indexer scores, position-masked attention with the output
        de-rotation), so a fused implementation runs a layer in a few launches."""
        a, B, attn, eps = self.args, x.shape[0], self.ops.attn, self.args.norm_eps
        st = {k: v[:B] for k, v in st.items()}  # views: the first B rows of the preallocated state
        # A CSA cache of at most index_topk entries (short max_seq_len) makes top-k select all of them:
        # attend to every visible entry as HCA does (same keys; decided by shape only).
        select = self.kind == CSA and st["ikv"].shape[1] > a.index_topk
        # Independent pieces run in branches (attn.branch: side streams while a CUDA graph is captured,
        # in line otherwise), each joined before its output is read:
        #   compress   the compressor step: reads x, writes its state and cache;
        #   icompress  the indexer compressor's step (and the indexer head weights): read x;
        #   kv         the window write: reads the wkv output;
        #   indexer    the indexer query, scores and top-k: reads qr and the indexer cache; or, when the
        #              query comes from the merged GEMV in line, the indexer head weights (reads x).
        branches, late = [], []  # joined before the attention core / after the output projection
        if self.compressor is not None:
            comp = attn.branch(x, "compress")
            with comp, self.prof("attn.compress"):
                self.compressor.decode(x, pos, self.freqs, self.qat, _state(st, "comp"), st["ckv"], attn)
            (late if late_compress else branches).append(comp)
        merged = select and self.merged_indexer_q and self.wq_bi is not None
        hw_own = merged and self.head_weights_branch  # the head weights in the "indexer" slot (free then)
        iw = None
        # the indexer compressor's branch joins late too unless it also forms the head weights the scores read
        late_icomp = late_compress and not (select and not hw_own)
        if self.kind == CSA:
            icomp = attn.branch(x, "icompress")
            with icomp, self.prof("attn.indexer"):
                self.indexer.compressor.decode(x, pos, self.freqs, self.qat, _state(st, "icomp"), st["ikv"], attn)
                wi = self.indexer.head_weights(x) if select and not hw_own else None
            (late if late_icomp else branches).append(icomp)
            if hw_own:
                iw = attn.branch(x, "indexer")
                with iw, self.prof("attn.indexer"):
                    wi = self.indexer.head_weights(x)
                branches.append(iw)
        with self.prof("attn.q"):
            qa, kv = self._qkv_a(x, qkv_a)
        kvb = attn.branch(x, "kv")
        with kvb, self.prof("attn.kv"):
            attn.kv_store(st["win"], kv, self.kv_norm, pos, self.freqs, eps, self.qat)
        branches.append(kvb)
        def indexer_select(qi: Tensor, rope: Tensor | None) -> Tensor:
            """qi [B, H, d] (all index heads: the indexer is replicated over ranks; before its RoPE when rope
            is given) -> top-k indices [B, k]."""
            if not late_icomp:
                icomp.join()  # the indexer cache entry of this step
            if iw is not None:
                iw.join()  # the head weights
            # invisible entries score -inf inside the scores op
            return self.indexer.select_decode(qi[:, None], wi[:, None], st["ikv"], a.index_topk, pos, self.m, rope)

        idx = None
        if select and not merged:
            ib = attn.branch(x, "indexer")
            with ib, self.prof("attn.indexer"):  # q_norm + the indexer's wq_b, scores and top-k in its branch
                idx = indexer_select(*self.indexer.decode_query(qa, self.q_norm, eps, pos, self.freqs))
            branches.append(ib)
        with self.prof("attn.q"):  # q_norm + wq_b (attn.q_up); the per-head RMS and RoPE happen inside attn.decode
            if merged:  # + the indexer's query rows in the same GEMV (before their RoPE, and under qat their
                # Hadamard + FP4: the scores op applies them)
                # while a row's visible entries all fit in the top-k, its selection is all of them whatever the
                # scores: its index query may be zeros (RowSkip), which the fused GEMV does not compute
                skip = RowSkip(pos, self.m, a.index_topk, self.wq_b.out_features) if self.skip_index_query else None
                q, qi = attn.q_up(qa, self.q_norm, eps, self.wq_bi, self.ops.linear, self.qat, skip).split(
                    (self.wq_b.out_features, self.idx_wq_b.out_features), -1)
            else:
                q = attn.q_up(qa, self.q_norm, eps, self.wq_b, self.ops.linear, self.qat)
            q = q.unflatten(-1, (self.n_heads, a.head_dim))
        # opt-in: wo_a / wo_b into L2 while the indexer and the attention core run (ds4.ops.prefetch sites o, b)
        self.ops.linear.prefetch("o", [self.wo_a], x)
        self.ops.linear.prefetch("b", [self.wo_b], x)
        if merged:  # scores and top-k in line (measured the same as in their own branch: bench token noidxm)
            with self.prof("attn.indexer"):
                idx = indexer_select(qi.unflatten(-1, (self.indexer.n_heads, a.index_head_dim)), self.freqs)
        ext = st["ckv"] if self.compressor is not None else None
        # DS4_PJOIN=attn (opt-in): the branches join the attention core's first launch by programmatic edges where
        # the implementation says that launch waits before it reads their outputs (decode_join_site)
        site_of = getattr(attn, "decode_join_site", None)
        site = site_of(q, st["win"], pos, ext, idx, self.sink, self.freqs, eps) if site_of is not None else None
        for br in branches:
            br.join(site)
        with self.prof("attn.sparse"):
            o = attn.decode(q, st["win"], pos, ext, idx, self.m or 1, self.sink, self.scale, self.freqs, eps,
                            **({} if ride is None else {"ride": ride}))
        out = self._out(o, fold)
        for br in late:
            br.join()
        return out


def _state(st: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """A compressor's decode state: kv, score, and the deferred projection's ring x where allocated."""
    return {k: st[f"{prefix}_{k}"] for k in ("kv", "score", "x") if f"{prefix}_{k}" in st}


def _row_state(st: dict[str, Tensor], prefix: str, row: int) -> dict[str, Tensor]:
    return {k: v[row] for k, v in _state(st, prefix).items()}
