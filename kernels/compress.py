"""A DeepSeek-V4 compressor's update in one kernel a decode step and two for any other (where
PyTorch takes ~40 launches), as `CompressedKV.update` does it.

Decode (`compress_decode`, a plan of `step.decode_group_plan`): each sequence's one new token
joins its group of m positions; the group's entry is pooled and the sequence's state record
advanced in place.

Per sequence b at position n (its group e = n // m, the token its row j0 = n % m), per entry
channel c (programs split the channels: pooling is channel by channel):
  - the group's rows: state's pending rows j < j0 (raw kv, raw gate), the new row j0, nothing past;
    gate + position_bias[j], absent rows -inf;
  - overlap (CSA, C = 2 Dc): the entry softmaxes over the previous group's Ca (kv, biased gate from
    the state; kv 0, gate -inf before group 1) and this group's Cb (channels Dc + c);
  - pooled[c] = sum_j kv_j * softmax_j(gate), rounded where PyTorch rounds (kv in the model dtype,
    the softmax in float32 then rounded, the products, the sum);
  - the new record: the group's first (n + 1) % m rows (both halves of C), zeros past them, and
    with overlap the Ca this group hands on (its own when complete, else the one it read).
Every value is read before any is written (a barrier between): a program writes only the record
channels it reads.

Any step (`compress_chunk`, a plan of `step.group_plan`: prefill and chunked-prefill chunks, mixed
steps, verify chunks whose records go to spare slots): `_compress_pool`, programs (group, channel
block), pools every group the step touches from the rows its plan names (the state's pending rows
or the step's new ones; with overlap the previous group's Ca: the state's for a sequence's first
group of the step, else that group's own rows), rounding as above; then `_compress_record`,
programs (sequence, channel block), writes each sequence's new record from its last group. Two
launches because several groups of one sequence read its record, which the second rewrites when
dst is the slot read.

Legend: B sequences (in decode one token each), T the step's tokens, U groups its plan touches, m
rate, C kv width (2 Dc with overlap, else Dc), Dc entry dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve_kernels._launch import cdiv, next_pow2
from pdserve_kernels.glue import round_to

BLOCK_C = 32  # entry channels a program


@triton.jit
def _rows(rec, new_ptr, j, j0, ch, c_ok, C: tl.constexpr, dt: tl.constexpr):
    """[MP, BC] the group's raw rows of channels ch: state rows j < j0, the new row j0, 0 past."""
    state = tl.load(rec + j[:, None] * C + ch[None, :], mask=(j < j0)[:, None] & c_ok[None, :], other=0.0)
    new = tl.load(new_ptr + ch, mask=c_ok, other=0.0).to(tl.float32)
    return tl.where((j == j0)[:, None], new[None, :], round_to(state.to(tl.float32), dt))


@triton.jit
def _softmax_pool(kv_own, gate_own, kv_prev, gate_prev, mx, OVERLAP: tl.constexpr, dt: tl.constexpr):
    """[BC] the entry: sum_j kv_j * softmax_j(gate) over the group's rows (and, with overlap, the
    previous group's Ca), rounded where PyTorch rounds (the softmax in float32, then dt)."""
    ex_own = tl.exp(gate_own - mx[None, :])
    total = tl.sum(ex_own, axis=0)
    if OVERLAP:
        ex_prev = tl.exp(gate_prev - mx[None, :])
        total += tl.sum(ex_prev, axis=0)
    pooled = tl.sum(round_to(kv_own * round_to(ex_own / total[None, :], dt), dt), axis=0)
    if OVERLAP:
        pooled += tl.sum(round_to(kv_prev * round_to(ex_prev / total[None, :], dt), dt), axis=0)
    return round_to(pooled, dt)


