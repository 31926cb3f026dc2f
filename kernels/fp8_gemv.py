"""Block-scaled FP8 GEMV: y = x @ W^T for the few rows of a decode step (M <= 16), the weight
streamed once in one launch; plain or grouped (V4's o_a projection: every group in the launch),
or a gate / up pair (V4's shared expert, `SWIGLU`): a program streams the same rows of both
weights and the last of its splits writes the clamped SwiGLU of the two sums, each first rounded
to y's dtype as the two projections' outputs were (`glue.swiglu_clamped`: the SwiGLU kernel's math).

Legend: M rows of x, K in features, G groups, R weight rows (out features) a group, N = G * R,
bn x bk weight block (128 x 128), BN/BK tile, BM the M tile (16 for the dots, next_pow2(M) for
the FMA path), S K-splits, P = G * ceil(R / BN) output tiles.

Weight W [N, K] float8_e4m3fn with `weight_scale_inv` [ceil(N / bn), ceil(K / bk)] float32, as
DeepSeek ships it. Grouped: x [M, G, K], and output row n of group g = n // R reads x[:, g]
(G = 1: a plain linear, x [M, K]).

Why beside fp8_gemm's kernel: at decode a projection is a weight stream, and its time is set by
how evenly the N * K bytes spread over the multiprocessors. The GEMM splits K into whole slices
of a tile's K loop and sums the float32 partials in a second kernel; here
- grid (P, S): a program owns BN rows of one group over K steps [s * T // S, (s+1) * T // S)
  (T = ceil(K / BK)), S = the split count that brings P * S to `waves` programs per SM: every
  program streams the same bytes, within one K step;
- one launch: with S > 1 each program stores its float32 partial [M, BN] and bumps its tile's
  arrival counter (`_launch.arrival_counters`); the last to arrive sums the S partials in split
  order (deterministic), adds the bias, writes y and zeroes the counter (graph replays);
- per K step one of (constexpr MODE): e4m3 x e4m3 dot, x quantized per token and per BK = bk
  values in registers (DeepSeek's act_quant, as fp8_gemm's small-M path); a dot on the weight
  upcast to x's dtype; an IEEE float32 dot (float32 x: parity runs); float32 products on CUDA
  cores (no MMA, BM = next_pow2(M), x not quantized).
The weight tile is the dot's M side (acc^T [BN, BM] = W x^T), so one decode row does not pad a
64-row MMA. No host sync; graph-capturable (the counters exist before capture: call once first).
Reference: `ref_fp8.fp8_linear_ref` / `ref_fp8.grouped_linear_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve_kernels import configs
from pdserve_kernels._launch import arrival_counters, capability, cdiv, interpreting, next_pow2, sm_count
from pdserve_kernels.fused_moe_fp8 import _round_e4m3
from pdserve_kernels.glue import round_to, swiglu_clamped

FP8_ACT, X_DOT, IEEE, FMA = 0, 1, 2, 3  # MODE: the inner product of a K step


@triton.jit
def _step(w, xt, s, x_dtype, MODE: tl.constexpr, INTERPRET: tl.constexpr):
    """One K step's contribution to acc [BN, BM]: w [BN, BK] e4m3, xt [BK, BM], s [BN] scales."""
    if MODE == 0:  # x quantized per token (a column of x^T) over the step's bk values
        x_s = tl.maximum(tl.max(tl.abs(xt.to(tl.float32)), 0), 1e-10) / 448.0
        x_q = tl.minimum(tl.maximum(xt.to(tl.float32) / x_s[None, :], -448.0), 448.0)
        if INTERPRET:
            x_q = _round_e4m3(x_q)
        return tl.dot(w, x_q.to(tl.float8e4nv)) * s[:, None] * x_s[None, :]
    elif MODE == 1:
        return tl.dot(w.to(x_dtype), xt) * s[:, None]
    elif MODE == 2:
        return tl.dot(w.to(tl.float32), xt, input_precision="ieee") * s[:, None]
    else:
        prod = w.to(tl.float32)[:, :, None] * xt.to(tl.float32)[None, :, :]  # [BN, BK, BM]
        return tl.sum(prod, axis=1) * s[:, None]


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    u_ptr,
    su_ptr,
    y_ptr,
    b_ptr,
    part_ptr,
    cnt_ptr,
    M,
    N,
    K,
    R,
    STEPS,
    limit,
    s_xm,
    s_xg,
    s_wn,
    s_sn,
    s_sk,
    s_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_BLOCK_N: tl.constexpr,
    W_BLOCK_K: tl.constexpr,
    MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    INTERPRET: tl.constexpr,
    K_C: tl.constexpr,
    S_C: tl.constexpr,
    SWIGLU: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    S = tl.num_programs(1)
    tiles = tl.cdiv(R, BLOCK_N)  # output tiles a group
    g = pid_t // tiles
    offs_r = (pid_t % tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_r < R
    offs_n = g * R + offs_r  # weight rows = y columns
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = (pid_s * STEPS // S) * BLOCK_K
    k_hi = tl.minimum(K, ((pid_s + 1) * STEPS // S) * BLOCK_K)
    x_ptrs = x_ptr + g.to(tl.int64) * s_xg + offs_m[None, :] * s_xm + offs_k[:, None]  # x^T [BK, BM]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * s_wn + offs_k[None, :]  # W [BN, BK]
    s_ptrs = s_ptr + (offs_n // W_BLOCK_N) * s_sn
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # SWIGLU: the up projection's rows beside the gate's
    # the interpreter cannot loop to a runtime bound: it walks all of K, masked to [k_lo, k_hi)
    for k0 in range(0 if INTERPRET else k_lo, K_C if INTERPRET else k_hi, BLOCK_K):
        k = k0 + offs_k
        k_ok = (k >= k_lo) & (k < k_hi)
        xt = tl.load(x_ptrs + k0, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0).to(tl.float8e4nv, bitcast=True)
        s = tl.load(s_ptrs + (k0 // W_BLOCK_K) * s_sk, mask=n_ok, other=0.0)
        acc += _step(w, xt, s, x_ptr.dtype.element_ty, MODE, INTERPRET)
        if SWIGLU:  # the same rows of the up weight (same strides and scale layout as the gate's)
            w_off = offs_n.to(tl.int64)[:, None] * s_wn + offs_k[None, :] + k0
            wu = tl.load(u_ptr + w_off, mask=n_ok[:, None] & k_ok[None, :], other=0).to(tl.float8e4nv, bitcast=True)
            su = tl.load(su_ptr + (offs_n // W_BLOCK_N) * s_sn + (k0 // W_BLOCK_K) * s_sk, mask=n_ok, other=0.0)
            acc_u += _step(wu, xt, su, x_ptr.dtype.element_ty, MODE, INTERPRET)
    out_ok = n_ok[:, None] & m_ok[None, :]
    y_ptrs = y_ptr + offs_m[None, :] * s_ym + offs_n[:, None]  # y^T [BN, BM]
    if SPLIT:
        # partials [S, M, N] float32 (SWIGLU: [S, 2, M, N], gate then up)
        part = part_ptr + offs_m[None, :] * N + offs_n[:, None]
        PARTS: tl.constexpr = 2 if SWIGLU else 1
        tl.store(part + pid_s * PARTS * M * N, acc, mask=out_ok)
        if SWIGLU:
            tl.store(part + (pid_s * 2 + 1) * M * N, acc_u, mask=out_ok)
        # the barrier orders every thread's partial stores before the counter's release
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_t, 1, sem="acq_rel", scope="gpu")
        if arrived == S - 1:  # the last of the tile's splits: sum them in split order
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for i in range(0, S_C if INTERPRET else S):
                acc += tl.load(part + i * PARTS * M * N, mask=out_ok, other=0.0, cache_modifier=".cg")
                if SWIGLU:
                    acc_u += tl.load(part + (i * 2 + 1) * M * N, mask=out_ok, other=0.0, cache_modifier=".cg")
            _epilogue(acc, acc_u, b_ptr, y_ptrs, offs_n, n_ok, out_ok, limit, HAS_BIAS, SWIGLU)
            tl.atomic_xchg(cnt_ptr + pid_t, 0, sem="relaxed", scope="gpu")  # zero for the next launch
    else:
        _epilogue(acc, acc_u, b_ptr, y_ptrs, offs_n, n_ok, out_ok, limit, HAS_BIAS, SWIGLU)


@triton.jit
def _epilogue(acc, acc_u, b_ptr, y_ptrs, offs_n, n_ok, out_ok, limit, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr):
    """y^T [BN, BM] = acc (+ bias), or with SWIGLU the clamped SwiGLU of the gate (acc) and up
    (acc_u) sums, each first rounded to y's dtype as the two projections' outputs are."""
    dt = y_ptrs.dtype.element_ty
    if SWIGLU:
        acc = swiglu_clamped(round_to(acc, dt), round_to(acc_u, dt), limit, dt)
    elif HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptrs, acc.to(dt), mask=out_ok)


def gemv_splits(tiles: int, steps: int, sms: int, waves: int) -> int:
    """K splits so that tiles x splits reaches about `waves` programs per multiprocessor (at most
    one split per K step)."""
    return max(1, min(steps, (waves * sms) // max(tiles, 1)))


def fp8_gemv(
    x: torch.Tensor,  # [M, K], or [M, G, K] grouped; bf16/fp16 (fp32: parity), M <= 16
    weight: torch.Tensor,  # [N, K] float8_e4m3fn (grouped: N = G * R, group g's rows g*R..)
    weight_scale_inv: torch.Tensor,  # [ceil(N/bn), ceil(K/bk)] float32
    block: tuple[int, int] = (128, 128),  # (bn, bk)
    bias: torch.Tensor | None = None,  # [N]
    config: configs.Fp8GemvConfig | None = None,
    up: tuple[torch.Tensor, torch.Tensor] | None = None,  # SwiGLU: the up projection (weight, scale) beside the gate
    swiglu_limit: float = 0.0,
) -> torch.Tensor:
    """y [M, N] in x's dtype (grouped: [M, G * R], group-major); with `up`, weight is the gate and
    y = swiglu(x W^T, x U^T) clamped at swiglu_limit. Inputs are checked by the callers
    (`fp8_gemm.fp8_linear` / `fp8_grouped_linear` / `fp8_swiglu`)."""
    grouped = x.dim() == 3
    M, G, K = x.shape if grouped else (x.shape[0], 1, x.shape[1])
    N, (bn, bk) = weight.shape[0], block
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    if M > 16:
        raise ValueError(f"fp8_gemv takes at most 16 rows, got {M}")
    cfg = config or configs.fp8_gemv_config(capability(x.device), 1, x.dtype)  # the tile does not depend on M
    fp32 = x.dtype == torch.float32
    # float32 x: always the IEEE dot. The FMA form's broadcast-multiply-sum is rewritten by Triton
    # into a tl.dot (TF32 for float32 operands) where the tile allows it (BM 16: seen on an H100)
    mode = IEEE if fp32 else FMA if cfg.fma else FP8_ACT if cfg.fp8_act else X_DOT
    block_k = bk if mode == FP8_ACT else min(cfg.block_k, bk)  # one scale per K step; fp8: one act group
    block_m = next_pow2(M) if mode == FMA else 16
    R = N // G
    tiles = G * cdiv(R, cfg.block_n)
    steps = cdiv(K, block_k)
    # SwiGLU: a program streams both weights' rows, split as one projection is (each sum in its order)
    splits = gemv_splits(tiles, steps, sm_count(x.device), cfg.waves)
    parts = 2 if up is not None else 1
    part = torch.empty(splits, parts, M, N, dtype=torch.float32, device=x.device) if splits > 1 else y
    counters = arrival_counters(x.device, tiles, "fp8_gemv") if splits > 1 else y
    up_w, up_s = up if up is not None else (weight, weight_scale_inv)
    interp = interpreting()
    _fp8_gemv_kernel[(tiles, splits)](
        x, weight.view(torch.uint8), weight_scale_inv, up_w.view(torch.uint8), up_s, y,
        bias if bias is not None else weight_scale_inv, part, counters, M, N, K, R, steps, float(swiglu_limit),
        x.stride(0), x.stride(1) if grouped else 0, weight.stride(0), *weight_scale_inv.stride(), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, W_BLOCK_N=bn, W_BLOCK_K=bk, MODE=mode,
        HAS_BIAS=bias is not None, SPLIT=splits > 1, INTERPRET=interp, K_C=K if interp else 0,
        S_C=splits if interp else 0, SWIGLU=up is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y
