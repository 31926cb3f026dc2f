"""The Triton kernels of the FP4 fused MoE; `fused_moe_fp4.py` checks the arguments, aligns the
pairs, plans the launch (tile config, split-K) and runs them.

Legend: T tokens, k experts per token, P = T * k pairs, E experts, I expert intermediate size,
hidden model width, R aligned rows, BM/BN/BK tile (BK: K values per loop step, a multiple of the
32-value scale group), S splits of K.

Grouped GEMMs over the expert-sorted, block-aligned pairs of `fused_moe.moe_align`, computed
transposed (acc [BN, BM] = W @ x^T: the weights are the M side of the dot, which sm_90's
warpgroup MMA takes from registers). Per 32-value group g of a K step:

    bytes [BN, 16] -> lo = codes of the even k, hi = codes of the odd k
    d = e2m1(lo) @ x[:, even k]^T + e2m1(hi) @ x[:, odd k]^T       (two K = 16 dots)
    acc += d * scale[n, g]                                          (one scale per weight row)

so no weight is ever interleaved or multiplied by its scale in registers: the nibble becomes an
fp16 bit pattern in three integer ops (`_e2m1_bits`: the value times 2**-14, exact, an fp16
subnormal for code 1), and 2**14 is folded into the scale. x's even and odd columns are two
strided loads of the (small, cached) activation tile. DeepSeek-V4's `swiglu_limit` clamps gate
(above) and up (both sides) before SiLU-and-mul when given.

Split-K: grid (R / BM, N / BN, S); `_w13_fp4_kernel` then writes float32 gate | up partials
[S, P, 2I] that `_swiglu_kernel` sums, clamps and activates, and `_w2_fp4_kernel` writes
[S, P, hidden] partials that join the top-k sum. Deterministic (no atomics).

DOT_SCALED (`MoEConfig.dot_scaled`) instead hands the packed tile and its scales to
`tl.dot_scaled` (x as "bf16"/"fp16", the weight as "e2m1" with its ue8m0 scales [BN, BK/32]), so
the compiler does the upcast: on sm_90 it dequantizes to bf16 in registers as well (and swaps the
operands itself: that path keeps acc [BM, BN]); on sm_120 Triton 3.6 upcasts this mix too (bf16
mma.sync): its block-scaled MMA takes equal MX formats only (`fused_moe_fp4_mx8_kernels.py`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _e2m1_bits(code, DTYPE: tl.constexpr):
    """4-bit e2m1 codes (uint8, in [0, 16)) -> their values times 2**-14 in DTYPE, exactly: the
    magnitude bits land in fp16's low exponent bits and top mantissa bit (code 1, 0.5, becomes
    the fp16 subnormal 2**-15), the sign bit in fp16's sign."""
    c = code.to(tl.uint16)
    bits = ((c & 7) << 9) | ((c & 8) << 12)
    return bits.to(tl.float16, bitcast=True).to(DTYPE)


