"""DeepSeek-V4's decode-step metadata in a few kernels (model/deepseek_v4/decode_step.py calls them):
what model/deepseek_v4/step.py builds with ~110 PyTorch launches a 4-layer step (the window rows,
the rope's cos / sin, and for each compressor rate its entry table, the entries each query sees
and the compressor's group plan) comes from one launch plus one a rate, the same values:

  - `window_rope`: one program a token: its window rows (`step.window_in_pool`), the window row its
    kv goes to, and the cos / sin of both ropes at its position (`rope.RotaryEmbedding`);
  - `rate_entries`: programs (b, k) of one rate m: token b's seen count and sequence b's group plan
    (`step.decode_group_plan`, with the compress rope at e*m) at k = 0; the k-th block of columns
    of the visible rows (`step.visible_rows`, HCA rates) and of the strided entry table
    (`step.entry_table`, rates over the block size).

A decode step has one token a sequence (T = B, token b of sequence b). Integers are computed as
step.py computes them (positions are >= 0, so C and floor division agree); cos / sin by
libdevice's cosf / sinf on a GPU, the CUDA math library's functions torch calls (numpy's under
the interpreter, within an ulp of torch's CPU ones). step.py's device check that every window
position has a block (a block-manager bug otherwise) is not repeated here: it is skipped in a
CUDA graph there too.

Legend: T tokens, B sequences, W sliding window, Wt columns of a window / block table, bs block
size, m rate, Em = max_context // m, R/2 rope pairs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from pdserve_kernels._launch import cdiv, interpreting, next_pow2

COLS = 256  # table / visible columns a program


@triton.jit
def _rope_row(pos, inv_ptr, factor, cos_ptr, sin_ptr, row, HALF: tl.constexpr, BLOCK: tl.constexpr,
              PRECISE: tl.constexpr):  # fmt: skip
    """cos / sin [HALF] of position pos (int64) into row `row`: (p * inv).cos() * factor, in float32."""
    i = tl.arange(0, BLOCK)
    ok = i < HALF
    f = pos.to(tl.float32) * tl.load(inv_ptr + i, mask=ok, other=0.0)
    if PRECISE:
        c, s = libdevice.cos(f), libdevice.sin(f)
    else:
        c, s = tl.cos(f), tl.sin(f)
    tl.store(cos_ptr + row * HALF + i, c * factor, mask=ok)
    tl.store(sin_ptr + row * HALF + i, s * factor, mask=ok)


@triton.jit
def _window_rope(pos_ptr, seq_ptr, wt_ptr, stride_wt, window_ptr, write_ptr, inv_a, factor_a, cos_a, sin_a,
                 inv_b, factor_b, cos_b, sin_b, bs, W: tl.constexpr, BLOCK_W: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_R: tl.constexpr, PRECISE: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + t)
    table = wt_ptr + tl.load(seq_ptr + t).to(tl.int64) * stride_wt
    j = tl.arange(0, BLOCK_W)
    q = p - W + 1 + j  # [W] positions (p - W, p]
    qc = tl.maximum(q, 0)
    blocks = tl.load(table + qc // bs, mask=j < W, other=0)
    rows = tl.where(q >= 0, blocks * bs + qc % bs, -1)
    tl.store(window_ptr + t * W + j, rows.to(tl.int32), mask=j < W)
    tl.store(write_ptr + t, tl.load(table + p // bs) * bs + p % bs)
    _rope_row(p, inv_a, factor_a, cos_a, sin_a, t, HALF, BLOCK_R, PRECISE)
    _rope_row(p, inv_b, factor_b, cos_b, sin_b, t, HALF, BLOCK_R, PRECISE)


def window_rope(
    positions: torch.Tensor,  # [T] int64, >= 0
    seq_ids: torch.Tensor,  # [T] int32
    window_tables: torch.Tensor,  # [B, Wt] int64 window-space blocks
    block_size: int,
    window: int,
    ropes: list[tuple[torch.Tensor, float]],  # two (inv_freq [R/2] float32, attention factor)
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(window [T, W] int32, window_write [T] int64, [(cos, sin) [T, R/2] float32] a rope)."""
    T, dev = positions.shape[0], positions.device
    half = ropes[0][0].shape[0]
    if len(ropes) != 2 or ropes[1][0].shape[0] != half or window_tables.stride(-1) != 1:
        raise ValueError("window_rope: two ropes of one width and a row-major window table")
    window_rows = torch.empty(T, window, dtype=torch.int32, device=dev)
    write = torch.empty(T, dtype=torch.int64, device=dev)
    cs = [(torch.empty(T, half, device=dev), torch.empty(T, half, device=dev)) for _ in ropes]
    if T:
        (inv_a, fa), (inv_b, fb) = ropes
        _window_rope[(T,)](
            positions, seq_ids, window_tables, window_tables.stride(0), window_rows, write, inv_a, fa, *cs[0],
            inv_b, fb, *cs[1], block_size, W=window, BLOCK_W=next_pow2(window), HALF=half,
            BLOCK_R=next_pow2(half), PRECISE=not interpreting(),
        )  # fmt: skip
    return window_rows, write, cs


