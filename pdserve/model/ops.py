"""One switch between the Triton kernels (CUDA) and their PyTorch references (everywhere else).

Model code calls only these functions; which implementation runs is decided by the device of
the inputs, unless `set_backend("torch"|"triton")` forces one (tests, benchmarks).
"""

from __future__ import annotations

import torch

from pdserve_kernels import ref

_forced: str | None = None


def set_backend(name: str | None) -> None:
    """Force "torch" or "triton" for every call; None restores per-device choice."""
    global _forced
    if name not in (None, "torch", "triton"):
        raise ValueError(f"unknown kernel backend {name!r}; expected 'torch' or 'triton'")
    _forced = name


def _use_triton(t: torch.Tensor) -> bool:
    if _forced is not None:
        return _forced == "triton"
    return t.is_cuda


def sparse_mla_decode(q, kv, indices, sm_scale: float, d_v: int, sink=None):
    if _use_triton(q):
        from pdserve_kernels import sparse_mla_decode as kernel

        return kernel(q, kv, indices, sm_scale, d_v, sink=sink)
    return ref.sparse_mla_decode_ref(q, kv, indices, sm_scale, d_v, sink=sink)


def fused_moe(x, w13, w2, topk_weights, topk_ids):
    if _use_triton(x):
        from pdserve_kernels import fused_moe as kernel

        return kernel(x, w13, w2, topk_weights, topk_ids)
    return ref.fused_moe_ref(x, w13, w2, topk_weights, topk_ids)


def indexer_topk(q, k_cache, weights, candidates, topk: int):
    if _use_triton(q):
        from pdserve_kernels import indexer_topk as kernel

        return kernel(q, k_cache, weights, candidates, topk)
    return ref.indexer_topk_ref(q, k_cache, weights, candidates, topk)


def mla_prefill_attention(q, k_nope, k_rope, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, sm_scale: float,
                          max_seqlen_k: int | None = None):
    if _use_triton(q):
        from pdserve_kernels import mla_prefill_attention as kernel

        return kernel(q, k_nope, k_rope, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, sm_scale, max_seqlen_k=max_seqlen_k)
    return ref.mla_prefill_attention_ref(q, k_nope, k_rope, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, sm_scale)


def paged_mla_decode(q, kv, block_tables, seq_ids, context_lens, page: int, max_len: int, sm_scale: float, d_v: int, sink=None):
    if _use_triton(q):
        from pdserve_kernels import paged_mla_decode as kernel

        return kernel(q, kv, block_tables, seq_ids, context_lens, page, max_len, sm_scale, d_v, sink=sink)
    return ref.paged_mla_decode_ref(q, kv, block_tables, seq_ids, context_lens, page, max_len, sm_scale, d_v, sink=sink)


def indexer_topk_paged(q, k_cache, weights, block_tables, seq_ids, context_lens, page: int, max_len: int, topk: int):
    if _use_triton(q):
        from pdserve_kernels import indexer_topk_paged as kernel

        return kernel(q, k_cache, weights, block_tables, seq_ids, context_lens, page, max_len, topk)
    return ref.indexer_topk_paged_ref(q, k_cache, weights, block_tables, seq_ids, context_lens, page, max_len, topk)
