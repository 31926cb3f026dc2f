"""Fused MoE for decode: expert-sorted, block-aligned grouped GEMMs in vLLM's weight layout.

Legend: T tokens, k experts per token, P = T * k (token, expert) pairs, E experts, I expert
intermediate size, hidden model width, BM/BN/BK tile, R padded sorted rows.

FP8 block-scaled weights go to `fused_moe_fp8.py` (same alignment, e4m3 GEMMs).

1. `moe_align` (torch, no host sync; one Triton program, `moe_align_fast`, at decode sizes):
   pairs p = t * k + j sorted by expert, each expert's run
   padded to a multiple of BM with the sentinel P; one expert id per BM-row block, -1 for blocks
   past the end. Experts nobody picked get no block, so their weights are never read.
2. `_w13_kernel`, grid (R / BM, I / BN): act[p, n] = silu(x[t] . gate[e, n]) * (x[t] . up[e, n])
   with gate rows w13[e, n] and up rows w13[e, I + n]; both products share the x tile.
3. `_w2_kernel`, grid (R / BM, hidden / BN): y_pair[p, :] = topk_weight[p] * act[p] @ w2[e]^T in
   float32; the top-k sum and the cast to x's dtype are one `sum_pairs` (deterministic, no
   atomics; the [P, hidden] buffer is small next to the weights a decode step streams).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve_kernels import configs
from pdserve_kernels._launch import capability, cdiv, interpreting, next_pow2
from pdserve_kernels.glue import round_to


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """topk_ids [T, k] -> (sorted_pairs [R] int32 with sentinel P, block_expert [R / BM] int32
    with -1 for unused blocks). R = P + min(E, P) * (BM - 1) rounded up to BM: the most rows the
    padding can take, so nothing here waits for the GPU."""
    flat = topk_ids.reshape(-1).long()
    P = flat.numel()
    rows = cdiv(P + min(num_experts, P) * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(P, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert]
    sorted_pairs = torch.full((rows,), P, dtype=torch.int32, device=flat.device)
    sorted_pairs[ends[expert] - padded[expert] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, rows, block_m, device=flat.device)
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


@triton.jit
def _align_kernel(
    ids_ptr,
    pairs_ptr,
    bexp_ptr,
    scratch_ptr,
    P,
    E,
    R,
    NB,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    R_CHUNKS: tl.constexpr,
    B_CHUNKS: tl.constexpr,
    J_BLOCKS: tl.constexpr,
):
    """`moe_align` in one program (decode sizes): a launch instead of ~25 small torch ops, and no
    serial loop over pairs or blocks (each step of one would wait on the memory system).
    scratch [2 * BLOCK_E] int32: each expert's first row, then its pairs' rank offset."""
    offs_p = tl.arange(0, BLOCK_P)
    ids = tl.load(ids_ptr + offs_p, mask=offs_p < P, other=BLOCK_E - 1).to(tl.int32)
    offs_e = tl.arange(0, BLOCK_E)
    counts = tl.where(offs_e < E, tl.histogram(ids, BLOCK_E), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, 0) - padded
    tl.store(scratch_ptr + offs_e, starts)
    tl.store(scratch_ptr + BLOCK_E + offs_e, tl.cumsum(counts, 0) - counts)  # pairs of lower experts
    for c in range(0, R_CHUNKS):
        offs_r = c * BLOCK_R + tl.arange(0, BLOCK_R)
        tl.store(pairs_ptr + offs_r, tl.zeros([BLOCK_R], tl.int32) + P, mask=offs_r < R)
    for c in range(0, B_CHUNKS):
        offs_b = c * BLOCK_R + tl.arange(0, BLOCK_R)
        tl.store(bexp_ptr + offs_b, tl.zeros([BLOCK_R], tl.int32) - 1, mask=offs_b < NB)
    tl.debug_barrier()  # the sentinels and scratch are written before anything below reads or overwrites them
    for j in range(0, J_BLOCKS):  # an expert's j-th block (stores only: nothing waits)
        tl.store(bexp_ptr + starts // BLOCK_M + j, offs_e, mask=(j * BLOCK_M < counts) & (offs_e < E))
    key = tl.sort(ids * BLOCK_P + offs_p)  # by expert, then pair: the order `moe_align` keeps
    e, p = key // BLOCK_P, key % BLOCK_P
    ok = p < P
    rank = offs_p - tl.load(scratch_ptr + BLOCK_E + e, mask=ok, other=0)  # sorted position - lower experts' pairs
    dest = tl.load(scratch_ptr + e, mask=ok, other=0) + rank
    tl.store(pairs_ptr + dest, p, mask=ok)


MAX_KERNEL_ALIGN_PAIRS = 1024  # above this the torch ops cost little next to the GEMMs


def moe_align_fast(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Same output as `moe_align`, from one Triton program (P <= MAX_KERNEL_ALIGN_PAIRS)."""
    flat = topk_ids.reshape(-1)
    P = flat.numel()
    rows = cdiv(P + min(num_experts, P) * (block_m - 1), block_m) * block_m
    nb = rows // block_m
    pairs = torch.empty(rows, dtype=torch.int32, device=flat.device)
    bexp = torch.empty(nb, dtype=torch.int32, device=flat.device)
    block_e = next_pow2(num_experts + 1)
    scratch = torch.empty(2 * block_e, dtype=torch.int32, device=flat.device)
    block_p, block_r = max(16, next_pow2(P)), 1024
    _align_kernel[(1,)](
        flat, pairs, bexp, scratch, P, num_experts, rows, nb,
        BLOCK_P=block_p, BLOCK_E=block_e, BLOCK_M=block_m, BLOCK_R=block_r,
        R_CHUNKS=cdiv(rows, block_r), B_CHUNKS=cdiv(nb, block_r), J_BLOCKS=cdiv(block_p, block_m), num_warps=4,
    )  # fmt: skip
    return pairs, bexp


