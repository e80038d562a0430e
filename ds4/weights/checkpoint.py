"""Read a DeepSeek-V4 checkpoint directory (HF layout) into the official naming (spec §10).

Layout: `config.json`, `model.safetensors.index.json` (weight_map) + shards, or a single
`model.safetensors`. Two namings are accepted:

* official — the release (`embed.weight`, `layers.N.attn.wq_a.weight` + `.scale`, ...), FP8/FP4
  or dense; dtypes must match `expected_tensors` (where it says BF16, F32 is taken too).
* transformers — keys under `model.` (module or `save_pretrained` spelling, see hf_naming);
  dense BF16 or F32 weights, routed experts stacked or not. Returned renamed to the official
  naming with `dense_args(args)` (no `.scale` tensors).

Everything is validated from the safetensors headers (names, dtypes, shapes, offsets, index
consistency) before any tensor data is read; all problems are reported together in one
`CheckpointError`. Then only this rank's slice of each tensor is read (routed experts: only
the owned ones). safetensors only: no pickle, no network, no remote code.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ds4.model.args import ModelArgs
from ds4.weights.hf_naming import dense_args, hf_key_to_official, is_hf_name
from ds4.weights.schema import TensorSpec, expected_tensors, expert_owner, local_tensors

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_REPORTED = 20

ST_DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool,
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
DTYPE_POLICIES = ("keep", "schema")


class CheckpointError(ValueError):
    """An invalid checkpoint; `problems` lists every problem found (file, tensor, expected/found)."""

    def __init__(self, msg: str, problems: list[str] | None = None):
        super().__init__(msg)
        self.problems = problems or [msg]


@dataclass(frozen=True)
class StEntry:
    """One tensor of a safetensors header."""
    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _st(dtype: torch.dtype) -> str:
    return ST_NAMES.get(dtype, str(dtype))


def read_safetensors_header(path: str | os.PathLike) -> dict[str, StEntry]:
    """Parse and check a safetensors header without reading tensor data (raises CheckpointError)."""
    path = Path(path)
    fname = path.name
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(f"{fname}: truncated file ({size} bytes, no header length)")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > size - 8:
            raise CheckpointError(f"{fname}: corrupt or truncated: header length {n} beyond file size {size}")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{fname}: corrupt header ({e})") from None
    data_size = size - 8 - n
    out: dict[str, StEntry] = {}
    bad = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            bad.append(f"{fname}: tensor {key}: corrupt header entry {info!r}")
            continue
        if dtype not in ST_DTYPES:
            bad.append(f"{fname}: tensor {key}: unknown dtype {dtype}")
            continue
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=ST_DTYPES[dtype]).element_size()
        if not 0 <= b <= e or e - b != nbytes:
            bad.append(f"{fname}: tensor {key}: corrupt data offsets [{b}, {e}) for {dtype} {list(shape)} ({nbytes} bytes)")
        elif e > data_size:
            bad.append(f"{fname}: tensor {key}: data offsets [{b}, {e}) beyond file end "
                       f"({data_size} data bytes; truncated file?)")
        else:
            out[key] = StEntry(fname, dtype, shape, b, e)
    if bad:
        raise CheckpointError(bad[0], bad)
    return out


def _read_json(path: Path, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path.name}: cannot read {what}: {e}") from None


def _raise(root: Path, problems: list[str]) -> None:
    head = problems[:MAX_REPORTED]
    more = f"\n  ... and {len(problems) - MAX_REPORTED} more" if len(problems) > MAX_REPORTED else ""
    raise CheckpointError(f"invalid checkpoint {root} ({len(problems)} problem(s)):\n  " + "\n  ".join(head) + more,
                          problems)


@dataclass
class _Source:
    """Where an official tensor comes from: file key, and for stacked experts (expert, part)."""
    key: str
    expert: int | None = None
    part: str | None = None  # "w1" | "w3" | "w2" inside a stacked tensor


def scan_checkpoint(path: str | os.PathLike) -> tuple[dict, dict[str, StEntry], list[str]]:
    """(config.json dict or {}, key -> header entry, problems) for a checkpoint directory."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint directory not found")
    problems: list[str] = []
    cfg = _read_json(root / "config.json", "config") if (root / "config.json").exists() else {}
    weight_map: dict[str, str] | None = None
    if (root / INDEX_FILE).exists():
        weight_map = _read_json(root / INDEX_FILE, "index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{INDEX_FILE}: no weight_map")
        files = sorted(set(weight_map.values()))
    elif (root / SINGLE_FILE).exists():
        files = [SINGLE_FILE]
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{root}: no {INDEX_FILE}, {SINGLE_FILE} or *.safetensors files")
    entries: dict[str, StEntry] = {}
    unreadable: set[str] = set()
    for fname in files:
        fp = root / fname
        if not fp.is_file():
            keys = [k for k, v in (weight_map or {}).items() if v == fname]
            problems.append(f"{INDEX_FILE}: points to missing shard {fname} ({len(keys)} tensors, e.g. {keys[0] if keys else '-'})")
            unreadable.add(fname)
            continue
        try:
            header = read_safetensors_header(fp)
        except CheckpointError as e:
            problems.extend(e.problems)
            unreadable.add(fname)
            continue
        for key, ent in header.items():
            if key in entries:
                problems.append(f"{fname}: tensor {key}: also in {entries[key].file}")
            entries[key] = ent
    if unreadable and weight_map is None:  # nothing tells which tensors the broken file held
        _raise(root, problems)
    if weight_map is not None:
        for key, fname in weight_map.items():
            if fname in unreadable:
                continue
            if key not in entries:
                problems.append(f"{INDEX_FILE}: maps {key} to {fname}, which does not contain it")
            elif entries[key].file != fname:
                problems.append(f"{INDEX_FILE}: maps {key} to {fname}, but it is in {entries[key].file}")
        for key, ent in entries.items():
            if key not in weight_map:
                problems.append(f"{ent.file}: tensor {key}: not listed in {INDEX_FILE}")
    # Tensors of unreadable shards must not also be reported as missing.
    for key, fname in (weight_map or {}).items():
        if fname in unreadable:
            entries.setdefault(key, StEntry(fname, "?", (), 0, 0))
    return cfg, entries, problems


