"""A module whose weights are stored tensors in checkpoint-native formats.

Weights are registered as (non-persistent) buffers so `named_buffers()` sees every byte the
model holds (for bytes/token and parameter counts); QWeight views group a linear layer's
stored weight and scale. Nothing is copied or converted here: the loader creates tensors on
the right device in the right format, and this module only files them.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor, nn

from ds4.ops.base import QWeight
from ds4.weights.heap import trim_heap


class WeightsModule(nn.Module):
    def take(self, attr: str, tensors: Mapping[str, Tensor], name: str) -> Tensor:
        t = _get(tensors, name)
        self.register_buffer(attr, t, persistent=False)
        return t

    def take_linear(self, attr: str, tensors: Mapping[str, Tensor], name: str, fmt: str) -> QWeight:
        w = _get(tensors, f"{name}.weight")
        s = tensors.get(f"{name}.scale") if fmt != "bf16" else None
        if fmt != "bf16" and s is None:
            raise KeyError(f"missing tensor {name}.scale (format {fmt})")
        self.register_buffer(f"{attr}_weight", w, persistent=False)
        if s is not None:
            self.register_buffer(f"{attr}_scale", s, persistent=False)
        q = QWeight(fmt, w, s)
        setattr(self, attr, q)  # plain attribute (not a buffer)
        return q

    @staticmethod
    def mergeable(tensors: Mapping[str, Tensor], names: list[str], fmt: str) -> bool:
        """Whether take_merged_linear can concatenate these linear layers: all stored in `fmt`, and FP8
        ones with 128-aligned row counts (so their scale blocks concatenate too)."""
        ws = [_get(tensors, f"{n}.weight") for n in names]
        return all(weight_format(w) == fmt for w in ws) and (fmt != "fp8" or all(w.shape[0] % 128 == 0 for w in ws))

    def take_merged_linear(self, attr: str, tensors: Mapping[str, Tensor], names: list[str], fmt: str,
                           parts: list[str]) -> QWeight:
        """Row-concatenate linear layers that read the same input into one QWeight (one GEMV launch
        instead of several; same bytes). Each part stays available as a row-slice view `parts[i]`.
        The parts must be `mergeable`."""
        ws = [_get(tensors, f"{n}.weight") for n in names]
        ss = [tensors.get(f"{n}.scale") for n in names] if fmt != "bf16" else None
        w = torch.cat(ws)
        s = torch.cat(ss) if ss is not None else None
        self.register_buffer(f"{attr}_weight", w, persistent=False)
        if s is not None:
            self.register_buffer(f"{attr}_scale", s, persistent=False)
        q = QWeight(fmt, w, s)
        setattr(self, attr, q)
        self.set_row_views(q, parts, [wi.shape[0] for wi in ws])
        return q

    def refile_linear(self, attr: str, q: QWeight) -> QWeight:
        """Attribute `attr` as q, its weight buffer replaced where q holds a new tensor (an implementation's re-laid
        copy, ds4.ops.linear_cuda.lay_fp8; the old one is the caller's, or freed)."""
        if getattr(self, f"{attr}_weight") is not q.weight:
            self.register_buffer(f"{attr}_weight", q.weight, persistent=False)
        setattr(self, attr, q)
        return q

    def set_row_views(self, merged: QWeight, parts: list[str], rows: list[int]) -> None:
        """Attributes `parts` as consecutive row slices of `merged` (rows[i] rows each) in its format, with their
        scale rows (128-row blocks for fp8 / fp8t, whose parts start on block boundaries)."""
        blocked = merged.fmt in ("fp8", "fp8t")
        r0 = 0
        for part, n in zip(parts, rows):
            r1 = r0 + n
            srows = slice(r0 // 128, r1 // 128) if blocked else slice(r0, r1)
            setattr(self, part, QWeight(merged.fmt, merged.weight[r0:r1],
                                        None if merged.scale is None else merged.scale[srows]))
            r0 = r1

    def take_stacked(self, attr: str, tensors: Mapping[str, Tensor], names: list[str], fmt: str) -> QWeight:
        """Stack per-expert linear layers into one [E, ...] QWeight (one copy at load time, same bytes)."""
        w = _stack(tensors, [f"{n}.weight" for n in names])
        s = _stack(tensors, [f"{n}.scale" for n in names]) if fmt != "bf16" else None
        self.register_buffer(f"{attr}_weight", w, persistent=False)
        if s is not None:
            self.register_buffer(f"{attr}_scale", s, persistent=False)
        q = QWeight(fmt, w, s)
        setattr(self, attr, q)
        return q


def _stack(tensors: Mapping[str, Tensor], names: list[str], trim_every: int = 32) -> Tensor:
    """torch.stack of the named tensors, copied one by one into the stacked tensor. From a dict, each original is
    dropped once copied (the model no longer needs it), so the stack and the originals never coexist in full:
    stacking V4's 256 experts' w1 at once held 1.1 GiB more at a CPU run's peak (session 68). On CPU the C heap
    hands the originals' pages back every `trim_every` (ds4.weights.heap)."""
    first = _get(tensors, names[0])
    like = (first.shape, first.dtype, first.device)
    out = torch.empty((len(names), *first.shape), dtype=first.dtype, device=first.device)
    del first
    drop = isinstance(tensors, dict)
    for i, name in enumerate(names):
        t = _get(tensors, name)
        if (t.shape, t.dtype, t.device) != like:  # torch.stack's own checks (copy_ would cast or broadcast)
            raise ValueError(f"cannot stack {name} ({tuple(t.shape)}, {t.dtype}, {t.device}) with {names[0]} "
                             f"({tuple(like[0])}, {like[1]}, {like[2]})")
        out[i].copy_(t)
        if drop:
            del tensors[name], t
            if out.device.type == "cpu" and (i % trim_every == trim_every - 1 or i == len(names) - 1):
                trim_heap()
    return out


def _get(tensors: Mapping[str, Tensor], name: str) -> Tensor:
    if name not in tensors:
        raise KeyError(f"missing tensor {name}")
    return tensors[name]


def weight_format(t: Tensor) -> str:
    """The storage format of a linear weight tensor, from its dtype."""
    if t.dtype == torch.float8_e4m3fn:
        return "fp8"
    if t.dtype in (torch.int8, torch.uint8):
        return "fp4"
    return "bf16"