@triton.jit
def _rate_entries(pos_ptr, seq_ptr, starts_ptr, rows_ptr, bt_ptr, stride_bt, every, table_ptr, table_cols,
                  seen_ptr, visible_ptr, max_seen, src_ptr, present_ptr, first_ptr, prev_ptr, has_prev_ptr,
                  slot_ptr, pending_ptr, inv_ptr, factor, cos_ptr, sin_ptr, B, page, M: tl.constexpr,
                  BLOCK_M: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, COLS: tl.constexpr,
                  TABLE: tl.constexpr, VISIBLE: tl.constexpr, PRECISE: tl.constexpr):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1)
    c = k * COLS + tl.arange(0, COLS)
    if TABLE:  # the entry table: every `every`-th block of the block table
        tl.store(table_ptr + b * table_cols + c, tl.load(bt_ptr + b * stride_bt + c * every, mask=c < table_cols),
                 mask=c < table_cols)  # fmt: skip
    seen = (tl.load(pos_ptr + b) + 1) // M
    if VISIBLE:  # rows of the entries token b sees, -1 past them
        seq = tl.load(seq_ptr + b).to(tl.int64)
        ec = tl.minimum(c, tl.maximum(max_seen - 1, 0))  # entry c (clamped as step.visible_rows does)
        sees = c < seen
        blocks = tl.load(bt_ptr + seq * stride_bt + (ec // page) * every, mask=sees, other=0).to(tl.int64)
        tl.store(visible_ptr + b * max_seen + c, tl.where(sees, blocks * page + ec % page, -1).to(tl.int32),
                 mask=c < max_seen)  # fmt: skip
    if k == 0:
        tl.store(seen_ptr + b, seen.to(tl.int32))
        s, n = tl.load(rows_ptr + b), tl.load(starts_ptr + b)
        e, r = n // M, n % M  # the new token's group and its place in it
        j = tl.arange(0, BLOCK_M)
        present = j <= r
        src = tl.where(j < r, s * (M - 1) + j, B * (M - 1) + s)
        tl.store(src_ptr + b * M + j, tl.where(present, src, 0), mask=j < M)
        tl.store(present_ptr + b * M + j, present, mask=j < M)
        tl.store(first_ptr + b, True)
        tl.store(prev_ptr + b, tl.maximum(s - 1, 0))
        tl.store(has_prev_ptr + b, e >= 1)
        block = tl.load(bt_ptr + s * stride_bt + (e // page) * every).to(tl.int64)
        tl.store(slot_ptr + b, block * page + e % page)
        tl.store(pending_ptr + b, (n + 1) % M)
        _rope_row(e * M, inv_ptr, factor, cos_ptr, sin_ptr, b, HALF, BLOCK_R, PRECISE)


def rate_outputs(
    block_tables: torch.Tensor,
    block_size: int,
    rate: int,
    T: int,
    B: int,
    U: int,
    max_seen: int,
    visible: bool,
    rope: tuple[torch.Tensor, float],
) -> tuple[bool, int, int, int, torch.Tensor, dict]:
    """What a rate's entry kernels (here and v4_chunk_step.py) write: whether the table is strided
    (rate > block size: one entry a block, in every (m / bs)-th block), that stride, the entries a
    block of the table holds, its columns, the table (the block table itself when not strided), and
    the outputs, empty: seen [T], visible [T, Em], and the group plan's tensors for U groups and B
    sequences."""
    dev = block_tables.device
    strided = rate > block_size
    every, page = (rate // block_size, 1) if strided else (1, block_size // rate)
    cols = cdiv(block_tables.shape[1], every)
    table = torch.empty(B, cols, dtype=block_tables.dtype, device=dev) if strided else block_tables
    half = rope[0].shape[0]
    i64, b8 = dict(dtype=torch.int64, device=dev), dict(dtype=torch.bool, device=dev)
    out = dict(
        seen=torch.empty(T, dtype=torch.int32, device=dev),
        visible=torch.empty(T, max_seen, dtype=torch.int32, device=dev) if visible else None,
        src=torch.empty(U, rate, **i64), present=torch.empty(U, rate, **b8), first=torch.empty(U, **b8),
        prev=torch.empty(U, **i64), has_prev=torch.empty(U, **b8), slot=torch.empty(U, **i64),
        pending=torch.empty(B, **i64), cos=torch.empty(U, half, device=dev), sin=torch.empty(U, half, device=dev),
    )  # fmt: skip
    return strided, every, page, cols, table, out


def rate_entries(
    positions: torch.Tensor,  # [T] int64, >= 0 (T = B)
    seq_ids: torch.Tensor,  # [T] int32
    starts: torch.Tensor,  # [B] int64
    rows: torch.Tensor,  # [B] int64, each sequence's row (ForwardBatch.decode_rows)
    block_tables: torch.Tensor,  # [B, Wb] int32
    block_size: int,
    rate: int,
    max_seen: int,
    visible: bool,
    rope: tuple[torch.Tensor, float],  # the compress rope: inv_freq [R/2] float32, attention factor
) -> dict:
    """One rate's entry table (as step.entry_table), seen [T] int32, visible [T, Em] int32 (when
    `visible`, else None) and its group plan's tensors (step.GroupPlan's names; cos / sin [B, R/2])."""
    B, T = starts.shape[0], positions.shape[0]
    if T != B or block_tables.stride(-1) != 1:
        raise ValueError(f"rate_entries: a decode step (T = B), got T {T}, B {B}, and a row-major block table")
    strided, every, page, cols, table, out = rate_outputs(
        block_tables, block_size, rate, T, B, B, max_seen, visible, rope
    )
    half = rope[0].shape[0]
    if B:
        blocks = max(cdiv(cols, COLS) if strided else 1, cdiv(max_seen, COLS) if visible else 1)
        _rate_entries[(B, blocks)](
            positions, seq_ids, starts, rows, block_tables, block_tables.stride(0), every, table, cols,
            out["seen"], out["visible"] if visible else table, max_seen, out["src"], out["present"],
            out["first"], out["prev"], out["has_prev"], out["slot"], out["pending"], rope[0], rope[1], out["cos"],
            out["sin"], B, page, M=rate, BLOCK_M=next_pow2(rate), HALF=half, BLOCK_R=next_pow2(half), COLS=COLS,
            TABLE=strided, VISIBLE=visible, PRECISE=not interpreting(),
        )  # fmt: skip
    return dict(out, table=table, page=page)
