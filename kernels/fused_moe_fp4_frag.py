"""The Triton kernels of the FP4 fused MoE on weights in the fragment layout (`ref_fp4.frag_fp4`,
made once at load): W4A16 for decode sizes, each thread's loaded bytes its warpgroup-MMA operand.
`fused_moe_fp4.py` checks the arguments, aligns the pairs, plans the launch and runs them.

Legend: T tokens, k experts per token, P = T * k pairs, E experts, I expert intermediate size,
hidden model width, BM rows (pairs) of a tile, TN x TK = 64 x 128 the layout's weight tile, S
splits of K; in a tile t = 32 w + 4 g + q the thread, hf / kq the half and the 16-column step in
it, c / h / p the fragment's column half, row half and column pair bit (`ref_fp4` layout note).

A K step reads one tile: 4,096 value bytes (16 contiguous bytes a thread per half) and 256 scale
bytes (8 a thread, shared by the 4 threads of a row quad). Each 32-bit word is the 8 weights a
thread feeds one 16-column MMA step; `_dq_frag` turns it into four bf16x2 registers:

    (0, 1) = word & M    (2, 3) = (word << 3) & M    (4, 5) = (word << 6) & M    (6, 7): 3 shifts
    M = 0x81C081C0: sign at bits 15 / 31, magnitude at 6-8 / 22-24 (the code times 2**-126)

each times 2**(b - 1) as bf16x2 (bits (b + 126) << 7: restores 2**126 and applies the group's
scale 2**(b - 127); b <= 128, which the layout's maker checks): 15 instructions per 8 weights and
no shared-memory round trip for the weights, whose [64, 128] tile is the MMA's register operand
(acc [64, BM] = W @ x^T). The reshapes and permutes after the unpack only rename registers: they
spell the fragment order for the compiler. Elsewhere (interpreter, fp16 / fp32 x) the same bits
decode through `fused_moe_fp4_kernels._e2m1_bits` and a float32 multiply (portable, slower).
Rows of a block past its expert's pairs are masked (never read: padding rows all reading one
real row would hammer its L2 lines, 2-3x slower on an H100 in an earlier layout's kernels).
"""

from __future__ import annotations

import triton
import triton.language as tl

from pdserve_kernels import ref_fp4
from pdserve_kernels.fused_moe_fp4_kernels import _e2m1_bits, _swiglu

FRAG_N = tl.constexpr(ref_fp4.FRAG_N)
FRAG_K = tl.constexpr(ref_fp4.FRAG_K)
VAL_BYTES = tl.constexpr(ref_fp4.FRAG_BYTES)
SCALE_BYTES = tl.constexpr(ref_fp4.FRAG_SCALE_BYTES)


@triton.jit
def _dq_frag(words, m):
    """words [.., 4] uint8 (a 32-bit word each 4), m [.., 4] bf16 (2**(b - 1) of rows h = 0, 0, 1,
    1) -> (r0, r1) [.., 4] bf16: the word's elements 0-3 and 4-7."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 a, b;
        and.b32 a, $4, 0x81C081C0;
        mul.rn.bf16x2 $0, a, $5;
        shl.b32 a, $4, 3;
        and.b32 a, a, 0x81C081C0;
        mul.rn.bf16x2 $1, a, $6;
        shl.b32 a, $4, 6;
        and.b32 a, a, 0x81C081C0;
        mul.rn.bf16x2 $2, a, $5;
        shr.b32 a, $4, 4;
        and.b32 a, a, 0x00C000C0;
        shr.b32 b, $4, 5;
        and.b32 b, b, 0x01000100;
        or.b32 a, a, b;
        shl.b32 b, $4, 1;
        and.b32 b, b, 0x80008000;
        or.b32 a, a, b;
        mul.rn.bf16x2 $3, a, $6;
        }""",
        constraints="=r,=r,=r,=r,r,r,r",
        args=[words, m],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _code(w, B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, BS: tl.constexpr):
    """The e2m1 code whose bits sit at B0, B1, B2 (magnitude) and BS (sign) of the words w."""
    return ((w >> B0) & 1) | (((w >> B1) & 1) << 1) | (((w >> B2) & 1) << 2) | (((w >> BS) & 1) << 3)


