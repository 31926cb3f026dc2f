"""Block-scaled FP8 GEMM: y = x @ W^T (+ bias), W kept as DeepSeek's checkpoints ship it.

Legend: M rows of x (tokens), K in features, N out features, bn x bk weight block (128 x 128),
BM/BN/BK tile (BK divides bk: one weight scale per column per K step), S K-splits.

Weight W [N, K] float8_e4m3fn and `weight_scale_inv` [ceil(N / bn), ceil(K / bk)] float32: the
real weight is W * scale_inv of its block (last row/column blocks may be partial). One Triton
kernel, two dots (the `FP8_ACT` constexpr), operands swapped (acc^T = W x^T: the weight tile is
the MMA's M side, so a decode step's few rows do not pad a 64-row MMA):
- fp8 activations (bf16 / fp16 x; sm_90's choice up to M = 256, configs.FP8_GEMM): x quantized in
  registers per row and per group of bk values (DeepSeek's act_quant: s = max(amax, 1e-10) / 448),
  one e4m3 x e4m3 `tl.dot` per K step: acc += (q_w @ q_x^T) * s_w * s_x. Faster than upcasting
  the weight tile at decode (docs/kernels.md).
- w8a16: the e4m3 tile upcast in registers to x's dtype (exact: e4m3 values are bf16 / fp16
  values), one `tl.dot` in x's dtype, acc += dot * scale of each weight row's block. float32 x
  (parity runs) always takes it, with IEEE dots.
Large M (`dequant`: prefill chunks, compute-bound) dequantizes the weight into x's dtype with one
small kernel (1 byte read, 2 written a value) and multiplies with torch (cuBLAS): the Triton dots
reach about a third of cuBLAS's rate there.
Small grids split K (S programs per output tile, partial sums in float32, reduced by a second
small kernel that adds the bias and casts): at M = 1 a projection has only N / BN tiles, too few
to keep the copy engines of every multiprocessor busy.
Decode rows (M <= configs.Fp8GemvConfig.max_rows) go to the GEMV (fp8_gemv.py: one launch, the
weight spread evenly over the SMs) unless a GEMM config is given.
Grouped (`fp8_grouped_linear`, V4's o_a): x [M, G, K], weight [G * R, K]; an output tile lies in
one group and reads that group's x, so all groups are one launch on every path.
Reference: `ref_fp8.fp8_linear_ref` / `ref_fp8.grouped_linear_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve_kernels import configs
from pdserve_kernels._launch import capability, interpreting, sm_count
from pdserve_kernels.fp8_gemv import fp8_gemv
from pdserve_kernels.fused_moe_fp8 import _round_e4m3
from pdserve_kernels.glue import swiglu
from pdserve_kernels.ref_fp8 import grouped_mm


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    b_ptr,
    M,
    N,
    K,
    R,
    K_SPLIT,
    s_xm,
    s_xg,
    s_wn,
    s_sn,
    s_sk,
    s_ys,
    s_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_BLOCK_N: tl.constexpr,
    W_BLOCK_K: tl.constexpr,
    FP8_ACT: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INTERPRET: tl.constexpr,
    K_C: tl.constexpr,
):
    """acc^T [BN, BM] += W tile [BN, BK] @ x^T tile [BK, BM]: the weight is the MMA's M side (64+
    rows even when M is 1), its upcast tile an operand from registers, x^T from shared memory.
    Grouped (R rows a group): tile pid_n of group g = pid_n // ceil(R / BN) reads x[:, g]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    tiles = tl.cdiv(R, BLOCK_N)
    g = pid_n // tiles
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = (pid_n % tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = g * R + offs_r
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_r < R
    k_lo = pid_s * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    x_ptrs = x_ptr + g.to(tl.int64) * s_xg + offs_m.to(tl.int64)[None, :] * s_xm + offs_k[:, None]  # x^T [BK, BM]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * s_wn + offs_k[None, :]  # W [BN, BK]
    s_ptrs = s_ptr + (offs_n // W_BLOCK_N) * s_sn
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    # the interpreter cannot loop to a runtime bound: it walks all of K, masked to [k_lo, k_hi)
    for k0 in range(0 if INTERPRET else k_lo, K_C if INTERPRET else k_hi, BLOCK_K):
        k = k0 + offs_k
        k_ok = (k >= k_lo) & (k < k_hi)
        xt = tl.load(x_ptrs + k0, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0).to(tl.float8e4nv, bitcast=True)
        s = tl.load(s_ptrs + (k0 // W_BLOCK_K) * s_sk, mask=n_ok, other=0.0)
        if FP8_ACT:  # x quantized per token (a column of x^T) and per BK = bk values
            x_s = tl.maximum(tl.max(tl.abs(xt.to(tl.float32)), 0), 1e-10) / 448.0
            x_q = tl.minimum(tl.maximum(xt.to(tl.float32) / x_s[None, :], -448.0), 448.0)
            if INTERPRET:
                x_q = _round_e4m3(x_q)
            acc += tl.dot(w, x_q.to(tl.float8e4nv)) * s[:, None] * x_s[None, :]
        elif IEEE:
            acc += tl.dot(w.to(tl.float32), xt, input_precision="ieee") * s[:, None]
        else:
            acc += tl.dot(w.to(x_ptr.dtype.element_ty), xt) * s[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out = y_ptr + pid_s * s_ys + offs_m.to(tl.int64)[None, :] * s_ym + offs_n[:, None]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _dequant_kernel(
    w_ptr,
    s_ptr,
    out_ptr,
    N,
    K,
    s_wn,
    s_sn,
    s_sk,
    s_on,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_BLOCK_N: tl.constexpr,
    W_BLOCK_K: tl.constexpr,
):
    """out [N, K] (x's dtype) = W * its block scale: the large-M path then multiplies with cuBLAS."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * s_wn + offs_k[None, :], mask=ok, other=0)
    s = tl.load(
        s_ptr + (offs_n // W_BLOCK_N)[:, None] * s_sn + (offs_k // W_BLOCK_K)[None, :] * s_sk, mask=ok, other=0.0
    )
    out = w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * s_on + offs_k[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _split_sum_kernel(
    p_ptr, b_ptr, y_ptr, MN, N, s_ps, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    """y [M, N] = sum of the S float32 partials [S, M, N] (+ bias), in y's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLITS):
        acc += tl.load(p_ptr + s * s_ps + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def _check(x, weight, scale_inv, block, bias):
    """x [M, K], or [M, G, K] grouped (weight [G * R, K])."""
    if x.dim() not in (2, 3) or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x must be [M, K] or [M, G, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.dim() == 3 and (x.shape[1] < 1 or weight.shape[0] % x.shape[1]):
        raise ValueError(f"weight rows {weight.shape[0]} do not split into {x.shape[1]} groups")
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight must be float8_e4m3fn, got {weight.dtype}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    (N, K), (bn, bk) = weight.shape, block
    if bk not in (16, 32, 64, 128, 256) or bn < 1:
        raise ValueError(f"block {block}: bk must be a power of two in [16, 256]")
    want = (triton.cdiv(N, bn), triton.cdiv(K, bk))
    if tuple(scale_inv.shape) != want or scale_inv.dtype != torch.float32:
        raise ValueError(
            f"weight_scale_inv must be float32 {want} for weight {(N, K)} and block {block}, "
            f"got {scale_inv.dtype} {tuple(scale_inv.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"bias must be [{N}], got {tuple(bias.shape)}")
    if x.stride(-1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need contiguous last dims")


def splits_for(tiles: int, k_blocks: int, sms: int, waves: int) -> int:
    """K splits so that tiles x splits reaches about `waves` programs per multiprocessor."""
    if tiles >= sms:
        return 1
    return max(1, min(k_blocks, (waves * sms) // tiles))


Config = configs.Fp8GemmConfig | configs.Fp8GemvConfig


def fp8_linear(
    x: torch.Tensor,  # [M, K] bf16/fp16 (fp32: parity runs)
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale_inv: torch.Tensor,  # [ceil(N/bn), ceil(K/bk)] float32
    block: tuple[int, int] = (128, 128),  # (bn, bk) of weight_scale_inv
    bias: torch.Tensor | None = None,  # [N]
    config: Config | None = None,  # override (benchmark sweeps): a GEMM tile or the GEMV's
) -> torch.Tensor:
    """y [M, N] in x's dtype; same contract as `ref_fp8.fp8_linear_ref` (with act_quant = the
    config's fp8_act when x is bf16 / fp16). By M: the GEMV (fp8_gemv.py) up to its max_rows,
    then this file's kernel, then (`dequant`) cuBLAS on the dequantized weight."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    return _linear(x, weight, weight_scale_inv, block, bias, config)


def fp8_grouped_linear(
    x: torch.Tensor,  # [M, G, K] bf16/fp16 (fp32: parity runs), any strides but the last
    weight: torch.Tensor,  # [G * R, K] float8_e4m3fn: group g's rows g*R .. g*R+R-1
    weight_scale_inv: torch.Tensor,  # [ceil(G*R/bn), ceil(K/bk)] float32
    block: tuple[int, int] = (128, 128),
    config: Config | None = None,
) -> torch.Tensor:
    """y [M, G * R]: y[:, g*R:(g+1)*R] = x[:, g] @ W_g^T for every group in one launch (V4's
    o_a projection); reference `ref_fp8.grouped_linear_ref`."""
    if x.dim() != 3:
        raise ValueError(f"x must be [M, G, K], got {tuple(x.shape)}")
    return _linear(x, weight, weight_scale_inv, block, None, config)


def fp8_swiglu(
    x: torch.Tensor,  # [M, K] bf16/fp16 (fp32: parity runs)
    gate: tuple[torch.Tensor, torch.Tensor],  # (weight [I, K] e4m3, weight_scale_inv [ceil(I/bn), ceil(K/bk)])
    up: tuple[torch.Tensor, torch.Tensor],  # the same shapes and strides
    limit: float,
    block: tuple[int, int] = (128, 128),
    config: Config | None = None,
    joined: tuple[torch.Tensor, torch.Tensor] | None = None,  # (weight [2I, K], scales): gate's rows, then up's
) -> torch.Tensor:
    """swiglu(x G^T, x U^T) [M, I] clamped at `limit` (V4's shared expert, glue.swiglu's math): at
    decode M (the GEMV's) one launch, both weights streamed by the same programs and the SwiGLU in
    its epilogue; else one linear over `joined` (the two weights as rows of one, scale blocks
    lined up) or the two linears, then glue.swiglu on the halves. Reference: the two
    `ref_fp8.fp8_linear_ref` then `ref_glue.swiglu_ref`."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    for w, s in (gate, up):
        _check(x, w, s, block, None)
    if gate[0].shape != up[0].shape or gate[0].stride() != up[0].stride() or gate[1].stride() != up[1].stride():
        raise ValueError(
            f"fp8_swiglu: gate {tuple(gate[0].shape)} and up {tuple(up[0].shape)} must match in shape and strides"
        )
    gemv = configs.fp8_gemv_config(capability(x.device), x.shape[0], x.dtype) if config is None else config
    if isinstance(gemv, configs.Fp8GemvConfig) and x.shape[0] > 0:
        return fp8_gemv(x, *gate, block, config=gemv, up=up, swiglu_limit=limit)
    if joined is not None:
        y = _linear(x, *joined, block, None, config)
        return swiglu(y[:, : gate[0].shape[0]], y[:, gate[0].shape[0] :], limit)
    return swiglu(_linear(x, *gate, block, None, config), _linear(x, *up, block, None, config), limit)


def _linear(x, weight, weight_scale_inv, block, bias, config) -> torch.Tensor:
    _check(x, weight, weight_scale_inv, block, bias)
    (M, K), N, (bn, bk) = (x.shape[0], x.shape[-1]), weight.shape[0], block
    grouped = x.dim() == 3
    G = x.shape[1] if grouped else 1
    cc = capability(x.device)
    gemv = configs.fp8_gemv_config(cc, M, x.dtype) if config is None else config
    if isinstance(gemv, configs.Fp8GemvConfig) and M > 0:
        return fp8_gemv(x, weight, weight_scale_inv, block, bias, gemv)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    cfg = config or configs.fp8_gemm_config(cc, M, x.dtype)
    if cfg.dequant and x.dtype != torch.float32:  # compute-bound: dequantize (1 + 2 B a value), then cuBLAS
        w = torch.empty(N, K, dtype=x.dtype, device=x.device)
        _dequant_kernel[(triton.cdiv(N, 64), triton.cdiv(K, 128))](
            weight.view(torch.uint8),
            weight_scale_inv,
            w,
            N,
            K,
            weight.stride(0),
            *weight_scale_inv.stride(),
            w.stride(0),
            BLOCK_N=64,
            BLOCK_K=128,
            W_BLOCK_N=bn,
            W_BLOCK_K=bk,
        )
        return grouped_mm(x, w) if grouped else torch.nn.functional.linear(x, w, bias)
    fp8_act = cfg.fp8_act and x.dtype != torch.float32
    block_k = bk if fp8_act else min(cfg.block_k, bk)  # one scale per K step; fp8: one act group
    R = N // G
    n_tiles = G * triton.cdiv(R, cfg.block_n)
    tiles = triton.cdiv(M, cfg.block_m) * n_tiles
    k_steps = triton.cdiv(K, block_k)
    splits = splits_for(tiles, k_steps, sm_count(x.device), cfg.waves) if cfg.split_k else 1
    k_split = triton.cdiv(k_steps, splits) * block_k
    splits = triton.cdiv(K, k_split)
    out = y if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    interp = interpreting()
    _fp8_gemm_kernel[(triton.cdiv(M, cfg.block_m), n_tiles, splits)](
        x,
        weight.view(torch.uint8),
        weight_scale_inv,
        out,
        bias if bias is not None else weight_scale_inv,
        M,
        N,
        K,
        R,
        k_split,
        x.stride(0),
        x.stride(1) if grouped else 0,
        weight.stride(0),
        *weight_scale_inv.stride(),
        out.stride(0) if splits > 1 else 0,
        out.stride(-2),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=block_k,
        W_BLOCK_N=bn,
        W_BLOCK_K=bk,
        FP8_ACT=fp8_act,
        IEEE=x.dtype == torch.float32,
        HAS_BIAS=bias is not None and splits == 1,
        INTERPRET=interp,
        K_C=K if interp else 0,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if splits > 1:
        BLOCK = 1024
        _split_sum_kernel[(triton.cdiv(M * N, BLOCK),)](
            out,
            bias if bias is not None else out,
            y,
            M * N,
            N,
            out.stride(0),
            SPLITS=splits,
            HAS_BIAS=bias is not None,
            BLOCK=BLOCK,
        )
    return y
