"""PyTorch references for every kernel in pdserve_kernels.

These are the CPU implementation the engine runs (through `pdserve.model.ops`) and the
oracle the Triton kernels are tested against (upcast to float64 in the tests). Plain torch,
no Triton import, so they work everywhere.

Legend: B batch (sequences or flattened tokens), S query tokens per sequence, H heads,
D record / head dim, K top-k, N KV slots, T tokens, E experts, I expert intermediate size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _up(t: torch.Tensor) -> torch.Tensor:
    """float32 math, or float64 when given float64 (the tests' oracle)."""
    return t.double() if t.dtype == torch.float64 else t.float()


def sparse_mla_decode_ref(
    q: torch.Tensor,  # [B, S, H, D]
    kv: torch.Tensor,  # [N, D], any row stride; V = kv[:, :d_v]
    indices: torch.Tensor,  # [B, S, K] int32 slot ids, -1 = padding
    sm_scale: float,
    d_v: int,
    sink: torch.Tensor | None = None,  # [H] attention-sink logits (DeepSeek-V4)
    extra_kv: torch.Tensor | None = None,  # [N2, D] a second key source
    extra_indices: torch.Tensor | None = None,  # [B, S, K2] int32 rows of extra_kv, -1 = padding
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over its own K gathered KV rows (and K2 rows of extra_kv, in
    the same softmax). Returns (out [B,S,H,d_v] in q's dtype, lse [B,S,H] float32, natural
    log). All-padding queries get zeros and lse=-inf. The sink adds exp(sink[h]) to the
    softmax denominator only (it has no value row)."""
    valid = indices >= 0  # [B, S, K]
    rows = _up(kv[indices.clamp(min=0).long()])  # [B, S, K, D]
    if extra_kv is not None:
        valid = torch.cat([valid, extra_indices >= 0], dim=2)
        rows = torch.cat([rows, _up(extra_kv[extra_indices.clamp(min=0).long()])], dim=2)
    scores = torch.einsum("bshd,bskd->bshk", _up(q), rows) * sm_scale
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, S, H]
    if sink is not None:
        lse_all = torch.logaddexp(lse, _up(sink)[None, None, :])
    else:
        lse_all = lse
    probs = torch.exp(scores - lse_all[..., None])
    probs = torch.nan_to_num(probs, nan=0.0)  # all -inf rows
    out = torch.einsum("bshk,bskd->bshd", probs, rows[..., :d_v])
    return out.to(q.dtype), lse_all


def paged_slots(
    block_tables: torch.Tensor,  # [B, W] block ids
    seq_ids: torch.Tensor,  # [T] row of block_tables of each query
    context_lens: torch.Tensor,  # [T] keys of each query: positions 0..len-1
    page: int,
    max_len: int,
) -> torch.Tensor:
    """The slot ids [T, max_len] int32 of each query's positions 0..len-1, -1 beyond (what the
    paged kernels compute tile by tile; references and tests only: it is a [T, C] matrix)."""
    pos = torch.arange(max_len, device=block_tables.device)  # [C]
    rows = block_tables.long()[seq_ids.long()]  # [T, W]
    pages = (
        rows.gather(1, (pos // page).clamp(max=max(rows.shape[1] - 1, 0)).expand(len(seq_ids), -1))
        if max_len
        else rows[:, :0]
    )
    slots = pages * page + pos % page
    return torch.where(pos[None, :] < context_lens.long()[:, None], slots, -1).to(torch.int32)


def paged_mla_decode_ref(
    q: torch.Tensor,  # [T, 1, H, D]
    kv: torch.Tensor,  # [N, D]
    block_tables: torch.Tensor,  # [B, W]
    seq_ids: torch.Tensor,  # [T]
    context_lens: torch.Tensor,  # [T]
    page: int,
    max_len: int,
    sm_scale: float,
    d_v: int,
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense MLA decode over the paged pool: sparse_mla_decode_ref over each query's positions."""
    idx = paged_slots(block_tables, seq_ids, context_lens, page, max_len)[:, None]  # [T, 1, C]
    return sparse_mla_decode_ref(q, kv, idx, sm_scale, d_v, sink=sink)


def fused_moe_ref(
    x: torch.Tensor,  # [T, hidden]
    w13: torch.Tensor,  # [E, 2I, hidden], gate rows then up rows
    w2: torch.Tensor,  # [E, hidden, I]
    topk_weights: torch.Tensor,  # [T, k] float
    topk_ids: torch.Tensor,  # [T, k] int
    *,
    w13_scale_inv: torch.Tensor | None = None,  # fp8 weights only (see ref_fp8.py)
    w2_scale_inv: torch.Tensor | None = None,
    block_shape: tuple[int, int] = (128, 128),
    swiglu_limit: float | None = None,  # DeepSeek-V4: gate <= limit, -limit <= up <= limit
) -> torch.Tensor:
    """y[t] = sum_j topk_weights[t,j] * w2[e] @ (silu(gate_e x) * up_e x), e = topk_ids[t,j].
    float8_e4m3fn weights with block scales: `ref_fp8.fused_moe_fp8_ref`, activations quantized
    as the kernel does (not for float32 / float64 x)."""
    if w13.dtype == torch.float8_e4m3fn or w2.dtype == torch.float8_e4m3fn:
        if swiglu_limit is not None:
            raise ValueError("swiglu_limit is for bf16 / fp16 / fp32 weights here (FP8 experts: not built)")
        from pdserve_kernels.ref_fp8 import fused_moe_fp8_ref

        return fused_moe_fp8_ref(
            x,
            w13,
            w2,
            w13_scale_inv,
            w2_scale_inv,
            topk_weights,
            topk_ids,
            block_shape=block_shape,
            act_quant=x.dtype not in (torch.float32, torch.float64),
        )
    T, hidden = x.shape
    y = torch.zeros(T, hidden, dtype=_up(x).dtype, device=x.device)
    inter = w2.shape[2]
    flat_ids = topk_ids.reshape(-1)
    for e in torch.unique(flat_ids).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        h = _up(x[tok]) @ _up(w13[e]).t()  # [n, 2I]
        gate, up = h[:, :inter], h[:, inter:]
        if swiglu_limit is not None:
            gate, up = gate.clamp(max=swiglu_limit), up.clamp(min=-swiglu_limit, max=swiglu_limit)
        act = F.silu(gate) * up
        out = act @ _up(w2[e]).t()  # [n, hidden]
        y.index_add_(0, tok, out * _up(topk_weights[tok, slot, None]).to(y.dtype))
    return y.to(x.dtype)


def indexer_topk_ref(
    q: torch.Tensor,  # [T, H, D] index queries (rope already applied)
    k_cache: torch.Tensor,  # [N, D] index keys, any row stride
    weights: torch.Tensor,  # [T, H] per-head weights (softmax scale and H^-0.5 folded in)
    candidates: torch.Tensor,  # [T, C] int32 slot ids a query may attend to (causal), -1 = padding
    topk: int,
) -> torch.Tensor:
    """DSA lightning indexer: score[t,c] = sum_h weights[t,h] * relu(q[t,h] . k[c]) over the
    candidate slots; returns the top-k candidate slot ids [T, min(topk, C)] int32 by descending
    score, -1 where a query has fewer candidates."""
    valid = candidates >= 0
    keys = _up(k_cache[candidates.clamp(min=0).long()])  # [T, C, D]
    logits = torch.relu(torch.einsum("thd,tcd->thc", _up(q), keys))
    scores = torch.einsum("th,thc->tc", _up(weights).to(logits.dtype), logits)
    scores = scores.masked_fill(~valid, float("-inf"))
    top = topk_first(scores, min(topk, candidates.shape[1]))
    picked = torch.gather(candidates, 1, top.indices)
    return torch.where(torch.isinf(top.values), torch.full_like(picked, -1), picked).to(torch.int32)


def topk_first(scores: torch.Tensor, k: int) -> torch.return_types.topk:
    """torch.topk over the last dim with ties at the k-th value taken in position order (-0 as +0),
    the kernels' rule. torch.topk's pick among equal scores changes with the row's length, and
    ReLU'd index scores tie exactly (at 0) often: a decode step and a prefill of the same prefix
    would read different entries."""
    top = scores.sort(dim=-1, descending=True, stable=True)
    return torch.return_types.topk((top.values[..., :k], top.indices[..., :k]))


def indexer_topk_paged_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    weights: torch.Tensor,
    block_tables: torch.Tensor,
    seq_ids: torch.Tensor,
    context_lens: torch.Tensor,
    page: int,
    max_len: int,
    topk: int,
) -> torch.Tensor:
    """indexer_topk_ref over each query's positions 0..len-1 (see paged_slots)."""
    cand = paged_slots(block_tables, seq_ids, context_lens, page, max_len)
    return indexer_topk_ref(q, k_cache, weights, cand, topk)


