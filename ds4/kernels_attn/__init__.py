"""The ds4_attn CUDA extension (mHC pre/post/head, sparse MQA decode attention, indexer scores).

Kept apart from ``ds4.kernels`` (the GEMV/MoE extension) so the two build and load independently.
Sources: ``csrc/attn/*.cu`` (launchers over raw pointers, CUDA headers only) + one binding file
``csrc/attn/attn_bindings.cpp`` registering ``torch.ops.ds4_attn.*`` with TORCH_LIBRARY. Built with
ninja through ``torch.utils.cpp_extension.load`` into ``<repo>/.ext_build/attn`` (override with
``DS4_ATTN_EXT_BUILD_DIR``) for ``TORCH_CUDA_ARCH_LIST`` (default "8.0;9.0"). Nothing here is needed
or imported on a CPU machine unless a CUDA option is chosen; ``unavailable_reason()`` says why not.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
from torch import Tensor

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc" / "attn"
SOURCES = ("attn_bindings.cpp", "hc.cu", "sparse_attn.cu", "indexer.cu")
EXT_NAME = "ds4_attn_ext"


def build_dir() -> Path:
    return Path(os.environ.get("DS4_ATTN_EXT_BUILD_DIR", REPO / ".ext_build" / "attn"))


@functools.lru_cache(maxsize=None)
def load(verbose: bool = False) -> None:
    """Build (if needed) and load the extension; registers the ops and their fake implementations."""
    from ds4.kernels import build_and_load
    build_and_load(EXT_NAME, CSRC, SOURCES, build_dir(), verbose)
    from ds4.kernels_attn import _fake  # noqa: F401  fake impls once the schemas exist


def unavailable_reason() -> str | None:
    """None when the attention/indexer/mHC kernels can run here, else why not."""
    from ds4.kernels import extension_reason
    return extension_reason("ds4_attn", build_dir() / f"{EXT_NAME}.so", load)


def _ops():
    load()
    return torch.ops.ds4_attn


# ---- typed wrappers -----------------------------------------------------------------------------------
def hc_pre(h: Tensor, fn: Tensor, scale: Tensor, base: Tensor, iters: int, hc_eps: float,
           norm_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """h [N, hc, D] bf16|f32 -> (x [N, D] h.dtype, post [N, hc] f32, comb [N, hc, hc] f32). Two launches."""
    return _ops().hc_pre(h.contiguous(), fn.float().contiguous(), scale.float().contiguous(),
                         base.float().contiguous(), int(iters), float(hc_eps), float(norm_eps))


def hc_head(h: Tensor, fn: Tensor, scale: Tensor, base: Tensor, hc_eps: float, norm_eps: float) -> Tensor:
    return _ops().hc_head(h.contiguous(), fn.float().contiguous(), scale.float().contiguous(),
                          base.float().contiguous(), float(hc_eps), float(norm_eps))


def hc_post(x: Tensor, res: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    return _ops().hc_post(x.contiguous(), res.contiguous(), post.float().contiguous(), comb.float().contiguous())


def _rows_ok(t: Tensor) -> Tensor:
    ok = t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(
        t.stride(i) % 8 == 0 or t.shape[i] == 1 for i in range(t.dim() - 1))
    return t if ok else t.contiguous()


def sparse_attn(q: Tensor, kv: Tensor, valid: Tensor, sel_kv: Tensor | None, sel_valid: Tensor | None,
                sink: Tensor, scale: float) -> Tensor:
    """bf16 q [B, S, H, D], kv [B, K, D], valid bool [B, S, K], sel_kv [B, S, P, D], sel_valid [B, S, P],
    sink f32 [H] -> bf16 [B, S, H, D]. Two launches (chunks, combine)."""
    if valid.stride(-1) != 1:
        valid = valid.contiguous()
    if sel_valid is not None and sel_valid.stride(-1) != 1:
        sel_valid = sel_valid.contiguous()
    return _ops().sparse_attn(q.contiguous(), _rows_ok(kv), valid, None if sel_kv is None else _rows_ok(sel_kv),
                              sel_valid, sink.float().contiguous(), float(scale))


def indexer_scores(q: Tensor, w: Tensor, keys: Tensor, bf16: bool = False) -> Tensor:
    """bf16 q [B, S, H, d], f32 w [B, S, H], bf16 keys [B, T, d] -> [B, S, T] (f32, or bf16 when bf16)."""
    return _ops().indexer_scores(q.contiguous(), w.float().contiguous(), _rows_ok(keys), bool(bf16))


__all__ = ["load", "unavailable_reason", "build_dir", "cuda_flags", "hc_pre", "hc_head", "hc_post", "sparse_attn",
           "indexer_scores"]
