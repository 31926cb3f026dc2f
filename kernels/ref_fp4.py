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


E4M3_MAX = 448.0


def quant_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MXFP8 along the last dim: x [..., K] -> (q [..., K] float8_e4m3fn, scale [..., G] uint8
    ue8m0 bytes). Per 32-value group the smallest power of two s = 2**e with amax / s <= 448
    (e = ceil(log2(amax / 448)) in [-127, 127]; NVIDIA's MXFP8 recipe), q = x / s rounded to
    nearest e4m3, ties to even (torch's cast; |x / s| <= 448 so nothing saturates)."""
    *lead, K = x.shape
    G = -(-K // GROUP)
    xg = F.pad(x.double(), (0, G * GROUP - K)).reshape(*lead, G, GROUP)
    mant, exp = torch.frexp(xg.abs().amax(-1) / E4M3_MAX)  # amax / 448 = mant * 2**exp, mant in [0.5, 1)
    e = torch.where(mant == 0.5, exp - 1, exp)  # ceil(log2(.)): an exact power of two keeps its exponent
    e = torch.where(mant == 0, -127, e).clamp(-127, 127)
    q = (xg / torch.exp2(e.double())[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(*lead, G * GROUP)[..., :K], (e + 127).to(torch.uint8)


def dequant_mxfp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """q [..., K] e4m3 and scale [..., G] -> q * 2**(scale - 127) in `dtype` (exact in float64)."""
    s = scale_to_float(scale, torch.float64).repeat_interleave(GROUP, dim=-1)[..., : q.shape[-1]]
    return (q.double() * s).to(dtype)


def mxfp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x rounded through MXFP8 (quantized, dequantized), float64."""
    return dequant_mxfp8(*quant_mxfp8(x))


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
    w13: torch.Tensor,  # [E, 2I, hidden/2] packed e2m1, gate rows then up rows (or fragment)
    w2: torch.Tensor,  # [E, hidden, I/2] packed e2m1 (or fragment)
    w13_scale: torch.Tensor | None,  # [E, 2I, ceil(hidden/32)] ue8m0 (fragment: [.., 256])
    w2_scale: torch.Tensor | None,  # [E, hidden, ceil(I/32)] ue8m0
    topk_weights: torch.Tensor,  # [T, k] float
    topk_ids: torch.Tensor,  # [T, k] int
    swiglu_limit: float | None = None,
    act_dtype: torch.dtype | None = None,  # dtype the SiLU-and-mul output is rounded to; x's by default
    mxfp8_act: bool = False,  # x and the SiLU-and-mul output through MXFP8 (`quant_mxfp8`), as the MX8 kernels
) -> torch.Tensor:
    """y[t] = sum_j w[t,j] * W2_e @ act_dtype(silu(clamp(G_e x[t])) * clamp(U_e x[t])), with W the
    dequantized FP4 weights; activations are not quantized (the kernel multiplies x's dtype),
    unless mxfp8_act: then x[t] and the activation are rounded through MXFP8 per token instead."""
    if w13.dim() == 5:  # the fragment layout (`frag_experts`): back to the checkpoint's, I padded
        w13, w2, w13_scale, w2_scale = unfrag_experts(w13, w2, w13_scale, w2_scale, x.shape[1], w13.shape[2] * FRAG_N)
    math = torch.float64 if x.dtype == torch.float64 else torch.float32
    act_dtype = act_dtype or x.dtype
    T, hidden = x.shape
    inter = w13.shape[1] // 2
    y = torch.zeros(T, hidden, dtype=math, device=x.device)
    for e in torch.unique(topk_ids.reshape(-1)).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        xe = mxfp8_round_trip(x[tok]) if mxfp8_act else x[tok]
        h = xe.to(math) @ dequant_fp4(w13[e], w13_scale[e], math).t()  # [n, 2I]
        act = swiglu(h, inter, swiglu_limit)
        act = mxfp8_round_trip(act) if mxfp8_act else act.to(act_dtype)
        act = act.to(math)
        out = act @ dequant_fp4(w2[e], w2_scale[e], math).t()  # [n, hidden]
        y.index_add_(0, tok, out * topk_weights[tok, slot, None].to(math))
    return y.to(x.dtype)


# --- the fragment layout (`frag_fp4`, made once at load): a thread's bytes are its MMA operand --
# A weight [N, K] is cut into tiles of 64 rows x 128 K values, each 4,096 value bytes (values
# [..., NB, KB, 4096]) and 256 scale bytes (scales [..., NB, KB, 256]). sm_90's warpgroup MMA
# takes a [64, 16] bf16 A fragment from registers: thread t = 32 w + 4 g + q (warp w, lane 4 g + q)
# holds rows 16 w + 8 h + g (h = 0, 1) and columns 8 c + 2 q + p (c, p = 0, 1) of every 16-column
# step ks (col = 16 ks + 8 c + 2 q + p). Those 8 values of one step are one 32-bit word (`frag_word`),
# element e = 4 c + 2 h + p; the tile's words are [2 (hf), 128 (t), 4 (kq)] (ks = 4 hf + kq), so
# a thread's 16 bytes of one half are contiguous (one 16-byte load, a warp 512 contiguous bytes).
# Scale bytes [4 (w), 8 (g), 4 (group r), 2 (h)]: a thread's 8 scales are one 8-byte load.
# Rows and columns past N / K are zero codes with scale 127.
FRAG_N, FRAG_K = 64, 128
FRAG_BYTES, FRAG_SCALE_BYTES = FRAG_N * FRAG_K // 2, FRAG_N * FRAG_K // GROUP
# where element e's code sits in its word: (first magnitude bit, second, third, sign); the kernel
# makes bf16 bit patterns (magnitude at bits 6-8 / 22-24, sign at 15 / 31) of elements (0, 1) by
# word & mask, (2, 3) by word << 3, (4, 5) by word << 6 and (6, 7) from three shifts (`_dq_frag`)
FRAG_BITS = (
    (6, 7, 8, 15),
    (22, 23, 24, 31),
    (3, 4, 5, 12),
    (19, 20, 21, 28),
    (0, 1, 2, 9),
    (16, 17, 18, 25),
    (10, 11, 13, 14),
    (26, 27, 29, 30),
)


def frag_word(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., 8] (uint8 in [0, 16), element order e) -> int64 [...]: the 32-bit word."""
    word = torch.zeros(codes.shape[:-1], dtype=torch.int64, device=codes.device)
    c = codes.to(torch.int64)
    for e, bits in enumerate(FRAG_BITS):
        for j, b in enumerate(bits):
            word |= ((c[..., e] >> j) & 1) << b
    return word


def frag_codes(word: torch.Tensor) -> torch.Tensor:
    """Inverse of `frag_word`: int64 [...] -> codes [..., 8] uint8."""
    out = [sum(((word >> b) & 1) << j for j, b in enumerate(bits)) for bits in FRAG_BITS]
    return torch.stack(out, -1).to(torch.uint8)


_FRAG_ROWS, _FRAG_COLS = (4, 2, 8), (2, 4, 2, 4, 2)  # (w, h, g), (hf, kq, c, q, p)


def frag_fp4(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """packed [..., N, K/2] + scale [..., N, ceil(K/32)] (checkpoint layout) -> (values [..., NB, KB,
    FRAG_BYTES], scales [..., NB, KB, FRAG_SCALE_BYTES]) uint8 (layout above)."""
    *lead, N, half = packed.shape
    NB, KB = -(-N // FRAG_N), -(-2 * half // FRAG_K)
    n = len(lead)
    codes = F.pad(unpack_fp4(packed), (0, KB * FRAG_K - 2 * half, 0, NB * FRAG_N - N))
    codes = codes.reshape(*lead, NB, *_FRAG_ROWS, KB, *_FRAG_COLS)  # [.., NB, w, h, g, KB, hf, kq, c, q, p]
    d = [n + i for i in (0, 4, 5, 1, 3, 8, 6, 7, 2, 9)]  # -> [.., NB, KB, hf, w, g, q, kq, c, h, p]
    codes = codes.permute(*range(n), *d).reshape(*lead, NB, KB, -1, 8)
    words = frag_word(codes)  # [.., NB, KB, 1024]
    values = torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], -1).to(torch.uint8).flatten(-2)
    s = scale.view(torch.uint8)
    s = F.pad(s, (0, KB * FRAG_K // GROUP - s.shape[-1], 0, NB * FRAG_N - N), value=127)
    s = s.reshape(*lead, NB, 4, 2, 8, KB, FRAG_K // GROUP)  # [.., NB, w, h, g, KB, r]
    s = s.permute(*range(n), *[n + i for i in (0, 4, 1, 3, 5, 2)]).reshape(*lead, NB, KB, -1)
    return values.contiguous(), s.contiguous()


def unfrag_fp4(values: torch.Tensor, scales: torch.Tensor, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `frag_fp4`: -> (packed [..., N, K/2], scale [..., N, ceil(K/32)])."""
    *lead, NB, KB, _ = values.shape
    n = len(lead)
    b = values.reshape(*lead, NB, KB, -1, 4).to(torch.int64)
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    codes = frag_codes(words).reshape(*lead, NB, KB, 2, 4, 8, 4, 4, 2, 2, 2)  # hf w g q kq c h p
    d = [n + i for i in (0, 3, 8, 4, 1, 2, 6, 7, 5, 9)]  # -> [.., NB, w, h, g, KB, hf, kq, c, q, p]
    codes = codes.permute(*range(n), *d).reshape(*lead, NB * FRAG_N, KB * FRAG_K)[..., :N, :K]
    s = scales.reshape(*lead, NB, KB, 4, 8, FRAG_K // GROUP, 2)  # [.., NB, KB, w, g, r, h]
    s = s.permute(*range(n), *[n + i for i in (0, 2, 5, 3, 1, 4)])
    s = s.reshape(*lead, NB * FRAG_N, KB * FRAG_K // GROUP)[..., :N, : -(-K // GROUP)]
    return pack_fp4(codes).contiguous(), s.contiguous()


def frag_experts(w13, w13_scale, w2, w2_scale):
    """Checkpoint experts -> (w13 values [E, 2, NB, KB, FRAG_BYTES], w2 values [E, NB, KB,
    FRAG_BYTES], w13 scales [E, 2, NB, KB, FRAG_SCALE_BYTES], w2 scales [E, NB, KB, ...])."""
    inter = w13.shape[1] // 2
    (g, gs), (u, us) = frag_fp4(w13[:, :inter], w13_scale[:, :inter]), frag_fp4(w13[:, inter:], w13_scale[:, inter:])
    v2, s2 = frag_fp4(w2, w2_scale)
    return torch.stack([g, u], 1), v2, torch.stack([gs, us], 1), s2


def unfrag_experts(v13, v2, s13, s2, hidden: int, inter: int):
    """Inverse of `frag_experts`: (w13, w2, w13_scale, w2_scale) in the checkpoint layout."""
    (g, gs), (u, us) = unfrag_fp4(v13[:, 0], s13[:, 0], inter, hidden), unfrag_fp4(v13[:, 1], s13[:, 1], inter, hidden)
    w2, w2s = unfrag_fp4(v2, s2, hidden, inter)
    return torch.cat([g, u], 1), w2, torch.cat([gs, us], 1), w2s
