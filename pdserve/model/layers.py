"""Small building blocks: RMSNorm and the SiLU-gated MLP (dense layers and shared experts).

Under tensor parallelism the MLP splits its intermediate dim: gate/up column-parallel, down
row-parallel (one all-reduce, or none with reduce=False when the caller sums partials first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed.group import TPGroup
from pdserve.model.parallel import ColumnParallelLinear, RowParallelLinear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalize in float32, scale in the input dtype (as transformers does)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)); checkpoint names gate_proj / up_proj / down_proj."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        tp: TPGroup | None = None,
        reduce: bool = True,
        fp8_block: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        tp, fp8 = tp or TPGroup.single(), fp8_block
        self.gate_proj = ColumnParallelLinear(
            hidden_size, intermediate_size, tp, what="intermediate size", fp8_block=fp8
        )
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, tp, what="intermediate size", fp8_block=fp8)
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, tp, reduce=reduce, what="intermediate size", fp8_block=fp8
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
