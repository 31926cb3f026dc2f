"""Block-scaled FP8 (e4m3) weights, as DeepSeek ships them.

A weight W [N, K] is stored as e4m3 values plus `weight_scale_inv` [ceil(N/bn), ceil(K/bk)]
float32, one scale per (bn x bk) block (128 x 128 in DeepSeek's checkpoints); the real weight is
W_fp8 * scale_inv of its block (the last row/column blocks may be partial).
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn,)


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in FP8_DTYPES


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [N, K] e4m3, scale_inv [ceil(N/bn), ceil(K/bk)] -> float32 [N, K]. Raises ValueError
    on shapes that do not fit the block size."""
    if weight.dim() != 2:
        raise ValueError(f"block-scaled fp8 weights must be 2-D, got shape {tuple(weight.shape)}")
    (N, K), (bn, bk) = weight.shape, block
    expected = (-(-N // bn), -(-K // bk))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv shape {tuple(scale_inv.shape)} does not fit weight {(N, K)} with "
            f"blocks {block}: expected {expected}"
        )
    scale = scale_inv.float().repeat_interleave(bn, dim=0)[:N].repeat_interleave(bk, dim=1)[:, :K]
    return weight.float() * scale
