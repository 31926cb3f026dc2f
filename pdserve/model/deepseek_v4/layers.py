"""Small DeepSeek-V4 building blocks: its RMSNorms and its interleaved rope on a trailing slice.

Legend: T tokens, D features, R rope dims (the trailing R of D), ... any middle dims (heads).

V4's RMSNorm keeps its weight in float32 and multiplies before casting back (transformers'
DeepseekV4RMSNorm), unlike V3's. Rope rotates the *last* R dims of each vector as interleaved
pairs (2i, 2i+1) and writes them back in place, so the layout stays [nope | rope].
Each is one kernel on a GPU (`ops.rms_norm` / `ops.rope_tail`; references in
kernels/ref_glue.py), and so is a norm whose output also goes to pool records (`normed_records`). `store_records` writes K = V records into a pool region of either kind: values [N, D], or
"fp8_ds_v4" pages [blocks, records a block, bytes] (`--kv-cache-dtype fp8`). Linears that read one
input keep their weights as rows of one tensor (`join_rows`, at load), so one GEMM runs them
(`joined_rows`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model import ops


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMSNorm over the last dim (statistics in float32, the scale rounded to x's dtype)."""
    return ops.rms_norm(x, None, eps)


class V4RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))  # kept float32
        self.eps = eps

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [T, ..., D] -> weight * x / rms(x), rounded to x's dtype; then `rope_tail` by rope =
        (cos, sin) when given (one kernel on a GPU)."""
        return ops.rms_norm(x, self.weight, self.eps, rope=rope)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [T, ..., D]; cos/sin [T, R/2] float32 -> x with its last R dims rotated as pairs
    (x[2i], x[2i+1]) -> (x[2i] cos - x[2i+1] sin, x[2i+1] cos + x[2i] sin), in float32; by -angle
    (sin negated, in the kernel) when `inverse`."""
    return ops.rope_tail(x, cos, sin, inverse=inverse)


def fused_store(region: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether the norm's kernel can store x's normed rows into the region itself (a GPU's path, a
    region of x's dtype)."""
    return region.dtype == x.dtype and region.is_contiguous() and ops.uses_triton(x)


def normed_records(
    norm: V4RMSNorm, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], region: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """norm(x, rope) [n, D], also stored as records `slots` [n] of a pool region (`store_records`):
    by the norm's own kernel where `fused_store`."""
    if fused_store(region, x):
        return ops.rms_norm(x, norm.weight, norm.eps, rope=rope, store=(region, slots))
    out = norm(x, rope=rope)
    store_records(region, slots, out, 2 * rope[0].shape[-1])
    return out


def store_records(region: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, rope: int) -> None:
    """values [n, D] -> records `slots` [n] of a pool region (a slot written twice gets the same
    values both times: step.py's padding repeats)."""
    if region.dtype == torch.uint8:  # fp8_ds_v4 pages: quantized, rope dims in bf16
        ops.store_kv_fp8_v4(region, slots, values, rope)
    else:
        region.index_copy_(0, slots, values.to(region.dtype))


def join_rows(*linears: nn.Module) -> None:
    """Re-seat the `weight`s of linears that read one input (same dtype, in-features and device)
    as consecutive row slices of one [sum N, K] tensor, values kept, so that `joined_outputs` runs
    them as one GEMM. FP8 linears join their `weight_scale_inv` rows too, when every weight but
    the last ends on a scale-block edge (else they stay apart). The parameters keep their names
    and shapes (loaders, TP shards and dummy fills write into them in place); a weight replaced
    later simply ends the sharing."""
    w0 = linears[0].weight
    if joined_weights(*linears) is not None:  # already rows of one tensor (a wider join holds them)
        return
    if any(m.weight.dim() != 2 or m.weight.dtype != w0.dtype or m.weight.shape[1] != w0.shape[1] for m in linears):
        return
    if any(m.weight.device != w0.device or getattr(m, "bias", None) is not None for m in linears):
        return
    names = ["weight"]
    if getattr(linears[0], "weight_scale_inv", None) is not None:  # FP8: the scale rows must line up
        blocks = {getattr(m, "fp8_block", None) for m in linears}
        bn = next(iter(blocks))[0] if len(blocks) == 1 and None not in blocks else 0
        if not bn or any(m.weight.shape[0] % bn for m in linears[:-1]):
            return
        names.append("weight_scale_inv")
    for name in names:
        parts = [getattr(m, name) for m in linears]
        joined, start = torch.cat([p.detach() for p in parts]), 0
        for m, p in zip(linears, parts):
            setattr(m, name, nn.Parameter(joined[start : start + p.shape[0]], requires_grad=False))
            start += p.shape[0]


def joined_rows(*weights: torch.Tensor) -> torch.Tensor | None:
    """The [sum N, K] tensor whose consecutive row slices `weights` are (`join_rows`), or None."""
    w0 = weights[0]
    if w0.dim() != 2 or not w0.is_contiguous():
        return None
    at = w0.storage_offset()
    for w in weights:
        if w.untyped_storage().data_ptr() != w0.untyped_storage().data_ptr() or not w.is_contiguous():
            return None
        if w.dtype != w0.dtype or w.shape[1] != w0.shape[1] or w.storage_offset() != at:
            return None
        at += w.numel()
    return w0.as_strided((sum(w.shape[0] for w in weights), w0.shape[1]), w0.stride())


def joined_weights(*linears: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight [sum N, K], weight_scale_inv or None) of linears `join_rows` joined, or None."""
    w = joined_rows(*(m.weight for m in linears))
    if w is None or getattr(linears[0], "weight_scale_inv", None) is None:
        return None if w is None else (w, None)
    s = joined_rows(*(m.weight_scale_inv for m in linears))
    return None if s is None else (w, s)


def joined_outputs(x: torch.Tensor, *linears: nn.Module) -> list[torch.Tensor]:
    """[m(x) for m in linears], from one GEMM over their joined rows (views of its [T, sum N]
    output, rows strided) where `join_rows` joined them, else one GEMM each."""
    joined = joined_weights(*linears)
    if joined is None:
        return [m(x) for m in linears]
    w, s = joined
    y = F.linear(x, w) if s is None else ops.fp8_linear(x, w, s, linears[0].fp8_block)
    return list(y.split([m.weight.shape[0] for m in linears], dim=-1))
