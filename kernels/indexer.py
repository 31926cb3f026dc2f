"""DSA lightning indexer: index scores over candidate slots (Triton) and their top-k (torch).

score[t, c] = sum_h weights[t, h] * relu(q[t, h] . k[cand[t, c]]), -inf where cand = -1.
Grid (C / BC, T): a program gathers BC candidate keys once and scores them against all H index
heads of its query in one `tl.dot` ([BH, D] x [D, BC]); the ReLU and the weighted head sum stay in
registers, so only the [T, C] float32 scores reach memory. The top-k selection takes ties at the k-th
score in position order (`ref.topk_first`; paged: one kernel, `_select_slots`, selects and turns
positions into slots).
Paged candidates (`indexer_topk_paged`): query t's candidates are positions 0..len-1 of its
sequence, their slots computed in the kernel from the block table (no [T, C] candidate matrix),
and the queries are scored in row chunks so the transient scores stay under SCORES_BYTES.

Legend: T query tokens, H index heads, D index head dim, N key slots, C candidates, BC tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve_kernels import configs
from pdserve_kernels._launch import capability, cdiv, next_pow2
from pdserve_kernels.ref import topk_first


@triton.jit
def _index_scores_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    cand_ptr,
    score_ptr,
    bt_ptr,
    seq_ptr,
    len_ptr,
    H,
    D,
    C,
    s_qt,
    s_qh,
    s_qd,
    s_kn,
    s_kd,
    s_wt,
    s_wh,
    s_ct,
    s_cc,
    s_bt,
    w_scale,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_C: tl.constexpr,
    FP32_DOT: tl.constexpr,
    PAGED: tl.constexpr = False,
    PAGE: tl.constexpr = 1,
):
    pid_c = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    h_ok = offs_h < H
    d_ok = offs_d < D
    q = tl.load(
        q_ptr + t * s_qt + offs_h[:, None] * s_qh + offs_d[None, :] * s_qd,
        mask=h_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    w = tl.load(w_ptr + t * s_wt + offs_h * s_wh, mask=h_ok, other=0.0).to(tl.float32) * w_scale  # float32 product
    if PAGED:  # offs_c are positions of the query's sequence
        seen = offs_c < tl.load(len_ptr + t)
        page = tl.load(bt_ptr + tl.load(seq_ptr + t).to(tl.int64) * s_bt + offs_c // PAGE, mask=seen, other=0)
        cand = tl.where(seen, page * PAGE + offs_c % PAGE, -1)
    else:
        cand = tl.load(cand_ptr + t * s_ct + offs_c * s_cc, mask=offs_c < C, other=-1)
    valid = cand >= 0
    keys = tl.load(
        k_ptr + cand.to(tl.int64)[:, None] * s_kn + offs_d[None, :] * s_kd,
        mask=valid[:, None] & d_ok[None, :],
        other=0.0,
    )
    if FP32_DOT:
        logits = tl.dot(q, tl.trans(keys), input_precision="ieee")  # [BH, BC]
    else:
        logits = tl.dot(q, tl.trans(keys))
    score = tl.sum(tl.maximum(logits, 0.0) * w[:, None], 0)  # [BC]
    score = tl.where(valid, score, float("-inf"))
    tl.store(score_ptr + t * C + offs_c, score, mask=offs_c < C)


SCORES_BYTES = 256 << 20  # transient [rows, C] float32 scores of one chunk of paged queries


def index_scores(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    weights: torch.Tensor,
    candidates: torch.Tensor | None,
    paged: tuple | None = None,
    weight_scale: float = 1.0,
) -> torch.Tensor:
    """scores [T, C] float32 (-inf at padding); shapes as in `indexer_topk`. paged:
    (block_tables, seq_ids, context_lens, page, max_len) instead of candidates (C = max_len).
    The weights are read as weights.float() * weight_scale."""
    T, H, D = q.shape
    C = candidates.shape[1] if paged is None else paged[4]
    scores = torch.empty(T, C, dtype=torch.float32, device=q.device)
    if T == 0 or C == 0:
        return scores
    if paged is None:
        tables, seq_ids, lens, page = candidates, candidates, candidates, 1  # tables..lens unused
    else:
        tables, seq_ids, lens, page, _ = paged
        candidates = lens.view(T, 1)  # unused
    cfg = configs.indexer_config(capability(q.device))
    _index_scores_kernel[(cdiv(C, cfg.block_c), T)](
        q,
        k_cache,
        weights,
        candidates,
        scores,
        tables,
        seq_ids,
        lens,
        H,
        D,
        C,
        *q.stride(),
        *k_cache.stride(),
        *weights.stride(),
        *candidates.stride(),
        tables.stride(0),
        weight_scale,
        BLOCK_H=max(16, next_pow2(H)),
        BLOCK_D=max(16, next_pow2(D)),
        BLOCK_C=cfg.block_c,
        FP32_DOT=q.dtype == torch.float32,
        PAGED=paged is not None,
        PAGE=page,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return scores


def indexer_topk(
    q: torch.Tensor,  # [T, H, D] index queries (rope applied), bf16/fp16/fp32
    k_cache: torch.Tensor,  # [N, D] index keys, q's dtype, any strides
    weights: torch.Tensor,  # [T, H] per-head weights (softmax scale and H^-0.5 folded in)
    candidates: torch.Tensor,  # [T, C] int32 slot ids a query may attend to, -1 = padding
    topk: int,
) -> torch.Tensor:
    """Top-k candidate slot ids [T, min(topk, C)] int32 by descending index score, -1 where a
    query has fewer valid candidates. Same contract as `ref.indexer_topk_ref`."""
    if q.dim() != 3 or k_cache.dim() != 2 or k_cache.shape[1] != q.shape[2]:
        raise ValueError(f"q must be [T, H, D] and k_cache [N, D]; got {tuple(q.shape)}, {tuple(k_cache.shape)}")
    if tuple(weights.shape) != tuple(q.shape[:2]):
        raise ValueError(f"weights must be [T, H] = {tuple(q.shape[:2])}, got {tuple(weights.shape)}")
    if candidates.dim() != 2 or candidates.shape[0] != q.shape[0] or candidates.dtype != torch.int32:
        raise ValueError(
            f"candidates must be int32 [T={q.shape[0]}, C], got {candidates.dtype} {tuple(candidates.shape)}"
        )
    if k_cache.dtype != q.dtype:
        raise ValueError(f"k_cache dtype {k_cache.dtype} must match q dtype {q.dtype}")
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    scores = index_scores(q, k_cache, weights, candidates)
    top = topk_first(scores, min(topk, candidates.shape[1]))  # ties in position order, as select_slots
    picked = torch.gather(candidates, 1, top.indices)
    return torch.where(torch.isinf(top.values), torch.full_like(picked, -1), picked)


def indexer_topk_paged(
    q: torch.Tensor,  # [T, H, D] index queries (rope applied)
    k_cache: torch.Tensor,  # [N, D] index keys, q's dtype
    weights: torch.Tensor,  # [T, H]
    block_tables: torch.Tensor,  # [B, W] int32
    seq_ids: torch.Tensor,  # [T] int32, each query's row of block_tables
    context_lens: torch.Tensor,  # [T] int32, candidates: positions 0..len-1 of that sequence
    page: int,  # tokens per block
    max_len: int,  # >= every context_lens entry
    topk: int,
    weight_scale: float = 1.0,  # the weights read as weights.float() * weight_scale
) -> torch.Tensor:
    """`indexer_topk` over paged candidates: the top-k slot ids [T, min(topk, max_len)] int32,
    -1 where a query has fewer candidates (reference: `ref.indexer_topk_paged_ref`)."""
    T = q.shape[0]
    for name, t in (("seq_ids", seq_ids), ("context_lens", context_lens)):
        if t.dtype != torch.int32 or tuple(t.shape) != (T,):
            raise ValueError(f"{name} must be int32 [{T}], got {t.dtype} {tuple(t.shape)}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(f"block_tables must be int32 [B, W], got {block_tables.dtype} {tuple(block_tables.shape)}")
    if k_cache.dtype != q.dtype or tuple(weights.shape) != tuple(q.shape[:2]) or topk < 1:
        raise ValueError("k_cache must have q's dtype, weights [T, H], topk >= 1")
    k = min(topk, max_len)
    out = torch.empty((T, k), dtype=torch.int32, device=q.device)  # every row written below
    rows = max(1, SCORES_BYTES // (4 * max(max_len, 1)))
    for r0 in range(0, T if k else 0, rows):
        r = slice(r0, min(T, r0 + rows))
        paged = (block_tables, seq_ids[r], context_lens[r], page, max_len)
        select_slots(
            index_scores(q[r], k_cache, weights[r], None, paged, weight_scale),
            block_tables,
            seq_ids[r],
            page,
            k,
            out[r],
        )
    return out


def select_slots(
    scores: torch.Tensor,  # [T, C] float32 over positions 0..C-1 of each query's sequence, -inf: none
    block_tables: torch.Tensor,  # [B, W] int32
    seq_ids: torch.Tensor,  # [T] int32
    page: int,
    k: int,  # 1 <= k <= C
    out: torch.Tensor | None = None,  # [T, k] int32
) -> torch.Tensor:
    """The slots of each row's k largest scores (in position order, ties at the k-th value taken
    by position), -1 for a chosen -inf: `torch.topk` + the block-table lookup in one launch."""
    T, C = scores.shape
    if not 1 <= k <= C or scores.dtype != torch.float32 or not scores.is_contiguous():
        raise ValueError(
            f"scores must be contiguous float32 [T, C >= k], got {scores.dtype} {tuple(scores.shape)}, k {k}"
        )
    out = torch.empty((T, k), dtype=torch.int32, device=scores.device) if out is None else out
    tile = min(next_pow2(C), SELECT_TILE)
    search = C <= tile  # a longer row: one program re-reading it 32 times would be slow; torch finds the k-th
    kth = scores if search else scores.topk(k, dim=-1, sorted=False).values.amin(dim=-1)  # [T]
    if T:
        _select_slots[(T,)](
            scores, kth, C, block_tables, block_tables.stride(0), seq_ids, out, page, k,
            TILE=tile, TILES=cdiv(C, tile), SEARCH=search, num_warps=8 if tile >= 2048 else 4,
        )  # fmt: skip
    return out


SELECT_TILE = 4096  # scores a program holds in registers (16 a thread at 8 warps)


@triton.jit
def _order_keys(s):
    """float32 -> int64 in [0, 2^32) with the floats' order (negatives' bits flipped; -0 as +0)."""
    b = s.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    b = tl.where(b == 0x80000000, 0, b)
    return tl.where(b >= 0x80000000, 0xFFFFFFFF - b, b + 0x80000000)


@triton.jit
def _select_slots(
    s_ptr, kth_ptr, C, bt_ptr, stride_bt, seq_ptr, out_ptr, page, k,
    TILE: tl.constexpr, TILES: tl.constexpr, SEARCH: tl.constexpr,
):  # fmt: skip
    """A query's top-k of its C scores -> their slots (block_tables[seq, p // page] * page + p % page),
    -1 where the score is infinite (no candidate), in position order: one launch for torch.topk's
    sort and gather plus the slot lookup. SEARCH (a row of one tile, in registers): the k-th
    largest score is found bit by bit (32 counts of "keys >= candidate"); else it is read from
    kth_ptr [T]. The scores above it and the first ties at it are compacted by a prefix sum."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, TILE)
    row = s_ptr + t * C
    keys = _order_keys(tl.load(row + i, mask=i < C, other=0.0))
    keys = tl.where(i < C, keys, -1)  # padding lanes sort below everything, -inf included
    if SEARCH:
        tau = tl.zeros((), dtype=tl.int64)
        for bit in tl.static_range(31, -1, -1):
            cand = tau | (1 << bit)
            tau = tl.where(tl.sum((keys >= cand).to(tl.int32), 0) >= k, cand, tau)
    else:
        tau = _order_keys(tl.load(kth_ptr + t))
    seq = tl.load(seq_ptr + t).to(tl.int64)
    base = tl.zeros((), dtype=tl.int32)  # slots written so far
    ties = k - tl.zeros((), dtype=tl.int32)  # ties at tau still to take: k minus the count above tau
    for j in range(TILES):
        x = keys if TILES == 1 else _order_keys(tl.load(row + j * TILE + i, mask=j * TILE + i < C, other=0.0))
        x = tl.where(j * TILE + i < C, x, -1)
        ties -= tl.sum((x > tau).to(tl.int32), 0)
    for j in range(TILES):
        p = j * TILE + i
        x = keys if TILES == 1 else _order_keys(tl.load(row + p, mask=p < C, other=0.0))
        x = tl.where(p < C, x, -1)
        eq = (x == tau).to(tl.int32)
        take = (x > tau) | ((eq == 1) & (tl.cumsum(eq, 0) <= ties))
        ties -= tl.sum(eq, 0)
        at = base + tl.cumsum(take.to(tl.int32), 0) - 1
        block = tl.load(bt_ptr + seq * stride_bt + p // page, mask=take, other=0)
        slot = block.to(tl.int64) * page + p % page
        inf = (x == 0x007FFFFF) | (x == 0xFF800000)  # -inf, +inf as order keys
        tl.store(out_ptr + t * k + at, tl.where(inf, -1, slot).to(tl.int32), mask=take)
        base += tl.sum(take.to(tl.int32), 0)
