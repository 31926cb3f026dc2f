"""DeepSeek-V4's metadata of a step with chunks longer than one token (speculative decoding's verify
steps, prefill chunks, mixed steps) in a few kernels (model/deepseek_v4/chunk_step.py calls them):
what model/deepseek_v4/step.py builds with ~200 PyTorch launches a 4-layer verify step comes from
one launch plus one a compressor rate, the same values:

  - `chunk_window_rope`: a program a block of ROWS (16) tokens: their rows of the key buffer
    (`step.window_buffer`'s `window`), the row each one's kv goes to and the row of the kv written
    there (`window_write`, `window_src`), and both ropes' cos / sin at their positions; then a
    program a block of ROWS sequences: their W-1 window-region rows before the chunk (`window_old`);
  - `chunk_rate_entries`: programs (block of RATE_ROWS (8) rows r, column block k) of one rate
    m: tokens r's seen counts, the k-th block of columns of their visible rows (HCA rates) and of
    sequences r's strided entry table (rates over the block size); at k = 0 groups r of the group
    plan (`step.group_plan`, with the compress rope at e*m), and sequences r's last group and
    pending count.

The sequence-level prefix sums (each chunk's first row, the groups each sequence touches and the
group -> sequence search) run inside every program over all B sequences at once ([ROWS, BLOCK_B]
tiles), so B is bounded (`MAX_B`; model/deepseek_v4/chunk_step.py leaves larger steps to
step.py). Integers as step.py computes them: positions and starts are >= 0, lens >= 1, so C's and
floor division agree wherever they divide (the one quotient that may be -1, (n + L - 1) // m of
an empty chunk, is taken as (n + L - 1 + m) // m - 1). cos / sin as kernels/v4_step.py's. step.py's
device check that every window position has a block is not repeated (it is skipped in a CUDA
graph there too).

Legend: T tokens, B sequences, W sliding window, K = W - 1, Wt columns of a window / block table,
bs block size, m rate, Em = max_context // m, U groups of rate m (a bound: step.group_plan), R/2
rope pairs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from pdserve_kernels._launch import cdiv, interpreting, next_pow2
from pdserve_kernels.v4_step import rate_outputs

MAX_B = 256  # sequences a step (the prefix sums' tiles)
ROWS = 16  # tokens or sequences a program of `chunk_window_rope`
RATE_ROWS = 8  # rows a program of `chunk_rate_entries` (fewer: more of its tiles are [ROWS, BLOCK_B])
COLS = 64  # table / visible columns a program


@triton.jit
def _rope_rows(pos, ok, inv_ptr, factor, cos_ptr, sin_ptr, rows, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
               PRECISE: tl.constexpr):  # fmt: skip
    """cos / sin [ROWS, HALF] of positions pos [ROWS] (int64) into rows `rows` where ok:
    (p * inv).cos() * factor in float32, as kernels/v4_step.py's `_rope_row`."""
    i = tl.arange(0, BLOCK_R)
    f = pos.to(tl.float32)[:, None] * tl.load(inv_ptr + i, mask=i < HALF, other=0.0)[None, :]
    if PRECISE:
        c, s = libdevice.cos(f), libdevice.sin(f)
    else:
        c, s = tl.cos(f), tl.sin(f)
    at, ok2 = rows[:, None] * HALF + i[None, :], ok[:, None] & (i < HALF)[None, :]
    tl.store(cos_ptr + at, c * factor, mask=ok2)
    tl.store(sin_ptr + at, s * factor, mask=ok2)


