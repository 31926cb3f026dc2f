"""Fused MoE with FP4 (e2m1) expert weights and ue8m0 scales per 32 values: DeepSeek-V4's routed
experts. Activations stay in x's dtype (bf16/fp16; fp32 for tests): the weights are dequantized
in registers, since sm_90 has no FP4 tensor cores. The wrapper, its argument checks and the
launch plan (tile config, split-K); the Triton kernels are in `fused_moe_fp4_frag.py` (weights in
the fragment layout) and `fused_moe_fp4_kernels.py` (the checkpoint's layout).

Legend: T tokens, k experts per token, P = T * k pairs, E experts, I expert intermediate size,
hidden model width, BK K values per loop step (a multiple of the 32-value scale group),
G = ceil(K / 32) scale groups of a weight row.

Two weight layouts (both in `ref_fp4.py`), told apart by rank:
- fragment (`frag_experts`, once at load; the fast one, docs/kernels.md): w13 [E, 2, NB, KB, 4096]
  (gate, up), w2 [E, NB, KB, 4096], scales [.., 256] beside them: a thread's bytes its MMA operand;
- checkpoint: w13 [E, 2I, hidden/2] and w2 [E, hidden, I/2] packed two e2m1 codes a byte along K
  (even element in the low nibble), scales [E, 2I, G] / [E, hidden, G] uint8 exponents
  (2**(b - 127)).
Same expert-sorted, block-aligned grouped GEMMs as `fused_moe.py` (same `moe_align`).

Split-K (`split_k`, automatic when the grid has under 2 programs per SM, as at decode's T = 1):
each GEMM's K is cut into S slices whose float32 partials are summed (w13's by `_swiglu_kernel`
before the activation, w2's with the top-k sum). Deterministic (no atomics).

`MoEConfig.dot_scaled` (checkpoint layout, GPU, bf16/fp16 only) hands the dequantization to
`tl.dot_scaled` (bf16 x e2m1: Triton 3.6 upcasts it to bf16 MMAs on sm_120 as on sm_90; the
block-scaled MMA is reached by `fused_moe_fp4_mx8`).
Reference: `ref_fp4.fused_moe_fp4_ref` (either layout).
"""

from __future__ import annotations

import torch

from pdserve_kernels import configs, ref_fp4
from pdserve_kernels._launch import capability, cdiv, interpreting, next_pow2, sm_count
from pdserve_kernels.fused_moe import MAX_KERNEL_ALIGN_PAIRS, moe_align, moe_align_fast, sum_pairs
from pdserve_kernels.fused_moe_fp4_frag import _w2_frag_kernel, _w13_frag_kernel
from pdserve_kernels.fused_moe_fp4_kernels import _swiglu_kernel, _w2_fp4_kernel, _w13_fp4_kernel

GROUP = 32  # values per ue8m0 scale
MAX_FRAG_SCALE = 128  # largest ue8m0 byte the fragment layout's bf16 path takes (2**(b - 1) must fit bf16)
_FP4_DTYPES = tuple(d for d in (torch.uint8, torch.int8, getattr(torch, "float4_e2m1fn_x2", None)) if d)
_SCALE_DTYPES = tuple(d for d in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)) if d)


def split_k(programs: int, K: int, block_k: int, cfg: configs.MoEConfig, device, per_sm: int = 4) -> tuple[int, int]:
    """(splits, K per split, a multiple of block_k). Auto (cfg.split_k == 0): split only when the
    grid is under 2 programs per SM (decode at small T), aiming at `per_sm` per SM, at most 8 splits."""
    sms = sm_count(device)
    want = cfg.split_k or (1 if programs >= 2 * sms else min(8, cdiv(per_sm * sms, programs)))
    k_split = cdiv(cdiv(K, max(1, want)), block_k) * block_k
    return cdiv(K, k_split), k_split


