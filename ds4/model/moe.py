"""Mixture of experts block (spec §6): router, routed experts (local to this rank), shared expert."""
from __future__ import annotations

import re
from typing import Mapping

import torch
from torch import Tensor

from ds4.model.args import ModelArgs
from ds4.model.weights_module import WeightsModule, weight_format
from ds4.ops.base import MoEWeights
from ds4.profile import NULL_PROFILER


class MoE(WeightsModule):
    def __init__(self, args: ModelArgs, is_hash: bool, ops, qat: bool, comm, profiler=NULL_PROFILER):
        super().__init__()
        self.args, self.is_hash, self.ops, self.qat, self.comm, self.prof = args, is_hash, ops, qat, comm, profiler

    def load(self, t: Mapping[str, Tensor], p: str) -> None:
        a = self.args
        gate = self.take("gate", t, f"{p}.gate.weight")
        bias = tid2eid = None
        if self.is_hash:
            # The reference holds tid2eid as int32 (half the bytes of the int64 in the file).
            tid2eid = t[f"{p}.gate.tid2eid"].to(torch.int32)
            self.register_buffer("tid2eid", tid2eid, persistent=False)
        else:
            bias = self.take("bias", t, f"{p}.gate.bias")
        pat = re.compile(re.escape(p) + r"\.experts\.(\d+)\.w1\.weight$")
        local = sorted(int(m.group(1)) for k in t if (m := pat.match(k)))
        if not local or local != list(range(local[0], local[0] + len(local))):
            raise KeyError(f"{p}: routed experts must be a non-empty contiguous id range, found {local[:8]}...")
        names = lambda w: [f"{p}.experts.{e}.{w}" for e in local]  # noqa: E731
        efmt = weight_format(t[f"{names('w1')[0]}.weight"])
        sfmt = weight_format(t[f"{p}.shared_experts.w1.weight"])
        # parallel.shared_expert=tp: this rank holds a slice of the shared expert's intermediate dim, so its
        # output is a partial sum like the routed experts' (schema.SHARED_LAYOUTS)
        shared_rows = t[f"{p}.shared_experts.w1.weight"].shape[0]
        if a.moe_inter_dim % shared_rows:
            raise ValueError(f"{p}: {shared_rows} shared-expert rows are no slice of {a.moe_inter_dim}")
        self.shared_partial = shared_rows < a.moe_inter_dim
        self.mw = MoEWeights(
            gate=gate, bias=bias, tid2eid=tid2eid,
            w1=self.take_stacked("w1", t, names("w1"), efmt),
            w2=self.take_stacked("w2", t, names("w2"), efmt),
            w3=self.take_stacked("w3", t, names("w3"), efmt),
            shared_w1=self.take_linear("shared_w1", t, f"{p}.shared_experts.w1", sfmt),
            shared_w2=self.take_linear("shared_w2", t, f"{p}.shared_experts.w2", sfmt),
            shared_w3=self.take_linear("shared_w3", t, f"{p}.shared_experts.w3", sfmt),
            n_experts=a.n_routed_experts, expert_offset=local[0], topk=a.n_activated_experts,
            route_scale=a.route_scale, swiglu_limit=a.swiglu_limit)
        self.prepare_weights()

    def prepare_weights(self) -> None:
        """Let the MoE implementation lay out the experts its own way (moe=fp4_topk: the routed experts as fp4t in
        place, the shared expert as fp8t in new tensors, which replace the buffers); every other reader
        dequantises through QWeight, which knows the layout."""
        prepare = getattr(self.ops.moe, "prepare", None)
        if prepare is not None and hasattr(self, "mw"):  # (configure() may run before load)
            self.mw = prepare(self.mw)
            for name in ("w1", "w2", "w3", "shared_w1", "shared_w2", "shared_w3"):
                self.refile_linear(name, getattr(self.mw, name))  # the attributes describe the laid-out bytes

    @property
    def gate(self) -> Tensor:
        """The router's gate [E, dim] (bf16), for an hc implementation that forms the logits itself."""
        return self.mw.gate

    @property
    def rides_sinkhorn(self) -> bool:
        """Whether forward takes a SinkhornRide along (the MoE implementation's router launch runs it)."""
        return getattr(self.ops.moe, "rides_sinkhorn", False)

    def forward(self, x: Tensor, token_ids: Tensor, logits: Tensor | None = None, fold=None, ride=None) -> Tensor:
        """x [N, dim], token_ids [N] -> [N, dim]: routed sum (fp32, reduced over ranks) + shared expert.
        logits: the router's x . gate^T when the caller formed them (hc's router fold), else None.
        fold: the block's pending mHC step (ds4.ops.base.HcFold), which the kernel forming the output may do
        where nothing is reduced over ranks after it, else the all-reduce (comm=ll).
        ride: the site's deferred mHC Sinkhorn (ds4.ops.base.SinkhornRide; only where rides_sinkhorn), which the
        router's launch finishes."""
        moe = self.ops.moe
        rk = {} if ride is None else {"ride": ride}
        # qat's FP8 activation simulation before the routed GEMMs: FP8 / FP4 experts only (spec §2: a BF16 weight, a
        # dense checkpoint's, takes the plain product; the shared expert's implementations check their own format)
        aq = self.qat and self.mw.w1.fmt != "bf16"
        ffn_ok = getattr(moe, "ffn_ok", None)
        if self.comm.world == 1 and ffn_ok is not None and ffn_ok(x, self.mw, self.qat):
            # routed and shared experts in one launch (nothing is reduced over ranks after it, so it may fold); with
            # DS4_MOE_FFN=2 the shared expert's gate+up runs beside the router first
            with self.prof("moe.shared_up"):
                up = moe.ffn_shared_up(x, self.mw)
            with self.prof("moe.gate"):
                w, ids = moe.route(x, token_ids, self.mw, logits, **rk)
            with self.prof("moe.ffn"):
                return moe.ffn(x, w, ids, self.mw, fold=fold, shared=up)

        def start_shared():  # may start on a side stream, overlapping routing (unless late) and routed experts
            with self.prof("moe.shared_up"):
                return moe.shared_up(x, self.mw, act_quant=self.qat)

        late = getattr(moe, "shared_after_route", False)  # where a side-stream shared expert forks
        up = None if late else start_shared()
        with self.prof("moe.gate"):
            w, ids = moe.route(x, token_ids, self.mw, logits, **rk)
        if late:
            up = start_shared()
        if self.shared_partial:  # one all-reduce sums routed and shared partials; it writes x's dtype
            if self.comm.world == 1:
                raise RuntimeError("a sliced shared expert (parallel.shared_expert=tp) needs the tensor-parallel comm")
            with self.prof("moe.routed"):
                if up is not None:  # the shared partial (bf16) added in the down kernel's epilogue, fp32 out
                    y = moe.routed(x, w, ids, self.mw, act_quant=aq, shared=up, partial=True)
                else:
                    y = moe.routed(x, w, ids, self.mw, act_quant=aq)
                    y = y + moe.shared(x, self.mw, act_quant=self.qat).float()
            with self.prof(self.comm.stage("moe")):
                return self.comm.all_reduce(y, "moe", out_dtype=x.dtype, fold=fold)
        if up is not None and self.comm.world == 1:
            with self.prof("moe.routed"):  # nothing to reduce: returns (routed + shared.float()).to(x.dtype)
                return moe.routed(x, w, ids, self.mw, act_quant=aq, shared=up, fold=fold)
        with self.prof("moe.routed"):
            y = moe.routed(x, w, ids, self.mw, act_quant=aq)
        with self.prof(self.comm.stage("moe")):
            y = self.comm.all_reduce(y, "moe")
        with self.prof("moe.shared"):  # returns (y + shared.float()).to(x.dtype); the block output: may fold
            return moe.shared(x, self.mw, act_quant=self.qat, add=y, up=up, fold=fold)
