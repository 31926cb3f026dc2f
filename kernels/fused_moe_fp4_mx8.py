"""Fused MoE with FP4 (e2m1) expert weights x MXFP8 activations ("MX8"): both GEMM operands in
e4m3 with ue8m0 scales per 32 along K, the form Triton 3.6 lowers to sm_120's block-scaled
tensor-core MMA (kind::mxf8f6f4; docs/kernels.md says which GPU runs which FP4 path). The
wrapper, its argument checks and the launch plan; the kernels are in `fused_moe_fp4_mx8_kernels.py`.

Legend: T tokens, k experts per token, P = T * k pairs, E experts, I expert intermediate size,
hidden model width, G = ceil(K / 32) scale groups of a weight row, S splits of K.

Weights in the checkpoint layout (`ref_fp4.py`): w13 [E, 2I, hidden/2] (gate rows, then up rows)
and w2 [E, hidden, I/2], two e2m1 codes a byte along K (even element in the low nibble), ue8m0
scales w13_scale [E, 2I, ceil(hidden/32)], w2_scale [E, hidden, ceil(I/32)]; the same bytes as
`fused_moe_fp4`, no repacking. x is quantized to MXFP8 per token inside w13's programs, the
intermediate activation to MXFP8 as w13 writes it ([P, I] e4m3 bytes + [P, ceil(I/32)] scales).
Numerics: `ref_fp4.fused_moe_fp4_ref(..., mxfp8_act=True)`.
"""

from __future__ import annotations

import torch

from pdserve_kernels import configs
from pdserve_kernels._launch import capability, cdiv, interpreting, next_pow2
from pdserve_kernels.fused_moe import MAX_KERNEL_ALIGN_PAIRS, moe_align, moe_align_fast, sum_pairs
from pdserve_kernels.fused_moe_fp4 import GROUP, _check, split_k
from pdserve_kernels.fused_moe_fp4_mx8_kernels import _swiglu_mx8_kernel, _w2_mx8_kernel, _w13_mx8_kernel


def fused_moe_fp4_mx8(
    x: torch.Tensor,  # [T, hidden] bf16/fp16/fp32 (quantized to MXFP8 in the kernel)
    w13: torch.Tensor,  # [E, 2I, hidden/2] packed e2m1 (uint8/int8/float4_e2m1fn_x2), gate then up
    w2: torch.Tensor,  # [E, hidden, I/2] packed e2m1
    w13_scale: torch.Tensor,  # [E, 2I, ceil(hidden/32)] ue8m0 (uint8 / float8_e8m0fnu)
    w2_scale: torch.Tensor,  # [E, hidden, ceil(I/32)] ue8m0
    topk_weights: torch.Tensor,  # [T, k] float
    topk_ids: torch.Tensor,  # [T, k] int, in [0, E); -1: no expert
    *,
    swiglu_limit: float | None = None,  # DeepSeek-V4's clamp of gate / up (config.swiglu_limit)
    config: configs.MoEConfig | None = None,  # tile override (benchmark sweeps)
) -> torch.Tensor:
    """y [T, hidden] in x's dtype: `ref_fp4.fused_moe_fp4_ref(..., mxfp8_act=True)`'s contract."""
    _check(x, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids)
    T, hidden = x.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    P = T * top_k
    if P == 0:
        return torch.zeros(T, hidden, dtype=x.dtype, device=x.device)
    cfg = config or configs.moe_fp4_mx8_config(capability(x.device), P / E)
    for name, v in (("block_k", cfg.block_k), ("block_n", cfg.block_n), ("block_n2", cfg.w2_block_n)):
        if v % GROUP or v < GROUP:
            raise ValueError(f"{name} {v} must be a multiple of the {GROUP}-value scale group")
    align = moe_align_fast if P <= MAX_KERNEL_ALIGN_PAIRS else moe_align
    pairs, bexp = align(topk_ids, E, cfg.block_m)
    blocks = bexp.numel()
    n13, n2 = cdiv(inter, cfg.block_n), cdiv(hidden, cfg.w2_block_n)
    sp13, ks13 = split_k(blocks * n13, hidden, cfg.block_k, cfg, x.device)
    sp2, ks2 = split_k(blocks * n2, inter, cfg.block_k, cfg, x.device)
    act = torch.empty(P, inter, dtype=torch.uint8, device=x.device)  # e4m3 bytes
    act_s = torch.empty(P, cdiv(inter, GROUP), dtype=torch.uint8, device=x.device)
    # split w13: float32 gate | up partials, summed, activated and quantized by `_swiglu_mx8_kernel`
    h13 = act if sp13 == 1 else torch.empty(sp13, P, two_i, dtype=torch.float32, device=x.device)
    y_part = torch.empty(sp2, P, hidden, dtype=torch.float32, device=x.device)
    interp = interpreting()
    b13, b2 = w13.view(torch.uint8), w2.view(torch.uint8)
    s13, s2 = w13_scale.view(torch.uint8), w2_scale.view(torch.uint8)
    limit = float(swiglu_limit) if swiglu_limit is not None else 0.0
    has_limit = swiglu_limit is not None
    common = dict(BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, EMULATE=interp, INTERPRET=interp)
    common.update(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _w13_mx8_kernel[(blocks, n13, sp13)](
        x, b13, s13, h13, act_s, pairs, bexp, P, inter, hidden, ks13, limit,
        x.stride(0), b13.stride(0), b13.stride(1), s13.stride(0), s13.stride(1),
        h13.stride(0) if sp13 > 1 else 0, h13.stride(-2), act_s.stride(0),
        TOP_K=top_k, BLOCK_N=cfg.block_n, SPLIT=sp13, HAS_LIMIT=has_limit, KS_C=ks13 if interp else 0, **common,
    )  # fmt: skip
    if sp13 > 1:
        block = max(GROUP, min(1024, next_pow2(inter)))
        _swiglu_mx8_kernel[(P, cdiv(inter, block))](
            h13, act, act_s, P, inter, limit, h13.stride(0), h13.stride(1), act.stride(0), act_s.stride(0),
            SPLIT=sp13, HAS_LIMIT=has_limit, BLOCK=block, EMULATE=interp, num_warps=4,
        )  # fmt: skip
    _w2_mx8_kernel[(blocks, n2, sp2)](
        act, act_s, b2, s2, topk_weights.reshape(-1).contiguous(), y_part, pairs, bexp, P, hidden, inter, ks2,
        act.stride(0), act_s.stride(0), b2.stride(0), b2.stride(1), s2.stride(0), s2.stride(1),
        y_part.stride(0), y_part.stride(1),
        BLOCK_N=cfg.w2_block_n, KS_C=ks2 if interp else 0, **common,
    )  # fmt: skip
    return sum_pairs(y_part, top_k, x.dtype)
