"""Reference MoE (spec §6): router on the device, selected experts dequantised, torch matmuls.

Decode (few tokens) gathers the selected experts' stored bytes by the device id tensor and
dequantises only those: no host sync. Many tokens (prefill) sort the (token, slot) pairs by
expert (one host sync for the counts) and run each expert that has tokens once; the choice
depends on the shape only, never on tensor values."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ds4.ops.base import MoEWeights, QWeight
from ds4.quant import act_quant_sim

GATHER_MAX_ROWS = 64  # N*k up to this: gather experts; above: loop over local experts


def route(x: Tensor, token_ids: Tensor, mw: MoEWeights, logits: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(weights [N, k] f32, ids [N, k]); logits: x . gate^T (fp32 [N, E]) when the caller has them already."""
    if logits is None:
        logits = x.float() @ mw.gate.float().t()                   # [N, E]
    scores = F.softplus(logits).sqrt()
    if mw.tid2eid is not None:
        ids = mw.tid2eid[token_ids].long()                         # hash layers: no bias
    else:
        ids = (scores + mw.bias.float()).topk(mw.topk, dim=-1).indices
    w = scores.gather(-1, ids)
    w = w / w.sum(-1, keepdim=True) * mw.route_scale
    return w, ids


def swiglu(g: Tensor, u: Tensor, limit: float) -> Tensor:
    """fp32 SiLU(min(g, limit)) * clamp(u, +-limit) (spec §6.2)."""
    return F.silu(g.float().clamp(max=limit)) * u.float().clamp(-limit, limit)


def _mm(x: Tensor, w: Tensor) -> Tensor:
    """x [M, I] @ w[M, O, I]^T per row -> [M, O]."""
    return torch.bmm(w, x.unsqueeze(-1)).squeeze(-1)


class DequantMoE:
    name = "dequant"

    def route(self, x: Tensor, token_ids: Tensor, mw: MoEWeights,
              logits: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return route(x, token_ids, mw, logits)

    def routed(self, x: Tensor, weights: Tensor, ids: Tensor, mw: MoEWeights, act_quant: bool = False,
               shared: None = None, fold=None, partial: bool = False) -> Tensor:  # never folds
        if shared is not None:
            raise ValueError(f"moe={self.name}: routed() takes no shared-expert result (its shared_up starts nothing)")
        n, k = ids.shape
        e_local = mw.w1.weight.shape[0]
        local = ids - mw.expert_offset
        owned = (local >= 0) & (local < e_local)
        weights = weights.float() * owned
        local = local.clamp(0, e_local - 1)
        xq = act_quant_sim(x, 128) if act_quant else x
        if n * k <= GATHER_MAX_ROWS:
            flat = local.reshape(-1)
            xs = xq.repeat_interleave(k, dim=0)                              # [N*k, D]
            a = swiglu(_mm(xs, mw.w1[flat].dequant(x.dtype)), _mm(xs, mw.w3[flat].dequant(x.dtype)), mw.swiglu_limit)
            a = (a * weights.reshape(-1, 1)).to(x.dtype)                     # route weight before w2
            if act_quant:
                a = act_quant_sim(a, 128)
            y = _mm(a, mw.w2[flat].dequant(x.dtype)).float()                 # [N*k, D]
            return y.view(n, k, -1).sum(1)
        # Prefill: group the (token, slot) pairs by expert with one sort and one host sync for the
        # counts, then one dequantise + matmul per expert that has tokens.
        y = torch.zeros(n, x.shape[-1], dtype=torch.float32, device=x.device)
        perm, counts_dev = pairs_by_expert(ids, mw.expert_offset, e_local)
        counts = counts_dev.tolist()
        start = 0
        for e, cnt in enumerate(counts):
            if cnt == 0:
                continue
            pairs = perm[start:start + cnt]
            start += cnt
            rows, slot = pairs // k, pairs % k
            xe = xq[rows]
            a = swiglu(F.linear(xe, mw.w1[e].dequant(x.dtype)), F.linear(xe, mw.w3[e].dequant(x.dtype)), mw.swiglu_limit)
            a = (a * weights[rows, slot].unsqueeze(-1)).to(x.dtype)
            if act_quant:
                a = act_quant_sim(a, 128)
            y.index_add_(0, rows, F.linear(a, mw.w2[e].dequant(x.dtype)).float())
        return y

    def shared_up(self, x: Tensor, mw: MoEWeights, act_quant: bool = False) -> None:
        return None

    def shared(self, x: Tensor, mw: MoEWeights, act_quant: bool = False, add: Tensor | None = None,
               up: None = None, fold=None) -> Tensor:  # never folds
        return shared_block(x, mw, act_quant, add)


def pairs_by_expert(ids: Tensor, expert_offset: int, e_local: int) -> tuple[Tensor, Tensor]:
    """ids [N, k] global expert ids -> (perm [N k]: the flattened (token, slot) pairs sorted by local expert, token
    order inside, those of other ranks last; counts [e_local] on the device: each local expert's pairs)."""
    local = ids.to(torch.int64) - expert_offset
    flat = torch.where((local >= 0) & (local < e_local), local, e_local).flatten()  # e_local = not on this rank
    return flat.argsort(stable=True), torch.bincount(flat, minlength=e_local + 1)[:e_local]


def shared_block(x: Tensor, mw: MoEWeights, act_quant: bool, add: Tensor | None,
                 dense: Callable[[QWeight, torch.dtype], Tensor] = QWeight.dequant) -> Tensor:
    """The shared expert's output, plus add (bf16(add + y) in fp32) when given; dense forms the weights."""
    y = shared_expert(x, mw.shared_w1, mw.shared_w2, mw.shared_w3, mw.swiglu_limit, act_quant, dense)
    return y if add is None else (add + y.float()).to(x.dtype)


def shared_expert(x: Tensor, w1: QWeight, w2: QWeight, w3: QWeight, limit: float, act_quant: bool,
                  dense: Callable[[QWeight, torch.dtype], Tensor] = QWeight.dequant) -> Tensor:
    """The shared expert on dense weights; dense(w, dtype) forms them (the reference: QWeight.dequant)."""
    xq = act_quant_sim(x, 128) if act_quant and w1.fmt != "bf16" else x
    a = swiglu(F.linear(xq, dense(w1, x.dtype)), F.linear(xq, dense(w3, x.dtype)), limit).to(x.dtype)
    if act_quant and w2.fmt != "bf16":
        a = act_quant_sim(a, 128)
    return F.linear(a, dense(w2, x.dtype))
