"""Tensor-parallel linear layers (Megatron's split): each knows which slice of the checkpoint's
full weight is its own, so the loader reads one shard per rank by name.

- ColumnParallelLinear: output rows split; rank r holds rows [r*n, (r+1)*n). For q_b_proj and
  kv_b_proj (head-major rows) that is a split by attention heads.
- RowParallelLinear: input columns split; each rank's partial product is summed by an all-reduce
  (or left partial, reduce=False, when the caller sums several partials with one all-reduce).
- Stacked MoE experts (deepseek_v3/moe.py, deepseek_v4/moe.py) split every expert's
  intermediate dim I: `shard_expert` slices one expert's checkpoint weight, `shard_stacked_experts` a stacked one.
With a TPGroup of size 1 both are plain linear layers. Given `fp8_block` they keep their weight
FP8 with its block scales (fp8.py): `weight_scale_inv` is cut with the weight, on block edges.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed.group import TPGroup
from pdserve.model import ops
from pdserve.model.fp8 import Block, check_block_shard, fp8_params, shard_scales


def narrow_shard(full: torch.Tensor, dim: int, start: int, n: int, size: int) -> torch.Tensor:
    """full's [start, start+n) along dim, after checking full has size*n there (the loader turns
    the ValueError into a CheckpointError naming the tensor)."""
    if full.dim() <= dim or full.shape[dim] != n * size:
        raise ValueError(
            f"expected {n * size} along dim {dim} to split into {size} shard(s), got shape {tuple(full.shape)}"
        )
    return full.narrow(dim, start, n)


def shard_expert(proj: str, full: torch.Tensor, start: int, n: int, size: int) -> torch.Tensor:
    """One expert's weight -> the slice [start, start+n) of its I: gate/up [I, hidden] rows,
    down_proj [hidden, I] columns."""
    return narrow_shard(full, 1 if proj == "down_proj" else 0, start, n, size)


def shard_stacked_experts(name: str, full: torch.Tensor, start: int, n: int, size: int) -> torch.Tensor:
    """Stacked expert weights -> the slice [start, start+n) of I: down_proj [E, hidden, I] by
    column; gate_up_proj [E, 2I, hidden] (gate rows, then up rows) split in each half."""
    if name == "down_proj":
        return narrow_shard(full, 2, start, n, size)
    if full.dim() != 3 or full.shape[1] != 2 * n * size:
        raise ValueError(
            f"expected [E, {2 * n * size}, hidden] (gate rows, then up rows), got shape {tuple(full.shape)}"
        )
    gate, up = full.chunk(2, dim=1)
    return torch.cat([gate.narrow(1, start, n), up.narrow(1, start, n)], dim=1)


class _ShardedLinear(nn.Module):
    """weight [out, in] (this rank's shard) in the model dtype, or e4m3 + weight_scale_inv."""

    def _weights(self, out_features: int, in_features: int, fp8_block: Block | None) -> None:
        self.fp8_block = None if fp8_block is None else tuple(fp8_block)
        if fp8_block is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features))
            self.weight_scale_inv = None
        else:
            self.weight, self.weight_scale_inv = fp8_params(out_features, in_features, self.fp8_block)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.fp8_block is None:
            return F.linear(x, self.weight, bias)
        return ops.fp8_linear(x, self.weight, self.weight_scale_inv, self.fp8_block, bias)


class ColumnParallelLinear(_ShardedLinear):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TPGroup,
        bias: bool = False,
        what: str = "out_features",
        fp8_block: Block | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.n = tp.shard(out_features, what)
        if fp8_block is not None:
            check_block_shard(self.n, tp.size, fp8_block[0], what)
        self._weights(self.n, in_features, fp8_block)
        self.bias = nn.Parameter(torch.empty(self.n)) if bias else None

    def shard_weight(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if name == "weight_scale_inv":
            return shard_scales(full, 0, self.start, self.n, self.fp8_block[0])
        return narrow_shard(full, 0, self.start, self.n, self.tp.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class RowParallelLinear(_ShardedLinear):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TPGroup,
        bias: bool = False,
        reduce: bool = True,
        what: str = "in_features",
        fp8_block: Block | None = None,
    ) -> None:
        super().__init__()
        if bias and not reduce:
            raise ValueError("a row-parallel bias is added once, after the all-reduce: bias needs reduce=True")
        self.tp, self.reduce = tp, reduce
        self.start, self.n = tp.shard(in_features, what)
        if fp8_block is not None:
            check_block_shard(self.n, tp.size, fp8_block[1], what)
        self._weights(out_features, self.n, fp8_block)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def shard_weight(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if name == "weight_scale_inv":
            return shard_scales(full, 1, self.start, self.n, self.fp8_block[1])
        return narrow_shard(full, 1, self.start, self.n, self.tp.size) if name == "weight" else full

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._matmul(x, self.bias)
        y = self._matmul(x, None)
        if self.reduce:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias
