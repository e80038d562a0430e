"""Write a checkpoint directory in the official HF layout (spec §10.1).

`config.json` (args.to_hf_config(quantized=True)), shards `model-0000k-of-0000n.safetensors`
split at `max_shard_bytes`, `model.safetensors.index.json` (metadata.total_size, weight_map) and,
optionally, the byte-level tokenizer files (ds4.tokenizer.write_tokenizer_files).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from torch import Tensor

from ds4.model.args import ModelArgs
from ds4.weights.checkpoint import INDEX_FILE

DEFAULT_SHARD_BYTES = 4 << 30


def _shard_plan(tensors: dict[str, Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Greedy split in the given order; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def write_checkpoint(path: str | os.PathLike, args: ModelArgs, tensors: dict[str, Tensor],
                     max_shard_bytes: int = DEFAULT_SHARD_BYTES, tokenizer: bool = True) -> Path:
    """Write `tensors` (official naming, native dtypes, full tensors) to directory `path`."""
    from safetensors.torch import save_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "config.json", "w", encoding="utf-8") as f:
        json.dump(args.to_hf_config(quantized=True), f, indent=2)
    plan = _shard_plan(tensors, max_shard_bytes)
    n = len(plan)
    weight_map: dict[str, str] = {}
    total = 0
    for k, names in enumerate(plan, 1):
        fname = f"model-{k:05d}-of-{n:05d}.safetensors"
        # own, contiguous CPU storage per tensor (safetensors refuses shared storage)
        part = {name: tensors[name].detach().to("cpu").contiguous().clone() for name in names}
        save_file(part, str(root / fname), metadata={"format": "pt"})
        for name in names:
            weight_map[name] = fname
            total += part[name].numel() * part[name].element_size()
    with open(root / INDEX_FILE, "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    if tokenizer:
        from ds4.tokenizer import write_tokenizer_files
        write_tokenizer_files(root, model_max_length=args.max_position_embeddings)
    return root


__all__ = ["write_checkpoint", "DEFAULT_SHARD_BYTES"]