@triton.jit
def _w13_kernel(
    x_ptr,
    w_ptr,
    act_ptr,
    pairs_ptr,
    bexp_ptr,
    P,
    INTER,
    HIDDEN,
    s_xt,
    s_we,
    s_wn,
    s_wk,
    s_at,
    limit,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
    INTERPRET: tl.constexpr,
    HIDDEN_C: tl.constexpr,
    HAS_LIMIT: tl.constexpr = False,
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
    a_ptrs = x_ptr + tok[:, None] * s_xt + offs_k[None, :]
    g_ptrs = w_ptr + tl.maximum(e, 0).to(tl.int64) * s_we + offs_n[None, :] * s_wn + offs_k[:, None] * s_wk
    u_ptrs = g_ptrs + INTER * s_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_end = tl.where(e >= 0, HIDDEN, 0)  # unused block: no weight traffic
    for k0 in range(0, HIDDEN_C if INTERPRET else k_end, BLOCK_K):
        k_ok = offs_k < HIDDEN - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP32_DOT:
            acc_g += tl.dot(a, g, input_precision="ieee")
            acc_u += tl.dot(a, u, input_precision="ieee")
        else:
            acc_g += tl.dot(a, g)
            acc_u += tl.dot(a, u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * s_wk
        u_ptrs += BLOCK_K * s_wk
    if HAS_LIMIT:  # DeepSeek-V4's clamped SwiGLU: gate <= limit, -limit <= up <= limit
        acc_g = tl.minimum(acc_g, limit)
        acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    out = act_ptr + pairs.to(tl.int64)[:, None] * s_at + offs_n[None, :]
    tl.store(out, act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _w2_kernel(
    act_ptr,
    w_ptr,
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
    s_wk,
    s_yp,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
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
    a_ptrs = act_ptr + rows[:, None] * s_at + offs_k[None, :]
    b_ptrs = w_ptr + tl.maximum(e, 0).to(tl.int64) * s_we + offs_n[None, :] * s_wn + offs_k[:, None] * s_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_end = tl.where(e >= 0, INTER, 0)
    for k0 in range(0, INTER_C if INTERPRET else k_end, BLOCK_K):
        k_ok = offs_k < INTER - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP32_DOT:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * s_wk
    w = tl.load(topw_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    out = y_ptr + rows[:, None] * s_yp + offs_n[None, :]
    tl.store(out, acc * w[:, None], mask=row_ok[:, None] & n_ok[None, :])


def fused_moe(
    x: torch.Tensor,  # [T, hidden] bf16/fp16 (fp32 for tests)
    w13: torch.Tensor,  # [E, 2I, hidden], gate rows then up rows, x's dtype
    w2: torch.Tensor,  # [E, hidden, I], x's dtype
    topk_weights: torch.Tensor,  # [T, k] float
    topk_ids: torch.Tensor,  # [T, k] int, in [0, E)
    config: configs.MoEConfig | None = None,  # tile override (benchmark sweeps)
    *,
    w13_scale_inv: torch.Tensor | None = None,  # fp8 weights only: [E, ceil(2I/bn), ceil(hidden/bk)]
    w2_scale_inv: torch.Tensor | None = None,  # fp8 weights only: [E, ceil(hidden/bn), ceil(I/bk)]
    block_shape: tuple[int, int] = (128, 128),  # fp8 weights only: (bn, bk) of the scales
    swiglu_limit: float | None = None,  # DeepSeek-V4: gate clamped to <= limit, up to [-limit, limit]
) -> torch.Tensor:
    """y [T, hidden] in x's dtype: y[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(gate_e x[t])
    * up_e x[t]), e = topk_ids[t, j]. Same contract as `ref.fused_moe_ref`. With float8_e4m3fn
    weights and their block scales this is `fused_moe_fp8.fused_moe_fp8` (FP8 activations too)."""
    if w13.dtype == torch.float8_e4m3fn or w2.dtype == torch.float8_e4m3fn:
        if swiglu_limit is not None:
            raise ValueError("swiglu_limit is for bf16 / fp16 / fp32 weights here (FP8 experts: not built)")
        from pdserve_kernels.fused_moe_fp8 import fused_moe_fp8

        return fused_moe_fp8(
            x, w13, w2, w13_scale_inv, w2_scale_inv, topk_weights, topk_ids, block_shape=block_shape, config=config
        )
    if w13_scale_inv is not None or w2_scale_inv is not None:
        raise ValueError(f"weight scales were given but w13/w2 are {w13.dtype}/{w2.dtype}, not float8_e4m3fn")
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError("x must be [T, hidden], w13 [E, 2I, hidden], w2 [E, hidden, I]")
    T, hidden = x.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    if w13.shape[2] != hidden or tuple(w2.shape) != (E, hidden, inter) or two_i % 2:
        raise ValueError(f"shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids and topk_weights must both be [T={T}, k]")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"weights ({w13.dtype}, {w2.dtype}) must match x ({x.dtype})")
    if w13.stride(2) != 1 or w2.stride(2) != 1 or x.stride(1) != 1:
        raise ValueError("x, w13 and w2 need contiguous last dims")
    top_k = topk_ids.shape[1]
    P = T * top_k
    if P == 0:
        return torch.zeros(T, hidden, dtype=x.dtype, device=x.device)
    fp32 = x.dtype == torch.float32
    cfg = config or (configs.MOE_FP32 if fp32 and x.is_cuda else configs.moe_config(capability(x.device), P / E))
    align = moe_align_fast if P <= MAX_KERNEL_ALIGN_PAIRS else moe_align
    pairs, bexp = align(topk_ids, E, cfg.block_m)
    blocks = bexp.numel()
    act = torch.empty(P, inter, dtype=x.dtype, device=x.device)
    y_pair = torch.empty(P, hidden, dtype=torch.float32, device=x.device)
    interp = interpreting()
    _w13_kernel[(blocks, cdiv(inter, cfg.block_n))](
        x,
        w13,
        act,
        pairs,
        bexp,
        P,
        inter,
        hidden,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        w13.stride(2),
        act.stride(0),
        float(swiglu_limit or 0.0),
        TOP_K=top_k,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        FP32_DOT=fp32,
        INTERPRET=interp,
        HIDDEN_C=hidden if interp else 0,
        HAS_LIMIT=swiglu_limit is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    _w2_kernel[(blocks, cdiv(hidden, cfg.w2_block_n))](
        act,
        w2,
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
        w2.stride(2),
        y_pair.stride(0),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.w2_block_n,
        BLOCK_K=cfg.block_k,
        FP32_DOT=fp32,
        INTERPRET=interp,
        INTER_C=inter if interp else 0,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return sum_pairs(y_pair[None], top_k, x.dtype)


SUM_BLOCK = 1024  # hidden values a `_sum_pairs_kernel` program


@triton.jit
def _sum_pairs_kernel(part_ptr, y_ptr, hidden, s_split, S: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(S):  # splits, then the token's k pairs, in order
        for j in tl.static_range(K):
            acc += tl.load(part_ptr + s * s_split + (t * K + j) * hidden + c, mask=ok, other=0.0)
    dt = y_ptr.dtype.element_ty
    tl.store(y_ptr + t * hidden + c, round_to(acc, dt).to(dt), mask=ok)


def sum_pairs(part: torch.Tensor, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """part [S, T * k, hidden] float32 (each split's per-pair outputs, rows contiguous) -> y [T,
    hidden] in dtype: the sum over splits and each token's k pairs, rounded once (one launch where
    torch's sum and cast take two)."""
    S, P, hidden = part.shape
    if part.stride(2) != 1 or part.stride(1) != hidden or P % max(top_k, 1):
        raise ValueError(f"sum_pairs: part {tuple(part.shape)} (strides {part.stride()}) for top_k {top_k}")
    T = P // top_k if top_k else 0
    y = torch.empty(T, hidden, dtype=dtype, device=part.device)
    if T and hidden:
        grid = (T, cdiv(hidden, SUM_BLOCK))
        _sum_pairs_kernel[grid](part, y, hidden, part.stride(0), S=S, K=top_k, BLOCK=SUM_BLOCK)
    return y