def detect_naming(keys) -> str:
    """'transformers' when keys live under `model.` (or `lm_head.weight`), else 'official'."""
    return "transformers" if any(is_hf_name(k) for k in keys) else "official"


def _check(problems: list[str], ent: StEntry, name: str, allowed: tuple[torch.dtype, ...], shape: tuple[int, ...]):
    if ent.dtype == "?":  # its shard is already reported as unreadable
        return
    if ST_DTYPES[ent.dtype] not in allowed:
        problems.append(f"{ent.file}: tensor {name}: expected dtype {'|'.join(_st(d) for d in allowed)}, found {ent.dtype}")
    if ent.shape != tuple(shape):
        problems.append(f"{ent.file}: tensor {name}: expected shape {list(shape)}, found {list(ent.shape)}")


def _plan_official(args, entries, include_mtp, problems, trimmed: range) -> dict[str, _Source]:
    full = expected_tensors(args, include_mtp=True)
    for key, ent in entries.items():
        if _layer_of(key) in trimmed or (not include_mtp and key.startswith("mtp.")):
            continue  # not read: a layer model.n_layers trimmed away, or the MTP head (of any variant) unused
        if key not in full:
            problems.append(f"{ent.file}: unexpected tensor {key}")
    plan = {}
    for name, spec in expected_tensors(args, include_mtp).items():
        if name not in entries:
            problems.append(f"missing tensor {name} (expected {_st(spec.dtype)} {list(spec.shape)})")
            continue
        # BF16 tensors may be stored as F32 (a dequantised FP32 checkpoint), as the transformers naming allows
        allowed = (spec.dtype, torch.float32) if spec.dtype == torch.bfloat16 else (spec.dtype,)
        _check(problems, entries[name], name, allowed, spec.shape)
        plan[name] = _Source(name)
    return plan


