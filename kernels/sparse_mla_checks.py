"""The argument checks of the sparse / paged MLA decode wrappers (`sparse_mla.py`): q and its
key list (top-k indices or paged block tables), KV rows in q's dtype, FP8 records, a second key
source, fp8_ds_v4 pages (and the kernel's record constexprs they imply). Each raises ValueError
naming the argument, its expected shape / dtype and what it got.

Legend: B batch, S query tokens per sequence, H heads, D record dim (d_v value dims + D - d_v
rope dims), K top-k, N KV slots, T query rows (paged: one per token).
"""

from __future__ import annotations

import math

import torch

from pdserve_kernels import kv_fp8
from pdserve_kernels._launch import next_pow2


def _check(q, indices, sm_scale, d_v, sink) -> None:
    """The checks every wrapper shares: q [B, S, H, D], indices [B, S, K] int32, d_v, sink [H], sm_scale."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, S, H, D], got shape {tuple(q.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q must be bf16, fp16 or fp32, got {q.dtype}")
    B, S, H, D = q.shape
    if indices.dim() != 3 or tuple(indices.shape[:2]) != (B, S):
        raise ValueError(f"indices must be [B, S, K] = [{B}, {S}, K], got {tuple(indices.shape)}")
    if indices.dtype != torch.int32:
        raise ValueError(f"indices must be int32, got {indices.dtype}")
    if not 0 < d_v <= D:
        raise ValueError(f"d_v must be in (0, D={D}], got {d_v}")
    if sink is not None and tuple(sink.shape) != (H,):
        raise ValueError(f"sink must be [H] = [{H}], got {tuple(sink.shape)}")
    if not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale must be finite, got {sm_scale}")
    for name, t in (("kv/indices", indices), ("sink", sink)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")


def _check_kv(q: torch.Tensor, name: str, kv: torch.Tensor) -> None:
    """kv [N, D] rows in q's dtype, on q's device."""
    if kv.dim() != 2 or kv.shape[1] != q.shape[3]:
        raise ValueError(f"{name} must be [N, D={q.shape[3]}], got {tuple(kv.shape)}")
    if kv.dtype != q.dtype:
        raise ValueError(f"{name} dtype {kv.dtype} must match q dtype {q.dtype}")
    if kv.device != q.device:
        raise ValueError(f"{name} is on {kv.device}, q on {q.device}")


def _extra(q, kv, extra_kv, extra_indices, sm_scale, d_v, sink, check_records):
    """The second key source of `sparse_mla_decode(_fp8)`, checked: (extra_kv, extra_indices) or None."""
    if (extra_kv is None) != (extra_indices is None):
        raise ValueError("extra_kv and extra_indices come together")
    if extra_kv is None:
        return None
    _check(q, extra_indices, sm_scale, d_v, sink)
    check_records(extra_kv)
    if extra_kv.stride(1) != kv.stride(1):
        raise ValueError(f"extra_kv's column stride {extra_kv.stride(1)} must be kv's ({kv.stride(1)})")
    return extra_kv, extra_indices


def _paged_keys(q, block_tables, seq_ids, context_lens, page, max_len, sm_scale, d_v, sink) -> torch.Tensor:
    """Checks a paged key list (q [T, 1, H, D], one query row per token) and q; returns the empty
    [T, 1, 0] indices `sparse_mla._run` takes with it."""
    if q.dim() != 4 or q.shape[1] != 1:
        raise ValueError(f"q must be [T, 1, H, D], got {tuple(q.shape)}")
    T = q.shape[0]
    for name, t in (("seq_ids", seq_ids), ("context_lens", context_lens)):
        if t.dtype != torch.int32 or tuple(t.shape) != (T,) or t.device != q.device:
            raise ValueError(f"{name} must be int32 ({T},) on {q.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.device != q.device:
        raise ValueError(
            f"block_tables must be int32 [B, W] on {q.device}, got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if page < 1 or max_len < 0:
        raise ValueError(f"page must be >= 1 and max_len >= 0, got {page}, {max_len}")
    empty_idx = torch.empty(T, 1, 0, dtype=torch.int32, device=q.device)
    _check(q, empty_idx, sm_scale, d_v, sink)
    return empty_idx


def _check_fp8_records(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> None:
    if q.dtype == torch.float32:
        raise ValueError("FP8 KV records take bf16 or fp16 q")
    D = q.shape[3]
    need = kv_fp8.record_bytes(d_v, D - d_v)
    if kv.dtype != torch.uint8 or kv.dim() != 2 or kv.shape[1] != need or kv.stride(1) != 1:
        raise ValueError(
            f"kv must be uint8 [N, {need}] records with contiguous bytes, got "
            f"{kv.dtype} {tuple(kv.shape)} strides {kv.stride()}"
        )
    if d_v != next_pow2(d_v) or d_v % kv_fp8.GROUP:
        raise ValueError(f"fp8 records need d_v a power of two and a multiple of {kv_fp8.GROUP}")
    if kv.stride(0) % 16 or kv.data_ptr() % 16:
        raise ValueError("fp8 records must start on 16-byte boundaries (row stride and base)")


def _v4_record(q: torch.Tensor, kv: torch.Tensor, rope: int) -> dict:
    """Checks fp8_ds_v4 pages against q; the kernel's record constexprs."""
    rec = kv_fp8.V4Record(q.shape[3], rope)
    pages = kv.dim() == 3 and kv.shape[2] == rec.bytes and kv.stride(2) == 1 and kv.stride(1) == rec.bytes
    if kv.dtype != torch.uint8 or not pages:
        raise ValueError(
            f"kv must be uint8 [Nb, P, {rec.bytes}] pages (each page's bytes contiguous), got "
            f"{kv.dtype} {tuple(kv.shape)} strides {kv.stride()}"
        )
    if kv.device != q.device:
        raise ValueError(f"kv is on {kv.device}, q on {q.device}")
    if rec.dim < 33:
        raise ValueError(f"fp8_ds_v4 records need D > 32 (one 64-value scale group per tile), got {rec.dim}")
    if kv.data_ptr() % 16 or kv.stride(0) % 8:
        raise ValueError("fp8_ds_v4 pages must start on a 16-byte boundary and have a page stride multiple of 8")
    return dict(KV_V4=True, V4_NOPE=rec.nope, V4_SB=rec.scale_bytes, V4_PAGE=kv.shape[1])
