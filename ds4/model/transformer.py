"""The DeepSeek-V4 stack (spec §3): embedding, hyper-connected blocks, hc_head, norm, LM head, MTP.

The model is built from plain dataclasses (ModelArgs, registry.Ops) and filled with tensors in
the official naming by `load_weights`. `prefill` runs one sequence into one row of the decode
state; `decode` advances every row by one token at the positions held in the state (device
tensors), with no host synchronisation, so a whole step can be captured in a CUDA graph.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Collection, Iterable, Mapping

import torch
from torch import Tensor

from ds4.dist import SingleProcess
from ds4.model.args import ModelArgs
from ds4.model.attention import Attention
from ds4.model.moe import MoE
from ds4.model.norm import rms_norm
from ds4.model.weights_module import WeightsModule, weight_format
from ds4.ops import prefetch
from ds4.ops.base import HcFold, SinkhornRide
from ds4.profile import NULL_PROFILER, Profiler


# (x, res, post, comb): a block output whose hc.post onto the streams `res` is pending (Block.forward), or
# the hc fold that the block's last kernel formed (the post done, the next site's partials ready)
Carry = tuple[Tensor, Tensor, Tensor, Tensor] | HcFold


@dataclass
class DecodeState:
    """Everything decode reads and writes, preallocated for (max_batch, max_seq_len) (spec §9)."""
    layers: list[dict[str, Tensor]]
    pos: Tensor            # [B] int64: position of the next token of each row
    max_seq_len: int

    def reset_row(self, row: int) -> None:
        """Fresh sequence in `row`: zero caches, kv state 0, score state -inf (the reference forgets this)."""
        for st in self.layers:
            for k, v in st.items():
                v[row].fill_(float("-inf") if k.endswith("_score") else 0)
        self.pos[row] = 0


class Block(WeightsModule):
    def __init__(self, args: ModelArgs, layer: int, is_hash: bool, ops, qat: bool, comm, prof: Profiler):
        super().__init__()
        self.args, self.ops, self.prof = args, ops, prof
        self.attn = Attention(args, layer, ops, qat, comm, prof)
        self.ffn = MoE(args, is_hash, ops, qat, comm, prof)

    def load(self, t: Mapping[str, Tensor], p: str) -> None:
        for site in ("attn", "ffn"):
            for part in ("fn", "base", "scale"):
                self.take(f"hc_{site}_{part}", t, f"{p}.hc_{site}_{part}")
        self.attn_norm = self.take("attn_norm", t, f"{p}.attn_norm.weight")
        self.ffn_norm = self.take("ffn_norm", t, f"{p}.ffn_norm.weight")
        self.attn.load(t, f"{p}.attn")
        self.ffn.load(t, f"{p}.ffn")

    def _defers_sinkhorn(self, h: Tensor, site: str) -> bool:
        """Whether the finish at `site` ("attn" / "ffn") over the streams h leaves its Sinkhorn to the site's next
        launch able to take it (ds4.ops.base.SinkhornRide): the hc implementation allows it there and the
        attention / MoE implementation takes the ride."""
        defers = getattr(self.ops.hc, "defers_sinkhorn", None)
        rides = self.attn.rides_sinkhorn if site == "attn" else self.ffn.rides_sinkhorn
        return defers is not None and rides and defers(h, site)

    def forward(self, h: Tensor, token_ids: Tensor,
                attend: Callable[..., Tensor],
                carry: Carry | None = None, next_fn: Tensor | None = None,
                defer_sinkhorn: bool = False) -> tuple[Tensor, Carry]:
        """h [N, hc, dim] residual streams; `attend(attn, x, fold, qkv_a)` runs prefill or decode attention (qkv_a:
        the attention's wq_a + wkv rows of x when the hc finish formed them, hc.fold_pre's projection fold; else None).
        carry: the previous block's FFN output with its post / comb, whose hc.post onto h is still to be
        done: it is done here together with this block's first hc.pre (hc.post_pre: one step, which the
        CUDA implementation runs in 2 launches instead of 3). Returns (h, carry) with this block's own
        last hc.post left to the caller in the same way (`finish_streams` applies it).
        The hc fold (hc.fold; the CUDA implementation's default): the kernel that forms a sub-block's output
        (wo_b, the MoE down) may also do that post and the next site's first launch; next_fn (the next block's
        hc_attn_fn) lets the FFN's fold reach into the next block, whose forward then takes the fold as its
        carry.
        defer_sinkhorn (decode steps): each site's finish may leave its mHC Sinkhorn to a later launch of the site
        (_defers_sinkhorn), which attend(..., ride=) / the FFN then get as a SinkhornRide."""
        a, hc = self.args, self.ops.hc
        qkv_a = None
        defer = defer_sinkhorn and self._defers_sinkhorn(h, "attn")
        dk = {"defer_sinkhorn": True} if defer else {}
        # opt-in (DS4_L2_PREFETCH, measured slower): a captured decode step starts bringing the query
        # up-projection into L2 beside this block's first mHC and wq_a + wkv (ds4.ops.prefetch)
        self.attn.prefetch_q(h)
        with self.prof("hc.pre"):  # x comes back already RMS-normed with attn_norm
            if carry is None:
                x, post, comb = hc.pre(h, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base,
                                       a.hc_sinkhorn_iters, a.hc_eps, a.norm_eps, self.attn_norm, **dk)
            elif isinstance(carry, HcFold):  # the finish may also form the attention's wq_a + wkv rows (qkv_a)
                h, x, post, comb, qkv_a = hc.fold_pre(carry, self.hc_attn_scale, self.hc_attn_base,
                                                      a.hc_sinkhorn_iters, a.hc_eps, a.norm_eps, self.attn_norm,
                                                      proj=self.attn.fold_proj(), **dk)
            else:
                h, x, post, comb = hc.post_pre(*carry, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base,
                                               a.hc_sinkhorn_iters, a.hc_eps, a.norm_eps, self.attn_norm, **dk)
        rk = {"ride": SinkhornRide(comb, a.hc_sinkhorn_iters, a.hc_eps)} if defer else {}
        # the fold is formed by the kernel producing the sub-block output on one rank; under tensor parallelism by
        # the all-reduce after it where the communicator takes it (comm.folds_hc: comm=ll with DS4_AR_FOLD=1)
        comm = self.attn.comm
        folds = comm.world == 1 or comm.folds_hc
        fold = hc.fold(h, post, comb, self.hc_ffn_fn) if folds else None
        x = attend(self.attn, x, fold, qkv_a, **rk)
        defer = defer_sinkhorn and self._defers_sinkhorn(h, "ffn")
        dk = {"defer_sinkhorn": True} if defer else {}
        with self.prof("hc.pre"):  # hc.post of the attention output, then hc.pre of the FFN (which may also give
            # the router's logits: hc's router fold, the CUDA implementation's default)
            if fold is not None and fold.fused:
                h, x, post, comb, logits = hc.fold_pre(fold, self.hc_ffn_scale, self.hc_ffn_base, a.hc_sinkhorn_iters,
                                                       a.hc_eps, a.norm_eps, self.ffn_norm, self.ffn.gate, **dk)
            else:
                h, x, post, comb, logits = hc.post_pre_route(x, h, post, comb, self.hc_ffn_fn, self.hc_ffn_scale,
                                                             self.hc_ffn_base, a.hc_sinkhorn_iters, a.hc_eps,
                                                             a.norm_eps, self.ffn_norm, self.ffn.gate, **dk)
        rk = {"ride": SinkhornRide(comb, a.hc_sinkhorn_iters, a.hc_eps)} if defer else {}
        fold = hc.fold(h, post, comb, next_fn) if next_fn is not None and folds else None
        x = self.ffn(x, token_ids, logits, fold, **rk)
        if fold is not None and fold.fused:
            return h, fold
        return h, (x, h, post, comb)

    def finish_streams(self, carry: Carry) -> Tensor:
        """The pending hc.post of a carry: the block's output streams [N, hc, dim]."""
        if isinstance(carry, HcFold):  # (only a forward given next_fn returns one)
            return carry.out
        with self.prof("hc.post"):
            return self.ops.hc.post(*carry)


