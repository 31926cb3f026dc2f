"""MXFP8 (OCP Microscaling: e4m3 values, one ue8m0 power-of-two scale per 32 along K) in Triton:
the in-register helpers of the MX8 FP4 MoE (`fused_moe_fp4_mx8.py`) and a standalone per-row
quantizer `quant_mxfp8` (tests, benchmarks). Reference: `ref_fp4.quant_mxfp8` (torch, float64).

Scale choice: the smallest power of two s = 2**e with amax / s <= 448 (e4m3's largest value),
e = ceil(log2(amax / 448)) clamped to [-127, 127], stored as the byte e + 127; so no value
saturates and each block keeps as many significant bits as e4m3 allows. This is NVIDIA's MXFP8
recipe (Transformer Engine, FlashInfer's mxfp8_quantize, what vLLM / SGLang feed sm_120's MMA);
the OCP spec's own example, e = floor(log2 amax) - 8, maps amax into [256, 512) and saturates
the top of that range to 448. Values: x / s rounded to nearest e4m3, ties to even.

e2m1 -> e4m3 (`e2m1_to_e4m3`): every e2m1 value is exact in e4m3 (bias 1 -> 7): a magnitude
code m >= 2 is exponent (m >> 1) + 6, mantissa (m & 1) << 2, i.e. the bits (m << 2) + 0x30;
code 1 (0.5) is 0x30, code 0 is 0; the sign moves from bit 3 to bit 7.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve_kernels._launch import cdiv, interpreting

E4M3_MAX = 448.0
GROUP = 32


@triton.jit
def e2m1_to_e4m3(code):
    """e2m1 codes (uint8 in [0, 16)) -> the e4m3 bit patterns (uint8) of the same values."""
    m = code & 7
    bits = tl.where(m > 1, (m << 2) + 0x30, tl.where(m == 1, 0x30, 0))
    return (bits | ((code & 8) << 4)).to(tl.uint8)


@triton.jit
def _e4m3_bits_rne(q):
    """float32 q, |q| <= 448 -> its e4m3 bits (uint8), round to nearest even, by integer
    arithmetic (the interpreter's float8 cast truncates). Normal range: round the float32
    mantissa to 3 bits; below 2**-6: to a multiple of 2**-9 (e4m3's subnormal step) by the
    2**23 magic add, exact for the values here."""
    a = tl.abs(q)
    ab = a.to(tl.uint32, bitcast=True)
    normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - (120 << 3)  # (exponent + 7) << 3 | mantissa
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)  # multiples of 2**-9, in [0, 8]
    mag = tl.where(a < 0.015625, sub, normal)
    sign = (q.to(tl.uint32, bitcast=True) >> 24) & 0x80
    return (mag | sign).to(tl.uint8)


@triton.jit
def mxfp8_quant(x, ROWS: tl.constexpr, COLS: tl.constexpr, EXACT_CVT: tl.constexpr):
    """x [ROWS, COLS] float32 (COLS a multiple of 32) -> (e4m3 bits [ROWS, COLS] uint8, ue8m0
    scale bytes [ROWS, COLS / 32] uint8), one scale per 32 consecutive columns (module docstring).
    EXACT_CVT: the integer rounding (`_e4m3_bits_rne`, the interpreter); else the hardware's
    cvt.rn.satfinite to e4m3."""
    xg = tl.reshape(x, (ROWS, COLS // 32, 32))
    amax = tl.max(tl.abs(xg), axis=2)  # [ROWS, G]
    ab = amax.to(tl.int32, bitcast=True)
    # ceil(log2(amax / 448)) exactly: amax = f * 2**E, f in [1, 2); 448 = 1.75 * 2**8
    e = ((ab >> 23) & 0xFF) - 135 + ((ab & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -127), 127)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2**-e (e <= 120 for finite amax)
    q = tl.minimum(tl.maximum(xg * inv[:, :, None], -448.0), 448.0)
    q = tl.reshape(q, (ROWS, COLS))
    if EXACT_CVT:
        bits = _e4m3_bits_rne(q)
    else:
        bits = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return bits, (e + 127).to(tl.uint8)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, N, COLS, s_x, s_q, s_s, BLOCK: tl.constexpr, EXACT_CVT: tl.constexpr):
    """Grid (rows, cdiv(COLS, BLOCK)): one row's BLOCK columns."""
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r * s_x + offs, mask=offs < COLS, other=0.0).to(tl.float32)
    q, s = mxfp8_quant(tl.reshape(x, (1, BLOCK)), 1, BLOCK, EXACT_CVT)
    tl.store(q_ptr + r * s_q + offs, tl.reshape(q, (BLOCK,)), mask=offs < COLS)
    g = tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    tl.store(s_ptr + r * s_s + g, tl.reshape(s, (BLOCK // 32,)), mask=g * 32 < COLS)


def quant_mxfp8(x: torch.Tensor, exact_cvt: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] float -> (q [R, C] float8_e4m3fn, scale [R, ceil(C/32)] uint8 ue8m0 bytes);
    x ~= q * 2**(scale - 127) per 32 columns. exact_cvt: the integer rounding (default: only
    under the interpreter)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [R, C] with a contiguous last dim, got {tuple(x.shape)}")
    R, C = x.shape
    q = torch.empty(R, C, dtype=torch.uint8, device=x.device)
    s = torch.empty(R, cdiv(C, GROUP), dtype=torch.uint8, device=x.device)
    block = 128
    exact = interpreting() if exact_cvt is None else exact_cvt
    if R and C:
        _quant_rows_kernel[(R, cdiv(C, block))](
            x, q, s, R, C, x.stride(0), q.stride(0), s.stride(0), BLOCK=block, EXACT_CVT=exact
        )
    return q.view(torch.float8_e4m3fn), s
