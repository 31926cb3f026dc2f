"""FP4 (e2m1) expert weights as DeepSeek-V4 ships them, and the PyTorch reference MoE for
`fused_moe_fp4.fused_moe_fp4`. Plain torch, no Triton import.

Format (the routed experts of DeepSeek-V4; transformers' `FP8Experts` with expert_dtype "fp4"):
- values: e2m1, 4 bits = sign | 2 exponent bits | 1 mantissa bit, codes 0..7 =
  0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8..15 the same negated (code 8 is -0);
- packing: two values per byte along the reduction (K) dim, the even element in the low nibble
  (`byte = code[2i] | code[2i + 1] << 4`), so a weight [..., N, K] is stored uint8 [..., N, K/2]
  (checkpoints: int8 or float4_e2m1fn_x2, the same bytes);
- scales: ue8m0, one per 32 consecutive values along K of one row: uint8 exponent byte b,
  scale 2**(b - 127), stored [..., N, ceil(K/32)] (checkpoints: uint8 or float8_e8m0fnu).
W[n, k] = e2m1(code[n, k]) * 2**(scale[n, k // 32] - 127).

Legend: T tokens, k experts per token, E experts, I expert intermediate size, hidden model width,
N, K a weight's rows and reduction columns, G = ceil(K / 32) scale groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUP = 32  # values per ue8m0 scale along K
E2M1_MAX = 6.0
# e2m1 value of each 4-bit code
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e2m1_table(dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., K] uint8 in [0, 16), K even -> bytes [..., K/2], even element in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packs two values per byte: K = {codes.shape[-1]} must be even")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., K/2] (uint8, int8 or float4_e2m1fn_x2) -> codes [..., K] uint8."""
    b = packed.view(torch.uint8)
    return torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code of each value (clamped to +-6; ties to the even mantissa, as a hardware
    cvt.rn does), uint8."""
    mags = torch.tensor(E2M1_VALUES[:8], dtype=torch.float64, device=v.device)
    a = v.double().abs().clamp(max=E2M1_MAX)
    mid = (mags[1:] + mags[:-1]) / 2  # 7 midpoints
    idx = torch.bucketize(a, mid)  # a == mid goes down: fix the ties whose lower code is odd
    tie_up = (a[..., None] == mid).any(-1) & (idx % 2 == 1)
    idx = idx + tie_up.long()
    sign = (v < 0) | ((v == 0) & torch.signbit(v))
    return (idx + 8 * sign.long()).to(torch.uint8)


def scale_to_float(scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """ue8m0 exponent bytes (uint8 or float8_e8m0fnu) -> 2**(b - 127) in `dtype` (float64 exact)."""
    b = scale.view(torch.uint8).to(torch.float64)
    return torch.exp2(b - 127).to(dtype)


def quant_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] float, K even -> (packed uint8 [..., N, K/2], scale uint8 [..., N, G]): per
    32-value group the smallest power of two s with amax / s <= 6, codes = nearest e2m1 of w / s."""
    *lead, N, K = w.shape
    G = -(-K // GROUP)
    wf = F.pad(w.double(), (0, G * GROUP - K)).reshape(*lead, N, G, GROUP)
    amax = wf.abs().amax(-1)
    exp = torch.ceil(torch.log2(amax.clamp(min=2.0**-120) / E2M1_MAX)).clamp(-127, 127)
    codes = e2m1_encode(wf / torch.exp2(exp)[..., None]).reshape(*lead, N, G * GROUP)[..., :K]
    return pack_fp4(codes).contiguous(), (exp + 127).to(torch.uint8)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed [..., N, K/2] and scale [..., N, G] -> W [..., N, K] in `dtype` (exact in float32)."""
    vals = e2m1_table(torch.float64, packed.device)[unpack_fp4(packed).long()]
    s = scale_to_float(scale, torch.float64).repeat_interleave(GROUP, dim=-1)[..., : vals.shape[-1]]
    return (vals * s).to(dtype)


def swiglu(h: torch.Tensor, inter: int, limit: float | None) -> torch.Tensor:
    """h [n, 2I] (gate then up) -> silu(gate) * up, with DeepSeek-V4's clamp when `limit` is set:
    gate <= limit, -limit <= up <= limit (transformers' DeepseekV4Experts._apply_gate)."""
    gate, up = h[:, :inter], h[:, inter:]
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def fused_moe_fp4_ref(
    x: torch.Tensor,  # [T, hidden] bf16/fp16/fp32 (float64: oracle math)
    w13: torch.Tensor,  # [E, 2I, hidden/2] packed e2m1, gate rows then up rows
    w2: torch.Tensor,  # [E, hidden, I/2] packed e2m1
    w13_scale: torch.Tensor,  # [E, 2I, ceil(hidden/32)] ue8m0
    w2_scale: torch.Tensor,  # [E, hidden, ceil(I/32)] ue8m0
    topk_weights: torch.Tensor,  # [T, k] float
    topk_ids: torch.Tensor,  # [T, k] int
    swiglu_limit: float | None = None,
    act_dtype: torch.dtype | None = None,  # dtype the SiLU-and-mul output is rounded to; x's by default
) -> torch.Tensor:
    """y[t] = sum_j w[t,j] * W2_e @ act_dtype(silu(clamp(G_e x[t])) * clamp(U_e x[t])), with W the
    dequantized FP4 weights; activations are not quantized (the kernel multiplies x's dtype)."""
    math = torch.float64 if x.dtype == torch.float64 else torch.float32
    act_dtype = act_dtype or x.dtype
    T, hidden = x.shape
    inter = w13.shape[1] // 2
    y = torch.zeros(T, hidden, dtype=math, device=x.device)
    for e in torch.unique(topk_ids.reshape(-1)).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        h = x[tok].to(math) @ dequant_fp4(w13[e], w13_scale[e], math).t()  # [n, 2I]
        act = swiglu(h, inter, swiglu_limit).to(act_dtype).to(math)
        out = act @ dequant_fp4(w2[e], w2_scale[e], math).t()  # [n, hidden]
        y.index_add_(0, tok, out * topk_weights[tok, slot, None].to(math))
    return y.to(x.dtype)
