"""The Triton kernels of the MX8 FP4 MoE: FP4 (e2m1) expert weights x MXFP8 activations on the
block-scaled tensor cores (`fused_moe_fp4_mx8.py` checks the arguments, plans the launch and runs them).

Legend: T tokens, k experts per token, P = T * k pairs, E experts, I expert intermediate size,
hidden model width, R aligned rows, BM/BN/BK tile (BK, BN multiples of 32), G = BK/32 scale
groups of a K step, S splits of K.

Why: Triton 3.6 lowers `tl.dot_scaled` to sm_120's block-scaled MMA (mma.sync ... kind::mxf8f6f4
.block_scale ... ue8m0) only when both operands have the same MX format; bf16 x e2m1 and
e4m3 x e2m1 are upcast to bf16 MMAs. So both sides go in as e4m3:

    x [BM, BK] (x's dtype) -> MXFP8 in registers (`mxfp8.mxfp8_quant`: e4m3 bits, ue8m0 per 32)
    W bytes [BN, BK/2] (the checkpoint layout: even k in the low nibble) -> e4m3 codes of the
        same values (`mxfp8.e2m1_to_e4m3`, exact), interleaved back to [BN, BK]; its ue8m0
        scales [BN, G] as the checkpoint has them
    acc[BM, BN] += dot_scaled(x_e4m3, x_scale, "e4m3", W_e4m3^T, W_scale, "e4m3")

The intermediate activation leaves w13 as MXFP8 (e4m3 bytes [P, I] + scales [P, ceil(I/32)]),
quantized in the epilogue (or by `_swiglu_mx8_kernel` after a split w13), and w2 reads it as
its dot's left operand. Split-K and the (R / BM, N / BN, S) grid as `fused_moe_fp4_kernels.py`.

EMULATE (the interpreter, which has no dot_scaled): the same operands, multiplied out as
(x_e4m3 * 2**sx) @ (W_e4m3 * 2**sw)^T by an IEEE float32 `tl.dot` (exact products; the sums in
float32), and e4m3 rounding by integer arithmetic (`mxfp8.mxfp8_quant`'s EXACT_CVT).
"""

from __future__ import annotations

import triton
import triton.language as tl

from pdserve_kernels.fused_moe_fp4_kernels import _swiglu
from pdserve_kernels.mxfp8 import e2m1_to_e4m3, mxfp8_quant


@triton.jit
def _pow2(s):
    """ue8m0 bytes -> 2**(s - 127) in float32 (s = 0: 2**-127, a float32 subnormal)."""
    return tl.exp2(s.to(tl.float32) - 127.0)


