"""Registry entries of the CUDA implementations (imported by ds4.registry when present).

The notes' limits are read from the implementations' modules when an entry is resolved (its factory imports the
same module right after)."""
from __future__ import annotations

import torch

from ds4.registry import Entry, Setup


def _gemv_caveats(s: Setup) -> list[str]:
    from ds4.ops.linear_cuda import PREFILL_TOKENS
    out = []
    if s.weight_dtype == "bf16" and s.dtype not in (None, torch.bfloat16):
        out.append(f"BF16 dense weights with {str(s.dtype).removeprefix('torch.')} activations: torch matmuls, "
                   "as linear=dequant")
    if s.max_batch > PREFILL_TOKENS:
        out.append(f"decode batch {s.max_batch} > {PREFILL_TOKENS}: dequantise + torch matmul per step")
    return out


def _fp4_topk_sync(s: Setup) -> str | None:
    from ds4.ops.moe_cuda import PREFILL_TOKENS, chunked_tokens
    rows = max(PREFILL_TOKENS, chunked_tokens())
    if s.max_batch > rows:
        return f"batch {s.max_batch} > {rows}: the experts grouped by their counts, read on the host, per layer"
    return None


def _fp4_topk_caveats(s: Setup) -> list[str]:
    from ds4.ops.moe_cuda import PREFILL_TOKENS, chunked_tokens
    if s.max_batch > max(PREFILL_TOKENS, chunked_tokens()):
        return [f"decode batch {s.max_batch} > {max(PREFILL_TOKENS, chunked_tokens())}: the router's logits by a torch "
                "fp32 GEMM, the experts by torch grouped GEMMs on dequantised weights"]
    if s.max_batch > PREFILL_TOKENS:
        return [f"decode batch {s.max_batch} > {PREFILL_TOKENS}: the router's logits by a torch fp32 GEMM, the experts "
                f"in launches of {PREFILL_TOKENS} rows (each reading its experts again), the shared expert in line"]
    return []


def _router_fits(s: Setup) -> str | None:
    """Both MoE options route every token with the router's kernels, which have no torch fallback: a top-k of at most
    ROUTER_MAX_K experts out of at most ROUTER_MAX_EXPERTS (checked here, before the weights load)."""
    from ds4.kernels import ROUTER_MAX_EXPERTS, ROUTER_MAX_K
    if s.topk > ROUTER_MAX_K:
        return f"its router kernels select at most {ROUTER_MAX_K} experts a token (n_activated_experts={s.topk})"
    if s.n_experts > ROUTER_MAX_EXPERTS:
        return f"its router kernels score at most {ROUTER_MAX_EXPERTS} experts (n_routed_experts={s.n_experts})"
    return None


def _fp4_dp4a_fits(s: Setup) -> str | None:
    """The router's limits, and the integer-pipe gate+up's rows: FP4 experts (it reads E2M1 bytes), dim a multiple of 32
    up to DP4A_MAX_DIM (an explicit moe=fp4_dp4a whose kernel could not run would otherwise decode on fp4_topk's
    kernels under its name)."""
    from ds4.kernels import DP4A_MAX_DIM, dp4a_ok
    if s.expert_dtype != "fp4":
        return f"its gate+up kernel reads FP4 experts (expert_dtype={s.expert_dtype})"
    if s.dim and not dp4a_ok("fp4", 1, s.dim):
        return f"its gate+up kernel takes dim a multiple of 32 up to {DP4A_MAX_DIM} (dim={s.dim})"
    return _router_fits(s)


def _bf16_cache_caveats(s: Setup) -> list[str]:
    from ds4.ops.moe_cuda import PREFILL_TOKENS
    when = f"prompts and decode batch {s.max_batch}" if s.max_batch > PREFILL_TOKENS else "prompts"
    return [f"calls over {PREFILL_TOKENS} tokens ({when}): the torch reference's experts (moe=dequant) and router "
            "logits (a torch fp32 GEMM)"]


def _bf16_cache_sync(_s: Setup) -> str:
    return "its cache bookkeeping reads the expert ids every layer"


def entries(check):
    """check(device) -> None or the reason the compiled extension cannot run there."""
    return [
        (Entry("linear", "gemv_cuda", "ds4.ops.linear_cuda:GemvCudaLinear", check, 10,
               "CUDA FP8/MXFP4/BF16 GEMV on stored bytes + E8M0 scales, 1-16 tokens (prefill: dequant + matmul)",
               caveats=_gemv_caveats, ds4_ext=True), ()),
        (Entry("moe", "fp4_topk", "ds4.ops.moe_cuda:Fp4TopkMoE", check, 10,
               "CUDA router + all top-k MXFP4 experts in two launches (ids on the device) + fused FP8 shared expert",
               caveats=_fp4_topk_caveats, decode_sync=_fp4_topk_sync, ds4_ext=True, fits=_router_fits), ()),
        # below fp4_topk for auto: its gate+up is faster alone on an H100, but the decode step is slower (H100: 123.3 /
        # 123.4 against 121.7 / 121.6 us per layer, experiments/session64.md; H200: 106.5 / 106.2 against 104.8 / 104.4,
        # experiments/session65.md)
        (Entry("moe", "fp4_dp4a", "ds4.ops.moe_cuda:Fp4Dp4aMoE", check, 8,
               "fp4_topk with the one-token routed gate+up on the integer pipe (PRMT lookup of the E2M1 bytes, DP4A "
               "against x in 16 bits per 32 values)",
               caveats=_fp4_topk_caveats, decode_sync=_fp4_topk_sync, ds4_ext=True, fits=_fp4_dp4a_fits), ()),
        (Entry("moe", "bf16_cache", "ds4.ops.moe_cuda:Bf16CacheMoE", check, 5,
               "seed phase 5: LRU cache of dequantised BF16 hot experts (host sync per layer) + BF16/FP4 kernels",
               caveats=_bf16_cache_caveats,
               decode_sync=_bf16_cache_sync, ds4_ext=True, fits=_router_fits), ()),
    ]