@triton.jit
def _compress_decode(kv_ptr, gate_ptr, s_kv, s_gate, states_ptr, stride_s, slots_ptr, pos_ptr, bias_ptr, pooled_ptr,
                     M: tl.constexpr, MP: tl.constexpr, C: tl.constexpr, DC: tl.constexpr,
                     OVERLAP: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # entry channels
    j = tl.arange(0, MP)  # rows of the group
    c_ok = c < DC
    dt = pooled_ptr.dtype.element_ty
    st = states_ptr.dtype.element_ty
    n = tl.load(pos_ptr + b)
    j0, e = n % M, n // M
    rec = states_ptr + tl.load(slots_ptr + b) * stride_s
    P = (M - 1) * C  # pending kv values; the pending gate follows, then the Ca
    kv_new, gate_new = kv_ptr + b * s_kv, gate_ptr + b * s_gate
    own = c + DC if OVERLAP else c  # this group's channels of the entry (Cb with overlap)
    kv_own = _rows(rec, kv_new, j, j0, own, c_ok, C, dt)  # [MP, BC]
    graw_own = _rows(rec + P, gate_new, j, j0, own, c_ok, C, dt)
    bias_own = tl.load(bias_ptr + j[:, None] * C + own[None, :], mask=(j < M)[:, None] & c_ok[None, :], other=0.0)
    gate_own = tl.where((j <= j0)[:, None], graw_own + bias_own, float("-inf"))
    mx = tl.max(gate_own, axis=0)
    kv_prev, gate_prev = kv_own, gate_own  # read only with overlap
    if OVERLAP:  # the previous group's Ca, kept in the state
        kv_ca = _rows(rec, kv_new, j, j0, c, c_ok, C, dt)  # this group's Ca (channels c)
        graw_ca = _rows(rec + P, gate_new, j, j0, c, c_ok, C, dt)
        prev_ok = (j < M)[:, None] & c_ok[None, :] & (e >= 1)
        ca = rec + 2 * P + j[:, None] * DC + c[None, :]
        kv_prev = round_to(tl.load(ca, mask=prev_ok, other=0.0).to(tl.float32), dt)
        gate_prev = tl.load(ca + M * DC, mask=prev_ok, other=float("-inf")).to(tl.float32)
        mx = tl.maximum(mx, tl.max(gate_prev, axis=0))
    pooled = _softmax_pool(kv_own, gate_own, kv_prev, gate_prev, mx, OVERLAP, dt)
    tl.store(pooled_ptr + b * DC + c, pooled.to(dt), mask=c_ok)

    tl.debug_barrier()  # every read of the record is done: write it
    keep = (j < (n + 1) % M)[:, None] & (j < M - 1)[:, None] & c_ok[None, :]
    row = (j < M - 1)[:, None] & c_ok[None, :]
    tl.store(rec + j[:, None] * C + own[None, :], round_to(tl.where(keep, kv_own, 0.0), st).to(st), mask=row)
    tl.store(rec + P + j[:, None] * C + own[None, :], round_to(tl.where(keep, graw_own, 0.0), st).to(st), mask=row)
    if OVERLAP:
        tl.store(rec + j[:, None] * C + c[None, :], round_to(tl.where(keep, kv_ca, 0.0), st).to(st), mask=row)
        tl.store(rec + P + j[:, None] * C + c[None, :], round_to(tl.where(keep, graw_ca, 0.0), st).to(st), mask=row)
        full = (n + 1) % M == 0  # complete: its own Ca goes on, else the one it read
        bias_ca = tl.load(bias_ptr + j[:, None] * C + c[None, :], mask=(j < M)[:, None] & c_ok[None, :], other=0.0)
        kv_next = tl.where(full, kv_ca, kv_prev)
        gate_next = tl.where(full, graw_ca + bias_ca, gate_prev)
        ca_ok = (j < M)[:, None] & c_ok[None, :]
        tl.store(ca, round_to(kv_next, st).to(st), mask=ca_ok)
        tl.store(ca + M * DC, round_to(gate_next, st).to(st), mask=ca_ok)


def compress_decode(
    kv: torch.Tensor,  # [B, C] this step's kv_proj(x), the model dtype (rows may be strided)
    gate: torch.Tensor,  # [B, C] gate_proj(x) (the halves of one joined GEMM's output, as `CompressedKV.project` gives)
    states: torch.Tensor,  # [S, state_dim] the compressor's state region (advanced in place)
    slots: torch.Tensor,  # [B] int64 state rows
    positions: torch.Tensor,  # [B] int64 the new tokens' positions
    position_bias: torch.Tensor,  # [m, C] float32
    dim: int,  # Dc
    overlap: bool,
) -> torch.Tensor:
    """The entries [B, Dc] (before kv_norm and rope) of each sequence's group, as `CompressedKV.update`
    pools them in a decode step; `states` advanced in place."""
    B, C = kv.shape
    m = position_bias.shape[0]
    want = 2 * (m - 1) * C + (2 * m * dim if overlap else 0)
    if C != (2 * dim if overlap else dim) or states.shape[1] != want or states.stride(1) != 1:
        raise ValueError(f"compress_decode: kv {tuple(kv.shape)}, states {tuple(states.shape)} for dim {dim}, rate {m}")
    kv, gate = (t if t.stride(-1) == 1 else t.contiguous() for t in (kv, gate))
    pooled = kv.new_empty(B, dim)
    if B:
        _compress_decode[(B, cdiv(dim, BLOCK_C))](
            kv, gate, kv.stride(0), gate.stride(0), states, states.stride(0), slots, positions, position_bias.contiguous(),
            pooled, M=m, MP=next_pow2(m), C=C, DC=dim, OVERLAP=overlap, BLOCK_C=BLOCK_C,
        )  # fmt: skip
    return pooled


@triton.jit
def _plan_rows(x_ptr, s_x, states_ptr, stride_s, slots_ptr, src, ok, ch, c_ok, NP, OFF, M: tl.constexpr,
               C: tl.constexpr, dt: tl.constexpr):  # fmt: skip
    """[MP, BC] raw rows of channels ch named by a plan's src [MP] (rows of [B*(m-1) pending state
    rows ; T new rows], NP = B*(m-1)): a state row from its sequence's record (+ OFF: the gate's
    half), rounded to dt as PyTorch's `.to`; a new row from x; 0 where not ok."""
    pend = src < NP
    st_ok = (ok & pend)[:, None] & c_ok[None, :]
    srow = tl.load(slots_ptr + src // (M - 1), mask=ok & pend, other=0)
    state = tl.load(states_ptr + srow[:, None] * stride_s + OFF + (src % (M - 1))[:, None] * C + ch[None, :],
                    mask=st_ok, other=0.0)  # fmt: skip
    new = tl.load(
        x_ptr + (src - NP)[:, None] * s_x + ch[None, :], mask=(ok & ~pend)[:, None] & c_ok[None, :], other=0.0
    )
    return tl.where(pend[:, None], round_to(state.to(tl.float32), dt), new.to(tl.float32))


@triton.jit
def _group(kv_ptr, gate_ptr, s_kv, s_gate, states_ptr, stride_s, slots_ptr, src_ptr, present_ptr, bias_ptr, u, j, ch,
           c_ok, NP, M: tl.constexpr, C: tl.constexpr, dt: tl.constexpr):  # fmt: skip
    """Group u's rows of channels ch: raw kv, raw gate (rounded to dt) and the biased gate
    (float32, -inf at positions not yet seen), each [MP, BC]."""
    jm = j < M
    src = tl.load(src_ptr + u * M + j, mask=jm, other=0)
    seen = (tl.load(present_ptr + u * M + j, mask=jm, other=0) != 0) & jm
    kv = _plan_rows(kv_ptr, s_kv, states_ptr, stride_s, slots_ptr, src, seen, ch, c_ok, NP, 0, M, C, dt)
    graw = _plan_rows(gate_ptr, s_gate, states_ptr, stride_s, slots_ptr, src, seen, ch, c_ok, NP, (M - 1) * C, M, C, dt)
    bias = tl.load(bias_ptr + j[:, None] * C + ch[None, :], mask=jm[:, None] & c_ok[None, :], other=0.0)
    return kv, graw, tl.where(seen[:, None], graw + bias, float("-inf"))


@triton.jit
def _prev_ca(kv_ptr, gate_ptr, s_kv, s_gate, states_ptr, stride_s, slots_ptr, src_ptr, present_ptr, bias_ptr,
             first_ptr, prev_ptr, has_prev_ptr, seq_ptr, u, j, c, c_ok, NP, M: tl.constexpr, C: tl.constexpr,
             DC: tl.constexpr, dt: tl.constexpr):  # fmt: skip
    """The Ca group u pools beside its own Cb, [MP, BC] kv (dt-rounded) and biased gate: the state's
    when u is its sequence's first group of the step, else the previous group's own; kv 0 and
    gate -inf before entry 1."""
    first = tl.load(first_ptr + u) != 0
    has_prev = tl.load(has_prev_ptr + u) != 0
    ok = (j < M)[:, None] & c_ok[None, :] & has_prev
    rec = states_ptr + tl.load(slots_ptr + tl.load(seq_ptr + u)) * stride_s
    ca = rec + 2 * (M - 1) * C + j[:, None] * DC + c[None, :]  # the state's Ca: kv [m, Dc], then the biased gate
    kv_st = round_to(tl.load(ca, mask=ok & first, other=0.0).to(tl.float32), dt)
    gate_st = tl.load(ca + M * DC, mask=ok & first, other=float("-inf")).to(tl.float32)
    p = tl.load(prev_ptr + u)
    kv_p, _, gate_p = _group(kv_ptr, gate_ptr, s_kv, s_gate, states_ptr, stride_s, slots_ptr, src_ptr, present_ptr,
                             bias_ptr, p, j, c, c_ok & has_prev & ~first, NP, M, C, dt)  # fmt: skip
    kv_prev = tl.where(ok, tl.where(first, kv_st, kv_p), 0.0)
    return kv_prev, tl.where(ok, tl.where(first, gate_st, gate_p), float("-inf"))


@triton.jit
def _compress_pool(kv_ptr, gate_ptr, s_kv, s_gate, states_ptr, stride_s, slots_ptr, src_ptr, present_ptr, first_ptr,
                   prev_ptr, has_prev_ptr, seq_ptr, bias_ptr, pooled_ptr, NP, M: tl.constexpr, MP: tl.constexpr,
                   C: tl.constexpr, DC: tl.constexpr, OVERLAP: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    """pooled [U, Dc]: each group's entry before kv_norm and rope (programs (group, channel block))."""
    u = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, MP)
    c_ok = c < DC
    dt = pooled_ptr.dtype.element_ty
    own = c + DC if OVERLAP else c
    kv_own, _, gate_own = _group(kv_ptr, gate_ptr, s_kv, s_gate, states_ptr, stride_s, slots_ptr, src_ptr, present_ptr,
                                 bias_ptr, u, j, own, c_ok, NP, M, C, dt)  # fmt: skip
    mx = tl.max(gate_own, axis=0)
    kv_prev, gate_prev = kv_own, gate_own  # read only with overlap
    if OVERLAP:
        kv_prev, gate_prev = _prev_ca(kv_ptr, gate_ptr, s_kv, s_gate, states_ptr, stride_s, slots_ptr, src_ptr,
                                      present_ptr, bias_ptr, first_ptr, prev_ptr, has_prev_ptr, seq_ptr, u, j, c, c_ok,
                                      NP, M, C, DC, dt)  # fmt: skip
        mx = tl.maximum(mx, tl.max(gate_prev, axis=0))
    pooled = _softmax_pool(kv_own, gate_own, kv_prev, gate_prev, mx, OVERLAP, dt)
    tl.store(pooled_ptr + u * DC + c, pooled.to(dt), mask=c_ok)


@triton.jit
def _compress_record(kv_ptr, gate_ptr, s_kv, s_gate, states_ptr, stride_s, slots_ptr, dst_ptr, src_ptr, present_ptr,
                     first_ptr, prev_ptr, has_prev_ptr, seq_ptr, last_ptr, pending_ptr, bias_ptr, NP,
                     M: tl.constexpr, MP: tl.constexpr, C: tl.constexpr, DC: tl.constexpr, OVERLAP: tl.constexpr,
                     BLOCK_C: tl.constexpr):  # fmt: skip
    """Sequence b's new record at dst[b] (programs (sequence, channel block)): its last group's
    first `pending` rows (raw kv, raw gate; 0 past them) and, with overlap, the Ca it hands on."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, MP)
    c_ok = c < DC
    dt = kv_ptr.dtype.element_ty
    st = states_ptr.dtype.element_ty
    u, left = tl.load(last_ptr + b), tl.load(pending_ptr + b)
    own = c + DC if OVERLAP else c
    kv_own, graw_own, _ = _group(kv_ptr, gate_ptr, s_kv, s_gate, states_ptr, stride_s, slots_ptr, src_ptr,
                                 present_ptr, bias_ptr, u, j, own, c_ok, NP, M, C, dt)  # fmt: skip
    if OVERLAP:
        kv_ca, graw_ca, gate_ca = _group(kv_ptr, gate_ptr, s_kv, s_gate, states_ptr, stride_s, slots_ptr, src_ptr,
                                         present_ptr, bias_ptr, u, j, c, c_ok, NP, M, C, dt)  # fmt: skip
        kv_prev, gate_prev = _prev_ca(kv_ptr, gate_ptr, s_kv, s_gate, states_ptr, stride_s, slots_ptr, src_ptr,
                                      present_ptr, bias_ptr, first_ptr, prev_ptr, has_prev_ptr, seq_ptr, u, j, c, c_ok,
                                      NP, M, C, DC, dt)  # fmt: skip

    tl.debug_barrier()  # every read of the record is done (dst may be the slot read): write it
    rec = states_ptr + tl.load(dst_ptr + b) * stride_s
    keep = (j < left)[:, None] & (j < M - 1)[:, None] & c_ok[None, :]
    row = (j < M - 1)[:, None] & c_ok[None, :]
    P = (M - 1) * C
    tl.store(rec + j[:, None] * C + own[None, :], round_to(tl.where(keep, kv_own, 0.0), st).to(st), mask=row)
    tl.store(rec + P + j[:, None] * C + own[None, :], round_to(tl.where(keep, graw_own, 0.0), st).to(st), mask=row)
    if OVERLAP:
        tl.store(rec + j[:, None] * C + c[None, :], round_to(tl.where(keep, kv_ca, 0.0), st).to(st), mask=row)
        tl.store(rec + P + j[:, None] * C + c[None, :], round_to(tl.where(keep, graw_ca, 0.0), st).to(st), mask=row)
        full = left == 0  # the last group is complete: its own Ca goes on, else the one it read
        ca = rec + 2 * P + j[:, None] * DC + c[None, :]
        ca_ok = (j < M)[:, None] & c_ok[None, :]
        tl.store(ca, round_to(tl.where(full, kv_ca, kv_prev), st).to(st), mask=ca_ok)
        tl.store(ca + M * DC, round_to(tl.where(full, gate_ca, gate_prev), st).to(st), mask=ca_ok)


def compress_chunk(
    kv: torch.Tensor,  # [T, C] this step's kv_proj(x), the model dtype (rows may be strided)
    gate: torch.Tensor,  # [T, C] gate_proj(x)
    states: torch.Tensor,  # [S, state_dim] the compressor's state region
    slots: torch.Tensor,  # [B] int64 state rows read
    dst: torch.Tensor,  # [B] int64 state rows the new records go to (may be slots)
    plan: tuple,  # step.GroupPlan's (seq, src, present, first, prev, has_prev, last, pending)
    position_bias: torch.Tensor,  # [m, C] float32
    dim: int,  # Dc
    overlap: bool,
) -> torch.Tensor:
    """The entries [U, Dc] (before kv_norm and rope) of every group a step's plan touches, as
    `CompressedKV.update`'s general path pools them, and each sequence's new record at dst: two
    launches (every read of a record ends before any write of it)."""
    seq, src, present, first, prev, has_prev, last, pending = plan
    C, (U, m), B = kv.shape[1], src.shape, slots.shape[0]
    want = 2 * (m - 1) * C + (2 * m * dim if overlap else 0)
    if C != (2 * dim if overlap else dim) or states.shape[1] != want or states.stride(1) != 1 or m < 2:
        raise ValueError(f"compress_chunk: kv {tuple(kv.shape)}, states {tuple(states.shape)} for dim {dim}, rate {m}")
    kv, gate = (t if t.stride(-1) == 1 else t.contiguous() for t in (kv, gate))
    pooled, bias = kv.new_empty(U, dim), position_bias.contiguous()
    common = (kv, gate, kv.stride(0), gate.stride(0), states, states.stride(0), slots)
    shape = dict(M=m, MP=next_pow2(m), C=C, DC=dim, OVERLAP=overlap, BLOCK_C=BLOCK_C)
    if U:
        _compress_pool[(U, cdiv(dim, BLOCK_C))](*common, src, present, first, prev, has_prev, seq, bias, pooled,
                                                B * (m - 1), **shape)  # fmt: skip
    if B:
        _compress_record[(B, cdiv(dim, BLOCK_C))](*common, dst, src, present, first, prev, has_prev, seq, last,
                                                  pending, bias, B * (m - 1), **shape)  # fmt: skip
    return pooled
