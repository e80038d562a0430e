"""Synthetic weights in checkpoint-native formats (spec §10.2/§10.3), for tests and benchmarks.

Every tensor is drawn from its own generator, seeded from (seed, tensor name), as a FULL tensor
on the target device and then sliced for this rank. So a rank's slice is bit-identical to the
same slice of the world=1 weights, and routed experts cost only the experts a rank owns (the "ep"
layout; under "tp" every rank draws every expert and keeps its slice of each).

Magnitudes are chosen so activations stay O(1) through many layers and the model is confident
(a reference argmax with margins, spec BENCHMARKING): linear weights ~ N(0, 1/in) so outputs are
O(1), norm weights ~1, small mHC projections with non-trivial base/scale, and an LM head whose
logits have a standard deviation of a few units.
"""
from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from ds4.model.args import ModelArgs
from ds4.quant.formats import quant_fp4, quant_fp8
from ds4.weights.heap import trim_heap
from ds4.weights.schema import BF16, E8M0, F32, FP4_PACKED, FP8, I64, TensorSpec, expected_tensors, local_tensors

HEAD_LOGIT_STD = 4.0  # std of the logits for a unit-RMS final hidden state


def tensor_seed(seed: int, name: str) -> int:
    """A stable (process-independent) 63-bit seed for tensor `name`."""
    h = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def _gen(seed: int, name: str, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(tensor_seed(seed, name))
    return g


def _randn(shape, g: torch.Generator, device) -> Tensor:
    return torch.randn(tuple(shape), generator=g, device=device, dtype=torch.float32)


def _float_tensor(name: str, spec: TensorSpec, a: ModelArgs, g: torch.Generator, device) -> Tensor:
    """A full float tensor (fp32) with a magnitude that suits its role."""
    shape = spec.shape
    leaf = name.rsplit(".", 1)[-1]
    if name == "embed.weight":
        return _randn(shape, g, device)
    if name == "head.weight":
        return _randn(shape, g, device) * (HEAD_LOGIT_STD / a.dim ** 0.5)
    if "hc_" in name and name.endswith("_fn"):  # mHC projections: mix logits ~0.5
        return _randn(shape, g, device) * (0.5 / shape[-1] ** 0.5)
    if "hc_" in name and name.endswith("_base"):
        return _randn(shape, g, device) * 0.5
    if "hc_" in name and name.endswith("_scale"):
        return 1.0 + 0.1 * _randn(shape, g, device)
    if leaf == "attn_sink":
        return _randn(shape, g, device)
    if leaf == "ape":
        return _randn(shape, g, device) * 0.5
    if name.endswith("gate.bias"):
        return _randn(shape, g, device) * 0.1
    if len(shape) == 1:  # RMSNorm weights
        return 1.0 + 0.05 * _randn(shape, g, device)
    if len(shape) == 2:  # linear [out, in]
        return _randn(shape, g, device) * (1.0 / shape[1] ** 0.5)
    raise ValueError(f"no synthetic rule for {name} {spec}")


_TRIM_EVERY = 16  # tensors made between two heap trims (CPU)


def _tid2eid(spec: TensorSpec, a: ModelArgs, g: torch.Generator, device) -> Tensor:
    """[vocab, k] int64 with k DISTINCT expert ids per row (prefix of a random permutation)."""
    v, k = spec.shape
    keys = torch.rand((v, a.n_routed_experts), generator=g, device=device)
    return keys.argsort(dim=1, stable=True)[:, :k].contiguous().to(I64)


def _full_tensors(name: str, spec: TensorSpec, specs: dict[str, TensorSpec], a: ModelArgs,
                  seed: int, device) -> dict[str, Tensor]:
    """The full tensor `name`, plus its `.scale` partner for quantised linears."""
    g = _gen(seed, name, device)
    if spec.dtype == I64:
        return {name: _tid2eid(spec, a, g, device)}
    if spec.dtype in (FP8, FP4_PACKED):
        base = name[: -len(".weight")]
        out, packed_in = spec.shape
        inp = packed_in * 2 if spec.dtype == FP4_PACKED else packed_in
        w = _randn((out, inp), g, device) * (1.0 / inp ** 0.5)
        q, s = quant_fp8(w) if spec.dtype == FP8 else quant_fp4(w)
        sspec = specs[f"{base}.scale"]
        assert q.dtype == spec.dtype and tuple(q.shape) == spec.shape, (name, q.dtype, q.shape)
        assert s.dtype == E8M0 and tuple(s.shape) == sspec.shape, (name, s.dtype, s.shape)
        return {name: q, f"{base}.scale": s}
    if spec.dtype in (BF16, F32):
        return {name: _float_tensor(name, spec, a, g, device).to(spec.dtype)}
    raise ValueError(f"no synthetic rule for dtype {spec.dtype} of {name}")


def random_weights(args: ModelArgs, seed: int = 0, device="cpu", rank: int = 0, world: int = 1,
                   include_mtp: bool = True, experts: str = "ep", shared: str = "replicate",
                   progress: bool = False) -> dict[str, Tensor]:
    """Every tensor rank `rank` of `world` holds (schema.local_tensors, routed experts laid out as `experts`
    says, the shared expert as `shared`), native formats, on `device`.

    Deterministic: the same (args, seed, device type) gives bit-identical tensors, and rank r's
    tensors equal the same slices of the world=1 tensors. progress: a bar of the bytes made (as the checkpoint
    loader's): on a CPU, V4-Flash's weights take minutes per layer to draw and quantise.
    """
    from tqdm.auto import tqdm
    device = torch.device(device)
    specs = expected_tensors(args, include_mtp)
    local = local_tensors(args, rank, world, include_mtp, experts, shared)
    out: dict[str, Tensor] = {}
    pending: dict[str, Tensor] = {}
    bar = tqdm(total=sum(ls.nbytes for ls, _ in local.values()), unit="B", unit_scale=True,
               desc="creating synthetic weights", disable=not progress)
    for i, (name, (lspec, idx)) in enumerate(local.items()):
        if device.type == "cpu" and i % _TRIM_EVERY == _TRIM_EVERY - 1:
            trim_heap()
        if name in pending:
            full = {name: pending.pop(name)}
        else:
            if name.endswith(".scale"):
                raise AssertionError(f"{name} appears before its weight")
            full = _full_tensors(name, specs[name], specs, args, seed, device)
        for n, t in full.items():
            if n != name:
                pending[n] = t
                continue
            part = t[idx]
            if tuple(part.shape) != lspec.shape:
                raise AssertionError(f"{name}: slice {tuple(part.shape)} != {lspec.shape}")
            # A slice of a bigger tensor gets its own storage so the full tensor is freed.
            out[name] = part.clone() if part.data_ptr() != t.data_ptr() or part.numel() != t.numel() \
                else part.contiguous()
        bar.update(lspec.nbytes)
    bar.close()
    assert not pending, f"scales without weights: {sorted(pending)}"
    return out
