"""Sparse MLA decode attention: split-K over the top-k KV rows, all heads of a query per tile.

Legend: B batch, S query tokens per sequence, H heads, D record dim (d_v value dims + D - d_v
rope dims), K top-k, N KV slots, P splits, BH heads per program, BN rows per tile.

Pass 1 (`_mla_split_kernel`), grid (H / BH, P, B * S): a program gathers BN KV rows of its query
once and uses the tile for all BH heads (heads are the M dimension of `tl.dot`, on tensor cores):
scores = q[BH, D] @ kv[BN, D]^T, online softmax in base 2, acc[BH, d_v] += p @ kv[BN, :d_v].
With one split it writes the final output; otherwise each split writes its normalized partial
output and its log-sum-exp, and the splits are merged by LSE (plus the attention sink) either in
the same launch (`fused_merge`: the last split program of each (query, head block) to arrive,
counted by an atomic counter that it resets, merges them; no second launch, graph-safe) or by
pass 2 (`_mla_merge_kernel`, grid (H, B * S, d_v chunks)), whichever the config picks. The split count comes from the SM count and the work
(`num_splits`), so small batches still fill the GPU.

Key lists: `indices` [B, S, K] slot ids (sparse: the indexer's top-k), or paged
(`paged_mla_decode`, dense MLA): query row r reads positions 0..context_lens[r]-1 of sequence
seq_ids[r], slot = block_tables[seq, p // page] * page + p % page, computed in the kernel, so a
step's metadata is the block tables and two ints per query, never a [queries, context] matrix.

KV formats:
- bf16/fp16 (`sparse_mla_decode`): kv [N, D] in q's dtype, any row stride.
- fp8 (`sparse_mla_decode_fp8`): uint8 records, layout in `kv_fp8.py` (V3.2: 656 bytes =
  512 e4m3 + 4 fp32 scales, one per 128 values + 64 bf16 rope), dequantized in the kernel.
- fp8_v4 (`sparse_mla_decode_fp8_v4`, DeepSeek-V4, K = V): pages of P records (`kv_fp8.py`,
  "fp8_ds_v4": per page P x (448 e4m3 + 64 bf16 rope) then P x (7 ue8m0 scales + 1 pad) = P x 584
  bytes), dequantized in the kernel; the output has all 512 dims (rope included).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pdserve_kernels import configs, kv_fp8
from pdserve_kernels._launch import capability, cdiv, interpreting, next_pow2, sm_count

LOG2E = 1.4426950408889634
LAST_COMPILED: dict = {}  # kernel name -> last compiled kernel, for bench.py's resource report


@triton.jit
def _mla_split_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, cnt_ptr,
    bt_ptr, seq_ptr, len_ptr, kv2_ptr, idx2_ptr,
    scale_log2, H, K, K1, tiles_per_split,
    s_qb, s_qh, s_qd, s_kvn, s_kvd, s_ib, s_ik, s_ob, s_oh, s_pb, s_ps, s_ph, s_bt, s_kv2n, s_i2b, s_i2k,
    D_V: tl.constexpr, D_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr, HAS_SINK: tl.constexpr, DIRECT: tl.constexpr,
    FUSED_MERGE: tl.constexpr, KV_FP8: tl.constexpr, GROUP: tl.constexpr, FP32_DOT: tl.constexpr,
    INTERPRET: tl.constexpr, TILES_C: tl.constexpr, SPLITS_C: tl.constexpr,
    PAGED: tl.constexpr = False, PAGE: tl.constexpr = 1, EXTRA: tl.constexpr = False,
    KV_V4: tl.constexpr = False, V4_NOPE: tl.constexpr = 0, V4_SB: tl.constexpr = 8,
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
        q_t = tl.load(q_rows + (D_V + offs_t)[None, :] * s_qd, mask=h_ok[:, None] & t_ok[None, :],
                      other=0.0)

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
                idx_x = tl.load(idx2_ptr + pid_b * s_i2b + (offs_n - K1) * s_i2k,
                                mask=(offs_n >= K1) & (offs_n < K), other=-1)
                idx = tl.where(offs_n < K1, idx, idx_x)
        valid = idx >= 0
        if EXTRA:  # (not with KV_V4: its wrapper takes one source)
            rows = tl.where((offs_n < K1)[:, None], kv_ptr + idx.to(tl.int64)[:, None] * s_kvn,
                            kv2_ptr + idx.to(tl.int64)[:, None] * s_kv2n)
        else:
            rows = kv_ptr + idx.to(tl.int64)[:, None] * s_kvn
        if KV_V4:  # s_kvn: the page stride
            kv_v = _v4_rows(kv_ptr, idx, valid, s_kvn, offs_v, D_V, V4_NOPE, V4_SB, V4_PAGE,
                            BLOCK_N, BLOCK_V, q_v.dtype)
        elif KV_FP8:
            # record: D_V e4m3 bytes | D_V / GROUP fp32 scales | D_T bf16 tail
            NG: tl.constexpr = BLOCK_V // GROUP
            raw = tl.load(rows + offs_v[None, :], mask=valid[:, None], other=0)
            vals = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            offs_g = tl.arange(0, NG)
            scales = tl.load((rows + D_V).to(tl.pointer_type(tl.float32)) + offs_g[None, :],
                             mask=valid[:, None], other=0.0)
            vals = tl.reshape(vals, [BLOCK_N, NG, GROUP]) * scales[:, :, None]
            kv_v = tl.reshape(vals, [BLOCK_N, BLOCK_V]).to(q_v.dtype)
            if D_T > 0:
                tail = (rows + D_V + 4 * NG).to(tl.pointer_type(tl.bfloat16))
                kv_t = tl.load(tail + offs_t[None, :], mask=valid[:, None] & t_ok[None, :],
                               other=0.0).to(q_v.dtype)
        else:
            kv_v = tl.load(rows + offs_v[None, :] * s_kvd, mask=valid[:, None] & v_ok[None, :],
                           other=0.0)
            if D_T > 0:
                kv_t = tl.load(rows + (D_V + offs_t)[None, :] * s_kvd,
                               mask=valid[:, None] & t_ok[None, :], other=0.0)
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
                _merge_head_block(part_out_ptr, part_lse_ptr, sink_ptr, out_ptr, lse_ptr, pid_b,
                                  offs_h, h_ok, offs_v, out_mask, H, tl.num_programs(1),
                                  s_pb, s_ps, s_ph, s_ob, s_oh, BLOCK_H, BLOCK_V, HAS_SINK,
                                  INTERPRET, SPLITS_C)
                tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # zero for the next launch


@triton.jit
def _v4_rows(kv_ptr, idx, valid, s_page, offs_v, D: tl.constexpr, NOPE: tl.constexpr,
             SB: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
             DT: tl.constexpr):
    """[BN, BLOCK_V] K = V rows in dtype DT (q's) of slots idx from fp8_ds_v4 pages (kv_fp8.py):
    slot s is record s % PAGE of page s // PAGE; its NOPE e4m3 values times their group's ue8m0
    scale, then its D - NOPE bf16 rope values; zero where not valid or past D. The scaling runs
    in DT: e4m3 x a power of two is one rounding either way (exact in bf16 / fp32), so the tile
    never exists in float32 (with the [rows, 8, 64] byte tile, 5-15% faster on the H200 than a
    [rows, 512] tile scaled in float32: docs/kernels.md)."""
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
    e = tl.load((page + PAGE * VB + rec * SB)[:, None] + offs_g[None, :],
                mask=valid[:, None] & (offs_g * 64 < NOPE)[None, :], other=0)
    scale = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True).to(DT)  # ue8m0 byte b: 2^(b - 127)
    vals = raw.to(tl.float8e4nv, bitcast=True).to(DT) * scale[:, :, None]
    rope_at = (vals_at + NOPE).to(tl.pointer_type(tl.bfloat16))
    rope = tl.load(rope_at[:, None, None] + (col - NOPE)[None, :, :],
                   mask=ok & (~nope & (col < D))[None, :, :], other=0.0)
    return tl.reshape(tl.where(nope[None, :, :], vals, rope.to(DT)), [BLOCK_N, BLOCK_V])


@triton.jit
def _merge_head_block(
    part_out_ptr, part_lse_ptr, sink_ptr, out_ptr, lse_ptr, pid_b, offs_h, h_ok, offs_v,
    out_mask, H, n_splits, s_pb, s_ps, s_ph, s_ob, s_oh,
    BLOCK_H: tl.constexpr, BLOCK_V: tl.constexpr, HAS_SINK: tl.constexpr,
    INTERPRET: tl.constexpr, SPLITS_C: tl.constexpr,
):
    """out[h] = sum_p 2^(lse_p[h] - lse[h]) * o_p[h] over one query's splits, for BH heads; the
    partials are read through L2 (.cg): other programs wrote them during this launch."""
    lse_rows = part_lse_ptr + pid_b * n_splits * H + offs_h
    top = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for p in range(0, SPLITS_C if INTERPRET else n_splits):
        top = tl.maximum(top, tl.load(lse_rows + p * H, mask=h_ok, other=float("-inf"),
                                      cache_modifier=".cg"))
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    rows = part_out_ptr + pid_b * s_pb + offs_h[:, None] * s_ph + offs_v[None, :]
    for p in range(0, SPLITS_C if INTERPRET else n_splits):
        w = tl.exp2(tl.load(lse_rows + p * H, mask=h_ok, other=float("-inf"),
                            cache_modifier=".cg") - top)
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
    part_out_ptr, part_lse_ptr, sink_ptr, out_ptr, lse_ptr, H, num_splits,
    s_pb, s_ps, s_ph, s_ob, s_oh,
    D_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_P: tl.constexpr, HAS_SINK: tl.constexpr,
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
    rows = tl.load(part_out_ptr + b * s_pb + offs_p[:, None] * s_ps + h * s_ph + offs_v[None, :],
                   mask=p_ok[:, None] & v_ok[None, :], other=0.0)
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


MERGE_TILE = 4096  # fp32 values of partial output one merge program loads (32 registers/thread)


def num_splits(bs: int, head_blocks: int, tiles: int, sms: int, cfg: configs.MLAConfig) -> int:
    """Splits of the top-k per query: enough programs for `cfg.waves` per SM, at least
    `cfg.min_tiles` tiles each, at most `cfg.max_splits` (0: no cap); recomputed so that no split
    is empty."""
    base = bs * head_blocks
    want = max(1, (cfg.waves * sms) // base)
    if cfg.max_splits:
        want = min(want, cfg.max_splits)
    splits = max(1, min(want, tiles // max(cfg.min_tiles, 1)))
    per = cdiv(tiles, splits)
    return cdiv(tiles, per)


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown buffers, kept alive for graphs captured with them


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Arrival counters of the fused merge, one per (query, head block): zero between launches
    (the merging program resets its own), so one buffer per device serves every call and every
    CUDA-graph replay. Calls on one device must not overlap on two streams. Grows only outside
    graph capture (a graph cannot zero a buffer made while capturing before it replays)."""
    buf = _COUNTERS.get(device)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"sparse_mla_decode needs {n} merge counters on {device} but has "
                           f"{0 if buf is None else buf.numel()}: call it once at this batch size "
                           "before capturing a CUDA graph")
    if buf is not None:
        _RETIRED.append(buf)
    _COUNTERS[device] = buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return buf


