"""MLA prefill attention in the non-absorbed form: causal FlashAttention over expanded K/V.

Legend: T query tokens (all chunks of the step, concatenated), S key tokens (each sequence's
cached prefix + its chunk, concatenated), B sequences, H heads, Dn qk_nope_head_dim (128), R
qk_rope_head_dim (64), Dv v_head_dim (128), BM query rows / BN key rows per tile.

Prefill has many query tokens per sequence, so the absorbed form (queries in the 576-wide latent
space, as decode runs it) costs 3.4x the flops of expanding the cached latent through kv_b_proj
once per chunk and attending per head with qk dim Dn + R = 192 and v dim Dv = 128:

    k_nope, v = (latent @ kv_b_proj^T).split([Dn, Dv])       # [S, H, Dn], [S, H, Dv]
    k = [k_nope | k_rope]                                     # k_rope [S, R], shared by the heads
    out[t, h] = softmax(q[t, h] . k[:, h] * scale, causal) @ v[:, h]

Chunked prefill: sequence b's queries are rows cu_q[b]..cu_q[b+1] (its chunk), its keys rows
cu_k[b]..cu_k[b+1] (its whole context: the cached prefix, then the chunk itself), so query i of
the chunk sits at position P_b + i, P_b = len_k - len_q, and sees keys 0..P_b + i.

Grid (cdiv(max len_q, BM), H, B). A program holds BM queries of one head and walks the key tiles
in two loops: those every query of the tile sees (keys < P_b + first query: no mask) and the
diagonal ones (causal mask); base-2 online softmax, float32 accumulators, two tensor-core dots for
the scores (nope part + rope part: 192 is not a power of two) and one for p @ v.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve_kernels import configs
from pdserve_kernels._launch import capability, cdiv, interpreting, next_pow2

LOG2E = 1.4426950408889634


@triton.jit
def _tile(
    acc,
    m_i,
    l_i,
    q_a,
    q_b,
    k_rows,
    kr_rows,
    v_rows,
    start_n,
    offs_m_pos,
    key_end,
    s_kn,
    s_krn,
    s_vn,
    offs_a,
    offs_b,
    offs_v,
    a_ok,
    b_ok,
    v_ok,
    scale_log2,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    FP32_DOT: tl.constexpr,
    EVEN: tl.constexpr,
):
    """One key tile: scores, online-softmax update, p @ v. MASKED applies the causal mask
    (key j visible to the query at position p when j <= p) and the sequence's key bound; EVEN
    (head dims equal to their power-of-two tiles) lets the unmasked tiles load without masks."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < key_end
    k_a_ptrs = k_rows + offs_n[:, None] * s_kn + offs_a[None, :]
    k_b_ptrs = kr_rows + offs_n[:, None] * s_krn + offs_b[None, :]
    v_ptrs = v_rows + offs_n[:, None] * s_vn + offs_v[None, :]
    if MASKED:
        k_a = tl.load(k_a_ptrs, mask=n_ok[:, None] & a_ok[None, :], other=0.0)
        k_b = tl.load(k_b_ptrs, mask=n_ok[:, None] & b_ok[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=n_ok[:, None] & v_ok[None, :], other=0.0)
    elif EVEN:
        k_a = tl.load(k_a_ptrs)
        k_b = tl.load(k_b_ptrs)
        v = tl.load(v_ptrs)
    else:
        k_a = tl.load(k_a_ptrs, mask=a_ok[None, :], other=0.0)
        k_b = tl.load(k_b_ptrs, mask=b_ok[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=v_ok[None, :], other=0.0)
    if FP32_DOT:
        s = tl.dot(q_a, tl.trans(k_a), input_precision="ieee")
        s += tl.dot(q_b, tl.trans(k_b), input_precision="ieee")
    else:
        s = tl.dot(q_a, tl.trans(k_a))
        s += tl.dot(q_b, tl.trans(k_b))
    s = s * scale_log2
    if MASKED:
        seen = (offs_n[None, :] <= offs_m_pos[:, None]) & n_ok[None, :]
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP32_DOT:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _mla_prefill_kernel(
    q_ptr,
    k_ptr,
    kr_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    cu_q_ptr,
    cu_k_ptr,
    scale_log2,
    H,
    s_qt,
    s_qh,
    s_kn,
    s_kh,
    s_krn,
    s_vn,
    s_vh,
    s_ot,
    s_oh,
    D_A: tl.constexpr,
    D_B: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
    INTERPRET: tl.constexpr,
    TILES_C: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest (last) query tiles start first
    EVEN: tl.constexpr = (D_A == BLOCK_A) & (D_B == BLOCK_B) & (D_V == BLOCK_V)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b).to(tl.int64)
    q_len = (tl.load(cu_q_ptr + b + 1) - q_start).to(tl.int32)
    k_start = tl.load(cu_k_ptr + b).to(tl.int64)
    k_len = (tl.load(cu_k_ptr + b + 1) - k_start).to(tl.int32)
    if pid_m * BLOCK_M < q_len:
        prefix = k_len - q_len
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < q_len
        offs_a = tl.arange(0, BLOCK_A)
        offs_b = tl.arange(0, BLOCK_B)
        offs_v = tl.arange(0, BLOCK_V)
        a_ok, b_ok, v_ok = offs_a < D_A, offs_b < D_B, offs_v < D_V

        q_rows = q_ptr + (q_start + offs_m)[:, None] * s_qt + h * s_qh
        q_a = tl.load(q_rows + offs_a[None, :], mask=m_ok[:, None] & a_ok[None, :], other=0.0)
        q_b = tl.load(q_rows + D_A + offs_b[None, :], mask=m_ok[:, None] & b_ok[None, :], other=0.0)
        k_rows = k_ptr + k_start * s_kn + h * s_kh
        kr_rows = kr_ptr + k_start * s_krn
        v_rows = v_ptr + k_start * s_vn + h * s_vh

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
        pos = prefix + offs_m  # [BM] position of each query in its sequence
        n_full = (prefix + pid_m * BLOCK_M) // BLOCK_N  # tiles every query of this block sees whole
        key_end = tl.minimum(k_len, prefix + (pid_m + 1) * BLOCK_M)
        n_end = tl.cdiv(key_end, BLOCK_N)
        if INTERPRET:  # no runtime loop bounds there (see _launch.interpreting)
            for i in range(0, TILES_C):
                if i < n_full:
                    acc, m_i, l_i = _tile(
                        acc,
                        m_i,
                        l_i,
                        q_a,
                        q_b,
                        k_rows,
                        kr_rows,
                        v_rows,
                        i * BLOCK_N,
                        pos,
                        key_end,
                        s_kn,
                        s_krn,
                        s_vn,
                        offs_a,
                        offs_b,
                        offs_v,
                        a_ok,
                        b_ok,
                        v_ok,
                        scale_log2,
                        BLOCK_N,
                        False,
                        FP32_DOT,
                        EVEN,
                    )
                elif i < n_end:
                    acc, m_i, l_i = _tile(
                        acc,
                        m_i,
                        l_i,
                        q_a,
                        q_b,
                        k_rows,
                        kr_rows,
                        v_rows,
                        i * BLOCK_N,
                        pos,
                        key_end,
                        s_kn,
                        s_krn,
                        s_vn,
                        offs_a,
                        offs_b,
                        offs_v,
                        a_ok,
                        b_ok,
                        v_ok,
                        scale_log2,
                        BLOCK_N,
                        True,
                        FP32_DOT,
                        EVEN,
                    )
        else:
            for i in range(0, n_full):
                acc, m_i, l_i = _tile(
                    acc,
                    m_i,
                    l_i,
                    q_a,
                    q_b,
                    k_rows,
                    kr_rows,
                    v_rows,
                    i * BLOCK_N,
                    pos,
                    key_end,
                    s_kn,
                    s_krn,
                    s_vn,
                    offs_a,
                    offs_b,
                    offs_v,
                    a_ok,
                    b_ok,
                    v_ok,
                    scale_log2,
                    BLOCK_N,
                    False,
                    FP32_DOT,
                    EVEN,
                )
            for i in range(n_full, n_end):
                acc, m_i, l_i = _tile(
                    acc,
                    m_i,
                    l_i,
                    q_a,
                    q_b,
                    k_rows,
                    kr_rows,
                    v_rows,
                    i * BLOCK_N,
                    pos,
                    key_end,
                    s_kn,
                    s_krn,
                    s_vn,
                    offs_a,
                    offs_b,
                    offs_v,
                    a_ok,
                    b_ok,
                    v_ok,
                    scale_log2,
                    BLOCK_N,
                    True,
                    FP32_DOT,
                    EVEN,
                )

        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        lse2 = m_safe + tl.log2(l_i)
        denom = tl.where(lse2 == float("-inf"), 0.0, lse2)
        o = acc * tl.exp2(m_safe - denom)[:, None]
        o_rows = out_ptr + (q_start + offs_m)[:, None] * s_ot + h * s_oh
        tl.store(o_rows + offs_v[None, :], o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & v_ok[None, :])
        tl.store(lse_ptr + (q_start + offs_m) * H + h, lse2 * 0.6931471805599453, mask=m_ok)


def _dot_dim(n: int) -> int:
    """A head dim's tile: a power of two, and at least 16 (tl.dot's smallest K on a GPU)."""
    return max(16, next_pow2(n))


def mla_prefill_attention(
    q: torch.Tensor,  # [T, H, Dn + R], last dim contiguous
    k_nope: torch.Tensor,  # [S, H, Dn], last dim contiguous (a view of kv_b_proj's output is fine)
    k_rope: torch.Tensor,  # [S, R], last dim contiguous, shared by every head
    v: torch.Tensor,  # [S, H, Dv], last dim contiguous
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32, chunk boundaries in q
    cu_seqlens_k: torch.Tensor,  # [B + 1] int32, context boundaries in k/v (prefix + chunk)
    max_seqlen_q: int,
    sm_scale: float,
    *,
    max_seqlen_k: int | None = None,  # needed only by the CPU interpreter (its loop bound)
    config: configs.PrefillConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of each chunk's queries over its prefix + chunk. Returns (out [T, H, Dv]
    in q's dtype, lse [T, H] float32, natural log). Every sequence needs len_k >= len_q."""
    T, H, Dq = q.shape
    Dn, R, Dv = k_nope.shape[2], k_rope.shape[1], v.shape[2]
    if Dq != Dn + R or k_nope.shape[1] != H or v.shape[1] != H:
        raise ValueError(
            f"shapes q {tuple(q.shape)}, k_nope {tuple(k_nope.shape)}, k_rope "
            f"{tuple(k_rope.shape)}, v {tuple(v.shape)} do not match [T,H,Dn+R] [S,H,Dn] [S,R] [S,H,Dv]"
        )
    for name, t in (("q", q), ("k_nope", k_nope), ("k_rope", k_rope), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim (stride {t.stride(-1)})")
    B = cu_seqlens_q.numel() - 1
    out = torch.empty(T, H, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T == 0 or B == 0:
        return out, lse
    cc = capability(q.device)
    cfg = config or configs.prefill_config(cc, q.dtype)
    interp = interpreting()
    tiles_c = cdiv(max_seqlen_k, cfg.block_n) if (interp and max_seqlen_k) else 1
    if interp and not max_seqlen_k:
        tiles_c = cdiv(int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()), cfg.block_n)
    grid = (cdiv(max_seqlen_q, cfg.block_m), H, B)
    _mla_prefill_kernel[grid](
        q,
        k_nope,
        k_rope,
        v,
        out,
        lse,
        cu_seqlens_q,
        cu_seqlens_k,
        sm_scale * LOG2E,
        H,
        q.stride(0),
        q.stride(1),
        k_nope.stride(0),
        k_nope.stride(1),
        k_rope.stride(0),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        D_A=Dn,
        D_B=R,
        D_V=Dv,
        BLOCK_A=_dot_dim(Dn),
        BLOCK_B=_dot_dim(R),
        BLOCK_V=_dot_dim(Dv),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        FP32_DOT=q.dtype == torch.float32,
        INTERPRET=interp,
        TILES_C=tiles_c,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out, lse