@triton.jit
def _dq_portable(b, s, DTYPE: tl.constexpr):
    """b [2, 128, 4, 4] uint8 (words), s [2, 128, 2, 2] uint8 scales (hf, t, kq // 2, h) ->
    [2, 128, 4, 8] DTYPE (hf, t, kq, e): `ref_fp4.FRAG_BITS` read bit by bit."""
    sh = (tl.arange(0, 4) * 8)[None, None, None, :]
    w = tl.sum(b.to(tl.int32) << sh, 3)  # [2, 128, 4]
    v01 = tl.join(_code(w, 6, 7, 8, 15), _code(w, 22, 23, 24, 31))
    v23 = tl.join(_code(w, 3, 4, 5, 12), _code(w, 19, 20, 21, 28))
    v45 = tl.join(_code(w, 0, 1, 2, 9), _code(w, 16, 17, 18, 25))
    v67 = tl.join(_code(w, 10, 11, 13, 14), _code(w, 26, 27, 29, 30))
    codes = tl.join(tl.join(v01, v23), tl.join(v45, v67))  # [2, 128, 4, p, h, c]
    codes = tl.reshape(tl.permute(codes, (0, 1, 2, 5, 4, 3)), (2, 128, 4, 8))  # e = 4 c + 2 h + p
    v = _e2m1_bits(codes.to(tl.uint8), tl.float32)  # times 2**-14
    m = ((s.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)  # 2**(b - 127 + 14)
    m = tl.broadcast_to(m[:, :, :, None, None, :, None], (2, 128, 2, 2, 2, 2, 2))  # kq // 2, kq % 2, c, h, p
    return (v * tl.reshape(m, (2, 128, 4, 8))).to(DTYPE)


@triton.jit
def _frag_tile(vals, scales, live, DTYPE: tl.constexpr, FAST: tl.constexpr):
    """One tile (its value and scale pointers; `live` False: past K, read nothing) -> W [64, 128]
    in DTYPE, scaled: in registers as the warpgroup MMA's A fragment when FAST."""
    t = tl.arange(0, 128)[None, :, None]
    hf = tl.arange(0, 2)[:, None, None]
    b = tl.load(vals + hf * (VAL_BYTES // 2) + t * 16 + tl.arange(0, 16)[None, None, :], mask=live, other=0)
    b = tl.reshape(b, (2, 128, 4, 4))  # [hf, t, kq, byte]: a thread's 16 bytes of a half, one load
    # the scales as 32-bit words (4 bytes (kq // 2, h) of a half a word): a load the pipeline stages
    s_words = scales.to(tl.pointer_type(tl.int32)) + (tl.arange(0, 128)[None, :] // 4) * 2 + tl.arange(0, 2)[:, None]
    s32 = tl.load(s_words, mask=live, other=0x7F7F7F7F)  # [2, 128]
    s = tl.join(
        tl.join(s32 & 0xFF, (s32 >> 16) & 0xFF), tl.join((s32 >> 8) & 0xFF, (s32 >> 24) & 0xFF)
    )  # [2, 128, 2, 2]
    if FAST:
        m = ((s.to(tl.int32) + 126) << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)  # 2**(b - 1)
        m = tl.reshape(tl.broadcast_to(m[:, :, :, None, :, None], (2, 128, 2, 2, 2, 2)), (2, 128, 4, 4))
        r0, r1 = _dq_frag(b, m)
        w8 = tl.reshape(tl.permute(tl.join(r0, r1), (0, 1, 2, 4, 3)), (2, 128, 4, 8))
    else:
        w8 = _dq_portable(b, s, DTYPE)
    w8 = tl.reshape(w8, (2, 4, 8, 4, 4, 2, 2, 2))  # hf, w, g, q, kq, c, h, p
    return tl.reshape(tl.permute(w8, (1, 6, 2, 0, 4, 5, 3, 7)), (FRAG_N, FRAG_K))  # rows (w, h, g)


@triton.jit
def _frag_dot(acc, vals, scales, live, xt, FAST: tl.constexpr, FP32_DOT: tl.constexpr):
    """acc[64, BM] += W_tile @ xt (xt [128, BM]: the tile's columns of the activations, transposed)."""
    w = _frag_tile(vals, scales, live, xt.dtype, FAST)
    if FP32_DOT:
        return tl.dot(w, xt, acc, input_precision="ieee")
    return tl.dot(w, xt, acc)


@triton.jit
def _x_tile(a_row, a_ok, k0, K):
    """Activations [128, BM] at columns k0.. of the rows a_row (a_ok: real rows; others not read)."""
    kk = k0 + tl.arange(0, FRAG_K)
    return tl.load(a_row[None, :] + kk[:, None], mask=a_ok[None, :] & (kk < K)[:, None], other=0.0)


@triton.jit
def _w13_frag_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    pairs_ptr,
    bexp_ptr,
    P,
    HIDDEN,
    K_SPLIT,
    limit,
    s_xt,
    s_we,
    s_wh,
    s_wn,
    s_se,
    s_sh,
    s_sn,
    s_os,
    s_op,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    FAST: tl.constexpr,
    FP32_DOT: tl.constexpr,
    INTERPRET: tl.constexpr,
    KS_C: tl.constexpr,
):
    """Grid (R / BM, NB, SPLIT) over w13 tiles (values [E, 2, NB, KB, 4096], scales [E, 2, NB,
    KB, 256]; s_w* / s_s* their expert, gate-up half and row-block strides). SPLIT == 1: out = act
    [P, NB * 64] in x's dtype; else float32 gate | up partials out[k] [P, 2 * NB * 64]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    e = tl.load(bexp_ptr + pid_m)
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = (pairs < P) & (e >= 0)
    x_row = x_ptr + (pairs // TOP_K).to(tl.int64) * s_xt
    e64 = tl.maximum(e, 0).to(tl.int64)
    g_v, g_s = w_ptr + e64 * s_we + pid_n * s_wn, s_ptr + e64 * s_se + pid_n * s_sn
    acc_g = tl.zeros([FRAG_N, BLOCK_M], tl.float32)  # transposed: [n, pair]
    acc_u = tl.zeros([FRAG_N, BLOCK_M], tl.float32)
    k_lo = pid_k * K_SPLIT
    k_end = tl.where(e >= 0, tl.minimum(k_lo + K_SPLIT, HIDDEN), k_lo)  # unused block: no traffic
    for kk in range(0, KS_C if INTERPRET else k_end - k_lo, FRAG_K):
        k0 = k_lo + kk
        live = (k0 < k_end) | (not INTERPRET)
        v, s = g_v + (k0 // FRAG_K) * VAL_BYTES, g_s + (k0 // FRAG_K) * SCALE_BYTES
        xt = _x_tile(x_row, row_ok, k0, k_end)
        acc_g = _frag_dot(acc_g, v, s, live, xt, FAST, FP32_DOT)
        acc_u = _frag_dot(acc_u, v + s_wh, s + s_sh, live, xt, FAST, FP32_DOT)
    offs_n = pid_n * FRAG_N + tl.arange(0, FRAG_N)
    n_all = tl.num_programs(1) * FRAG_N
    out = out_ptr + pid_k * s_os + pairs.to(tl.int64)[None, :] * s_op + offs_n[:, None]
    mask = row_ok[None, :] & (offs_n < n_all)[:, None]
    if SPLIT == 1:
        tl.store(out, _swiglu(acc_g, acc_u, limit, HAS_LIMIT).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out, acc_g, mask=mask)
        tl.store(out + n_all, acc_u, mask=mask)


@triton.jit
def _w2_store(y_ptr, acc, w, rows, row_ok, n0, HIDDEN):
    offs_n = n0 + tl.arange(0, FRAG_N)
    out = y_ptr + rows[None, :] * HIDDEN + offs_n[:, None]
    tl.store(out, acc * w[None, :], mask=row_ok[None, :] & (offs_n < HIDDEN)[:, None])


@triton.jit
def _w2_frag_kernel(
    act_ptr,
    w_ptr,
    s_ptr,
    topw_ptr,
    y_ptr,
    pairs_ptr,
    bexp_ptr,
    P,
    HIDDEN,
    INTER,
    K_SPLIT,
    s_at,
    s_we,
    s_wn,
    s_se,
    s_sn,
    s_ys,
    BLOCK_M: tl.constexpr,
    N_TILES: tl.constexpr,
    FAST: tl.constexpr,
    FP32_DOT: tl.constexpr,
    INTERPRET: tl.constexpr,
    KS_C: tl.constexpr,
):
    """Grid (R / BM, NB / N_TILES, SPLIT) over w2 tiles (values [E, NB, KB, 4096], scales [E, NB,
    KB, 256]); a program takes N_TILES (1, 2 or 4) consecutive row blocks, which share the
    activation tile as w13's gate and up do: y[k, p] = topk_weight[p] * the K-slice k of act[p] @
    w2^T (act [P, INTER], INTER the padded I; y [S, P, HIDDEN] float32)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1) * N_TILES
    pid_k = tl.program_id(2)
    e = tl.load(bexp_ptr + pid_m)
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = (pairs < P) & (e >= 0)
    rows = pairs.to(tl.int64)
    a_row = act_ptr + rows * s_at
    e64 = tl.maximum(e, 0).to(tl.int64)
    w_v, w_s = w_ptr + e64 * s_we + pid_n * s_wn, s_ptr + e64 * s_se + pid_n * s_sn
    acc0 = tl.zeros([FRAG_N, BLOCK_M], tl.float32)  # transposed: [n, pair], row block pid_n + i
    acc1 = tl.zeros([FRAG_N, BLOCK_M], tl.float32)
    acc2 = tl.zeros([FRAG_N, BLOCK_M], tl.float32)
    acc3 = tl.zeros([FRAG_N, BLOCK_M], tl.float32)
    k_lo = pid_k * K_SPLIT
    k_end = tl.where(e >= 0, tl.minimum(k_lo + K_SPLIT, INTER), k_lo)
    for kk in range(0, KS_C if INTERPRET else k_end - k_lo, FRAG_K):
        k0 = k_lo + kk
        live = (k0 < k_end) | (not INTERPRET)
        xt = _x_tile(a_row, row_ok, k0, k_end)
        v, s = w_v + (k0 // FRAG_K) * VAL_BYTES, w_s + (k0 // FRAG_K) * SCALE_BYTES
        acc0 = _frag_dot(acc0, v, s, live, xt, FAST, FP32_DOT)
        if N_TILES > 1:
            acc1 = _frag_dot(acc1, v + s_wn, s + s_sn, live, xt, FAST, FP32_DOT)
        if N_TILES > 2:
            acc2 = _frag_dot(acc2, v + 2 * s_wn, s + 2 * s_sn, live, xt, FAST, FP32_DOT)
            acc3 = _frag_dot(acc3, v + 3 * s_wn, s + 3 * s_sn, live, xt, FAST, FP32_DOT)
    w = tl.load(topw_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    y = y_ptr + pid_k * s_ys
    _w2_store(y, acc0, w, rows, row_ok, pid_n * FRAG_N, HIDDEN)
    if N_TILES > 1:
        _w2_store(y, acc1, w, rows, row_ok, (pid_n + 1) * FRAG_N, HIDDEN)
    if N_TILES > 2:
        _w2_store(y, acc2, w, rows, row_ok, (pid_n + 2) * FRAG_N, HIDDEN)
        _w2_store(y, acc3, w, rows, row_ok, (pid_n + 3) * FRAG_N, HIDDEN)