class MTPBlock(Block):
    """Multi-token-prediction block (spec §8): combines the main model's last hidden streams at
    position i with the embedding of token i+1 and predicts token i+2. Shares embed and head."""

    def load(self, t: Mapping[str, Tensor], p: str) -> None:
        super().load(t, p)
        fmt = weight_format(t[f"{p}.e_proj.weight"])
        self.e_proj = self.take_linear("e_proj", t, f"{p}.e_proj", fmt)
        self.h_proj = self.take_linear("h_proj", t, f"{p}.h_proj", fmt)
        for n in ("enorm", "hnorm", "norm"):
            self.take(n, t, f"{p}.{n}.weight")
        for part in ("fn", "base", "scale"):
            self.take(f"hc_head_{part}", t, f"{p}.hc_head_{part}")


class Transformer(WeightsModule):
    def __init__(self, args: ModelArgs, ops, numerics: str = "plain", dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", rank: int = 0, world: int = 1,
                 profiler: Profiler | None = None, comm=None):
        super().__init__()
        if numerics not in ("plain", "qat"):
            raise ValueError(f"numerics must be plain|qat, got {numerics!r}")
        self.args, self.ops, self.numerics, self.dtype = args, ops, numerics, dtype
        self.device, self.rank, self.world = torch.device(device), rank, world
        self.prof = profiler or NULL_PROFILER
        self.comm = comm or SingleProcess()
        qat = numerics == "qat"
        self.layers = torch.nn.ModuleList(
            Block(args, i, args.is_hash(i), ops, qat, self.comm, self.prof) for i in range(args.n_layers))
        self.mtp = torch.nn.ModuleList(
            MTPBlock(args, args.n_layers + j, False, ops, qat, self.comm, self.prof) for j in range(args.n_mtp_layers))
        self.has_mtp = False

    def configure(self, ops=None, comm=None, numerics: str | None = None) -> None:
        """Swap implementations, communicator or numerics mode on a loaded model, so ablations
        and the fidelity reference share one copy of the weights. Every submodule is updated."""
        if numerics is not None and numerics not in ("plain", "qat"):
            raise ValueError(f"numerics must be plain|qat, got {numerics!r}")
        for mod in self.modules():
            if ops is not None and hasattr(mod, "ops"):
                mod.ops = ops
            if comm is not None and hasattr(mod, "comm"):
                mod.comm = comm
            if numerics is not None and hasattr(mod, "qat"):
                mod.qat = numerics == "qat"
            if ops is not None and hasattr(mod, "prepare_weights"):
                mod.prepare_weights()  # the new MoE implementation's weight layout (a no-op if it has none)
        if numerics is not None:
            self.numerics = numerics

    @contextlib.contextmanager
    def configured(self, ops=None, numerics: str | None = None):
        """Temporarily run with other implementations / numerics (e.g. the torch reference)."""
        saved = (self.ops, self.numerics)
        self.configure(ops=ops, numerics=numerics)
        try:
            yield self
        finally:
            self.configure(ops=saved[0], numerics=saved[1])

    # ---- weights ----------------------------------------------------------------------------
    def load_weights(self, tensors: Mapping[str, Tensor], consume: bool = False) -> None:
        """Take tensors (official naming, native formats, this rank's slices). Tensors already on
        the model's device are used as they are (no copy); others are moved. Routed experts are
        stacked per layer (one copy); each layer's per-expert originals are freed as soon as they
        are stacked when nothing else references them: the caller keeps no reference to `tensors`,
        or passes consume=True (a dict: its tensors are moved to the device in place, its
        per-expert entries removed as they are stacked, and each layer's other entries once the layer
        is loaded; the full model's experts, and the originals of merged or re-laid projections, would
        otherwise be held twice at the peak)."""
        if consume:
            if not isinstance(tensors, dict):
                raise TypeError("load_weights(consume=True) needs a dict")
            for k, v in tensors.items():
                if v.device != self.device:
                    tensors[k] = v.to(self.device)
            t = tensors
        else:
            t = {k: (v if v.device == self.device else v.to(self.device)) for k, v in tensors.items()}
        del tensors  # only `t` (and the caller, if it kept one) references the originals now
        self.embed = self.take("embed", t, "embed.weight")
        self.head = self.take("head", t, "head.weight")
        self.norm = self.take("norm", t, "norm.weight")
        for part in ("fn", "base", "scale"):
            self.take(f"hc_head_{part}", t, f"hc_head_{part}")
        for i, blk in enumerate(self.layers):
            blk.load(t, f"layers.{i}")
            if consume:  # what the layer merged (wq_a + wkv, wq_b + the indexer's, wkv + wgate) or re-laid (fp8t) is
                # held by the model in its new form: the dict's originals go now, not at the end of the load
                for k in [k for k in t if k.startswith(f"layers.{i}.")]:
                    del t[k]
        self.has_mtp = all(f"mtp.{j}.e_proj.weight" in t for j in range(len(self.mtp))) and len(self.mtp) > 0
        if self.has_mtp:
            for j, blk in enumerate(self.mtp):
                blk.load(t, f"mtp.{j}")

    def alloc_state(self, max_batch: int, max_seq_len: int) -> DecodeState:
        layers = [b.attn.alloc_state(max_batch, max_seq_len, self.dtype, self.device) for b in self.layers]
        return DecodeState(layers, torch.zeros(max_batch, dtype=torch.long, device=self.device), max_seq_len)

    @staticmethod
    def state_bytes(args: ModelArgs, max_batch: int, max_seq_len: int, dtype: torch.dtype) -> int:
        """The bytes alloc_state(max_batch, max_seq_len) allocates (formed on the meta device: nothing is allocated;
        every rank holds all of it under tensor parallelism: one KV head). For the memory check before loading."""
        n = max_batch * 8  # pos
        for i in range(args.n_layers):
            st = Attention(args, i, None, False, None).alloc_state(max_batch, max_seq_len, dtype, "meta")
            n += sum(v.nbytes for v in st.values())
        return n

    # ---- pieces -----------------------------------------------------------------------------
    def _embed(self, ids: Tensor) -> Tensor:
        """ids [N] -> residual streams [N, hc, dim] (the embedding copied into every stream)."""
        with self.prof("embed"):
            vocab_local, hc = self.embed.shape[0], self.args.hc_mult
            if self.world > 1:  # vocab-parallel: ids outside this rank's slice contribute zero
                local = ids - self.rank * vocab_local
                ok = (local >= 0) & (local < vocab_local)
                e = self.embed[local.clamp(0, vocab_local - 1)] * ok.unsqueeze(-1)
                e = self.comm.all_reduce(e.float(), "embed")
                return e.to(self.dtype).unsqueeze(1).expand(-1, hc, -1).contiguous()
            # one gather writes the row once per stream (advanced indexing + an expand copy were two launches)
            rows = ids.unsqueeze(1).expand(-1, hc).reshape(-1)  # [N * hc] (a copy of a few ids)
            return self.embed.index_select(0, rows).to(self.dtype).unflatten(0, (-1, hc))

    def logits(self, h: Tensor, fn=None, scale=None, base=None, norm=None, full_vocab: bool = True) -> Tensor:
        """h [N, hc, dim] -> fp32 logits [N, vocab]: hc_head, final norm, LM head (fp32 accumulate).
        Under tensor parallelism `full_vocab=False` returns this rank's vocab slice only."""
        a = self.args
        with self.prof("head"):
            y = self.ops.hc.head(h, self.hc_head_fn if fn is None else fn,  # hc_head and the final norm
                                 self.hc_head_scale if scale is None else scale,
                                 self.hc_head_base if base is None else base, a.hc_eps, a.norm_eps,
                                 self.norm if norm is None else norm)
            out = _head_matmul(y, self.head)
        if not full_vocab:
            return out
        with self.prof(self.comm.stage("head")):
            return self.comm.gather_vocab(out)

    def _run_blocks(self, h: Tensor, ids: Tensor, attend, state: DecodeState, defer_sinkhorn: bool = False) -> Tensor:
        """The blocks over h [N, hc, dim]; `attend(attn, x, layer_state, fold, qkv_a[, ride=])`. Each block's last
        hc.post is fused into the next block's first hc.pre (Block.forward's carry; next_fn for the hc fold).
        defer_sinkhorn: see Block.forward (decode steps)."""
        carry = None
        for i, (blk, st) in enumerate(zip(self.layers, state.layers)):
            nxt = self.layers[i + 1].hc_attn_fn if i + 1 < len(self.layers) else None
            h, carry = blk(h, ids, lambda attn, x, fold, qkv_a, st=st, **rk: attend(attn, x, st, fold, qkv_a, **rk),
                           carry, nxt, defer_sinkhorn)
        return h if carry is None else self.layers[-1].finish_streams(carry)

    # ---- prefill / decode ---------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, ids: Tensor, state: DecodeState, row: int, return_hidden: bool = False,
                full_vocab: bool = True):
        """ids [S] of one sequence -> logits [vocab] fp32 for its last position; fills `row` of the
        state (which must have been reset) and sets its position to S."""
        S = ids.shape[0]
        if S > state.max_seq_len:
            raise ValueError(f"prompt of {S} tokens is longer than max_seq_len={state.max_seq_len}")
        with self.prof.phase("prefill"):  # the stage table's prefill rows, apart from the decode steps'
            h = self._run_blocks(self._embed(ids), ids,
                                 lambda attn, x, st, fold, qkv_a: attn.prefill(x, st, row, fold, qkv_a), state)
            state.pos[row] = S
            out = self.logits(h[-1:], full_vocab=full_vocab)[0]
        return (out, h) if return_hidden else out

    @property
    def compress_ratios(self) -> frozenset[int]:
        """The compress ratios of this model's layers that have a compressor."""
        return frozenset(blk.attn.m for blk in self.layers if blk.attn.compressor is not None)

    def window_ends(self, positions: Iterable[int]) -> frozenset[int]:
        """The compress ratios whose window ends at one of `positions` (a decode step's rows, as host ints): decode's
        window_ends for that step."""
        ps = list(positions)
        return frozenset(m for m in self.compress_ratios if any((p + 1) % m == 0 for p in ps))

    @torch.inference_mode()
    def decode(self, ids: Tensor, state: DecodeState, full_vocab: bool = True,
               window_ends: Collection[int] | None = None) -> Tensor:
        """ids [B] (next token of every row) at positions state.pos -> logits [B, vocab] fp32; advances pos.
        window_ends: the compress ratios m whose window ends at this step for some row ((pos + 1) % m == 0), as the
        caller knows them from its own count of positions (`window_ends`); layers of any other ratio join their
        compressor branches late (Attention.decode's late_compress). None: not known, every layer joins them early."""
        pos = state.pos[: ids.shape[0]]
        prefetch.discard_pending()  # (only a step that failed before its join leaves any)

        def attend(attn, x, st, fold, qkv_a, ride=None):
            late = window_ends is not None and attn.compressor is not None and attn.m not in window_ends
            return attn.decode(x, pos, st, fold, qkv_a, late_compress=late, ride=ride)

        h = self._run_blocks(self._embed(ids), ids, attend, state, defer_sinkhorn=True)
        prefetch.join_pending()  # the step's L2 prefetch branches (ds4.ops.prefetch), in one place
        pos.add_(1)
        return self.logits(h, full_vocab=full_vocab)

    @torch.inference_mode()
    def mtp_logits(self, h: Tensor, next_ids: Tensor) -> Tensor:
        """MTP forward over one sequence (stateless): h [S, hc, dim] main hidden streams before hc_head
        at positions 0..S-1, next_ids [S] = tokens 1..S -> logits [S, vocab] predicting tokens 2..S+1."""
        if not self.has_mtp:
            raise RuntimeError("this model was loaded without MTP weights")
        blk: MTPBlock = self.mtp[0]
        a, S = self.args, h.shape[0]
        e = rms_norm(self.embed[next_ids].to(self.dtype), blk.enorm, a.norm_eps)
        hh = rms_norm(h, blk.hnorm, a.norm_eps)
        aq = blk.attn.qat  # (the linear implementations simulate FP8 activations only before FP8 / FP4 weights)
        x = self.ops.linear(e, blk.e_proj, act_quant=aq).unsqueeze(1) + self.ops.linear(hh, blk.h_proj, act_quant=aq)
        st = blk.attn.alloc_state(1, S, self.dtype, self.device)
        _, carry = blk(x, next_ids, lambda attn, xx, fold, qkv_a: attn.prefill(xx, st, 0, fold, qkv_a))
        x = blk.finish_streams(carry)
        return self.logits(x, blk.hc_head_fn, blk.hc_head_scale, blk.hc_head_base, blk.norm)

    # ---- accounting ---------------------------------------------------------------------------
    def param_count(self, include_mtp: bool = False) -> int:
        """Logical parameters held (FP4 counts one per value; scales and tid2eid not counted)."""
        n = 0
        for name, b in self.named_buffers():
            if b.dtype == torch.float8_e8m0fnu or name.endswith("tid2eid") or name.endswith("freqs"):
                continue
            if name.startswith("mtp.") and not include_mtp:
                continue
            n += b.numel() * (2 if b.dtype in (torch.int8, torch.uint8) else 1)
        return n

    def bytes_per_token(self, context_len: int = 0) -> int:
        """Bytes one decode step (batch 1) must read at `context_len` tokens of context: the
        weights (`weight_bytes_per_token`) plus the KV cache reads (spec §9), less the indexer's query rows and head
        weights of the CSA layers whose visible entries all fit in its top-k (`selects_all`: no score is needed)."""
        unread = sum(b.attn.indexer.wq_b.nbytes() + b.attn.indexer.weights_proj.nbytes
                     for i, b in enumerate(self.layers)
                     if b.attn.indexer is not None and self.selects_all(i, context_len))
        return self.weight_bytes_per_token() + self.kv_bytes_per_token(context_len) - unread

    def selects_all(self, layer: int, context_len: int) -> bool:
        """A CSA layer whose indexer top-k takes every visible compressed entry at `context_len` tokens."""
        a = self.args
        return a.layer_type(layer) == "csa" and context_len // a.ratio(layer) <= a.index_topk

    def weight_bytes_per_token(self) -> int:
        """Every weight once, except: one embedding row, one tid2eid row, the k selected of the
        routed experts (k*E_local/E on average on this rank), and no MTP (spec §13.2)."""
        a, total = self.args, 0
        for name, b in self.named_buffers():
            if name.startswith("mtp.") or name.endswith("freqs"):
                continue
            nb = b.numel() * b.element_size()
            if name == "embed":
                nb = b.shape[1] * b.element_size()
            elif name.endswith("tid2eid"):
                nb = b.shape[1] * b.element_size()
            elif ".ffn." in name and name.split(".")[-1].split("_")[0] in ("w1", "w2", "w3"):
                nb = nb * a.n_activated_experts // a.n_routed_experts
            total += nb
        return total

    def kv_bytes_per_token(self, context_len: int) -> int:
        """KV reads of one decode step: window ring, HCA entries, CSA indexer keys + selected entries."""
        a, total = self.args, 0
        elt = torch.empty((), dtype=self.dtype).element_size()
        for i in range(a.n_layers):
            total += a.window_size * a.head_dim * elt
            m, kind = a.ratio(i), a.layer_type(i)
            n = context_len // m if m else 0
            if kind == "hca":
                total += n * a.head_dim * elt
            elif kind == "csa":  # the indexer's key scan only where the top-k must choose (selects_all)
                scan = 0 if self.selects_all(i, context_len) else n * a.index_head_dim * elt
                total += scan + min(a.index_topk, n) * a.head_dim * elt
        return total


def _head_matmul(y: Tensor, head: Tensor) -> Tensor:
    """fp32 logits of y [N, dim] against the BF16 head [V, dim] without an fp32 copy of the head
    on CUDA (bf16 inputs, fp32 accumulate and output); upcast in chunks elsewhere."""
    if y.is_cuda and head.dtype == torch.bfloat16:
        try:
            return torch.mm(y.to(torch.bfloat16), head.t(), out_dtype=torch.float32)
        except TypeError:  # torch without mm(out_dtype=): same numerics via chunked upcast below
            pass
    yf = y.float()  # chunks of 4096 rows: 64 MiB of fp32 at a time at V4's width (a CPU run's working set)
    return torch.cat([yf @ head[i:i + 4096].float().t() for i in range(0, head.shape[0], 4096)], -1)
