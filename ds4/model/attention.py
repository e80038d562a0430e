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
from ds4.model.compressor import Compressor
from ds4.model.indexer import Indexer
from ds4.model.norm import rms_norm, unweighted_rms_norm
from ds4.model.rope import apply_rope, rotations, inv_freq
from ds4.model.weights_module import WeightsModule, weight_format
from ds4.profile import NULL_PROFILER
from ds4.quant import act_quant_sim

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

    def load(self, t: Mapping[str, Tensor], p: str) -> None:
        fmt = weight_format(t[f"{p}.wq_a.weight"])
        # RoPE frequencies live where the weights live (fp32, computed, never loaded)
        self.register_buffer("freqs", inv_freq(self.args, self.layer, t[f"{p}.wq_a.weight"].device), persistent=False)
        self.wq_a = self.take_linear("wq_a", t, f"{p}.wq_a", fmt)
        self.q_norm = self.take("q_norm", t, f"{p}.q_norm.weight")
        self.wq_b = self.take_linear("wq_b", t, f"{p}.wq_b", fmt)
        self.wkv = self.take_linear("wkv", t, f"{p}.wkv", fmt)
        self.kv_norm = self.take("kv_norm", t, f"{p}.kv_norm.weight")
        self.wo_a = self.take_linear("wo_a", t, f"{p}.wo_a", fmt)
        self.wo_b = self.take_linear("wo_b", t, f"{p}.wo_b", fmt)
        self.sink = self.take("sink", t, f"{p}.attn_sink")
        self.n_heads = self.wq_b.out_features // self.args.head_dim   # local heads (tensor parallel)
        self.groups = self.wo_a.out_features // self.args.o_lora_rank  # local o-groups
        if self.compressor is not None:
            self.compressor.load(t, f"{p}.compressor")
        if self.indexer is not None:
            self.indexer.load(t, f"{p}.indexer")

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
        return st

    # ---- pieces shared by prefill and decode ----------------------------------------------
    def _q(self, x: Tensor, cis: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, dim] -> q [N, H, D] (normed, rotated), qr [N, q_lora] (shared with the indexer)."""
        lin = self.ops.linear
        qr = rms_norm(lin(x, self.wq_a, act_quant=self.qat), self.q_norm, self.args.norm_eps)
        q = lin(qr, self.wq_b, act_quant=self.qat).unflatten(-1, (self.n_heads, self.args.head_dim))
        q = unweighted_rms_norm(q, self.args.norm_eps)
        return apply_rope(q, cis.unsqueeze(-2)), qr

    def _kv(self, x: Tensor, cis: Tensor) -> Tensor:
        """x [N, dim] -> window key/value [N, D]: norm, RoPE, (qat) FP8 simulation of the nope dims."""
        kv = rms_norm(self.ops.linear(x, self.wkv, act_quant=self.qat), self.kv_norm, self.args.norm_eps)
        kv = apply_rope(kv, cis)
        if self.qat:
            nope = self.args.nope_head_dim
            kv = torch.cat((act_quant_sim(kv[..., :nope], 64), kv[..., nope:]), -1)
        return kv

    def _out(self, o: Tensor, cis: Tensor) -> Tensor:
        """o [N, H, D] -> [N, dim]: de-rotate at the query position, grouped wo_a, wo_b."""
        o = apply_rope(o, cis.unsqueeze(-2), inverse=True)
        o = o.flatten(-2).unflatten(-1, (self.groups, -1))                  # [N, G, H*D/G]
        u = self.ops.linear.grouped(o, self.wo_a, self.groups).flatten(-2)  # [N, G*R]
        y = self.ops.linear(u, self.wo_b, act_quant=self.qat)
        with self.prof("comm.attn"):
            return self.comm.all_reduce(y, "attn")

    # ---- prefill: one sequence ----------------------------------------------------------
    def prefill(self, x: Tensor, st: dict[str, Tensor], row: int) -> Tensor:
        """x [S, dim] at positions 0..S-1 of batch row `row`; fills that row's state. -> [S, dim]."""
        a, W, S = self.args, self.args.window_size, x.shape[0]
        pos = torch.arange(S, device=x.device)
        cis = rotations(self.freqs, pos)
        with self.prof("attn.q"):
            q, qr = self._q(x, cis)
        with self.prof("attn.kv"):
            kv = self._kv(x, cis)
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
                    sc = self.comm.all_reduce(self.indexer.scores(qi[None, a0:e0], wi[None, a0:e0], ikeys[None]), "indexer")
                    visible = torch.arange(n, device=x.device).unsqueeze(0) < (t + 1) // self.m
                    idx, sel_valid = self.indexer.select(sc, visible.unsqueeze(0), min(a.index_topk, n))
                sel_kv = entries[idx]                                        # [1, Sq, k, D]
            with self.prof("attn.sparse"):
                outs.append(self.ops.attn.sparse(q[None, a0:e0], keys[None], valid[None], sel_kv, sel_valid,
                                                 self.sink, self.scale)[0])
        with self.prof("attn.out"):
            return self._out(torch.cat(outs, 0), cis)

    # ---- decode: one token per row ------------------------------------------------------
    def decode(self, x: Tensor, pos: Tensor, st: dict[str, Tensor]) -> Tensor:
        """x [B, dim], pos [B] (device) -> [B, dim]. No host synchronisation."""
        a, W, B = self.args, self.args.window_size, x.shape[0]
        st = {k: v[:B] for k, v in st.items()}  # views: the first B rows of the preallocated state
        rows = torch.arange(B, device=x.device)
        cis = rotations(self.freqs, pos)
        with self.prof("attn.q"):
            q, qr = self._q(x, cis)
        with self.prof("attn.kv"):
            kv = self._kv(x, cis)
            st["win"][rows, pos % W] = kv
        keys = st["win"]
        valid = torch.arange(W, device=x.device).unsqueeze(0) <= pos.unsqueeze(-1)   # [B, W]
        sel_kv = sel_valid = None
        if self.compressor is not None:
            with self.prof("attn.compress"):
                self.compressor.decode(x, pos, self.freqs, self.qat, _state(st, "comp"), st["ckv"])
            n_vis = (pos + 1) // self.m
            slots = torch.arange(st["ckv"].shape[1], device=x.device).unsqueeze(0)
            if self.kind == HCA:
                keys = torch.cat((keys, st["ckv"]), 1)
                valid = torch.cat((valid, slots < n_vis.unsqueeze(-1)), 1)
            else:
                with self.prof("attn.indexer"):
                    self.indexer.compressor.decode(x, pos, self.freqs, self.qat, _state(st, "icomp"), st["ikv"])
                    qi, wi = self.indexer.query(qr, x, pos, self.freqs)
                    sc = self.comm.all_reduce(self.indexer.scores(qi[:, None], wi[:, None], st["ikv"]), "indexer")
                    visible = (slots < n_vis.unsqueeze(-1)).unsqueeze(1)
                    idx, sel_valid = self.indexer.select(sc, visible, min(a.index_topk, st["ikv"].shape[1]))
                sel_kv = st["ckv"][rows.view(B, 1, 1), idx]                  # [B, 1, k, D]
        with self.prof("attn.sparse"):
            o = self.ops.attn.sparse(q[:, None], keys, valid[:, None], sel_kv, sel_valid, self.sink, self.scale)[:, 0]
        with self.prof("attn.out"):
            return self._out(o, cis)


def _state(st: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {"kv": st[f"{prefix}_kv"], "score": st[f"{prefix}_score"]}


def _row_state(st: dict[str, Tensor], prefix: str, row: int) -> dict[str, Tensor]:
    return {"kv": st[f"{prefix}_kv"][row], "score": st[f"{prefix}_score"][row]}