def mla_prefill_attention_ref(
    q: torch.Tensor,  # [T, H, Dn + R]
    k_nope: torch.Tensor,  # [S, H, Dn]
    k_rope: torch.Tensor,  # [S, R], shared by every head
    v: torch.Tensor,  # [S, H, Dv]
    cu_seqlens_q: torch.Tensor,  # [B + 1] chunk boundaries in q
    cu_seqlens_k: torch.Tensor,  # [B + 1] context (prefix + chunk) boundaries in k / v
    max_seqlen_q: int,
    sm_scale: float,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-absorbed MLA prefill (kernel: mla_prefill.py): the chunk's query i, at position
    P + i (P = len_k - len_q, the cached prefix), attends to keys 0..P + i of its sequence.
    Returns (out [T, H, Dv] in q's dtype, lse [T, H] float32, natural log)."""
    T, H, _ = q.shape
    out = torch.zeros(T, H, v.shape[2], dtype=_up(q).dtype, device=q.device)
    lse = torch.zeros(T, H, dtype=out.dtype, device=q.device)
    for b in range(cu_seqlens_q.numel() - 1):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        k0, k1 = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        if q1 == q0:
            continue
        k_h = torch.cat([_up(k_nope[k0:k1]), _up(k_rope[k0:k1, None, :]).expand(-1, H, -1)], -1)  # [Lk, H, Dq]
        scores = torch.einsum("qhd,khd->hqk", _up(q[q0:q1]), k_h) * sm_scale
        pos = (k1 - k0) - (q1 - q0) + torch.arange(q1 - q0, device=q.device)  # [Lq]
        seen = torch.arange(k1 - k0, device=q.device)[None, :] <= pos[:, None]  # [Lq, Lk]
        scores = scores.masked_fill(~seen, float("-inf"))
        lse[q0:q1] = torch.logsumexp(scores, -1).transpose(0, 1)
        out[q0:q1] = torch.einsum("hqk,khv->qhv", torch.softmax(scores, -1), _up(v[k0:k1]))
    return out.to(q.dtype), lse.float()


def hc_mix_ref(
    mixes: torch.Tensor,  # [T, (2+N)*N]: the projection of a token's normalized streams
    base: torch.Tensor,  # [(2+N)*N]
    scale: torch.Tensor,  # [3]: pre, post, comb
    n: int,
    iters: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's hyper-connection gates as transformers computes them: pre [T, N] and post [T, N]
    (sigmoids), comb [T, N, N] (a softmax over its last axis pushed towards a doubly-stochastic
    matrix by Sinkhorn-Knopp iterations). float32 math (float64 when given float64)."""
    mixes, base, scale = _up(mixes), _up(base), _up(scale)
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * scale[2] + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def copy_blocks_ref(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """dst[:, dst_ids] = src[:, src_ids] (kernel: block_copy.py); src [L, Ns, W], dst [L, Nd, W]."""
    dst[:, dst_ids.long()] = src[:, src_ids.long()].to(dst.device)


def checksum_blocks_ref(
    words: torch.Tensor, ids: torch.Tensor | None, acc: torch.Tensor, n: int | None = None, per_block: bool = False
) -> None:
    """acc[0] += the weighted word-sum checksum of blocks ids of words [L, N, W] (kernel:
    kv_checksum.py, which gives the formula); ids < 0 skipped, None: every block; int64, wrapping.
    per_block: acc[i] += block i's own terms."""
    L, N = words.shape[:2]
    ids = torch.arange(N) if ids is None else ids.long().cpu()
    n = ids.numel() if n is None else n
    pos = torch.nonzero(ids >= 0).flatten()
    sums = words[:, ids[pos].to(words.device)].sum(-1, dtype=torch.int64)  # [L, kept]
    weights = torch.arange(L, device=words.device)[:, None] * n + pos.to(words.device)[None, :]
    terms = sums * (2 * weights + 1)  # [L, kept]
    if per_block:
        acc[pos.to(acc.device)] += terms.sum(0).to(acc.device)
    else:
        acc[0] += terms.sum()