def _check(x, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids):
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError("x must be [T, hidden], w13 [E, 2I, hidden/2], w2 [E, hidden, I/2]")
    T, hidden = x.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    if hidden % 2 or two_i % 2 or inter % 2:
        raise ValueError(f"hidden ({hidden}) and I ({two_i // 2}) must be even (two FP4 values a byte)")
    if tuple(w13.shape) != (E, two_i, hidden // 2) or tuple(w2.shape) != (E, hidden, inter // 2):
        raise ValueError(
            f"shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)} (want "
            f"[E, 2I, {hidden // 2}]), w2 {tuple(w2.shape)} (want [E, {hidden}, I/2])"
        )
    if w13.dtype not in _FP4_DTYPES or w2.dtype not in _FP4_DTYPES:
        raise ValueError(f"FP4 weights are packed bytes (uint8/int8/float4_e2m1fn_x2), got {w13.dtype}, {w2.dtype}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    want13 = (E, two_i, cdiv(hidden, GROUP))
    want2 = (E, hidden, cdiv(inter, GROUP))
    for name, s, want in (("w13_scale", w13_scale, want13), ("w2_scale", w2_scale, want2)):
        if s is None or tuple(s.shape) != want or s.dtype not in _SCALE_DTYPES:
            got = None if s is None else (tuple(s.shape), s.dtype)
            raise ValueError(f"{name} must be ue8m0 (uint8 / float8_e8m0fnu) {want}, got {got}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids and topk_weights must both be [T={T}, k]")
    for name, t in (("x", x), ("w13", w13), ("w2", w2), ("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim")


def fused_moe_fp4(
    x: torch.Tensor,  # [T, hidden] bf16/fp16 (fp32 for tests)
    w13: torch.Tensor,  # [E, 2I, hidden/2] packed e2m1 (uint8/int8/float4_e2m1fn_x2), gate then up
    w2: torch.Tensor,  # [E, hidden, I/2] packed e2m1
    w13_scale: torch.Tensor,  # [E, 2I, ceil(hidden/32)] ue8m0 (uint8 / float8_e8m0fnu)
    w2_scale: torch.Tensor,  # [E, hidden, ceil(I/32)] ue8m0
    topk_weights: torch.Tensor,  # [T, k] float
    topk_ids: torch.Tensor,  # [T, k] int, in [0, E)
    *,
    swiglu_limit: float | None = None,  # DeepSeek-V4's clamp of gate / up (config.swiglu_limit)
    config: configs.MoEConfig | None = None,  # tile override (benchmark sweeps)
) -> torch.Tensor:
    """y [T, hidden] in x's dtype; same contract as `ref_fp4.fused_moe_fp4_ref`. w13 / w2 in the
    fragment layout (`frag_experts`: values [E, 2, NB, KB, 4096] / [E, NB, KB, 4096], their scales
    [.., 256]) take the fragment kernels."""
    if w13.dim() == 5:
        return _fused_moe_frag(x, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, swiglu_limit, config)
    _check(x, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids)
    T, hidden = x.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    P = T * top_k
    if P == 0:
        return torch.zeros(T, hidden, dtype=x.dtype, device=x.device)
    fp32 = x.dtype == torch.float32
    cfg = config or configs.moe_fp4_config(capability(x.device), P / E, fp32)
    if cfg.block_k % GROUP or cfg.block_k < GROUP:
        raise ValueError(f"block_k {cfg.block_k} must be a multiple of the {GROUP}-value scale group")
    if cfg.dot_scaled and (fp32 or interpreting()):
        raise ValueError("dot_scaled configs need bf16/fp16 x on a GPU (the interpreter has no dot_scaled)")
    align = moe_align_fast if P <= MAX_KERNEL_ALIGN_PAIRS else moe_align
    pairs, bexp = align(topk_ids, E, cfg.block_m)
    blocks = bexp.numel()
    n13, n2 = cdiv(inter, cfg.block_n), cdiv(hidden, cfg.w2_block_n)
    sp13, ks13 = split_k(blocks * n13, hidden, cfg.block_k, cfg, x.device)
    sp2, ks2 = split_k(blocks * n2, inter, cfg.block_k, cfg, x.device)
    act = torch.empty(P, inter, dtype=x.dtype, device=x.device)
    # split w13: float32 gate | up partials, summed and activated by `_swiglu_kernel`
    h13 = act if sp13 == 1 else torch.empty(sp13, P, two_i, dtype=torch.float32, device=x.device)
    y_part = torch.empty(sp2, P, hidden, dtype=torch.float32, device=x.device)
    interp = interpreting()
    b13, b2 = w13.view(torch.uint8), w2.view(torch.uint8)
    s13, s2 = w13_scale.view(torch.uint8), w2_scale.view(torch.uint8)
    limit = float(swiglu_limit) if swiglu_limit is not None else 0.0
    common = dict(
        BLOCK_M=cfg.block_m,
        BLOCK_K=cfg.block_k,
        DOT_SCALED=cfg.dot_scaled,
        A_FMT="fp16" if x.dtype == torch.float16 else "bf16",
        FP32_DOT=fp32,
        INTERPRET=interp,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    _w13_fp4_kernel[(blocks, n13, sp13)](
        x,
        b13,
        s13,
        h13,
        pairs,
        bexp,
        P,
        inter,
        hidden,
        ks13,
        limit,
        x.stride(0),
        b13.stride(0),
        b13.stride(1),
        s13.stride(0),
        s13.stride(1),
        h13.stride(0) if sp13 > 1 else 0,
        h13.stride(-2),
        TOP_K=top_k,
        BLOCK_N=cfg.block_n,
        SPLIT=sp13,
        HAS_LIMIT=swiglu_limit is not None,
        KS_C=ks13 if interp else 0,
        **common,
    )
    if sp13 > 1:
        block = min(1024, next_pow2(inter))
        _swiglu_kernel[(P, cdiv(inter, block))](
            h13,
            act,
            P,
            inter,
            limit,
            h13.stride(0),
            h13.stride(1),
            act.stride(0),
            SPLIT=sp13,
            HAS_LIMIT=swiglu_limit is not None,
            BLOCK=block,
            num_warps=4,
        )
    _w2_fp4_kernel[(blocks, n2, sp2)](
        act,
        b2,
        s2,
        topk_weights.reshape(-1).contiguous(),
        y_part,
        pairs,
        bexp,
        P,
        hidden,
        inter,
        ks2,
        act.stride(0),
        b2.stride(0),
        b2.stride(1),
        s2.stride(0),
        s2.stride(1),
        y_part.stride(0),
        y_part.stride(1),
        BLOCK_N=cfg.w2_block_n,
        KS_C=ks2 if interp else 0,
        **common,
    )
    return sum_pairs(y_part, top_k, x.dtype)


def _check_bytes(w13, w2, w13_scale, w2_scale):
    for name, t in (("w13", w13), ("w2", w2), ("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if t.dim() != 3 or t.dtype not in _FP4_DTYPES + _SCALE_DTYPES:
            raise ValueError(f"{name} must be a 3-D checkpoint-layout byte tensor, got {tuple(t.shape)} {t.dtype}")


def frag_experts(w13, w2, w13_scale, w2_scale) -> tuple[torch.Tensor, ...]:
    """Checkpoint-layout experts -> (w13, w2, w13_scale, w2_scale) in the fragment layout
    (`ref_fp4.frag_experts`; once, at load: it reads the scales back, a host sync). ValueError if
    a scale exceeds 2 (ue8m0 byte > 128): the bf16 path folds 2**126 into it."""
    _check_bytes(w13, w2, w13_scale, w2_scale)
    top = max(int(w13_scale.view(torch.uint8).max()), int(w2_scale.view(torch.uint8).max()))
    if top > MAX_FRAG_SCALE:
        raise ValueError(f"a ue8m0 scale byte is {top} (> {MAX_FRAG_SCALE}: scale > 2): keep the checkpoint layout")
    v13, v2, s13, s2 = ref_fp4.frag_experts(
        w13.view(torch.uint8), w13_scale.view(torch.uint8), w2.view(torch.uint8), w2_scale.view(torch.uint8)
    )
    return v13, v2, s13, s2


def _check_frag(x, w13, w2, s13, s2, topk_weights, topk_ids):
    T, hidden = x.shape
    FB, SB = ref_fp4.FRAG_BYTES, ref_fp4.FRAG_SCALE_BYTES
    if w13.dim() != 5 or w2.dim() != 4 or w13.shape[1] != 2 or w13.shape[-1] != FB or w2.shape[-1] != FB:
        raise ValueError(
            f"fragment layout: w13 [E, 2, NB, KB, {FB}], w2 [E, NB, KB, {FB}] uint8, got {tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    E, _, nb13, kb13, _ = w13.shape
    inter_pad = nb13 * ref_fp4.FRAG_N
    if (
        kb13 != cdiv(hidden, ref_fp4.FRAG_K)
        or tuple(w2.shape[:2]) != (E, cdiv(hidden, ref_fp4.FRAG_N))
        or w2.shape[2] * ref_fp4.FRAG_K < inter_pad
    ):
        raise ValueError(f"fragment shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if (
        s13 is None
        or s2 is None
        or tuple(s13.shape) != (*w13.shape[:-1], SB)
        or tuple(s2.shape) != (*w2.shape[:-1], SB)
    ):
        raise ValueError(
            f"fragment scales must be [..., {SB}] beside their values, got {None if s13 is None else tuple(s13.shape)}, {None if s2 is None else tuple(s2.shape)}"
        )
    for t in (w13, w2, s13, s2):
        if t.dtype != torch.uint8 or not t.is_contiguous():
            raise ValueError("fragment values and scales are contiguous uint8")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or x.stride(-1) != 1:
        raise ValueError(f"x must be bf16, fp16 or fp32 with a contiguous last dim, got {x.dtype}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids and topk_weights must both be [T={T}, k]")
    return inter_pad


def _fused_moe_frag(x, w13, w2, s13, s2, topk_weights, topk_ids, swiglu_limit, config):
    inter = _check_frag(x, w13, w2, s13, s2, topk_weights, topk_ids)  # I padded to whole tiles
    T, hidden = x.shape
    E, top_k, TK = w13.shape[0], topk_ids.shape[1], ref_fp4.FRAG_K
    P = T * top_k
    if P == 0:
        return torch.zeros(T, hidden, dtype=x.dtype, device=x.device)
    interp = interpreting()
    fp32 = x.dtype == torch.float32
    cfg = config or configs.moe_fp4_frag_config(capability(x.device), P / E, fp32)
    align = moe_align_fast if P <= MAX_KERNEL_ALIGN_PAIRS else moe_align
    pairs, bexp = align(topk_ids, E, cfg.block_m)
    blocks = bexp.numel()
    tiles2 = max(t for t in (1, 2, 4) if t * ref_fp4.FRAG_N <= cfg.w2_block_n and w2.shape[1] % t == 0)
    n13, n2 = w13.shape[2], w2.shape[1] // tiles2  # a w2 program takes `tiles2` row blocks
    sp13, ks13 = split_k(blocks * n13, hidden, TK, cfg, x.device, per_sm=2)
    sp2, ks2 = split_k(blocks * n2, inter, TK, cfg, x.device, per_sm=2)
    act = torch.empty(P, inter, dtype=x.dtype, device=x.device)
    h13 = act if sp13 == 1 else torch.empty(sp13, P, 2 * inter, dtype=torch.float32, device=x.device)
    y_part = torch.empty(sp2, P, hidden, dtype=torch.float32, device=x.device)
    limit = float(swiglu_limit) if swiglu_limit is not None else 0.0
    fast = x.dtype == torch.bfloat16 and not interp
    common = dict(BLOCK_M=cfg.block_m, FAST=fast, FP32_DOT=fp32, INTERPRET=interp)
    common.update(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _w13_frag_kernel[(blocks, n13, sp13)](
        x, w13, s13, h13, pairs, bexp, P, hidden, ks13, limit, x.stride(0), *w13.stride()[:3], *s13.stride()[:3],
        h13.stride(0) if sp13 > 1 else 0, h13.stride(-2),
        TOP_K=top_k, SPLIT=sp13, HAS_LIMIT=swiglu_limit is not None, KS_C=ks13 if interp else 0, **common,
    )  # fmt: skip
    if sp13 > 1:
        block = min(1024, next_pow2(inter))
        _swiglu_kernel[(P, cdiv(inter, block))](
            h13, act, P, inter, limit, h13.stride(0), h13.stride(1), act.stride(0),
            SPLIT=sp13, HAS_LIMIT=swiglu_limit is not None, BLOCK=block, num_warps=4,
        )  # fmt: skip
    _w2_frag_kernel[(blocks, n2, sp2)](
        act, w2, s2, topk_weights.reshape(-1).contiguous(), y_part, pairs, bexp, P, hidden, inter, ks2,
        act.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), y_part.stride(0),
        N_TILES=tiles2, KS_C=ks2 if interp else 0, **common,
    )  # fmt: skip
    return sum_pairs(y_part, top_k, x.dtype)