def _plan_transformers(args, entries, problems, trimmed: range) -> dict[str, _Source]:
    full = expected_tensors(args, include_mtp=False)
    E, inter, d = args.n_routed_experts, args.moe_inter_dim, args.dim
    plan: dict[str, _Source] = {}

    def provide(name: str, src: _Source, ent: StEntry):
        if name in plan:
            problems.append(f"{ent.file}: tensor {src.key}: {name} is also provided by {plan[name].key}")
        plan[name] = src

    for key, ent in entries.items():
        name, stacked = hf_key_to_official(key)
        if name.startswith("mtp.") or _layer_of(name) in trimmed:
            continue  # transformers ignores MTP weights; a layer model.n_layers trimmed away is not read
        if stacked:
            layer = int(name.split(".")[1])
            if layer >= args.n_layers:
                problems.append(f"{ent.file}: unexpected tensor {key}")
                continue
            shape = (E, 2 * inter, d) if stacked == "gate_up" else (E, d, inter)
            _check(problems, ent, key, (torch.bfloat16, torch.float32), shape)
            for e in range(E):
                for part in (("w1", "w3") if stacked == "gate_up" else ("w2",)):
                    provide(f"{name}.ffn.experts.{e}.{part}.weight", _Source(key, e, part), ent)
            continue
        if not name or name not in full:
            problems.append(f"{ent.file}: unexpected tensor {key}")
            continue
        spec = full[name]
        allowed = (torch.int64,) if spec.dtype == torch.int64 else (torch.bfloat16, torch.float32)
        _check(problems, ent, key, allowed, spec.shape)
        provide(name, _Source(key), ent)
    for name, spec in full.items():
        if name not in plan:
            problems.append(f"missing tensor {name} (transformers naming; expected {list(spec.shape)})")
    return plan


_LAYER_NAME = re.compile(r"layers\.(\d+)(?:\.|$)")


def _layer_of(name: str) -> int:
    """N for an official name `layers.N...`, else -1."""
    m = _LAYER_NAME.match(name)
    return int(m.group(1)) if m else -1


# The routed experts' format by the stored dtype of an official-naming expert weight.
_EXPERT_FORMATS = {"I8": "fp4", "F8_E4M3": "fp8", "BF16": "bf16"}


def checkpoint_args(path: str | os.PathLike, scan=None) -> ModelArgs:
    """The ModelArgs of the checkpoint at `path`, from its config.json and, where the config is silent, its
    safetensors headers; transformers naming gives `dense_args` (what `load_checkpoint` returns).

    A config without `expert_dtype` has the experts' format from the stored dtype: the first HF revision's
    config has none though its experts are FP4 (spec §14.1), and the official convert's FP8 experts drop it
    (spec §10.4). A config that names a format keeps it; a shard that disagrees is then a problem the loader
    reports. `scan`: `scan_checkpoint(path)`'s result, if the caller has it."""
    root = Path(path)
    cfg, entries, _ = scan if scan is not None else scan_checkpoint(root)
    if not cfg:
        raise CheckpointError(f"{root}: no config.json (pass args explicitly)")
    try:
        args = ModelArgs.from_hf_config(cfg)
    except KeyError as e:
        raise CheckpointError(f"{root / 'config.json'}: missing field {e.args[0]!r} "
                              "(a HF DeepSeek-V4 config.json is expected)") from None
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{root / 'config.json'}: {e}") from None
    if detect_naming(entries) == "transformers":
        return dense_args(args)
    if cfg.get("expert_dtype") is None and (cfg.get("quantization_config") or {}).get("expert_dtype") is None:
        ent = entries.get("layers.0.ffn.experts.0.w1.weight")
        fmt = _EXPERT_FORMATS.get(ent.dtype) if ent is not None else None
        if fmt is not None:
            args = args.replace(expert_dtype=fmt)
    return args