@triton.jit
def _chunk_window_rope(pos_ptr, seq_ptr, starts_ptr, lens_ptr, wt_ptr, stride_wt, window_ptr, write_ptr, src_ptr,
                       old_ptr, inv_a, factor_a, cos_a, sin_a, inv_b, factor_b, cos_b, sin_b, T, B, bs, token_programs,
                       W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_B: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_R: tl.constexpr, ROWS: tl.constexpr, PRECISE: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    K = W - 1
    j = tl.arange(0, BLOCK_W)
    if pid < token_programs:  # tokens t
        t = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
        ok = t < T
        p = tl.load(pos_ptr + t, mask=ok, other=0)
        s = tl.load(seq_ptr + t, mask=ok, other=0).to(tl.int64)
        n, L = tl.load(starts_ptr + s, mask=ok, other=0), tl.load(lens_ptr + s, mask=ok, other=1)
        i = tl.arange(0, BLOCK_B)
        lens = tl.load(lens_ptr + i, mask=i < B, other=0)
        first_row = tl.sum(tl.where(i[None, :] < s[:, None], lens[None, :], 0), 1)  # the chunk's first row
        q = p[:, None] - W + 1 + j[None, :]  # [ROWS, W] positions (p - W, p]
        n2 = n[:, None]
        rows = tl.where(q < n2, s[:, None] * K + q - n2 + K, B * K + first_row[:, None] + q - n2)
        tl.store(window_ptr + t[:, None] * W + j[None, :], tl.where(q >= 0, rows, -1).to(tl.int32),
                 mask=ok[:, None] & (j < W)[None, :])  # fmt: skip
        table = wt_ptr + s * stride_wt
        # without a window block a token repeats its sequence's last token's write
        src = tl.where(tl.load(table + p // bs, mask=ok, other=0) >= 0, t, first_row + L - 1)
        ps = tl.load(pos_ptr + src, mask=ok, other=0)
        tl.store(src_ptr + t, src, mask=ok)
        tl.store(write_ptr + t, tl.load(table + ps // bs, mask=ok, other=0) * bs + ps % bs, mask=ok)
        _rope_rows(p, ok, inv_a, factor_a, cos_a, sin_a, t, HALF, BLOCK_R, PRECISE)
        _rope_rows(p, ok, inv_b, factor_b, cos_b, sin_b, t, HALF, BLOCK_R, PRECISE)
    else:  # sequences b: their K window records before the chunk
        b = (pid - token_programs).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        q = tl.load(starts_ptr + b, mask=b < B, other=0)[:, None] - K + j[None, :]  # [ROWS, K]
        mine = (b < B)[:, None] & (j < K)[None, :]
        blocks = tl.load(wt_ptr + b[:, None] * stride_wt + tl.maximum(q, 0) // bs, mask=mine & (q >= 0), other=0)
        tl.store(old_ptr + b[:, None] * K + j[None, :], tl.where(q >= 0, blocks * bs + tl.maximum(q, 0) % bs, 0),
                 mask=mine)  # fmt: skip


def chunk_window_rope(
    positions: torch.Tensor,  # [T] int64, >= 0
    seq_ids: torch.Tensor,  # [T] int32
    starts: torch.Tensor,  # [B] int64
    lens: torch.Tensor,  # [B] int64, >= 1
    window_tables: torch.Tensor,  # [B, Wt] int64 window-space blocks (-1: none)
    block_size: int,
    window: int,
    ropes: list[tuple[torch.Tensor, float]],  # two (inv_freq [R/2] float32, attention factor)
) -> tuple[dict, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(step.window_buffer's fields: window [T, W] int32, window_write [T] int64, window_src [T]
    int64, window_old [B*K] int64; [(cos, sin) [T, R/2] float32] a rope)."""
    T, B, dev = positions.shape[0], starts.shape[0], positions.device
    half = ropes[0][0].shape[0]
    if len(ropes) != 2 or ropes[1][0].shape[0] != half or window_tables.stride(-1) != 1:
        raise ValueError("chunk_window_rope: two ropes of one width and a row-major window table")
    if B > MAX_B or window < 1 or not all(t.is_contiguous() for t in (positions, seq_ids, starts, lens)):
        raise ValueError(f"chunk_window_rope: at most {MAX_B} sequences, a window and contiguous rows, got B {B}")
    i64 = dict(dtype=torch.int64, device=dev)
    out = dict(
        window=torch.empty(T, window, dtype=torch.int32, device=dev), window_write=torch.empty(T, **i64),
        window_src=torch.empty(T, **i64), window_old=torch.empty(B * (window - 1), **i64),
    )  # fmt: skip
    cs = [(torch.empty(T, half, device=dev), torch.empty(T, half, device=dev)) for _ in ropes]
    if T:
        (inv_a, fa), (inv_b, fb) = ropes
        tokens = cdiv(T, ROWS)
        _chunk_window_rope[(tokens + cdiv(B, ROWS),)](
            positions, seq_ids, starts, lens, window_tables, window_tables.stride(0), out["window"],
            out["window_write"], out["window_src"], out["window_old"], inv_a, fa, *cs[0], inv_b, fb, *cs[1], T, B,
            block_size, tokens, W=window, BLOCK_W=next_pow2(window), BLOCK_B=next_pow2(B), HALF=half,
            BLOCK_R=next_pow2(half), ROWS=ROWS, PRECISE=not interpreting(),
        )  # fmt: skip
    return out, cs


@triton.jit
def _chunk_rate_entries(pos_ptr, seq_ptr, starts_ptr, lens_ptr, bt_ptr, stride_bt, every, table_ptr, table_cols,
                        seen_ptr, visible_ptr, max_seen, gseq_ptr, src_ptr, present_ptr, first_ptr, prev_ptr,
                        has_prev_ptr, slot_ptr, last_ptr, pending_ptr, inv_ptr, factor, cos_ptr, sin_ptr, T, B, U,
                        page, M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr, HALF: tl.constexpr,
                        BLOCK_R: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, TABLE: tl.constexpr,
                        VISIBLE: tl.constexpr, PRECISE: tl.constexpr):  # fmt: skip
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    k = tl.program_id(1)
    c = k * COLS + tl.arange(0, COLS)  # [COLS]
    if TABLE:  # the entry table's rows r: every `every`-th block of the block table
        cell = (r < B)[:, None] & (c < table_cols)[None, :]
        tl.store(table_ptr + r[:, None] * table_cols + c[None, :],
                 tl.load(bt_ptr + r[:, None] * stride_bt + c[None, :] * every, mask=cell), mask=cell)  # fmt: skip
    tok = r < T  # tokens r
    seen = (tl.load(pos_ptr + r, mask=tok, other=0) + 1) // M
    if VISIBLE:  # rows of the entries each sees, -1 past them
        seq = tl.load(seq_ptr + r, mask=tok, other=0).to(tl.int64)
        ec = tl.minimum(c, tl.maximum(max_seen - 1, 0))  # entry c (clamped as step.visible_rows does)
        sees = c[None, :] < seen[:, None]  # [ROWS, COLS]
        at = seq[:, None] * stride_bt + ((ec // page) * every)[None, :]
        blocks = tl.load(bt_ptr + at, mask=sees & tok[:, None], other=0).to(tl.int64)
        tl.store(visible_ptr + r[:, None] * max_seen + c[None, :],
                 tl.where(sees, blocks * page + (ec % page)[None, :], -1).to(tl.int32),
                 mask=tok[:, None] & (c < max_seen)[None, :])  # fmt: skip
    if k == 0:
        tl.store(seen_ptr + r, seen.to(tl.int32), mask=tok)
        i = tl.arange(0, BLOCK_B)
        n_all = tl.load(starts_ptr + i, mask=i < B, other=0)
        lens = tl.load(lens_ptr + i, mask=i < B, other=0)
        count = (n_all + lens - 1 + M) // M - 1 - n_all // M + 1  # [B] groups touched (0 past B)
        ends = tl.cumsum(count, 0)
        mine = r < B  # sequences r: their last group, and what stays pending
        tl.store(last_ptr + r, tl.sum(tl.where(i[None, :] == r[:, None], ends[None, :], 0), 1) - 1, mask=mine)
        n_r, l_r = tl.load(starts_ptr + r, mask=mine, other=0), tl.load(lens_ptr + r, mask=mine, other=0)
        tl.store(pending_ptr + r, (n_r + l_r) % M, mask=mine)
        grp = r < U  # groups r, as step.group_plan finds them
        u = tl.minimum(r, tl.sum(count, 0) - 1)  # padding repeats the last group
        s = tl.sum(((ends[None, :] <= u[:, None]) & (i < B)[None, :]).to(tl.int64), 1)  # searchsorted, right
        g = u - tl.sum(tl.where(i[None, :] == s[:, None], (ends - count)[None, :], 0), 1)  # rank in its sequence
        n, L = tl.load(starts_ptr + s, mask=grp, other=0), tl.load(lens_ptr + s, mask=grp, other=0)
        first_row = tl.sum(tl.where(i[None, :] < s[:, None], lens[None, :], 0), 1)
        e = n // M + g  # the group's entry
        j = tl.arange(0, BLOCK_M)
        q = e[:, None] * M + j[None, :]  # [ROWS, m] its positions
        n2 = n[:, None]
        present = q < n2 + L[:, None]
        src = tl.where(q < n2, s[:, None] * (M - 1) + q - (n2 // M) * M, B * (M - 1) + first_row[:, None] + q - n2)
        src = tl.where(present, tl.minimum(tl.maximum(src, 0), B * (M - 1) + T - 1), 0)
        both = grp[:, None] & (j < M)[None, :]
        tl.store(src_ptr + r[:, None] * M + j[None, :], src, mask=both)
        tl.store(present_ptr + r[:, None] * M + j[None, :], present, mask=both)
        tl.store(gseq_ptr + r, s, mask=grp)
        tl.store(first_ptr + r, g == 0, mask=grp)
        tl.store(prev_ptr + r, tl.maximum(u - 1, 0), mask=grp)
        tl.store(has_prev_ptr + r, e >= 1, mask=grp)
        block = tl.load(bt_ptr + s * stride_bt + (e // page) * every, mask=grp, other=0).to(tl.int64)
        tl.store(slot_ptr + r, block * page + e % page, mask=grp)
        _rope_rows(e * M, grp, inv_ptr, factor, cos_ptr, sin_ptr, r, HALF, BLOCK_R, PRECISE)


def chunk_rate_entries(
    positions: torch.Tensor,  # [T] int64, >= 0
    seq_ids: torch.Tensor,  # [T] int32
    starts: torch.Tensor,  # [B] int64
    lens: torch.Tensor,  # [B] int64, >= 1
    block_tables: torch.Tensor,  # [B, Wb] int32
    block_size: int,
    rate: int,
    max_seen: int,
    visible: bool,
    rope: tuple[torch.Tensor, float],  # the compress rope: inv_freq [R/2] float32, attention factor
) -> dict:
    """One rate's entry table (as step.entry_table) and page, seen [T] int32, visible [T, Em] int32
    (when `visible`, else None) and its group plan's tensors (step.GroupPlan's names, U rows; cos /
    sin [U, R/2])."""
    B, T, dev = starts.shape[0], positions.shape[0], positions.device
    rows = (positions, seq_ids, starts, lens)
    if B > MAX_B or block_tables.stride(-1) != 1 or not all(t.is_contiguous() for t in rows):
        raise ValueError(
            f"chunk_rate_entries: at most {MAX_B} sequences, a row-major block table and contiguous rows, got B {B}"
        )
    U = (T + B * max(rate - 2, 0)) // rate + B
    strided, every, page, cols, table, out = rate_outputs(
        block_tables, block_size, rate, T, B, U, max_seen, visible, rope
    )
    half = rope[0].shape[0]
    out |= dict(seq=torch.empty(U, dtype=torch.int64, device=dev), last=torch.empty(B, dtype=torch.int64, device=dev))
    if T and B:
        blocks = max(cdiv(cols, COLS) if strided else 1, cdiv(max_seen, COLS) if visible else 1)
        _chunk_rate_entries[(cdiv(max(T, U), RATE_ROWS), blocks)](
            positions, seq_ids, starts, lens, block_tables, block_tables.stride(0), every, table, cols,
            out["seen"], out["visible"] if visible else table, max_seen, out["seq"], out["src"], out["present"],
            out["first"], out["prev"], out["has_prev"], out["slot"], out["last"], out["pending"], rope[0], rope[1],
            out["cos"], out["sin"], T, B, U, page, M=rate, BLOCK_M=next_pow2(rate), BLOCK_B=next_pow2(B), HALF=half,
            BLOCK_R=next_pow2(half), ROWS=RATE_ROWS, COLS=COLS, TABLE=strided, VISIBLE=visible, PRECISE=not interpreting(),
        )  # fmt: skip
    return dict(out, table=table, page=page)
