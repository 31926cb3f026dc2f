"""Rotary position embedding for the decoupled rope dims of MLA (and the DSA indexer), with YaRN.

Legend: T tokens, H heads, R rope dims (qk_rope_head_dim).

Matches transformers: cos/sin carry the YaRN attention factor; the interleaved variant rotates
pairs (x0, x1), (x2, x3), ... and writes the result de-interleaved (evens then odds), exactly as
`apply_rotary_pos_emb_interleave` does, so cached rope keys have transformers' layout.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pdserve.model.config import RopeConfig


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] (float32, CPU) and the cos/sin scale."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    factor = rope.factor
    attn = rope.attention_factor
    if attn is None:
        if rope.mscale and rope.mscale_all_dim:
            attn = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attn = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1 where high-frequency dims keep their original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attn)


def softmax_scale(rope: RopeConfig, qk_head_dim: int) -> float:
    """Attention scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = qk_head_dim**-0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = _yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * m * m
    return scale


class RotaryEmbedding(nn.Module):
    """cos/sin [T, R/2] for given positions. inv_freq is a plain attribute, not a buffer, so the
    module survives meta-device construction and needs no checkpoint entry."""

    def __init__(self, rope: RopeConfig, dim: int) -> None:
        super().__init__()
        self._inv_freq, self.attention_factor = rope_inv_freq(rope, dim)
        self._cache: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """The inverse frequencies [R/2] float32 on `device` (copied there once)."""
        inv = self._cache.get(device)
        if inv is None:
            inv = self._cache.setdefault(device, self._inv_freq.to(device))
        return inv

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]  # [T, R/2]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [T, ..., R]; cos/sin [T, R/2] float32. Half-split pairs (i, i+R/2) or interleaved pairs
    (2i, 2i+1); the output is always [rotated firsts, rotated seconds]."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    c, s = cos.view(shape).to(x.dtype), sin.view(shape).to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
