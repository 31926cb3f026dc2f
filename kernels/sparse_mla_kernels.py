"""The Triton kernels of sparse / paged MLA decode; `sparse_mla.py` checks the arguments, plans
the launch (tiles, split count) and runs them.

Legend: B batch, S query tokens per sequence, H heads, D record dim (d_v value dims + D - d_v
rope dims), K top-k, P splits, BH heads per program, BN rows per tile.

Pass 1 (`_mla_split_kernel`), grid (H / BH, P, B * S): a program gathers BN KV rows of its query
once and uses the tile for all BH heads (heads are the M dimension of `tl.dot`, on tensor cores):
scores = q[BH, D] @ kv[BN, D]^T, online softmax in base 2, acc[BH, d_v] += p @ kv[BN, :d_v].
With one split it writes the final output; otherwise each split writes its normalized partial
output and its log-sum-exp, and the splits are merged by LSE (plus the attention sink) either in
the same launch (FUSED_MERGE: the last split program of each (query, head block) to arrive,
counted by an atomic counter that it resets, merges them; no second launch, graph-safe) or by
pass 2 (`_mla_merge_kernel`, grid (H, B * S, d_v chunks)).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _mla_split_kernel(
    q_ptr,
    kv_ptr,
    idx_ptr,
    sink_ptr,
    out_ptr,
    lse_ptr,
    part_out_ptr,
    part_lse_ptr,
    cnt_ptr,
    bt_ptr,
    seq_ptr,
    len_ptr,
    kv2_ptr,
    idx2_ptr,
    scale_log2,
    H,
    K,
    K1,
    tiles_per_split,
    s_qb,
    s_qh,
    s_qd,
    s_kvn,
    s_kvd,
    s_ib,
    s_ik,
    s_ob,
    s_oh,
    s_pb,
    s_ps,
    s_ph,
    s_bt,
    s_kv2n,
    s_i2b,
    s_i2k,
    D_V: tl.constexpr,
    D_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_SINK: tl.constexpr,
    DIRECT: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    KV_FP8: tl.constexpr,
    GROUP: tl.constexpr,
    FP32_DOT: tl.constexpr,
    INTERPRET: tl.constexpr,
    TILES_C: tl.constexpr,
    SPLITS_C: tl.constexpr,
    PAGED: tl.constexpr = False,
    PAGE: tl.constexpr = 1,
    EXTRA: tl.constexpr = False,
    KV_V4: tl.constexpr = False,
    V4_NOPE: tl.constexpr = 0,
    V4_SB: tl.constexpr = 8,
    V4_PAGE: tl.constexpr = 1,
):
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_v = tl.arange(0, BLOCK_V)
    offs_t = tl.arange(0, BLOCK_T)
    h_ok = offs_h < H
    v_ok = offs_v < D_V
    t_ok = offs_t < D_T

    q_rows = q_ptr + pid_b * s_qb + offs_h[:, None] * s_qh
    q_v = tl.load(q_rows + offs_v[None, :] * s_qd, mask=h_ok[:, None] & v_ok[None, :], other=0.0)
    if D_T > 0:
        q_t = tl.load(q_rows + (D_V + offs_t)[None, :] * s_qd, mask=h_ok[:, None] & t_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)

    start = pid_s * tiles_per_split * BLOCK_N
    n_tiles = tiles_per_split
    if PAGED:
        seq = tl.load(seq_ptr + pid_b).to(tl.int64)
        ctx = tl.load(len_ptr + pid_b)
        # only the tiles below this query's context: the grid is sized for the longest one (or
        # for a CUDA graph's bound), so shorter queries leave their splits early
        n_tiles = tl.minimum(tiles_per_split, tl.maximum(ctx - start + BLOCK_N - 1, 0) // BLOCK_N)
    for i in range(0, TILES_C if INTERPRET else n_tiles):  # see _launch.interpreting
        offs_n = start + i * BLOCK_N + tl.arange(0, BLOCK_N)
        if PAGED:  # offs_n are positions of the query's sequence
            seen = offs_n < ctx
            page = tl.load(bt_ptr + seq * s_bt + offs_n // PAGE, mask=seen, other=0)
            idx = tl.where(seen, page * PAGE + offs_n % PAGE, -1)
        else:
            idx = tl.load(idx_ptr + pid_b * s_ib + offs_n * s_ik, mask=offs_n < K1, other=-1)
            if EXTRA:  # key list K1.. reads the second source
                idx_x = tl.load(
                    idx2_ptr + pid_b * s_i2b + (offs_n - K1) * s_i2k, mask=(offs_n >= K1) & (offs_n < K), other=-1
                )
                idx = tl.where(offs_n < K1, idx, idx_x)
        valid = idx >= 0
        if EXTRA:  # (not with KV_V4: its wrapper takes one source)
            rows = tl.where(
                (offs_n < K1)[:, None],
                kv_ptr + idx.to(tl.int64)[:, None] * s_kvn,
                kv2_ptr + idx.to(tl.int64)[:, None] * s_kv2n,
            )
        else:
            rows = kv_ptr + idx.to(tl.int64)[:, None] * s_kvn
        if KV_V4:  # s_kvn: the page stride
            kv_v = _v4_rows(
                kv_ptr, idx, valid, s_kvn, offs_v, D_V, V4_NOPE, V4_SB, V4_PAGE, BLOCK_N, BLOCK_V, q_v.dtype
            )
        elif KV_FP8:
            # record: D_V e4m3 bytes | D_V / GROUP fp32 scales | D_T bf16 tail
            NG: tl.constexpr = BLOCK_V // GROUP
            raw = tl.load(rows + offs_v[None, :], mask=valid[:, None], other=0)
            vals = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            offs_g = tl.arange(0, NG)
            scales = tl.load(
                (rows + D_V).to(tl.pointer_type(tl.float32)) + offs_g[None, :], mask=valid[:, None], other=0.0
            )
            vals = tl.reshape(vals, [BLOCK_N, NG, GROUP]) * scales[:, :, None]
            kv_v = tl.reshape(vals, [BLOCK_N, BLOCK_V]).to(q_v.dtype)
            if D_T > 0:
                tail = (rows + D_V + 4 * NG).to(tl.pointer_type(tl.bfloat16))
                kv_t = tl.load(tail + offs_t[None, :], mask=valid[:, None] & t_ok[None, :], other=0.0).to(q_v.dtype)
        else:
            kv_v = tl.load(rows + offs_v[None, :] * s_kvd, mask=valid[:, None] & v_ok[None, :], other=0.0)
            if D_T > 0:
                kv_t = tl.load(rows + (D_V + offs_t)[None, :] * s_kvd, mask=valid[:, None] & t_ok[None, :], other=0.0)
        if FP32_DOT:
            s = tl.dot(q_v, tl.trans(kv_v), input_precision="ieee")
            if D_T > 0:
                s += tl.dot(q_t, tl.trans(kv_t), input_precision="ieee")
        else:
            s = tl.dot(q_v, tl.trans(kv_v))
            if D_T > 0:
                s += tl.dot(q_t, tl.trans(kv_t))
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))  # [BH, BN], base-2 logits
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid row yet: keep exp2 finite
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, kv_v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(kv_v.dtype), kv_v)
        m_i = m_new

    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse2 = m_safe + tl.log2(l_i)  # -inf when the split saw no valid row
    out_mask = h_ok[:, None] & v_ok[None, :]
    if DIRECT:
        if HAS_SINK:
            sink2 = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            top = tl.maximum(lse2, sink2)
            lse2 = top + tl.log2(tl.exp2(lse2 - top) + tl.exp2(sink2 - top))
        denom = tl.where(lse2 == float("-inf"), 0.0, lse2)
        o = acc * tl.exp2(m_safe - denom)[:, None]
        o_ptrs = out_ptr + pid_b * s_ob + offs_h[:, None] * s_oh + offs_v[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=out_mask)
        tl.store(lse_ptr + pid_b * H + offs_h, lse2 * 0.6931471805599453, mask=h_ok)
    else:
        denom = tl.where(lse2 == float("-inf"), 0.0, lse2)
        o = acc * tl.exp2(m_safe - denom)[:, None]
        base = pid_b * s_pb + pid_s * s_ps
        tl.store(part_out_ptr + base + offs_h[:, None] * s_ph + offs_v[None, :], o, mask=out_mask)
        tl.store(part_lse_ptr + (pid_b * tl.num_programs(1) + pid_s) * H + offs_h, lse2, mask=h_ok)
        if FUSED_MERGE:
            # The last split program of this (query, head block) to arrive merges all splits:
            # the barrier orders every thread's partial stores before the counter's release.
            tl.debug_barrier()
            cnt = cnt_ptr + pid_b * tl.num_programs(0) + pid_h
            arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if arrived == tl.num_programs(1) - 1:
                _merge_head_block(
                    part_out_ptr,
                    part_lse_ptr,
                    sink_ptr,
                    out_ptr,
                    lse_ptr,
                    pid_b,
                    offs_h,
                    h_ok,
                    offs_v,
                    out_mask,
                    H,
                    tl.num_programs(1),
                    s_pb,
                    s_ps,
                    s_ph,
                    s_ob,
                    s_oh,
                    BLOCK_H,
                    BLOCK_V,
                    HAS_SINK,
                    INTERPRET,
                    SPLITS_C,
                )
                tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # zero for the next launch


@triton.jit
def _v4_rows(
    kv_ptr,
    idx,
    valid,
    s_page,
    offs_v,
    D: tl.constexpr,
    NOPE: tl.constexpr,
    SB: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    DT: tl.constexpr,
):
    """[BN, BLOCK_V] K = V rows in dtype DT (q's) of slots idx from fp8_ds_v4 pages (kv_fp8.py):
    slot s is record s % PAGE of page s // PAGE; its NOPE e4m3 values times their group's ue8m0
    scale, then its D - NOPE bf16 rope values; zero where not valid or past D. The scaling runs
    in DT: e4m3 x a power of two is one rounding either way (exact in bf16 / fp32), so the tile
    never exists in float32 (the [rows, 8, 64] byte tile is faster than a [rows, 512] tile scaled
    in float32: docs/kernels.md)."""
    VB: tl.constexpr = NOPE + 2 * (D - NOPE)  # value bytes of a record
    NG: tl.constexpr = BLOCK_V // 64
    slot = tl.where(valid, idx, 0).to(tl.int64)
    s_page = tl.multiple_of(s_page, 8)  # checked by the wrapper: 8-byte loads even at P = 1 (584 B)
    page = kv_ptr + (slot // PAGE) * s_page
    rec = slot % PAGE
    vals_at = page + rec * VB  # [BN]
    offs_g = tl.arange(0, NG)
    col = offs_g[:, None] * 64 + tl.arange(0, 64)[None, :]  # [NG, 64]: value index of (group, lane)
    nope = col < NOPE
    ok = valid[:, None, None]
    raw = tl.load(vals_at[:, None, None] + col[None, :, :], mask=ok & nope[None, :, :], other=0)
    e = tl.load(
        (page + PAGE * VB + rec * SB)[:, None] + offs_g[None, :],
        mask=valid[:, None] & (offs_g * 64 < NOPE)[None, :],
        other=0,
    )
    scale = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True).to(DT)  # ue8m0 byte b: 2^(b - 127)
    vals = raw.to(tl.float8e4nv, bitcast=True).to(DT) * scale[:, :, None]
    rope_at = (vals_at + NOPE).to(tl.pointer_type(tl.bfloat16))
    rope = tl.load(
        rope_at[:, None, None] + (col - NOPE)[None, :, :], mask=ok & (~nope & (col < D))[None, :, :], other=0.0
    )
    return tl.reshape(tl.where(nope[None, :, :], vals, rope.to(DT)), [BLOCK_N, BLOCK_V])


@triton.jit
def _merge_head_block(
    part_out_ptr,
    part_lse_ptr,
    sink_ptr,
    out_ptr,
    lse_ptr,
    pid_b,
    offs_h,
    h_ok,
    offs_v,
    out_mask,
    H,
    n_splits,
    s_pb,
    s_ps,
    s_ph,
    s_ob,
    s_oh,
    BLOCK_H: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HAS_SINK: tl.constexpr,
    INTERPRET: tl.constexpr,
    SPLITS_C: tl.constexpr,
):
    """out[h] = sum_p 2^(lse_p[h] - lse[h]) * o_p[h] over one query's splits, for BH heads; the
    partials are read through L2 (.cg): other programs wrote them during this launch."""
    lse_rows = part_lse_ptr + pid_b * n_splits * H + offs_h
    top = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for p in range(0, SPLITS_C if INTERPRET else n_splits):
        top = tl.maximum(top, tl.load(lse_rows + p * H, mask=h_ok, other=float("-inf"), cache_modifier=".cg"))
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    rows = part_out_ptr + pid_b * s_pb + offs_h[:, None] * s_ph + offs_v[None, :]
    for p in range(0, SPLITS_C if INTERPRET else n_splits):
        w = tl.exp2(tl.load(lse_rows + p * H, mask=h_ok, other=float("-inf"), cache_modifier=".cg") - top)
        total += w
        acc += w[:, None] * tl.load(rows + p * s_ps, mask=out_mask, other=0.0, cache_modifier=".cg")
    lse2 = top + tl.log2(total)  # -inf when no split saw a valid row
    if HAS_SINK:
        sink2 = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        t2 = tl.maximum(lse2, sink2)
        lse2 = t2 + tl.log2(tl.exp2(lse2 - t2) + tl.exp2(sink2 - t2))
    denom = tl.where(lse2 == float("-inf"), 0.0, lse2)
    o = acc * tl.exp2(top - denom)[:, None]
    o_ptrs = out_ptr + pid_b * s_ob + offs_h[:, None] * s_oh + offs_v[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=out_mask)
    tl.store(lse_ptr + pid_b * H + offs_h, lse2 * 0.6931471805599453, mask=h_ok)


@triton.jit
def _mla_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    sink_ptr,
    out_ptr,
    lse_ptr,
    H,
    num_splits,
    s_pb,
    s_ps,
    s_ph,
    s_ob,
    s_oh,
    D_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_P: tl.constexpr,
    HAS_SINK: tl.constexpr,
):
    """Grid (H, B * S, d_v / BLOCK_DV): one head's BLOCK_DV output values from all splits at
    once, one [BLOCK_P, BLOCK_DV] load (no loop over splits: at B = 1 the merge is one memory
    round trip, which is what bounds it)."""
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_p = tl.arange(0, BLOCK_P)
    p_ok = offs_p < num_splits
    offs_v = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    v_ok = offs_v < D_V
    rows = tl.load(
        part_out_ptr + b * s_pb + offs_p[:, None] * s_ps + h * s_ph + offs_v[None, :],
        mask=p_ok[:, None] & v_ok[None, :],
        other=0.0,
    )
    lses = tl.load(part_lse_ptr + (b * num_splits + offs_p) * H + h, mask=p_ok, other=float("-inf"))
    top = tl.max(lses, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lses - top)
    lse2 = top + tl.log2(tl.sum(w, 0))  # -inf when no split saw a valid row
    if HAS_SINK:
        sink2 = tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634
        t2 = tl.maximum(lse2, sink2)
        lse2 = t2 + tl.log2(tl.exp2(lse2 - t2) + tl.exp2(sink2 - t2))
    denom = tl.where(lse2 == float("-inf"), 0.0, lse2)
    acc = tl.sum(w[:, None] * rows, 0) * tl.exp2(top - denom)
    tl.store(out_ptr + b * s_ob + h * s_oh + offs_v, acc.to(out_ptr.dtype.element_ty), mask=v_ok)
    if tl.program_id(2) == 0:
        tl.store(lse_ptr + b * H + h, lse2 * 0.6931471805599453)
