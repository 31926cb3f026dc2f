"""The per-head fallback that sparse_mla_decode replaces, kept to measure against
(bench_mla.py) and checked by tests/kernels/test_kernels_sparse_mla.py.

One program per (query, head): it gathers its query's top-k KV rows by itself (so every head of a
query re-gathers the same rows), and computes q.k and p.v as elementwise products reduced on CUDA
cores, no tensor cores: the pattern that dominated decode time in the reference deployment
(docs/kernels.md). Same contract as `ref.sparse_mla_decode_ref`.

Legend: B batch, S query tokens, H heads, D record dim, K top-k, BN rows per step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve_kernels._launch import interpreting, next_pow2


@triton.jit
def _per_head_kernel(
    q_ptr,
    kv_ptr,
    idx_ptr,
    sink_ptr,
    out_ptr,
    lse_ptr,
    scale_log2,
    H,
    K,
    s_qb,
    s_qh,
    s_kvn,
    s_ib,
    D_V: tl.constexpr,
    D_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_SINK: tl.constexpr,
    INTERPRET: tl.constexpr,
    K_C: tl.constexpr,
):
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_v = tl.arange(0, BLOCK_V)
    offs_t = tl.arange(0, BLOCK_T)
    v_ok = offs_v < D_V
    t_ok = offs_t < D_T
    q_row = q_ptr + b * s_qb + h * s_qh
    q_v = tl.load(q_row + offs_v, mask=v_ok, other=0.0).to(tl.float32)
    q_t = tl.load(q_row + D_V + offs_t, mask=t_ok, other=0.0).to(tl.float32)
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_V], tl.float32)
    for n0 in range(0, K_C if INTERPRET else K, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + b * s_ib + offs_n, mask=offs_n < K, other=-1)
        valid = idx >= 0
        rows = kv_ptr + idx.to(tl.int64)[:, None] * s_kvn
        k_v = tl.load(rows + offs_v[None, :], mask=valid[:, None] & v_ok[None, :], other=0.0)
        k_t = tl.load(rows + D_V + offs_t[None, :], mask=valid[:, None] & t_ok[None, :], other=0.0)
        s = tl.sum(k_v.to(tl.float32) * q_v[None, :], 1) + tl.sum(k_t.to(tl.float32) * q_t[None, :], 1)
        s = tl.where(valid, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe)
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * k_v.to(tl.float32), 0)
        m_i = m_new
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse2 = m_safe + tl.log2(l_i)
    if HAS_SINK:
        sink2 = tl.load(sink_ptr + h + tl.zeros([1], tl.int32)).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(lse2, sink2)
        lse2 = top + tl.log2(tl.exp2(lse2 - top) + tl.exp2(sink2 - top))
    denom = tl.where(lse2 == float("-inf"), 0.0, lse2)
    out = acc * tl.exp2(m_safe - denom)
    tl.store(out_ptr + (b * H + h) * D_V + offs_v, out.to(out_ptr.dtype.element_ty), mask=v_ok)
    tl.store(lse_ptr + b * H + h + tl.arange(0, 1), lse2 * 0.6931471805599453)


def sparse_mla_decode_per_head(q, kv, indices, sm_scale: float, d_v: int, sink=None, block_n: int = 16):
    """q [B,S,H,D], kv [N,D] (row stride any, values contiguous), indices [B,S,K] int32."""
    B, S, H, D = q.shape
    K = indices.shape[2]
    q3 = q.reshape(B * S, H, D)
    if q3.stride(2) != 1 or kv.stride(1) != 1:
        raise ValueError("the per-head baseline needs contiguous head dims in q and kv")
    idx = indices.reshape(B * S, K).contiguous()
    out = torch.empty(B, S, H, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, S, H, dtype=torch.float32, device=q.device)
    d_t = D - d_v
    _per_head_kernel[(H, B * S)](
        q3,
        kv,
        idx,
        sink if sink is not None else lse,
        out,
        lse,
        sm_scale * 1.4426950408889634,
        H,
        K,
        q3.stride(0),
        q3.stride(1),
        kv.stride(0),
        idx.stride(0),
        D_V=d_v,
        D_T=d_t,
        BLOCK_N=block_n,
        BLOCK_V=next_pow2(d_v),
        BLOCK_T=next_pow2(max(d_t, 1)),
        HAS_SINK=sink is not None,
        INTERPRET=interpreting(),
        K_C=K if interpreting() else 0,
        num_warps=4,
    )
    return out, lse
