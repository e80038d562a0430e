"""Reference dense projection: dequantise the stored weight, then a torch matmul (seed phase 1)."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ds4.ops.base import QWeight
from ds4.quant import act_quant_sim


class DequantLinear:
    name = "dequant"

    def __call__(self, x: Tensor, w: QWeight, act_quant: bool = False, fold=None) -> Tensor:  # never folds
        if act_quant and w.fmt != "bf16":  # every FP8 / FP4 layout (spec §2), as the experts' rule
            x = act_quant_sim(x, 128)
        return F.linear(x, w.dequant(x.dtype))

    def grouped(self, x: Tensor, w: QWeight, groups: int) -> Tensor:
        """Block-diagonal projection (wo_a, spec §5.8): x [N, G, I], w [G*R, I] -> [N, G, R].

        The reference dequantises wo_a to BF16 and runs this einsum without activation quant."""
        wd = w.dequant(x.dtype).view(groups, -1, x.shape[-1])  # [G, R, I]
        return torch.einsum("ngi,gri->ngr", x, wd)

    def prefetch(self, site: str, ws: Sequence[QWeight], x: Tensor) -> bool:
        """No prefetch (the reference path)."""
        return False
