"""Sparse and paged MLA decode attention: the public wrappers and the launch plan (tile config,
split count); their argument checks are in `sparse_mla_checks.py`, the Triton kernels in
`sparse_mla_kernels.py`.

Legend: B batch, S query tokens per sequence, H heads, D record dim (d_v value dims + D - d_v
rope dims), K top-k, N KV slots, P splits, T query rows (paged: one per token).

Split-K over the top-k KV rows, all heads of a query per tile; the split count comes from the SM
count and the work (`num_splits`), so small batches still fill the GPU, and the splits are merged
in the same launch or a second one, whichever the config picks (`configs.mla_config`).

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

import torch

from pdserve_kernels import configs, kv_fp8
from pdserve_kernels._launch import arrival_counters, capability, cdiv, interpreting, next_pow2, sm_count
from pdserve_kernels.sparse_mla_checks import _check, _check_fp8_records, _check_kv, _extra, _paged_keys, _v4_record
from pdserve_kernels.sparse_mla_kernels import _mla_merge_kernel, _mla_split_kernel

LOG2E = 1.4426950408889634


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
        lse.copy_(torch.full_like(lse, float("-inf")) if sink is None else sink.float().expand(B, S, H))
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
    counters = arrival_counters(q.device, BS * head_blocks, "sparse_mla_decode") if fused else lse  # lse: unused
    sink_arg = sink if sink is not None else lse
    kv2, idx_x = (extra[0], extra[1].reshape(BS, -1)) if extra is not None else (kv, idx2)  # else unused
    _mla_split_kernel[(head_blocks, splits, BS)](
        q3,
        kv,
        idx2,
        sink_arg,
        out,
        lse,
        part_out,
        part_lse,
        counters,
        tables,
        seq_ids,
        lens,
        kv2,
        idx_x,
        sm_scale * LOG2E,
        H,
        K,
        K1,
        per,
        q3.stride(0),
        q3.stride(1),
        q3.stride(2),
        s_kvn,
        s_kvd,
        idx2.stride(0),
        idx2.stride(1),
        H * d_v,
        d_v,
        *s_p,
        tables.stride(0),
        kv2.stride(0),
        idx_x.stride(0),
        idx_x.stride(1),
        D_V=d_v,
        D_T=d_t,
        BLOCK_H=cfg.block_h,
        BLOCK_N=cfg.block_n,
        BLOCK_V=block_v,
        BLOCK_T=block_t,
        HAS_SINK=sink is not None,
        DIRECT=direct,
        FUSED_MERGE=fused,
        KV_FP8=kv_format == "fp8",
        GROUP=kv_fp8.GROUP,
        FP32_DOT=q.dtype == torch.float32,
        INTERPRET=interp,
        TILES_C=per if interp else 0,
        SPLITS_C=splits if interp else 0,
        PAGED=paged is not None,
        PAGE=page,
        EXTRA=extra is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **(record or {}),
    )
    if not direct and not fused:
        block_p = next_pow2(splits)
        block_dv = min(block_v, max(16, MERGE_TILE // block_p))
        _mla_merge_kernel[(H, BS, cdiv(d_v, block_dv))](
            part_out,
            part_lse,
            sink_arg,
            out,
            lse,
            H,
            splits,
            *s_p,
            H * d_v,
            d_v,
            D_V=d_v,
            BLOCK_DV=block_dv,
            BLOCK_P=block_p,
            HAS_SINK=sink is not None,
            num_warps=4,
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
    _check_kv(q, "kv", kv)
    extra = _extra(q, kv, extra_kv, extra_indices, sm_scale, d_v, sink, lambda t: _check_kv(q, "extra_kv", t))
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
    extra = _extra(q, kv, extra_kv, extra_indices, sm_scale, d_v, sink, lambda t: _check_fp8_records(q, t, d_v))
    return _run(q, kv, kv.stride(0), 1, indices, sm_scale, d_v, sink, "fp8", config, extra=extra)


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
    empty_idx = _paged_keys(q, block_tables, seq_ids, context_lens, page, max_len, sm_scale, d_v, sink)
    fp8 = kv.dtype == torch.uint8
    if fp8:
        _check_fp8_records(q, kv, d_v)
    else:
        _check_kv(q, "kv", kv)
    return _run(
        q,
        kv,
        kv.stride(0),
        1 if fp8 else kv.stride(1),
        empty_idx,
        sm_scale,
        d_v,
        sink,
        "fp8" if fp8 else "bf16",
        config,
        paged=(block_tables, seq_ids, context_lens, page, max_len),
    )


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
    page = kv.shape[1] if kv.dim() == 3 else 1  # a kv of another shape: refused by _v4_record
    D = q.shape[3] if q.dim() == 4 else 0
    empty_idx = _paged_keys(q, block_tables, seq_ids, context_lens, page, max_len, sm_scale, D, sink)
    record = _v4_record(q, kv, rope)
    return _run(
        q,
        kv,
        kv.stride(0),
        1,
        empty_idx,
        sm_scale,
        D,
        sink,
        "fp8_v4",
        config,
        paged=(block_tables, seq_ids, context_lens, page, max_len),
        record=record,
    )