def _check(q, indices, sm_scale, d_v, sink) -> None:
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


def _run(q, kv, s_kvn, s_kvd, indices, sm_scale, d_v, sink, kv_format, cfg, paged=None, record=None, extra=None):
    """paged: (block_tables [Bt, W], seq_ids [B*S], context_lens [B*S], page, max_len) instead
    of indices (then None): the key list of row r is its sequence's positions 0..len-1.
    record: the kernel's record constexprs of kv_format "fp8_v4" (`_v4_record`).
    extra: (kv2 [N2, D] in kv's format, indices2 [B, S, K2]): row r's key list goes on with
    rows of kv2 (same row layout and column stride as kv; not with "fp8_v4")."""
    B, S, H, D = q.shape
    K1 = indices.shape[2] if paged is None else paged[4]
    K = K1 + (extra[1].shape[2] if extra is not None else 0)
    BS = B * S
    out = torch.empty(B, S, H, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, S, H, dtype=torch.float32, device=q.device)
    if BS == 0 or H == 0:
        return out, lse
    if K == 0:
        out.zero_()
        lse.copy_(torch.full_like(lse, float("-inf")) if sink is None
                  else sink.float().expand(B, S, H))
        return out, lse
    cc = capability(q.device)
    cfg = cfg or configs.mla_config(cc, kv_format, H, BS, has_tail=D > d_v, fp32=q.dtype == torch.float32)
    q3 = q.reshape(BS, H, D)
    if paged is None:
        idx2 = indices.reshape(BS, K1)
        tables, seq_ids, lens, page = idx2, idx2, idx2, 1  # tables..lens unused
    else:
        tables, seq_ids, lens, page, _ = paged
        idx2 = lens.view(BS, 1)  # unused
    block_v, d_t = next_pow2(d_v), D - d_v
    block_t = max(16, next_pow2(d_t)) if d_t > 0 else 16
    block_v = max(16, block_v)
    head_blocks = cdiv(H, cfg.block_h)
    tiles = cdiv(K, cfg.block_n)
    splits = num_splits(BS, head_blocks, tiles, sm_count(q.device), cfg)
    per = cdiv(tiles, splits)
    direct = splits == 1
    fused = cfg.fused_merge and not direct
    interp = interpreting()
    if direct:
        part_out, part_lse = out, lse  # unused
        s_p = (0, 0, 0)
    else:
        part_out = torch.empty(BS, splits, H, d_v, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(BS, splits, H, dtype=torch.float32, device=q.device)
        s_p = part_out.stride()[:3]
    counters = _counters(q.device, BS * head_blocks) if fused else lse  # lse: unused
    sink_arg = sink if sink is not None else lse
    kv2, idx_x = (extra[0], extra[1].reshape(BS, -1)) if extra is not None else (kv, idx2)  # else unused
    LAST_COMPILED["split"] = _mla_split_kernel[(head_blocks, splits, BS)](
        q3, kv, idx2, sink_arg, out, lse, part_out, part_lse, counters,
        tables, seq_ids, lens, kv2, idx_x,
        sm_scale * LOG2E, H, K, K1, per,
        q3.stride(0), q3.stride(1), q3.stride(2), s_kvn, s_kvd, idx2.stride(0), idx2.stride(1),
        H * d_v, d_v, *s_p, tables.stride(0), kv2.stride(0), idx_x.stride(0), idx_x.stride(1),
        D_V=d_v, D_T=d_t, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, BLOCK_V=block_v,
        BLOCK_T=block_t, HAS_SINK=sink is not None, DIRECT=direct, FUSED_MERGE=fused,
        KV_FP8=kv_format == "fp8", GROUP=kv_fp8.GROUP, FP32_DOT=q.dtype == torch.float32,
        INTERPRET=interp, TILES_C=per if interp else 0, SPLITS_C=splits if interp else 0,
        PAGED=paged is not None, PAGE=page, EXTRA=extra is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **(record or {}),
    )
    if not direct and not fused:
        block_p = next_pow2(splits)
        block_dv = min(block_v, max(16, MERGE_TILE // block_p))
        LAST_COMPILED["merge"] = _mla_merge_kernel[(H, BS, cdiv(d_v, block_dv))](
            part_out, part_lse, sink_arg, out, lse, H, splits, *s_p, H * d_v, d_v,
            D_V=d_v, BLOCK_DV=block_dv, BLOCK_P=block_p, HAS_SINK=sink is not None, num_warps=4,
        )
    return out, lse


def sparse_mla_decode(
    q: torch.Tensor,  # [B, S, H, D] bf16/fp16 (fp32 for tests)
    kv: torch.Tensor,  # [N, D] same dtype as q, any row stride; V = kv[:, :d_v]
    indices: torch.Tensor,  # [B, S, K] int32 slot ids, -1 = padding (anywhere in the row)
    sm_scale: float,
    d_v: int,
    sink: torch.Tensor | None = None,  # [H] attention-sink logits (DeepSeek-V4)
    config: configs.MLAConfig | None = None,  # tile override (benchmark sweeps)
    extra_kv: torch.Tensor | None = None,  # [N2, D] a second key source, kv's dtype and column stride
    extra_indices: torch.Tensor | None = None,  # [B, S, K2] int32 rows of extra_kv, -1 = padding
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode. Returns out [B, S, H, d_v] in q's dtype and lse [B, S, H] float32
    (natural log, including the sink). A query whose indices are all -1 gets zeros and
    lse = -inf (= the sink when one is given). Same contract as `ref.sparse_mla_decode_ref`.
    With extra_kv, each query attends to its K rows of kv and its K2 rows of extra_kv in one
    softmax (FlashMLA's extra cache: DeepSeek-V4's window records and compressed entries live
    in two pool regions, read where they are)."""
    _check(q, indices, sm_scale, d_v, sink)
    for name, t in (("kv", kv), ("extra_kv", extra_kv)):
        if t is None:
            continue
        if t.dim() != 2 or t.shape[1] != q.shape[3]:
            raise ValueError(f"{name} must be [N, D={q.shape[3]}], got {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} dtype {t.dtype} must match q dtype {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    extra = None
    if (extra_kv is None) != (extra_indices is None):
        raise ValueError("extra_kv and extra_indices come together")
    if extra_kv is not None:
        _check(q, extra_indices, sm_scale, d_v, sink)
        if extra_kv.stride(1) != kv.stride(1):
            raise ValueError(f"extra_kv's column stride {extra_kv.stride(1)} must be kv's ({kv.stride(1)})")
        extra = (extra_kv, extra_indices)
    return _run(q, kv, kv.stride(0), kv.stride(1), indices, sm_scale, d_v, sink, "bf16", config, extra=extra)


def sparse_mla_decode_fp8(
    q: torch.Tensor,  # [B, S, H, D] bf16/fp16
    kv: torch.Tensor,  # [N, R] uint8 records (layout in kv_fp8.py), any row stride (16-aligned)
    indices: torch.Tensor,  # [B, S, K] int32, -1 = padding
    sm_scale: float,
    d_v: int,
    sink: torch.Tensor | None = None,  # [H]
    config: configs.MLAConfig | None = None,
    extra_kv: torch.Tensor | None = None,  # [N2, R] uint8 records of a second source
    extra_indices: torch.Tensor | None = None,  # [B, S, K2] int32, -1 = padding
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode over FP8 KV records, dequantized in the kernel (values x their group's
    fp32 scale, rounded to q's dtype before the dots). Same outputs as `sparse_mla_decode`
    (extra_kv too); reference: `kv_fp8.sparse_mla_decode_fp8_ref`."""
    _check(q, indices, sm_scale, d_v, sink)
    _check_fp8_records(q, kv, d_v)
    extra = None
    if (extra_kv is None) != (extra_indices is None):
        raise ValueError("extra_kv and extra_indices come together")
    if extra_kv is not None:
        _check(q, extra_indices, sm_scale, d_v, sink)
        _check_fp8_records(q, extra_kv, d_v)
        extra = (extra_kv, extra_indices)
    return _run(q, kv, kv.stride(0), 1, indices, sm_scale, d_v, sink, "fp8", config, extra=extra)


def _check_fp8_records(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> None:
    if q.dtype == torch.float32:
        raise ValueError("FP8 KV records take bf16 or fp16 q")
    D = q.shape[3]
    need = kv_fp8.record_bytes(d_v, D - d_v)
    if kv.dtype != torch.uint8 or kv.dim() != 2 or kv.shape[1] != need or kv.stride(1) != 1:
        raise ValueError(f"kv must be uint8 [N, {need}] records with contiguous bytes, got "
                         f"{kv.dtype} {tuple(kv.shape)} strides {kv.stride()}")
    if d_v != next_pow2(d_v) or d_v % kv_fp8.GROUP:
        raise ValueError(f"fp8 records need d_v a power of two and a multiple of {kv_fp8.GROUP}")
    if kv.stride(0) % 16 or kv.data_ptr() % 16:
        raise ValueError("fp8 records must start on 16-byte boundaries (row stride and base)")


def paged_mla_decode(
    q: torch.Tensor,  # [T, 1, H, D] bf16/fp16 (fp32 for tests): one query row per token
    kv: torch.Tensor,  # [N, D] same dtype as q, any row stride (V = kv[:, :d_v]), or [N, R] uint8 FP8 records
    block_tables: torch.Tensor,  # [B, W] int32 block ids of each sequence
    seq_ids: torch.Tensor,  # [T] int32, the sequence (row of block_tables) of each query
    context_lens: torch.Tensor,  # [T] int32, keys of each query: its sequence's positions 0..len-1
    page: int,  # tokens per block
    max_len: int,  # >= every context_lens entry (sizes the grid; no device sync to find it)
    sm_scale: float,
    d_v: int,
    sink: torch.Tensor | None = None,
    config: configs.MLAConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense MLA decode over the paged pool: query t attends to the first context_lens[t]
    positions of sequence seq_ids[t]. Same outputs as `sparse_mla_decode` with the indices those
    positions' slots (reference: `ref.paged_mla_decode_ref`)."""
    T = q.shape[0]
    if q.dim() != 4 or q.shape[1] != 1:
        raise ValueError(f"q must be [T, 1, H, D], got {tuple(q.shape)}")
    fp8 = kv.dtype == torch.uint8
    if fp8:
        _check_fp8_records(q, kv, d_v)
    elif kv.dim() != 2 or kv.shape[1] != q.shape[3] or kv.dtype != q.dtype or kv.device != q.device:
        raise ValueError(f"kv must be [N, D={q.shape[3]}] {q.dtype} on {q.device}, got {kv.dtype} {tuple(kv.shape)} on {kv.device}")
    for name, t, shape in (("seq_ids", seq_ids, (T,)), ("context_lens", context_lens, (T,))):
        if t.dtype != torch.int32 or tuple(t.shape) != shape or t.device != q.device:
            raise ValueError(f"{name} must be int32 {shape} on {q.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.device != q.device:
        raise ValueError(f"block_tables must be int32 [B, W] on {q.device}, got {block_tables.dtype} {tuple(block_tables.shape)}")
    if page < 1 or max_len < 0:
        raise ValueError(f"page must be >= 1 and max_len >= 0, got {page}, {max_len}")
    empty_idx = torch.empty(T, 1, 0, dtype=torch.int32, device=q.device)
    _check(q, empty_idx, sm_scale, d_v, sink)
    return _run(q, kv, kv.stride(0), 1 if fp8 else kv.stride(1), empty_idx, sm_scale, d_v, sink,
                "fp8" if fp8 else "bf16", config, paged=(block_tables, seq_ids, context_lens, page, max_len))


def sparse_mla_decode_fp8_v4(
    q: torch.Tensor,  # [B, S, H, D] bf16/fp16 (fp32 for tests); D = the record's dim (V4: 512)
    kv: torch.Tensor,  # [Nb, P, R] uint8 fp8_ds_v4 pages (kv_fp8.py; V4: R = 584), any page stride
    indices: torch.Tensor,  # [B, S, K] int32 slot ids (page * P + record), -1 = padding
    sm_scale: float,
    rope: int = 64,  # trailing dims of each record kept in bf16
    sink: torch.Tensor | None = None,  # [H] float32 attention-sink logits
    config: configs.MLAConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 sparse decode (one K = V head) over FP8 pages, dequantized in the kernel
    (e4m3 x power-of-two scale, bf16 rope, rounded to q's dtype before the dots). Returns out
    [B, S, H, D] (d_v = D: the rope dims included) and lse [B, S, H]; same contract as
    `sparse_mla_decode`. Reference: `kv_fp8.sparse_mla_decode_fp8_v4_ref`."""
    D = q.shape[3] if q.dim() == 4 else 0
    _check(q, indices, sm_scale, D, sink)
    record = _v4_record(q, kv, rope)
    return _run(q, kv, kv.stride(0), 1, indices, sm_scale, D, sink, "fp8_v4", config, record=record)


def paged_mla_decode_fp8_v4(
    q: torch.Tensor,  # [T, 1, H, D]
    kv: torch.Tensor,  # [Nb, page, R] uint8 fp8_ds_v4 pages: block b of the tables is page b
    block_tables: torch.Tensor,  # [B, W] int32
    seq_ids: torch.Tensor,  # [T] int32
    context_lens: torch.Tensor,  # [T] int32
    max_len: int,
    sm_scale: float,
    rope: int = 64,
    sink: torch.Tensor | None = None,
    config: configs.MLAConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`paged_mla_decode` over fp8_ds_v4 pages (the page size is the pool's: kv.shape[1])."""
    T, page = q.shape[0], kv.shape[1] if kv.dim() == 3 else 0
    if q.dim() != 4 or q.shape[1] != 1:
        raise ValueError(f"q must be [T, 1, H, D], got {tuple(q.shape)}")
    for name, t in (("seq_ids", seq_ids), ("context_lens", context_lens)):
        if t.dtype != torch.int32 or tuple(t.shape) != (T,) or t.device != q.device:
            raise ValueError(f"{name} must be int32 ({T},) on {q.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.device != q.device:
        raise ValueError(f"block_tables must be int32 [B, W] on {q.device}, got {block_tables.dtype} {tuple(block_tables.shape)}")
    if max_len < 0:
        raise ValueError(f"max_len must be >= 0, got {max_len}")
    empty_idx = torch.empty(T, 1, 0, dtype=torch.int32, device=q.device)
    _check(q, empty_idx, sm_scale, q.shape[3], sink)
    record = _v4_record(q, kv, rope)
    return _run(q, kv, kv.stride(0), 1, empty_idx, sm_scale, q.shape[3], sink, "fp8_v4", config,
                paged=(block_tables, seq_ids, context_lens, page, max_len), record=record)


def _v4_record(q: torch.Tensor, kv: torch.Tensor, rope: int) -> dict:
    """Checks fp8_ds_v4 pages against q; the kernel's record constexprs."""
    rec = kv_fp8.V4Record(q.shape[3], rope)
    if kv.dtype != torch.uint8 or kv.dim() != 3 or kv.shape[2] != rec.bytes or kv.stride(2) != 1 or kv.stride(1) != rec.bytes:
        raise ValueError(f"kv must be uint8 [Nb, P, {rec.bytes}] pages (each page's bytes contiguous), got "
                         f"{kv.dtype} {tuple(kv.shape)} strides {kv.stride()}")
    if kv.device != q.device:
        raise ValueError(f"kv is on {kv.device}, q on {q.device}")
    if rec.dim < 33:
        raise ValueError(f"fp8_ds_v4 records need D > 32 (one 64-value scale group per tile), got {rec.dim}")
    if kv.data_ptr() % 16 or kv.stride(0) % 8:
        raise ValueError("fp8_ds_v4 pages must start on a 16-byte boundary and have a page stride multiple of 8")
    return dict(KV_V4=True, V4_NOPE=rec.nope, V4_SB=rec.scale_bytes, V4_PAGE=kv.shape[1])
