"""Fused MoE with FP8 block-scaled weights (DeepSeek's checkpoints) and FP8 activations.

Legend: T tokens, k experts per token, P = T * k pairs, E experts, I expert intermediate size,
hidden model width, bn x bk weight block (128 x 128), BM/BN tile (BK = bk: one activation group
per K step).

Same expert-sorted, block-aligned grouped GEMMs as `fused_moe.py` (same `moe_align`), with:
- weights w13 [E, 2I, hidden] and w2 [E, hidden, I] in e4m3, scales `weight_scale_inv`
  [E, ceil(N / bn), ceil(K / bk)] float32 (N, K: the weight's rows and columns);
- activations quantized in registers per token and per group of bk values (the K step):
  s = max(amax, 1e-10) / 448, q = e4m3(x / s); for w13 the x tile, for w2 the SiLU-and-mul output
  (stored in x's dtype by `_w13_fp8_kernel`, quantized when `_w2_fp8_kernel` loads it);
- an e4m3 x e4m3 `tl.dot` per K step, scaled into the float32 accumulator by the activation
  scale of each row and the weight-block scale of each column: acc += (q_a @ q_w) * s_a * s_w.
Reference: `ref_fp8.fused_moe_fp8_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve_kernels import configs
from pdserve_kernels._launch import capability, cdiv, interpreting
from pdserve_kernels.fused_moe import MAX_KERNEL_ALIGN_PAIRS, moe_align, moe_align_fast, sum_pairs

E4M3_MAX = 448.0


@triton.jit
def _round_e4m3(y):
    """Round float32 values in [-448, 448] to the nearest e4m3 value (ties to even), as float32.
    Only under the interpreter, whose float32 -> fp8 cast rounds wrongly at binade edges; the GPU
    cast (cvt.rn.satfinite) is exact and is used there."""
    e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    a = tl.abs(y) / step
    f = tl.floor(a)
    d = a - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    r = (f + tl.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)) * step
    return tl.where(y < 0, -r, r)


@triton.jit
def _quant_rows(a, INTERPRET: tl.constexpr):
    """a [BM, BK] float32, one activation group per row -> (e4m3 [BM, BK], scales [BM])."""
    s = tl.maximum(tl.max(tl.abs(a), 1), 1e-10) / 448.0
    y = tl.minimum(tl.maximum(a / s[:, None], -448.0), 448.0)
    if INTERPRET:
        y = _round_e4m3(y)
    return y.to(tl.float8e4nv), s


@triton.jit
def _w13_fp8_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    act_ptr,
    pairs_ptr,
    bexp_ptr,
    P,
    INTER,
    HIDDEN,
    s_xt,
    s_we,
    s_wn,
    s_se,
    s_sn,
    s_sk,
    s_at,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_BLOCK_N: tl.constexpr,
    FP8_ACT: tl.constexpr,
    INTERPRET: tl.constexpr,
    HIDDEN_C: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + pid_m)
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = (pairs < P) & (e >= 0)
    tok = (pairs // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    e64 = tl.maximum(e, 0).to(tl.int64)
    a_ptrs = x_ptr + tok[:, None] * s_xt + offs_k[None, :]
    g_ptrs = w_ptr + e64 * s_we + offs_n[None, :] * s_wn + offs_k[:, None]
    u_ptrs = g_ptrs + INTER * s_wn
    gs_ptrs = ws_ptr + e64 * s_se + (offs_n // W_BLOCK_N) * s_sn  # gate rows' block scales
    us_ptrs = ws_ptr + e64 * s_se + ((INTER + offs_n) // W_BLOCK_N) * s_sn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_end = tl.where(e >= 0, HIDDEN, 0)  # unused block: no weight traffic
    for k0 in range(0, HIDDEN_C if INTERPRET else k_end, BLOCK_K):
        k_ok = offs_k < HIDDEN - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        g = tl.load(g_ptrs, mask=w_mask, other=0).to(tl.float8e4nv, bitcast=True)
        u = tl.load(u_ptrs, mask=w_mask, other=0).to(tl.float8e4nv, bitcast=True)
        kb = k0 // BLOCK_K
        g_s = tl.load(gs_ptrs + kb * s_sk, mask=n_ok, other=0.0)
        u_s = tl.load(us_ptrs + kb * s_sk, mask=n_ok, other=0.0)
        if FP8_ACT:
            a_q, a_s = _quant_rows(a.to(tl.float32), INTERPRET)
            acc_g += tl.dot(a_q, g) * a_s[:, None] * g_s[None, :]
            acc_u += tl.dot(a_q, u) * a_s[:, None] * u_s[None, :]
        else:  # float32 x (parity runs): the weights upcast, IEEE dots
            acc_g += tl.dot(a, g.to(tl.float32), input_precision="ieee") * g_s[None, :]
            acc_u += tl.dot(a, u.to(tl.float32), input_precision="ieee") * u_s[None, :]
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    out = act_ptr + pairs.to(tl.int64)[:, None] * s_at + offs_n[None, :]
    tl.store(out, act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _w2_fp8_kernel(
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
    s_at,
    s_we,
    s_wn,
    s_se,
    s_sn,
    s_sk,
    s_yp,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_BLOCK_N: tl.constexpr,
    FP8_ACT: tl.constexpr,
    INTERPRET: tl.constexpr,
    INTER_C: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + pid_m)
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = (pairs < P) & (e >= 0)
    rows = pairs.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < HIDDEN
    offs_k = tl.arange(0, BLOCK_K)
    e64 = tl.maximum(e, 0).to(tl.int64)
    a_ptrs = act_ptr + rows[:, None] * s_at + offs_k[None, :]
    b_ptrs = w_ptr + e64 * s_we + offs_n[None, :] * s_wn + offs_k[:, None]
    bs_ptrs = ws_ptr + e64 * s_se + (offs_n // W_BLOCK_N) * s_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_end = tl.where(e >= 0, INTER, 0)
    for k0 in range(0, INTER_C if INTERPRET else k_end, BLOCK_K):
        k_ok = offs_k < INTER - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0).to(tl.float8e4nv, bitcast=True)
        b_s = tl.load(bs_ptrs + (k0 // BLOCK_K) * s_sk, mask=n_ok, other=0.0)
        if FP8_ACT:
            a_q, a_s = _quant_rows(a.to(tl.float32), INTERPRET)
            acc += tl.dot(a_q, b) * a_s[:, None] * b_s[None, :]
        else:
            acc += tl.dot(a, b.to(tl.float32), input_precision="ieee") * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    w = tl.load(topw_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    out = y_ptr + rows[:, None] * s_yp + offs_n[None, :]
    tl.store(out, acc * w[:, None], mask=row_ok[:, None] & n_ok[None, :])


def _check(x, w13, w2, w13_scale_inv, w2_scale_inv, topk_weights, topk_ids, block_shape):
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError("x must be [T, hidden], w13 [E, 2I, hidden], w2 [E, hidden, I]")
    T, hidden = x.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    bn, bk = block_shape
    if w13.shape[2] != hidden or tuple(w2.shape) != (E, hidden, inter) or two_i % 2:
        raise ValueError(f"shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 MoE takes float8_e4m3fn w13 and w2, got {w13.dtype}, {w2.dtype}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    if bk not in (16, 32, 64, 128, 256) or bn < 1:
        raise ValueError(f"block_shape {block_shape}: bk must be a power of two in [16, 256]")
    if inter % bn:
        raise ValueError(
            f"I = {inter} must be a multiple of the weight block's bn = {bn} (gate "
            "and up rows must not share a scale block)"
        )
    want13 = (E, cdiv(two_i, bn), cdiv(hidden, bk))
    want2 = (E, cdiv(hidden, bn), cdiv(inter, bk))
    for name, s, want in (("w13_scale_inv", w13_scale_inv, want13), ("w2_scale_inv", w2_scale_inv, want2)):
        if s is None or tuple(s.shape) != want or s.dtype != torch.float32:
            got = None if s is None else (tuple(s.shape), s.dtype)
            raise ValueError(f"{name} must be float32 {want} for block {block_shape}, got {got}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids and topk_weights must both be [T={T}, k]")
    if w13.stride(2) != 1 or w2.stride(2) != 1 or x.stride(1) != 1:
        raise ValueError("x, w13 and w2 need contiguous last dims")


def fused_moe_fp8(
    x: torch.Tensor,  # [T, hidden] bf16/fp16 (fp32 for tests)
    w13: torch.Tensor,  # [E, 2I, hidden] float8_e4m3fn, gate rows then up rows
    w2: torch.Tensor,  # [E, hidden, I] float8_e4m3fn
    w13_scale_inv: torch.Tensor,  # [E, ceil(2I/bn), ceil(hidden/bk)] float32
    w2_scale_inv: torch.Tensor,  # [E, ceil(hidden/bn), ceil(I/bk)] float32
    topk_weights: torch.Tensor,  # [T, k] float
    topk_ids: torch.Tensor,  # [T, k] int, in [0, E)
    block_shape: tuple[int, int] = (128, 128),  # (bn, bk) of weight_scale_inv; bk = activation group
    config: configs.MoEConfig | None = None,  # tile override (benchmark sweeps); block_k is set to bk
) -> torch.Tensor:
    """y [T, hidden] in x's dtype; same contract as `ref_fp8.fused_moe_fp8_ref` (act_quant: x not
    float32)."""
    _check(x, w13, w2, w13_scale_inv, w2_scale_inv, topk_weights, topk_ids, block_shape)
    T, hidden = x.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    P = T * top_k
    if P == 0:
        return torch.zeros(T, hidden, dtype=x.dtype, device=x.device)
    bn, bk = block_shape
    fp8_act = x.dtype != torch.float32
    cfg = config or (
        configs.MOE_FP32 if not fp8_act and x.is_cuda else configs.moe_fp8_config(capability(x.device), P / E)
    )
    align = moe_align_fast if P <= MAX_KERNEL_ALIGN_PAIRS else moe_align
    pairs, bexp = align(topk_ids, E, cfg.block_m)
    blocks = bexp.numel()
    act = torch.empty(P, inter, dtype=x.dtype, device=x.device)
    y_pair = torch.empty(P, hidden, dtype=torch.float32, device=x.device)
    interp = interpreting()
    w13_b, w2_b = w13.view(torch.uint8), w2.view(torch.uint8)  # bitcast back to e4m3 in-kernel
    _w13_fp8_kernel[(blocks, cdiv(inter, cfg.block_n))](
        x,
        w13_b,
        w13_scale_inv,
        act,
        pairs,
        bexp,
        P,
        inter,
        hidden,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        *w13_scale_inv.stride(),
        act.stride(0),
        TOP_K=top_k,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=bk,
        W_BLOCK_N=bn,
        FP8_ACT=fp8_act,
        INTERPRET=interp,
        HIDDEN_C=hidden if interp else 0,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    _w2_fp8_kernel[(blocks, cdiv(hidden, cfg.w2_block_n))](
        act,
        w2_b,
        w2_scale_inv,
        topk_weights.reshape(-1).contiguous(),
        y_pair,
        pairs,
        bexp,
        P,
        hidden,
        inter,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        *w2_scale_inv.stride(),
        y_pair.stride(0),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.w2_block_n,
        BLOCK_K=bk,
        W_BLOCK_N=bn,
        FP8_ACT=fp8_act,
        INTERPRET=interp,
        INTER_C=inter if interp else 0,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return sum_pairs(y_pair[None], top_k, x.dtype)
