"""PyTorch references for the FP8 block-scaled fused MoE (`fused_moe_fp8.fused_moe_fp8`) and GEMM
(`fp8_gemm.fp8_linear`), with the quantizers they are defined by. Plain torch, no Triton import.

Weights come as DeepSeek checkpoints ship them: e4m3 values W_q [N, K] plus `weight_scale_inv`
[ceil(N / bn), ceil(K / bk)] float32, W = W_q * scale_inv of its (bn x bk) block (128 x 128).
Activations are quantized per token and per group of bk values along K (DeepSeek's `act_quant`):
s = max(amax, 1e-10) / 448, q = e4m3(clamp(x / s, -448, 448)), in float32. The kernel does exactly
this in registers, so the reference dequantizes both sides and multiplies in float32 (float64 when
given float64 x, the tests' oracle).

Legend: T tokens, k experts per token, E experts, I expert intermediate size, hidden model width,
bn x bk weight block, G = ceil(K / bk) groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0
SCALE_EPS = 1e-10  # keeps an all-zero group's scale finite (its values quantize to 0)


def quant_act_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (q [T, K] float8_e4m3fn, s [T, G] float32): per-token, per-`group` scales."""
    T, K = x.shape
    G = -(-K // group)
    xf = F.pad(x.float(), (0, G * group - K)).view(T, G, group)
    s = xf.abs().amax(-1).clamp(min=SCALE_EPS) / E4M3_MAX  # [T, G]
    q = (xf / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(T, G * group)[:, :K], s


def dequant_act_groups(q: torch.Tensor, s: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quant_act_groups`, in `dtype`."""
    scale = s.to(dtype).repeat_interleave(group, dim=1)[:, : q.shape[1]]
    return q.to(dtype) * scale


def quant_block_fp8(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] float -> (e4m3 values [..., N, K], scale_inv [..., ceil(N/bn), ceil(K/bk)]
    float32), one amax / 448 scale per block: how DeepSeek's FP8 checkpoints were made."""
    *lead, N, K = w.shape
    bn, bk = block
    gn, gk = -(-N // bn), -(-K // bk)
    wf = F.pad(w.float(), (0, gk * bk - K, 0, gn * bn - N)).reshape(*lead, gn, bn, gk, bk)
    s = wf.abs().amax(dim=(-3, -1)).clamp(min=SCALE_EPS) / E4M3_MAX  # [..., gn, gk]
    q = (wf / s[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(*lead, gn * bn, gk * bk)[..., :N, :K].contiguous(), s


def dequant_block_fp8(
    w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """e4m3 w [..., N, K] and scale_inv [..., ceil(N/bn), ceil(K/bk)] -> w in `dtype`."""
    N, K = w.shape[-2:]
    bn, bk = block
    scale = scale_inv.to(dtype).repeat_interleave(bn, dim=-2)[..., :N, :]
    scale = scale.repeat_interleave(bk, dim=-1)[..., :K]
    return w.to(dtype) * scale


def fused_moe_fp8_ref(
    x: torch.Tensor,  # [T, hidden] bf16/fp16/fp32 (float64: oracle math)
    w13: torch.Tensor,  # [E, 2I, hidden] float8_e4m3fn, gate rows then up rows
    w2: torch.Tensor,  # [E, hidden, I] float8_e4m3fn
    w13_scale_inv: torch.Tensor,  # [E, ceil(2I/bn), ceil(hidden/bk)] float32
    w2_scale_inv: torch.Tensor,  # [E, ceil(hidden/bn), ceil(I/bk)] float32
    topk_weights: torch.Tensor,  # [T, k] float
    topk_ids: torch.Tensor,  # [T, k] int
    block_shape: tuple[int, int] = (128, 128),
    act_dtype: torch.dtype | None = None,  # dtype the SiLU-and-mul output is rounded to; x's by default
    act_quant: bool = True,  # False: Q is the identity (the kernel's float32-x path, and the engine's CPU path)
) -> torch.Tensor:
    """y[t] = sum_j w[t,j] * W2_e @ Q(act_dtype(silu(G_e Q(x[t])) * U_e Q(x[t]))), with Q the
    per-token-group quantize-dequantize (group = bk) and W the block-dequantized weights."""
    math = torch.float64 if x.dtype == torch.float64 else torch.float32
    act_dtype = act_dtype or x.dtype
    bk = block_shape[1]
    T, hidden = x.shape
    inter = w2.shape[2]
    Q = (lambda a: dequant_act_groups(*quant_act_groups(a, bk), bk, math)) if act_quant else (lambda a: a.to(math))  # noqa: E731
    xq = Q(x)
    y = torch.zeros(T, hidden, dtype=math, device=x.device)
    for e in torch.unique(topk_ids.reshape(-1)).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        h = xq[tok] @ dequant_block_fp8(w13[e], w13_scale_inv[e], block_shape, math).t()  # [n, 2I]
        act = (F.silu(h[:, :inter]) * h[:, inter:]).to(act_dtype)
        aq = Q(act)
        out = aq @ dequant_block_fp8(w2[e], w2_scale_inv[e], block_shape, math).t()  # [n, hidden]
        y.index_add_(0, tok, out * topk_weights[tok, slot, None].to(math))
    return y.to(x.dtype)


def fp8_linear_ref(
    x: torch.Tensor,  # [M, K] bf16/fp16/fp32 (float64: oracle math)
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale_inv: torch.Tensor,  # [ceil(N/bn), ceil(K/bk)] float32
    block: tuple[int, int] = (128, 128),
    bias: torch.Tensor | None = None,  # [N]
    act_quant: bool = False,  # x quantize-dequantized per token and per bk values first (the fp8_act path)
) -> torch.Tensor:
    """y [M, N] = Q(x) @ W^T + bias in float32 (float64 for float64 x), returned in x's dtype;
    W the block-dequantized weight, Q the identity or (act_quant) the per-token-group e4m3
    round trip. float32 x gives what dequantizing at load and F.linear give, bit for bit."""
    math = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = dequant_block_fp8(weight, weight_scale_inv, block, math)
    xm = dequant_act_groups(*quant_act_groups(x, block[1]), block[1], math) if act_quant else x.to(math)
    return F.linear(xm, w, None if bias is None else bias.to(math)).to(x.dtype)


def grouped_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, G, K] and w [G * R, K] (same dtype) -> y [M, G * R], y[:, g*R:(g+1)*R] = x[:, g] @
    w_g^T: one strided-batched matmul (cuBLAS on a GPU) that writes y's group-major layout in
    place, no copy of x or y. V4's bf16 o_a projection and the FP8 GEMM's dequantized path use it."""
    M, G, K = x.shape
    R = w.shape[0] // G
    y = torch.empty(M, G * R, dtype=x.dtype, device=x.device)
    with torch.no_grad():  # an out= matmul; inference only
        torch.bmm(x.transpose(0, 1), w.view(G, R, K).transpose(1, 2), out=y.view(M, G, R).transpose(0, 1))
    return y


def grouped_linear_ref(
    x: torch.Tensor,  # [M, G, K] bf16/fp16/fp32 (float64: oracle math)
    weight: torch.Tensor,  # [G * R, K] float8_e4m3fn
    weight_scale_inv: torch.Tensor,  # [ceil(G*R/bn), ceil(K/bk)] float32
    block: tuple[int, int] = (128, 128),
    act_quant: bool = False,
) -> torch.Tensor:
    """y [M, G * R] = for each group g, fp8_linear_ref(x[:, g], rows g*R .. g*R+R-1 of W)."""
    M, G, K = x.shape
    math = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = dequant_block_fp8(weight, weight_scale_inv, block, math).view(G, -1, K)  # [G, R, K]
    xm = x.reshape(M * G, K)
    xm = dequant_act_groups(*quant_act_groups(xm, block[1]), block[1], math) if act_quant else xm.to(math)
    return torch.einsum("mgk,grk->mgr", xm.view(M, G, K), w).reshape(M, -1).to(x.dtype)
