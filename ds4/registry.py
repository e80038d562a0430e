"""(component, name) -> implementation. The only place where config names become code.

Each entry has a factory (builds the implementation object), a check (returns None when it can
run on a device, else the reason), the activation dtypes its kernels take, `fits` (the run's shapes its kernels
refuse where no other code takes over), and a priority used by `auto` (highest available wins). An explicit choice
that cannot run raises `ImplUnavailable` before any weights are loaded; only `auto` falls back, and it reports what
it chose and why. What an entry leaves to other code for the run's setup (`Setup`: decode rows past its kernels'
limit, BF16 dense weights) is said in its note, which the run prints.

Nothing here is mutated at run time: the table is filled once at import by `_builtin()`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field, fields
from typing import Callable

import torch

COMPONENTS = ("attn", "indexer", "hc", "moe", "linear")


class ImplUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class Setup:
    """What a run asks of its implementations, known before the weights load."""
    dtype: torch.dtype | None = None  # the activations' dtype (None: not checked)
    max_batch: int = 1                # decode rows
    weight_dtype: str = "fp8"         # the dense projections' stored format (ModelArgs.weight_dtype)
    topk: int = 6                     # routed experts per token (ModelArgs.n_activated_experts)
    index_len: int = 0                # entries of a selecting CSA layer's indexer cache per row (0: none / unknown)
    n_experts: int = 0                # routed experts (ModelArgs.n_routed_experts; 0: unknown)
    dim: int = 0                      # the model's hidden size (ModelArgs.dim; 0: unknown)
    expert_dtype: str = "fp4"         # the routed experts' stored format (ModelArgs.expert_dtype)


def _no_caveats(_setup: Setup) -> list[str]:
    return []


def _no_reason(_setup: Setup) -> str | None:
    """No decode sync, no shape refused: the default of an entry's `decode_sync` and `fits`."""
    return None


@dataclass(frozen=True)
class Entry:
    component: str
    name: str
    target: str                      # "module:attr" of a zero-argument factory
    check: Callable[[torch.device], str | None]
    priority: int = 0
    description: str = ""
    dtypes: tuple[torch.dtype, ...] = ()  # activation dtypes its kernels take (empty: any)
    caveats: Callable[[Setup], list[str]] = _no_caveats  # what other code runs for this setup, said in the note
    # why its decode step waits on the host for this setup (said in the note; runtime=cuda_graph refuses it), or None
    decode_sync: Callable[[Setup], str | None] = _no_reason
    ds4_ext: bool = False  # it runs the compiled ds4 (GEMV / MoE) extension
    # why its kernels cannot take this setup's shapes (a fixed limit no other code covers for it), or None
    fits: Callable[[Setup], str | None] = _no_reason

    def unavailable(self, device: torch.device, setup: Setup | None) -> str | None:
        """None when it can run on `device` for `setup`, else the reason."""
        why = self.check(device)
        if why is None and setup is not None and setup.dtype is not None and self.dtypes \
                and setup.dtype not in self.dtypes:
            takes = "/".join(str(d).removeprefix("torch.") for d in self.dtypes)
            why = f"its kernels take {takes} activations (dtype={str(setup.dtype).removeprefix('torch.')})"
        if why is None and setup is not None:
            why = self.fits(setup)
        return why

    def build(self):
        mod, attr = self.target.split(":")
        return getattr(importlib.import_module(mod), attr)()


def _always(_device: torch.device) -> str | None:
    return None


def _cuda_ext(_device: torch.device) -> str | None:
    """The compiled ds4 CUDA extension must be loadable and the device a CUDA GPU."""
    if _device.type != "cuda":
        return f"needs a CUDA device (device is {_device.type})"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    from ds4 import kernels
    return kernels.unavailable_reason()


# name -> Entry, per component; aliases map an alternative spelling to a canonical name.
_ENTRIES: dict[str, dict[str, Entry]] = {}
_ALIASES: dict[str, dict[str, str]] = {c: {} for c in COMPONENTS}


def _add(e: Entry, aliases: tuple[str, ...] = ()) -> None:
    _ENTRIES.setdefault(e.component, {})[e.name] = e
    for a in aliases:
        _ALIASES[e.component][a] = e.name


def _dequant_moe_sync(s: Setup) -> str | None:
    from ds4.ops.moe_torch import GATHER_MAX_ROWS
    if s.max_batch * s.topk > GATHER_MAX_ROWS:
        return (f"batch {s.max_batch} x {s.topk} experts > {GATHER_MAX_ROWS} pairs: the experts grouped by their "
                "counts, read on the host, per layer")
    return None