@triton.jit
def _scaled(bits, s, ROWS: tl.constexpr, COLS: tl.constexpr):
    """e4m3 bits [ROWS, COLS] and ue8m0 [ROWS, COLS / 32] -> the values in float32."""
    v = tl.reshape(bits.to(tl.float8e4nv, bitcast=True).to(tl.float32), (ROWS, COLS // 32, 32))
    return tl.reshape(v * _pow2(s)[:, :, None], (ROWS, COLS))


@triton.jit
def _mx_dot(acc, a, a_s, w, w_s, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EMULATE: tl.constexpr):
    """acc[BM, BN] += (a * 2**a_s) @ (w * 2**w_s)^T: a [BM, BK] and w [BN, BK] e4m3 bits (uint8),
    a_s [BM, BK/32] and w_s [BN, BK/32] ue8m0 bytes."""
    if EMULATE:
        acc = tl.dot(_scaled(a, a_s, BM, BK), tl.trans(_scaled(w, w_s, BN, BK)), acc, input_precision="ieee")
    else:
        a8 = a.to(tl.float8e4nv, bitcast=True)
        w8 = tl.trans(w.to(tl.float8e4nv, bitcast=True))
        acc = tl.dot_scaled(a8, a_s, "e4m3", w8, w_s, "e4m3", acc)
    return acc


@triton.jit
def _w_step(w_base, s_base, offs_n, n_ok, k0, K, s_wn, s_sn, BN: tl.constexpr, BK: tl.constexpr):
    """The K step at k0 of an expert's weight rows offs_n -> (e4m3 bits [BN, BK], ue8m0 [BN, BK/32]);
    past K (or n): zero codes, scale byte 127."""
    offs_b = k0 // 2 + tl.arange(0, BK // 2)
    w = tl.load(
        w_base + offs_n[:, None] * s_wn + offs_b[None, :], mask=n_ok[:, None] & (offs_b < K // 2)[None, :], other=0
    )
    w8 = tl.reshape(tl.join(e2m1_to_e4m3(w & 0xF), e2m1_to_e4m3(w >> 4)), (BN, BK))  # byte j: k = 2j, 2j + 1
    offs_g = k0 // 32 + tl.arange(0, BK // 32)
    s_mask = n_ok[:, None] & (offs_g * 32 < K)[None, :]
    s = tl.load(s_base + offs_n[:, None] * s_sn + offs_g[None, :], mask=s_mask, other=127)
    return w8, s


@triton.jit
def _w13_mx8_kernel(
    x_ptr, w_ptr, ws_ptr, out_ptr, outs_ptr, pairs_ptr, bexp_ptr,
    P, INTER, HIDDEN, K_SPLIT, limit,
    s_xt, s_we, s_wn, s_se, s_sn, s_os, s_op, s_osp,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, HAS_LIMIT: tl.constexpr, EMULATE: tl.constexpr, INTERPRET: tl.constexpr,
    KS_C: tl.constexpr,
):  # fmt: skip
    """Grid (R / BM, I / BN, SPLIT). SPLIT == 1: out = act e4m3 bytes [P, I], outs its ue8m0
    [P, ceil(I/32)]. Else program k sums hidden[k * K_SPLIT, (k + 1) * K_SPLIT) and writes float32
    gate | up to out[k] [P, 2I] (outs unused)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    e = tl.load(bexp_ptr + pid_m)
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = (pairs < P) & (e >= 0)
    x_row = x_ptr + (pairs // TOP_K).to(tl.int64) * s_xt
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    e64 = tl.maximum(e, 0).to(tl.int64)
    g_w, g_s = w_ptr + e64 * s_we, ws_ptr + e64 * s_se  # gate rows n, up rows INTER + n
    u_w, u_s = g_w + INTER * s_wn, g_s + INTER * s_sn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = pid_k * K_SPLIT
    k_end = tl.where(e >= 0, tl.minimum(k_lo + K_SPLIT, HIDDEN), k_lo)  # unused block: no traffic
    for kk in range(0, KS_C if INTERPRET else k_end - k_lo, BLOCK_K):
        k0 = k_lo + kk
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row[:, None] + offs_k[None, :], mask=row_ok[:, None] & (offs_k < HIDDEN)[None, :], other=0.0)
        xq, xs = mxfp8_quant(x.to(tl.float32), BLOCK_M, BLOCK_K, EMULATE)
        wg, sg = _w_step(g_w, g_s, offs_n, n_ok, k0, HIDDEN, s_wn, s_sn, BLOCK_N, BLOCK_K)
        acc_g = _mx_dot(acc_g, xq, xs, wg, sg, BLOCK_M, BLOCK_N, BLOCK_K, EMULATE)
        wu, su = _w_step(u_w, u_s, offs_n, n_ok, k0, HIDDEN, s_wn, s_sn, BLOCK_N, BLOCK_K)
        acc_u = _mx_dot(acc_u, xq, xs, wu, su, BLOCK_M, BLOCK_N, BLOCK_K, EMULATE)
    rows = pairs.to(tl.int64)[:, None]
    mask = row_ok[:, None] & n_ok[None, :]
    if SPLIT == 1:
        q, s = mxfp8_quant(_swiglu(acc_g, acc_u, limit, HAS_LIMIT), BLOCK_M, BLOCK_N, EMULATE)
        tl.store(out_ptr + rows * s_op + offs_n[None, :], q, mask=mask)
        offs_g = pid_n * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
        tl.store(outs_ptr + rows * s_osp + offs_g[None, :], s, mask=row_ok[:, None] & (offs_g * 32 < INTER)[None, :])
    else:
        out = out_ptr + pid_k * s_os + rows * s_op + offs_n[None, :]
        tl.store(out, acc_g, mask=mask)
        tl.store(out + INTER, acc_u, mask=mask)


@triton.jit
def _swiglu_mx8_kernel(
    part_ptr, act_ptr, acts_ptr, P, INTER, limit, s_ps, s_pp, s_at, s_as,
    SPLIT: tl.constexpr, HAS_LIMIT: tl.constexpr, BLOCK: tl.constexpr, EMULATE: tl.constexpr,
):  # fmt: skip
    """Grid (P, I / BLOCK), BLOCK a multiple of 32: act[p] = MXFP8(silu(clamp(sum_k gate_k[p])) *
    clamp(sum_k up_k[p])), e4m3 bytes and ue8m0 scales."""
    p = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < INTER
    g = tl.zeros([BLOCK], tl.float32)
    u = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(SPLIT):
        row = part_ptr + k * s_ps + p * s_pp
        g += tl.load(row + offs, mask=ok, other=0.0)
        u += tl.load(row + INTER + offs, mask=ok, other=0.0)
    q, s = mxfp8_quant(tl.reshape(_swiglu(g, u, limit, HAS_LIMIT), (1, BLOCK)), 1, BLOCK, EMULATE)
    tl.store(act_ptr + p * s_at + offs, tl.reshape(q, (BLOCK,)), mask=ok)
    offs_g = tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    tl.store(acts_ptr + p * s_as + offs_g, tl.reshape(s, (BLOCK // 32,)), mask=offs_g * 32 < INTER)


@triton.jit
def _w2_mx8_kernel(
    act_ptr, acts_ptr, w_ptr, ws_ptr, topw_ptr, y_ptr, pairs_ptr, bexp_ptr,
    P, HIDDEN, INTER, K_SPLIT,
    s_at, s_as, s_we, s_wn, s_se, s_sn, s_ys, s_yp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EMULATE: tl.constexpr, INTERPRET: tl.constexpr, KS_C: tl.constexpr,
):  # fmt: skip
    """Grid (R / BM, hidden / BN, SPLIT): y[k, p] = topk_weight[p] * the K-slice k of act[p] @ w2^T,
    act the MXFP8 activation (e4m3 bytes [P, I], ue8m0 [P, ceil(I/32)])."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    e = tl.load(bexp_ptr + pid_m)
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = (pairs < P) & (e >= 0)
    rows = pairs.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < HIDDEN
    e64 = tl.maximum(e, 0).to(tl.int64)
    w_base, s_base = w_ptr + e64 * s_we, ws_ptr + e64 * s_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = pid_k * K_SPLIT
    k_end = tl.where(e >= 0, tl.minimum(k_lo + K_SPLIT, INTER), k_lo)
    for kk in range(0, KS_C if INTERPRET else k_end - k_lo, BLOCK_K):
        k0 = k_lo + kk
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            act_ptr + rows[:, None] * s_at + offs_k[None, :], mask=row_ok[:, None] & (offs_k < INTER)[None, :], other=0
        )
        offs_g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        a_mask = row_ok[:, None] & (offs_g * 32 < INTER)[None, :]
        a_s = tl.load(acts_ptr + rows[:, None] * s_as + offs_g[None, :], mask=a_mask, other=127)
        w, w_s = _w_step(w_base, s_base, offs_n, n_ok, k0, INTER, s_wn, s_sn, BLOCK_N, BLOCK_K)
        acc = _mx_dot(acc, a.to(tl.uint8), a_s, w, w_s, BLOCK_M, BLOCK_N, BLOCK_K, EMULATE)
    tw = tl.load(topw_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    out = y_ptr + pid_k * s_ys + rows[:, None] * s_yp + offs_n[None, :]
    tl.store(out, acc * tw[:, None], mask=row_ok[:, None] & n_ok[None, :])