def load_checkpoint(path: str | os.PathLike, args: ModelArgs | None = None, rank: int = 0, world: int = 1,
                    device="cpu", include_mtp: bool = True, progress: bool = True,
                    dtype_policy: str = "keep", experts: str = "ep",
                    shared: str = "replicate") -> tuple[ModelArgs, dict[str, Tensor]]:
    """Validate then read rank `rank`'s tensors of the checkpoint at `path` (official naming out); routed
    experts in the layout `experts` (schema.EXPERT_LAYOUTS), the shared expert in `shared` (SHARED_LAYOUTS).

    args: `checkpoint_args(path)` unless given (transformers naming: always `dense_args`); args with fewer layers
    than the checkpoint (`ModelArgs.with_layers`) read and check only those layers.
    dtype_policy: "keep" = stored dtypes (a transformers F32 checkpoint stays F32);
    "schema" = cast floating tensors to the dtype `expected_tensors` names.
    Returns (args, name -> tensor on `device`) in `local_tensors` order."""
    if dtype_policy not in DTYPE_POLICIES:
        raise ValueError(f"dtype_policy must be one of {DTYPE_POLICIES}, got {dtype_policy!r}")
    root = Path(path)
    scan = scan_checkpoint(root)
    cfg, entries, problems = scan
    if args is None:
        args = checkpoint_args(root, scan)
    # Layers the args leave out (model.n_layers=N below the checkpoint's count) are neither read nor checked.
    stored = cfg.get("num_hidden_layers", args.n_layers) if cfg else args.n_layers
    trimmed = range(args.n_layers, stored if isinstance(stored, int) else args.n_layers)
    naming = detect_naming(entries)
    if naming == "transformers":
        args = dense_args(args)
        include_mtp = False
        plan = _plan_transformers(args, entries, problems, trimmed)
    else:
        plan = _plan_official(args, entries, include_mtp, problems, trimmed)
    if problems:
        _raise(root, problems)

    local = local_tensors(args, rank, world, include_mtp, experts, shared)
    full = expected_tensors(args, include_mtp)
    by_file: dict[str, list[str]] = {}
    for name in local:
        by_file.setdefault(entries[plan[name].key].file, []).append(name)
    total = sum(spec.nbytes for spec, _ in local.values())
    out: dict[str, Tensor] = {}
    from tqdm.auto import tqdm
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading checkpoint",
               disable=not progress or rank != 0)
    from safetensors import safe_open
    try:
        for fname in sorted(by_file):
            bar.set_postfix_str(fname)
            with safe_open(str(root / fname), framework="pt", device="cpu") as f:
                stacked_cache: dict[tuple[str, str], tuple[int, Tensor]] = {}
                for name in by_file[fname]:
                    src, (lspec, idx) = plan[name], local[name]
                    if src.expert is None:
                        t = f.get_slice(src.key)[idx]
                    else:
                        t = _read_expert(f, src, args, world if experts == "ep" else 1, stacked_cache, idx)
                    t = _apply_policy(t, full[name], dtype_policy)
                    if tuple(t.shape) != lspec.shape:
                        raise CheckpointError(f"{fname}: tensor {src.key}: read shape {list(t.shape)}, "
                                              f"expected {list(lspec.shape)}")
                    out[name] = t.to(device)
                    bar.update(lspec.nbytes)
    except CheckpointError:
        raise
    except Exception as e:  # a shard changed or is damaged in a way the header did not show
        raise CheckpointError(f"{root}: reading tensor data failed: {e!r}") from e
    finally:
        bar.close()
    return args, {name: out[name] for name in local}


def _read_expert(f, src: _Source, args: ModelArgs, world: int, cache: dict, idx: tuple[slice, ...]) -> Tensor:
    """One routed expert out of a stacked [E, ...] tensor, cut by idx (this rank's slice of the expert under
    experts=tp, whole slices otherwise). A part's block (w1's or w3's rows of gate_up, or down) is read once per
    layer for the owned experts (world: the ranks the experts are distributed over, 1 when every rank holds a slice
    of each) and already cut, so a rank reads only its share of the stacked tensor."""
    if (src.key, src.part) not in cache:
        layer = src.key.rsplit(".experts", 1)[0]
        for k in [k for k in cache if not k[0].startswith(layer + ".")]:
            del cache[k]  # keep only the current layer's blocks
        per = args.n_routed_experts // world
        lo = expert_owner(src.expert, args.n_routed_experts, world) * per
        rows, cols = idx
        if src.part in ("w1", "w3"):  # gate_up stacks w1's rows, then w3's
            inter = args.moe_inter_dim
            r0, r1, step = rows.indices(inter)
            off = 0 if src.part == "w1" else inter
            rows = slice(off + r0, off + r1, step)
        cache[(src.key, src.part)] = (lo, f.get_slice(src.key)[lo:lo + per, rows, cols])
    lo, block = cache[(src.key, src.part)]
    return block[src.expert - lo].clone()  # storage of its own (not a view of the layer's block)


def _apply_policy(t: Tensor, spec: TensorSpec, policy: str) -> Tensor:
    if policy == "schema" and t.dtype != spec.dtype and t.is_floating_point() and spec.dtype.is_floating_point:
        return t.to(spec.dtype)
    return t


__all__ = ["CheckpointError", "checkpoint_args", "load_checkpoint", "scan_checkpoint", "read_safetensors_header", "detect_naming",
           "ST_DTYPES", "ST_NAMES"]
