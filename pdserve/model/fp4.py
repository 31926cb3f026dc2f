"""FP4 (e2m1) weights with power-of-two block scales, as DeepSeek-V4 ships its routed experts.

A weight W [N, K] is stored packed, two e2m1 codes per byte ([N, K/2] int8 / uint8 /
float4_e2m1fn_x2; element 2j in the low nibble, 2j+1 in the high one), with one ue8m0 scale per
32 consecutive values of a row ([N, K/32]: float8_e8m0fnu, or raw uint8 exponents meaning
2^(b - 127), or plain floats). The real weight is code value * scale.

Kept FP4 (the default for such a checkpoint: deepseek_v4/moe.py's Experts), the bytes and the
scales go to the device as uint8 as they are (`packed_bytes`, `ue8m0_bytes`) and
`ops.fused_moe_fp4` reads them (kernels/ref_fp4.py documents the same layout); on a GPU the
experts are re-laid once into the layout the kernel reads fastest (`frag_experts`: each thread's
bytes its MMA operand); dequantized at load (`--quantization none`), `dequantize_fp4` makes floats
of them.
"""

from __future__ import annotations

import math

import torch

FP4_BLOCK = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP4_PACKED_DTYPES = (torch.int8, torch.uint8, *[getattr(torch, n) for n in ("float4_e2m1fn_x2",) if hasattr(torch, n)])


def is_fp4(t: torch.Tensor) -> bool:
    return t.dtype in FP4_PACKED_DTYPES


def scales_to_float(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 scales (float8_e8m0fnu or uint8 exponents) or float scales -> float32."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def check_fp4_shapes(packed: torch.Tensor, scale: torch.Tensor) -> None:
    """ValueError unless packed is [N, K/2] and scale [N, K/32]."""
    if packed.dim() != 2:
        raise ValueError(f"fp4 weights must be 2-D, got shape {tuple(packed.shape)}")
    N, K = packed.shape[0], 2 * packed.shape[1]
    if K % FP4_BLOCK or tuple(scale.shape) != (N, K // FP4_BLOCK):
        raise ValueError(
            f"fp4 scale shape {tuple(scale.shape)} does not fit packed weight {tuple(packed.shape)} "
            f"({K} values a row, one scale per {FP4_BLOCK}): expected {(N, K // FP4_BLOCK)}"
        )


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed [N, K/2], scale [N, K/32] -> float32 [N, K]. Raises ValueError on shapes that do
    not fit."""
    check_fp4_shapes(packed, scale)
    N, K = packed.shape[0], 2 * packed.shape[1]
    codes = packed.contiguous().view(torch.uint8)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = torch.stack([lut[(codes & 0xF).long()], lut[(codes >> 4).long()]], dim=-1).view(N, K)
    return values * scales_to_float(scale).repeat_interleave(FP4_BLOCK, dim=1)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (packed [N, K/2] int8, scale [N, K/32] float8_e8m0fnu): round to nearest
    e2m1 after dividing by a power-of-two scale that puts the block's max at or under 6."""
    N, K = w.shape
    blocks = w.float().view(N, K // FP4_BLOCK, FP4_BLOCK)
    amax = blocks.abs().amax(-1).clamp(min=2.0**-126)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 6.0)))  # [N, K/32]
    scaled = (blocks / scale[..., None]).reshape(N, K)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)  # [N, K]
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


def packed_bytes(packed: torch.Tensor) -> torch.Tensor:
    """A checkpoint's packed e2m1 tensor (int8 / uint8 / float4_e2m1fn_x2) as the uint8 bytes the
    kernels read: the same bytes, no copy."""
    return packed.view(torch.uint8)


def ue8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Scales as ue8m0 exponent bytes (uint8, 2^(b - 127)): float8_e8m0fnu and uint8 as they are,
    float scales only when each is a power of two in range (ValueError otherwise)."""
    if scale.dtype == torch.uint8:
        return scale
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scale.view(torch.uint8)
    mant, exp = torch.frexp(scale.float())  # scale = mant * 2^exp, mant in [0.5, 1)
    b = exp.to(torch.int32) + 126
    if not bool(((mant == 0.5) & (b >= 0) & (b <= 254)).all()):
        raise ValueError("fp4 scales given as floats must be powers of two (ue8m0) to be kept FP4")
    return b.to(torch.uint8)


MAX_FRAG_SCALE = 128  # kernels/fused_moe_fp4.py: the fragment-layout bf16 path takes scales up to 2**1
FRAG_CHUNK = 16  # experts re-laid at a time (bounds the transient memory)


@torch.no_grad()
def frag_experts(w13, w2, w13_scale, w2_scale) -> tuple[torch.Tensor, ...] | None:
    """Stacked checkpoint-layout experts (gate_up_proj [E, 2I, hidden/2], down_proj [E, hidden, I/2]
    and their ue8m0 scales) -> (w13, w2, w13_scale, w2_scale) in kernels/ref_fp4.py's fragment
    layout (values [E, 2, NB, KB, 4096] / [E, NB, KB, 4096], scales [.., 256]), made on their
    device a few experts at a time; None when a scale exceeds 2 (the bf16 path's range): keep the
    checkpoint layout. Reads the scales back (a host sync): once, at load."""
    from pdserve_kernels import ref_fp4

    s13, s2 = ue8m0_bytes(w13_scale), ue8m0_bytes(w2_scale)
    if max(int(s13.max()), int(s2.max())) > MAX_FRAG_SCALE:
        return None
    b13, b2, E = packed_bytes(w13), packed_bytes(w2), w13.shape[0]
    out = None
    for e in range(0, E, FRAG_CHUNK):
        c = slice(e, e + FRAG_CHUNK)
        part = ref_fp4.frag_experts(b13[c], s13[c], b2[c], s2[c])
        if out is None:
            out = tuple(t.new_empty((E, *t.shape[1:])) for t in part)
        for dst, src in zip(out, part):
            dst[c] = src
    return out


@torch.no_grad()
def fill_random_fp4_(name: str, t: torch.Tensor, gen: torch.Generator) -> None:
    """Random FP4 experts for `load_format: dummy`: packed codes uniform over all 16, and one scale
    for the whole tensor (`*_scale_inv`), the power of two nearest to giving values of std
    fan_in^-0.5 (fan_in = 32 x the groups a row), as the float matrices get."""
    if not name.endswith("_scale_inv"):
        t.random_(0, 256, generator=gen)
        return
    rms_code = (sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES)) ** 0.5  # ~2.93
    exponent = round(math.log2((FP4_BLOCK * t.shape[-1]) ** -0.5 / rms_code))
    t.fill_(127 + exponent)
