"""The Triton kernels of the FP4 fused MoE on weights in the tiled layout (`ref_fp4.tile_fp4`,
made once at load): W4A16 for decode sizes. `fused_moe_fp4.py` checks the arguments, aligns the
pairs, plans the launch and runs them.

Legend: T tokens, k experts per token, P = T * k pairs, E experts, I expert intermediate size,
hidden model width, BM rows (pairs) of a tile, TN x TK the layout's weight tile (64 x 128 or 256),
G = TK/32 scale groups of a tile row, S splits of K.

A K step reads one weight tile: TN x TK/2 value bytes, then TN x G scale bytes, contiguous (whole
128-byte lines, 16 bytes a thread). Byte j = 16 g + i of a row holds the codes of the tile's
columns 32 g + i ("lo") and 32 g + 16 + i ("hi"), so the step is two dots with K = TK/2, each
against a run of the activation tile (`_x_halves`):

    acc[TN, BM] += dq(lo) @ x[:, lo columns]^T + dq(hi) @ x[:, hi columns]^T

with the weights the M side of the MMA (sm_90's warpgroup MMA takes it from registers) and no
per-group work after the dot: the ue8m0 scale is folded into the dequantized weight. Rows of a
block past its expert's pairs are masked (never read: padding rows all pointed at one real row
would hammer its L2 lines, 2-3x slower on an H100).

dq, bf16 on a GPU (FAST, `_dq_fast`): a byte is [a's 3 magnitude bits | b's | a's sign | b's sign]
(`ref_fp4.tile_byte`); PRMT puts two bytes in bits 8-15 of the two halves of a 32-bit word, where
shifts and masks give each code's bf16 bit pattern times 2**-126 (sign at bit 15, magnitude at
bits 6-8: exact, code 1 lands on the bf16 subnormal 2**-127), and one bf16x2 multiply by 2**(b - 1)
(bits (b + 126) << 7) restores 2**-126 and applies the group's scale 2**(b - 127): 10 instructions
per 4 weights. Needs b <= 128 (scales up to 2), which `tile_experts` checks. Elsewhere
(interpreter, fp16 / fp32 x) the same values through `fused_moe_fp4_kernels._e2m1_bits` and a
float32 multiply (portable, slower). The scales are loaded as 32-bit words, which the software
pipeline stages with the value bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pdserve_kernels import ref_fp4
from pdserve_kernels.fused_moe_fp4_kernels import _e2m1_bits, _swiglu

TILE_N = tl.constexpr(ref_fp4.TILE_N)


@triton.jit
def _dq_fast(w, m):
    """w [..] uint8 (`ref_fp4.tile_byte`: two codes), m [..] bf16 2**(b - 1) -> (lo, hi) bf16
    weights. Two bytes at a time: PRMT puts byte i in bits 8-15 of half i, where the second code's
    sign already sits at bf16's sign bit and its magnitude 5 bits above bf16's bits 6-8."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 w, t, a, b;
        cvt.u32.u16 w, $2;
        prmt.b32 t, w, 0, 0x1404;
        shr.b32 a, t, 2;
        shl.b32 b, t, 1;
        and.b32 a, a, 0x01C001C0;
        and.b32 b, b, 0x80008000;
        or.b32 a, a, b;
        mul.rn.bf16x2 $0, a, $3;
        shr.b32 a, t, 5;
        and.b32 a, a, 0x01C001C0;
        and.b32 b, t, 0x80008000;
        or.b32 a, a, b;
        mul.rn.bf16x2 $1, a, $3;
        }""",
        constraints="=r,=r,h,r",
        args=[w, m],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=2,
    )


@triton.jit
def _dq_tile(tile, live, TILE_K: tl.constexpr, DTYPE: tl.constexpr, FAST: tl.constexpr):
    """One weight tile (pointer to its first byte; `live` False: past K, read nothing) ->
    (lo, hi) [TN, TK/2] in DTYPE: the tile's first and last TK/2 columns, scaled."""
    r = tl.arange(0, TILE_N)
    w = tl.load(tile + r[:, None] * (TILE_K // 2) + tl.arange(0, TILE_K // 2)[None, :], mask=live, other=0)
    # the scales as 32-bit words (4 a word, little-endian): a load the pipeline stages like the values
    W32: tl.constexpr = TILE_K // 128
    s_ptr = (tile + TILE_N * TILE_K // 2).to(tl.pointer_type(tl.int32))
    s32 = tl.load(s_ptr + r[:, None] * W32 + tl.arange(0, W32)[None, :], mask=live, other=0x7F7F7F7F)
    s = tl.join(tl.join(s32 & 0xFF, (s32 >> 8) & 0xFF), tl.join((s32 >> 16) & 0xFF, (s32 >> 24) & 0xFF))
    s = tl.reshape(tl.permute(s, (0, 1, 3, 2)), (TILE_N, TILE_K // 32))  # [TN, G]: byte g of word g // 4
    if FAST:
        m = ((s + 126) << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)  # 2**(b - 1)
    else:
        m = ((s + 14) << 23).to(tl.float32, bitcast=True)  # 2**(b - 127) * 2**14
    m = tl.reshape(
        tl.broadcast_to(m[:, :, None], (TILE_N, TILE_K // 32, 16)), (TILE_N, TILE_K // 2)
    )  # byte j: group j // 16
    if FAST:
        lo, hi = _dq_fast(w, m)
    else:
        lo = (_e2m1_bits((w & 7) | ((w >> 3) & 8), tl.float32) * m).to(DTYPE)
        hi = (_e2m1_bits(((w >> 3) & 7) | ((w >> 4) & 8), tl.float32) * m).to(DTYPE)
    return lo, hi


@triton.jit
def _x_halves(a_row, a_ok, k0, K, TILE_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The activation columns of the tile at k0: (xa, xb) [TK/2, BM], the low / high nibbles'.
    a_row / a_ok [BM] row pointers and which rows are real (the others are not read: padding rows
    all reading one real row would hammer its L2 lines); EVEN_K: every tile lies below K."""
    j = tl.arange(0, TILE_K // 2)
    kk = k0 + 32 * (j // 16) + j % 16  # the low nibbles' columns; the high ones' are 16 further
    if EVEN_K:
        xa = tl.load(a_row[None, :] + kk[:, None], mask=a_ok[None, :], other=0.0)
        xb = tl.load(a_row[None, :] + kk[:, None] + 16, mask=a_ok[None, :], other=0.0)
    else:
        xa = tl.load(a_row[None, :] + kk[:, None], mask=a_ok[None, :] & (kk < K)[:, None], other=0.0)
        xb = tl.load(a_row[None, :] + kk[:, None] + 16, mask=a_ok[None, :] & (kk + 16 < K)[:, None], other=0.0)
    return xa, xb


@triton.jit
def _tile_dot(acc, tile, live, xa, xb, TILE_K: tl.constexpr, FAST: tl.constexpr, FP32_DOT: tl.constexpr):
    """acc[TN, BM] += W_tile @ [xa; xb] (the tile's columns, split as `_x_halves`)."""
    lo, hi = _dq_tile(tile, live, TILE_K, xa.dtype, FAST)
    if FP32_DOT:
        acc = tl.dot(lo, xa, acc, input_precision="ieee")
        acc = tl.dot(hi, xb, acc, input_precision="ieee")
    else:
        acc = tl.dot(lo, xa, acc)
        acc = tl.dot(hi, xb, acc)
    return acc


@triton.jit
def _w13_tiled_kernel(
    x_ptr,
    w_ptr,
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
    s_os,
    s_op,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    FAST: tl.constexpr,
    FP32_DOT: tl.constexpr,
    INTERPRET: tl.constexpr,
    KS_C: tl.constexpr,
):
    """Grid (R / BM, NB, SPLIT) over w13 tiles [E, 2, NB, KB, bytes] (s_we / s_wh / s_wn: expert,
    gate-up half, row-block strides; a K tile is TILE_BYTES further). SPLIT == 1: out = act
    [P, NB * TN] in x's dtype; else float32 gate | up partials out[k] [P, 2 * NB * TN]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    e = tl.load(bexp_ptr + pid_m)
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = (pairs < P) & (e >= 0)
    x_row = x_ptr + (pairs // TOP_K).to(tl.int64) * s_xt
    g_t = w_ptr + tl.maximum(e, 0).to(tl.int64) * s_we + pid_n * s_wn
    acc_g = tl.zeros([TILE_N, BLOCK_M], tl.float32)  # transposed: [n, pair]
    acc_u = tl.zeros([TILE_N, BLOCK_M], tl.float32)
    k_lo = pid_k * K_SPLIT
    k_end = tl.where(e >= 0, tl.minimum(k_lo + K_SPLIT, HIDDEN), k_lo)  # unused block: no traffic
    tile_bytes = TILE_N * TILE_K // 2 + TILE_N * TILE_K // 32
    for kk in range(0, KS_C if INTERPRET else k_end - k_lo, TILE_K):
        k0 = k_lo + kk
        t = g_t + (k0 // TILE_K) * tile_bytes
        xa, xb = _x_halves(x_row, row_ok, k0, k_end, TILE_K, EVEN_K)
        acc_g = _tile_dot(acc_g, t, (k0 < k_end) | (not INTERPRET), xa, xb, TILE_K, FAST, FP32_DOT)
        acc_u = _tile_dot(acc_u, t + s_wh, (k0 < k_end) | (not INTERPRET), xa, xb, TILE_K, FAST, FP32_DOT)
    offs_n = pid_n * TILE_N + tl.arange(0, TILE_N)
    n_all = tl.num_programs(1) * TILE_N
    out = out_ptr + pid_k * s_os + pairs.to(tl.int64)[None, :] * s_op + offs_n[:, None]
    mask = row_ok[None, :] & (offs_n < n_all)[:, None]
    if SPLIT == 1:
        tl.store(out, _swiglu(acc_g, acc_u, limit, HAS_LIMIT).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out, acc_g, mask=mask)
        tl.store(out + n_all, acc_u, mask=mask)


@triton.jit
def _w2_tiled_kernel(
    act_ptr,
    w_ptr,
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
    s_ys,
    s_yp,
    BLOCK_M: tl.constexpr,
    TILE_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    FAST: tl.constexpr,
    FP32_DOT: tl.constexpr,
    INTERPRET: tl.constexpr,
    KS_C: tl.constexpr,
):
    """Grid (R / BM, NB, SPLIT) over w2 tiles [E, NB, KB, bytes]: y[k, p] = topk_weight[p] * the
    K-slice k of act[p] @ w2^T (act [P, INTER], INTER the padded I)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    e = tl.load(bexp_ptr + pid_m)
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = (pairs < P) & (e >= 0)
    rows = pairs.to(tl.int64)
    a_row = act_ptr + rows * s_at
    w_t = w_ptr + tl.maximum(e, 0).to(tl.int64) * s_we + pid_n * s_wn
    acc = tl.zeros([TILE_N, BLOCK_M], tl.float32)  # transposed: [n, pair]
    k_lo = pid_k * K_SPLIT
    k_end = tl.where(e >= 0, tl.minimum(k_lo + K_SPLIT, INTER), k_lo)
    tile_bytes = TILE_N * TILE_K // 2 + TILE_N * TILE_K // 32
    for kk in range(0, KS_C if INTERPRET else k_end - k_lo, TILE_K):
        k0 = k_lo + kk
        xa, xb = _x_halves(a_row, row_ok, k0, k_end, TILE_K, EVEN_K)
        acc = _tile_dot(
            acc, w_t + (k0 // TILE_K) * tile_bytes, (k0 < k_end) | (not INTERPRET), xa, xb, TILE_K, FAST, FP32_DOT
        )
    offs_n = pid_n * TILE_N + tl.arange(0, TILE_N)
    w = tl.load(topw_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    out = y_ptr + pid_k * s_ys + rows[None, :] * s_yp + offs_n[:, None]
    tl.store(out, acc * w[None, :], mask=row_ok[None, :] & (offs_n < HIDDEN)[:, None])