def _builtin() -> None:
    _add(Entry("attn", "torch", "ds4.ops.attn_torch:TorchAttention", _always, 0,
               "plain PyTorch attention (q path, window KV, compressor, sparse attention, o-proj)"))
    _add(Entry("indexer", "torch", "ds4.ops.attn_torch:TorchIndexer", _always, 0, "plain PyTorch lightning indexer"))
    _add(Entry("hc", "torch", "ds4.ops.hc_torch:TorchHC", _always, 0, "plain PyTorch mHC pre/post/head + Sinkhorn"))
    _add(Entry("moe", "dequant", "ds4.ops.moe_torch:DequantMoE", _always, 0,
               "seed phase 1: dequantise the selected experts, torch matmuls", decode_sync=_dequant_moe_sync))
    _add(Entry("linear", "dequant", "ds4.ops.linear_torch:DequantLinear", _always, 0,
               "seed phase 1: dequantise FP8 weights, torch matmul"))
    # CUDA options are listed by modules kept beside their kernels; each has entries(check).
    for mod in ("ds4.ops.cuda_registry", "ds4.ops.attn_cuda_registry"):
        try:
            listing = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
            continue
        for e, aliases in listing.entries(_cuda_ext):
            _add(e, aliases)


_builtin()


def names(component: str) -> list[str]:
    """Canonical names of a component's implementations (without 'auto' and aliases)."""
    return sorted(_ENTRIES[component])


def aliases(component: str) -> dict[str, str]:
    return dict(_ALIASES[component])


def entry(component: str, name: str) -> Entry:
    if component not in _ENTRIES:
        raise KeyError(f"unknown component {component!r}; components are {COMPONENTS}")
    name = _ALIASES[component].get(name, name)
    if name not in _ENTRIES[component]:
        valid = names(component) + sorted(_ALIASES[component]) + ["auto"]
        raise ImplUnavailable(f"{component}={name}: unknown implementation; choose one of {valid}")
    return _ENTRIES[component][name]


def resolve(component: str, name: str, device: torch.device, setup: Setup | None = None) -> tuple[Entry, str]:
    """The entry to use and a one-line note saying why (and, for `setup`, what other code it leaves some cases to).
    Raises ImplUnavailable for an explicit choice that cannot run here."""
    if name == "auto":
        tried = []
        for e in sorted(_ENTRIES[component].values(), key=lambda e: -e.priority):
            why = e.unavailable(device, setup)
            if why is None:
                skipped = "; ".join(tried)
                return e, _with_caveats(e, f"auto -> {e.name}" + (f" (skipped {skipped})" if skipped else ""), setup)
            tried.append(f"{e.name}: {why}")
        raise ImplUnavailable(f"{component}=auto: nothing can run here ({'; '.join(tried)})")
    e = entry(component, name)
    why = e.unavailable(device, setup)
    if why is not None:
        raise ImplUnavailable(f"{component}={name} cannot run here: {why}")
    return e, _with_caveats(e, name if e.name == name else f"{name} -> {e.name} (alias)", setup)


def _with_caveats(e: Entry, note: str, setup: Setup | None) -> str:
    said = [] if setup is None else e.caveats(setup)
    sync = None if setup is None else e.decode_sync(setup)
    if sync is not None:
        said.append(f"a decode step syncs with the host ({sync})")
    return note + "".join(f"; {c}" for c in said)


@dataclass(frozen=True)
class Impls:
    """One implementation choice per component (names as on the command line)."""
    attn: str = "torch"
    indexer: str = "torch"
    hc: str = "torch"
    moe: str = "dequant"
    linear: str = "dequant"


@dataclass
class Ops:
    """Resolved implementation objects, handed to the model."""
    attn: object
    indexer: object
    hc: object
    moe: object
    linear: object
    chosen: dict[str, str]   # component -> canonical name actually used
    notes: dict[str, str]    # component -> how it was resolved
    decode_syncs: dict[str, str] = field(default_factory=dict)  # component -> why its decode step syncs (the Setup's)
    # some choice runs the ds4 extension, so greedy decoding takes its argmax kernel too (ds4.runtime.sampling): the
    # run's own choices decide, not whether an earlier job of the same process (a sweep) loaded the extension
    ds4_ext: bool = False


def build_ops(impls: Impls, device: torch.device | str, setup: Setup | None = None) -> Ops:
    """The implementations for `impls` on `device`; with `setup`, also checked against the run's activation dtype,
    and their notes say what they leave to other code for it (decode rows past their kernels', BF16 weights)."""
    device = torch.device(device)
    objs, chosen, notes, syncs, ds4_ext = {}, {}, {}, {}, False
    for f in fields(Impls):
        e, note = resolve(f.name, getattr(impls, f.name), device, setup)
        objs[f.name] = e.build()
        chosen[f.name] = e.name
        notes[f.name] = note
        ds4_ext |= e.ds4_ext
        sync = None if setup is None else e.decode_sync(setup)
        if sync is not None:
            syncs[f.name] = sync
    return Ops(**objs, chosen=chosen, notes=notes, decode_syncs=syncs, ds4_ext=ds4_ext)


def torch_reference_ops() -> Ops:
    return build_ops(Impls(), "cpu")
