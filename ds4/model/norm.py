"""RMS norms as the reference computes them (spec §2)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """fp32 `x * rsqrt(mean(x^2) + eps) * weight` (weight upcast to fp32), cast back to x.dtype.
    One fused op instead of eight small ones (it matters inside a decode step)."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def unweighted_rms_norm(x: Tensor, eps: float) -> Tensor:
    """Per-head q norm after wq_b (spec §5.1 step 3): no weight; factor computed in fp32."""
    r = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)
    return x * r.to(x.dtype)
