"""Small DeepSeek-V4 building blocks: its RMSNorms and its interleaved rope on a trailing slice.

Legend: T tokens, D features, R rope dims (the trailing R of D), ... any middle dims (heads).

V4's RMSNorm keeps its weight in float32 and multiplies before casting back (transformers'
DeepseekV4RMSNorm), unlike V3's. Rope rotates the *last* R dims of each vector as interleaved
pairs (2i, 2i+1) and writes them back in place, so the layout stays [nope | rope].
`store_records` writes K = V records into a pool region of either kind: values [N, D], or
"fp8_ds_v4" pages [blocks, records a block, bytes] (`--kv-cache-dtype fp8`).
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.model import ops


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMSNorm over the last dim (statistics in float32)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class V4RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))  # kept float32
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., D]; cos/sin [T, R/2] float32 -> x with its last R dims rotated as pairs
    (x[2i], x[2i+1]) -> (x[2i] cos - x[2i+1] sin, x[2i+1] cos + x[2i] sin), in float32."""
    R = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (R,)
    c = cos.repeat_interleave(2, dim=-1).view(shape)  # [T, ..., R]
    s = sin.repeat_interleave(2, dim=-1).view(shape)
    nope, rope = x[..., :-R], x[..., -R:]
    pairs = rope.unflatten(-1, (-1, 2))
    rotated_half = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)  # (-x1, x0) per pair
    rotated = (rope.float() * c + rotated_half.float() * s).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def store_records(region: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, rope: int) -> None:
    """values [n, D] -> records `slots` [n] of a pool region (a slot written twice gets the same
    values both times: step.py's padding repeats)."""
    if region.dtype == torch.uint8:  # fp8_ds_v4 pages: quantized, rope dims in bf16
        ops.store_kv_fp8_v4(region, slots, values, rope)
    else:
        region.index_copy_(0, slots, values.to(region.dtype))