@triton.jit
def _ue8m0_x2p14(s):
    """ue8m0 exponent bytes -> 2**(s - 127) * 2**14 in float32 (the 2**14 undoes `_e2m1_bits`)."""
    return ((s.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _group_dot(w_ptrs, w_mask, b_e, b_o, s_ptrs, s_mask, FP32_DOT: tl.constexpr):
    """One 32-value group: w_ptrs [BN, 16] packed bytes, b_e/b_o [16, BM] x's even/odd columns
    (transposed), s_ptrs [BN] scales -> (W @ x^T)[BN, BM] float32."""
    w = tl.load(w_ptrs, mask=w_mask, other=0)
    lo = _e2m1_bits(w & 0xF, b_e.dtype)
    hi = _e2m1_bits(w >> 4, b_e.dtype)
    if FP32_DOT:
        d = tl.dot(lo, b_e, input_precision="ieee")
        d = tl.dot(hi, b_o, d, input_precision="ieee")
    else:
        d = tl.dot(lo, b_e)
        d = tl.dot(hi, b_o, d)
    s = tl.load(s_ptrs, mask=s_mask, other=0)
    return d * _ue8m0_x2p14(s)[:, None]


@triton.jit
def _fp4_step(
    acc,
    a_row,
    a_ok,
    k0,
    K,
    w_base,
    s_base,
    offs_n,
    n_ok,
    s_wn,
    s_sn,
    BLOCK_K: tl.constexpr,
    DOT_SCALED: tl.constexpr,
    A_FMT: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """acc[BN, BM] += W[offs_n, k0:k0+BK] @ a[:, k0:k0+BK]^T (DOT_SCALED: acc[BM, BN] += a @ W^T,
    faster that way round on sm_90): weights are the M side of the dot
    (rows n: 16 contiguous packed bytes per group, the operand a warpgroup MMA can take from
    registers), the BM rows (tokens) its N side. a_row [BM] row pointers of the activations (x's
    dtype), w_base / s_base the expert's packed weight and scale rows."""
    if DOT_SCALED:  # acc is [BM, BN] here: the compiler's own decomposition swaps the operands
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_row[:, None] + offs_k[None, :], mask=a_ok[:, None] & (offs_k < K)[None, :], other=0.0)
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        w = tl.load(
            w_base + offs_n[None, :] * s_wn + offs_b[:, None], mask=(offs_b < K // 2)[:, None] & n_ok[None, :], other=0
        )
        offs_g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        s = tl.load(
            s_base + offs_n[:, None] * s_sn + offs_g[None, :],
            mask=n_ok[:, None] & (offs_g * 32 < K)[None, :],
            other=127,
        )
        acc = tl.dot_scaled(a, None, A_FMT, w, s, "e2m1", acc)
    else:
        offs_i = tl.arange(0, 16)
        for g in tl.static_range(BLOCK_K // 32):
            kk = k0 + g * 32 + 2 * offs_i  # the even k of each byte (K is even)
            b_mask = a_ok[None, :] & (kk < K)[:, None]
            b_e = tl.load(a_row[None, :] + kk[:, None], mask=b_mask, other=0.0)
            b_o = tl.load(a_row[None, :] + kk[:, None] + 1, mask=b_mask, other=0.0)
            kb = k0 // 2 + g * 16 + offs_i
            w_ptrs = w_base + offs_n[:, None] * s_wn + kb[None, :]
            w_mask = n_ok[:, None] & (kb < K // 2)[None, :]
            s_ptrs = s_base + offs_n * s_sn + (k0 // 32 + g)
            acc += _group_dot(w_ptrs, w_mask, b_e, b_o, s_ptrs, n_ok & (k0 + g * 32 < K), FP32_DOT)
    return acc


@triton.jit
def _swiglu(g, u, limit, HAS_LIMIT: tl.constexpr):
    if HAS_LIMIT:  # DeepSeek-V4: gate <= limit, -limit <= up <= limit
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _w13_fp4_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    pairs_ptr,
    bexp_ptr,
    P,
    INTER,
    HIDDEN,
    K_SPLIT,
    limit,
    s_xt,
    s_we,
    s_wn,
    s_se,
    s_sn,
    s_os,
    s_op,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    DOT_SCALED: tl.constexpr,
    A_FMT: tl.constexpr,
    FP32_DOT: tl.constexpr,
    INTERPRET: tl.constexpr,
    KS_C: tl.constexpr,
):
    """Grid (R / BM, I / BN, SPLIT). SPLIT == 1: out = act [P, I] in x's dtype. Else program k
    sums hidden[k * K_SPLIT, (k + 1) * K_SPLIT) and writes float32 gate | up to out[k] [P, 2I]."""
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
    if DOT_SCALED:
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # transposed: [n, pair]
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    k_lo = pid_k * K_SPLIT
    k_end = tl.where(e >= 0, tl.minimum(k_lo + K_SPLIT, HIDDEN), k_lo)  # unused block: no traffic
    for kk in range(0, KS_C if INTERPRET else k_end - k_lo, BLOCK_K):
        k0 = k_lo + kk
        acc_g = _fp4_step(
            acc_g, x_row, row_ok, k0, HIDDEN, g_w, g_s, offs_n, n_ok, s_wn, s_sn, BLOCK_K, DOT_SCALED, A_FMT, FP32_DOT
        )
        acc_u = _fp4_step(
            acc_u, x_row, row_ok, k0, HIDDEN, u_w, u_s, offs_n, n_ok, s_wn, s_sn, BLOCK_K, DOT_SCALED, A_FMT, FP32_DOT
        )
    if DOT_SCALED:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    out = out_ptr + pid_k * s_os + pairs.to(tl.int64)[None, :] * s_op + offs_n[:, None]
    mask = row_ok[None, :] & n_ok[:, None]
    if SPLIT == 1:
        tl.store(out, _swiglu(acc_g, acc_u, limit, HAS_LIMIT).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out, acc_g, mask=mask)
        tl.store(out + INTER, acc_u, mask=mask)


@triton.jit
def _swiglu_kernel(
    part_ptr,
    act_ptr,
    P,
    INTER,
    limit,
    s_ps,
    s_pp,
    s_at,
    SPLIT: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid (P, I / BLOCK): act[p] = silu(clamp(sum_k gate_k[p])) * clamp(sum_k up_k[p])."""
    p = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < INTER
    g = tl.zeros([BLOCK], tl.float32)
    u = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(SPLIT):
        row = part_ptr + k * s_ps + p * s_pp
        g += tl.load(row + offs, mask=ok, other=0.0)
        u += tl.load(row + INTER + offs, mask=ok, other=0.0)
    act = _swiglu(g, u, limit, HAS_LIMIT)
    tl.store(act_ptr + p * s_at + offs, act.to(act_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _w2_fp4_kernel(
    act_ptr,
    w_ptr,
    ws_ptr,
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
    s_yp,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_SCALED: tl.constexpr,
    A_FMT: tl.constexpr,
    FP32_DOT: tl.constexpr,
    INTERPRET: tl.constexpr,
    KS_C: tl.constexpr,
):
    """Grid (R / BM, hidden / BN, SPLIT): y[k, p] = topk_weight[p] * the K-slice k of act[p] @ w2^T."""
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
    if DOT_SCALED:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # transposed: [n, pair]
    k_lo = pid_k * K_SPLIT
    k_end = tl.where(e >= 0, tl.minimum(k_lo + K_SPLIT, INTER), k_lo)
    for kk in range(0, KS_C if INTERPRET else k_end - k_lo, BLOCK_K):
        k0 = k_lo + kk
        acc = _fp4_step(
            acc,
            act_ptr + rows * s_at,
            row_ok,
            k0,
            INTER,
            w_ptr + e64 * s_we,
            ws_ptr + e64 * s_se,
            offs_n,
            n_ok,
            s_wn,
            s_sn,
            BLOCK_K,
            DOT_SCALED,
            A_FMT,
            FP32_DOT,
        )
    if DOT_SCALED:
        acc = tl.trans(acc)
    w = tl.load(topw_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    out = y_ptr + pid_k * s_ys + rows[None, :] * s_yp + offs_n[:, None]
    tl.store(out, acc * w[None, :], mask=row_ok[None, :] & n_ok[:, None])
