"""FP8 KV record format for sparse MLA (DeepSeek-V3.2 style), with its packer and reference.

One record per KV slot, bytes in this order (V3.2: d_v = 512, tail = 64 -> 656 bytes):

    [0, d_v)                      d_v float8_e4m3fn values: the latent (the V part)
    [d_v, d_v + 4*G)              G = d_v / 128 float32 scales, little endian; value i of the
                                  latent is e4m3[i] * scale[i // 128]
    [d_v + 4*G, d_v + 4*G + 2*T)  T bfloat16 values: the rope part, not quantized

Records may sit in a larger pool (row stride >= record size); the kernel needs each record on a
16-byte boundary (656 = 41 * 16). Pure torch: no Triton import.
"""

from __future__ import annotations

import torch

from pdserve_kernels.ref import sparse_mla_decode_ref

GROUP = 128
E4M3_MAX = 448.0


def record_bytes(d_v: int, tail: int) -> int:
    return d_v + 4 * (d_v // GROUP) + 2 * tail


def pack_kv_fp8(kv: torch.Tensor, d_v: int) -> torch.Tensor:
    """kv [N, D] float -> records [N, record_bytes(d_v, D - d_v)] uint8, per-128-value scales
    = amax / 448."""
    N, D = kv.shape
    if d_v % GROUP:
        raise ValueError(f"d_v must be a multiple of {GROUP}, got {d_v}")
    groups = kv[:, :d_v].float().reshape(N, d_v // GROUP, GROUP)
    scale = (groups.abs().amax(-1) / E4M3_MAX).clamp(min=1e-12)  # [N, G]
    vals = (groups / scale[..., None]).to(torch.float8_e4m3fn).reshape(N, d_v)
    tail = kv[:, d_v:].to(torch.bfloat16).contiguous()
    parts = [vals.view(torch.uint8), scale.contiguous().view(torch.uint8), tail.view(torch.uint8)]
    return torch.cat(parts, dim=1)


def unpack_kv_fp8(records: torch.Tensor, d_v: int, dim: int) -> torch.Tensor:
    """records [N, R] uint8 -> kv [N, dim] float32 (dequantized)."""
    N = records.shape[0]
    G = d_v // GROUP
    vals = records[:, :d_v].contiguous().view(torch.float8_e4m3fn).float()
    scale = records[:, d_v:d_v + 4 * G].contiguous().view(torch.float32)  # [N, G]
    tail = records[:, d_v + 4 * G:record_bytes(d_v, dim - d_v)].contiguous().view(torch.bfloat16)
    latent = (vals.reshape(N, G, GROUP) * scale[..., None]).reshape(N, d_v)
    return torch.cat([latent, tail.float()], dim=1)


def sparse_mla_decode_fp8_ref(
    q: torch.Tensor,  # [B, S, H, D]
    records: torch.Tensor,  # [N, R] uint8
    indices: torch.Tensor,  # [B, S, K] int32, -1 = padding
    sm_scale: float,
    d_v: int,
    sink: torch.Tensor | None = None,  # [H]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for `sparse_mla_decode_fp8`: dequantize the records, then the bf16 reference."""
    kv = unpack_kv_fp8(records, d_v, q.shape[3])
    kv = kv.double() if q.dtype == torch.float64 else kv
    return sparse_mla_decode_ref(q, kv, indices, sm_scale, d_v, sink=sink)
