"""FP8 KV record formats for sparse MLA, with their packers and references: DeepSeek-V3.2's
"fp8_ds_mla" (below) and DeepSeek-V4's "fp8_ds_v4" (further down).

One record per KV slot, bytes in this order (V3.2: d_v = 512, tail = 64 -> 656 bytes):

    [0, d_v)                      d_v float8_e4m3fn values: the latent (the V part)
    [d_v, d_v + 4*G)              G = d_v / 128 float32 scales, little endian; value i of the
                                  latent is e4m3[i] * scale[i // 128]
    [d_v + 4*G, d_v + 4*G + 2*T)  T bfloat16 values: the rope part, not quantized

Records may sit in a larger pool (row stride >= record size); the kernel needs each record on a
16-byte boundary (656 = 41 * 16). Pure torch: no Triton import.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve_kernels.ref import sparse_mla_decode_ref

GROUP = 128
E4M3_MAX = 448.0


def record_bytes(d_v: int, tail: int) -> int:
    return d_v + 4 * (d_v // GROUP) + 2 * tail


def pack_kv_fp8(kv: torch.Tensor, d_v: int) -> torch.Tensor:
    """kv [N, D] float -> records [N, record_bytes(d_v, D - d_v)] uint8, per-128-value scales
    = amax / 448."""
    N, D = kv.shape
    if d_v % GROUP:
        raise ValueError(f"d_v must be a multiple of {GROUP}, got {d_v}")
    groups = kv[:, :d_v].float().reshape(N, d_v // GROUP, GROUP)
    scale = (groups.abs().amax(-1) / E4M3_MAX).clamp(min=1e-12)  # [N, G]
    vals = (groups / scale[..., None]).to(torch.float8_e4m3fn).reshape(N, d_v)
    tail = kv[:, d_v:].to(torch.bfloat16).contiguous()
    parts = [vals.view(torch.uint8), scale.contiguous().view(torch.uint8), tail.view(torch.uint8)]
    return torch.cat(parts, dim=1)


def unpack_kv_fp8(records: torch.Tensor, d_v: int, dim: int) -> torch.Tensor:
    """records [N, R] uint8 -> kv [N, dim] float32 (dequantized)."""
    N = records.shape[0]
    G = d_v // GROUP
    vals = records[:, :d_v].contiguous().view(torch.float8_e4m3fn).float()
    scale = records[:, d_v : d_v + 4 * G].contiguous().view(torch.float32)  # [N, G]
    tail = records[:, d_v + 4 * G : record_bytes(d_v, dim - d_v)].contiguous().view(torch.bfloat16)
    latent = (vals.reshape(N, G, GROUP) * scale[..., None]).reshape(N, d_v)
    return torch.cat([latent, tail.float()], dim=1)


def sparse_mla_decode_fp8_ref(
    q: torch.Tensor,  # [B, S, H, D]
    records: torch.Tensor,  # [N, R] uint8
    indices: torch.Tensor,  # [B, S, K] int32, -1 = padding
    sm_scale: float,
    d_v: int,
    sink: torch.Tensor | None = None,  # [H]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for `sparse_mla_decode_fp8`: dequantize the records, then the bf16 reference."""
    kv = unpack_kv_fp8(records, d_v, q.shape[3])
    kv = kv.double() if q.dtype == torch.float64 else kv
    return sparse_mla_decode_ref(q, kv, indices, sm_scale, d_v, sink=sink)


# -- DeepSeek-V4: "fp8_ds_v4" pages -----------------------------------------------------------
#
# The layout is FlashMLA's MODEL1_FP8Sparse, the V4 FP8 KV cache (deepseek-ai/FlashMLA
# tests/quant.py `quantize_k_cache`; SGLang's deepseek_v4 backend reads the same pages). One K = V
# head of `dim` values per token (V4-Flash: 448 "nope" + 64 rope = 512), stored by pages of P
# tokens (P = the region's records per block), bytes of a page in this order:
#
#     [0, P*VB)             token r's values at [r*VB, (r+1)*VB), VB = nope + 2*rope (576):
#                             nope float8_e4m3fn values, then rope bfloat16 values (not quantized)
#     [P*VB, P*(VB+SB))     token r's scales at [P*VB + r*SB, ...), SB = ceil(nope/64) rounded up
#                             to 8 (V4-Flash: 7 + 1 pad byte): one ue8m0 byte per 64 nope values,
#                             value i = e4m3[i] * 2^(byte[i // 64] - 127)
#
# so a page is P records of VB + SB bytes (584 for V4-Flash), and P = 1 is one self-contained
# 584-byte record per token (the form of a gathered copy). The scale of a group is the power of
# two 2^ceil(log2(max(amax / 448, 1e-4))), as FlashMLA's quantizer picks it. Slot s of a pool of
# pages [Nb, P, VB + SB] is record s % P of page s // P (KVCache.slots numbers records so).

V4_GROUP = 64  # nope values per ue8m0 scale
V4_SCALE_FLOOR = 1e-4  # smallest scale before the power-of-two rounding (FlashMLA's amax margin)


@dataclass(frozen=True)
class V4Record:
    """The shape of an fp8_ds_v4 record: `dim` K = V values per token, the last `rope` in bf16."""

    dim: int = 512
    rope: int = 64

    def __post_init__(self) -> None:
        if not 0 <= self.rope < self.dim or self.nope % 16:
            raise ValueError(
                f"fp8_ds_v4 needs 0 <= rope < dim and dim - rope a multiple of 16, got dim {self.dim}, rope {self.rope}"
            )

    @property
    def nope(self) -> int:
        return self.dim - self.rope

    @property
    def value_bytes(self) -> int:
        return self.nope + 2 * self.rope

    @property
    def groups(self) -> int:
        return -(-self.nope // V4_GROUP)

    @property
    def scale_bytes(self) -> int:
        return (self.groups + 7) // 8 * 8  # the scale bytes padded to an 8-byte word

    @property
    def bytes(self) -> int:
        return self.value_bytes + self.scale_bytes


V4_FLASH = V4Record(512, 64)  # 448 + 128 + 8 = 584 bytes


def _quantize_v4(kv: torch.Tensor, rec: V4Record) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [n, dim] -> (values [n, value_bytes], scales [n, scale_bytes]) uint8."""
    n, groups = kv.shape[0], rec.groups
    nope = torch.zeros(n, groups * V4_GROUP, dtype=torch.float32, device=kv.device)
    nope[:, : rec.nope] = kv[:, : rec.nope].float()
    nope = nope.view(n, groups, V4_GROUP)
    floor = (nope.abs().amax(-1) / E4M3_MAX).clamp(min=V4_SCALE_FLOOR)  # [n, groups]
    mant, exp = torch.frexp(floor)  # floor = mant * 2^exp, mant in [0.5, 1): exact ceil(log2)
    exp = torch.where(mant == 0.5, exp - 1, exp)
    vals = (nope / torch.ldexp(torch.ones_like(floor), exp)[..., None]).to(torch.float8_e4m3fn)
    values = torch.cat(
        [
            vals.view(n, -1)[:, : rec.nope].view(torch.uint8),
            kv[:, rec.nope :].to(torch.bfloat16).contiguous().view(torch.uint8),
        ],
        dim=1,
    )
    scales = torch.zeros(n, rec.scale_bytes, dtype=torch.uint8, device=kv.device)
    scales[:, :groups] = (exp + 127).to(torch.uint8)
    return values, scales


def _split_pages(pages: torch.Tensor, rec: V4Record) -> tuple[torch.Tensor, torch.Tensor]:
    """pages [Nb, P, bytes] -> views (values [Nb, P, value_bytes], scales [Nb, P, scale_bytes])."""
    Nb, P, R = pages.shape
    if pages.dtype != torch.uint8 or R != rec.bytes or pages.stride(2) != 1 or pages.stride(1) != R:
        raise ValueError(
            f"fp8_ds_v4 pages must be uint8 [Nb, P, {rec.bytes}] with each page's bytes contiguous, "
            f"got {pages.dtype} {tuple(pages.shape)} strides {pages.stride()}"
        )
    flat = pages.as_strided((Nb, P * R), (pages.stride(0), 1))
    values = flat[:, : P * rec.value_bytes].unflatten(1, (P, rec.value_bytes))
    return values, flat[:, P * rec.value_bytes :].unflatten(1, (P, rec.scale_bytes))


def pack_kv_fp8_v4(kv: torch.Tensor, page: int = 1, rec: V4Record = V4_FLASH) -> torch.Tensor:
    """kv [n, dim] float -> pages [ceil(n / page), page, rec.bytes] uint8 (slot s = row s of kv;
    the records past n are zero)."""
    n = kv.shape[0]
    pages = torch.zeros(-(-n // page), page, rec.bytes, dtype=torch.uint8, device=kv.device)
    store_kv_fp8_v4(pages, torch.arange(n, device=kv.device), kv, rec)
    return pages


def store_kv_fp8_v4(pages: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, rec: V4Record = V4_FLASH) -> None:
    """Quantize kv [n, dim] into the records of `slots` [n] (ids s = page * P + record) of pages
    [Nb, P, rec.bytes], in place."""
    if kv.dim() != 2 or kv.shape[1] != rec.dim or slots.shape != (kv.shape[0],):
        raise ValueError(f"kv must be [n, {rec.dim}] with slots [n], got {tuple(kv.shape)} and {tuple(slots.shape)}")
    values, scales = _split_pages(pages, rec)
    P, s = pages.shape[1], slots.long()
    values[s // P, s % P], scales[s // P, s % P] = _quantize_v4(kv, rec)


def copy_kv_fp8_v4(
    src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor, rec: V4Record = V4_FLASH
) -> None:
    """Copy the records of `src_slots` [n] of pages `src` to `dst_slots` [n] of pages `dst` (any
    page sizes): bytes moved, nothing requantized."""
    if src_slots.shape != dst_slots.shape or src_slots.dim() != 1:
        raise ValueError(
            f"src_slots and dst_slots must be [n], got {tuple(src_slots.shape)} and {tuple(dst_slots.shape)}"
        )
    (sv, ss), (dv, ds) = _split_pages(src, rec), _split_pages(dst, rec)
    s, d, P, Q = src_slots.long(), dst_slots.long(), src.shape[1], dst.shape[1]
    dv[d // Q, d % Q], ds[d // Q, d % Q] = sv[s // P, s % P], ss[s // P, s % P]


def gather_kv_fp8_v4(pages: torch.Tensor, slots: torch.Tensor, rec: V4Record = V4_FLASH, page: int = 1) -> torch.Tensor:
    """The records of `slots` [n] as new pages [ceil(n / page), page, rec.bytes], slot i = the
    i-th of `slots` (bytes moved, nothing requantized). An even page keeps every page on a 16-byte
    boundary (584 = 8 x 73: with one record a page, every other page is off it, and the kernel reads
    those more slowly)."""
    out = torch.zeros(-(-slots.shape[0] // page), page, rec.bytes, dtype=torch.uint8, device=pages.device)
    copy_kv_fp8_v4(pages, slots, out, torch.arange(slots.shape[0], device=pages.device), rec)
    return out


def unpack_kv_fp8_v4(pages: torch.Tensor, rec: V4Record = V4_FLASH) -> torch.Tensor:
    """pages [Nb, P, rec.bytes] -> kv [Nb * P, dim] float32 (dequantized; row = slot id)."""
    values, scales = (t.reshape(-1, t.shape[2]) for t in _split_pages(pages, rec))
    n, groups = values.shape[0], rec.groups
    nope = values[:, : rec.nope].contiguous().view(torch.float8_e4m3fn).float()
    scale = torch.ldexp(torch.ones(n, groups, device=pages.device), scales[:, :groups].int() - 127)
    nope = nope * scale.repeat_interleave(V4_GROUP, dim=1)[:, : rec.nope]
    return torch.cat([nope, values[:, rec.nope :].contiguous().view(torch.bfloat16).float()], dim=1)


def sparse_mla_decode_fp8_v4_ref(
    q: torch.Tensor,  # [B, S, H, dim]
    pages: torch.Tensor,  # [Nb, P, rec.bytes] uint8
    indices: torch.Tensor,  # [B, S, K] int32 slot ids, -1 = padding
    sm_scale: float,
    rope: int = 64,
    sink: torch.Tensor | None = None,  # [H]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for `sparse_mla_decode_fp8_v4`: dequantize every record, then the reference
    with d_v = dim (K = V: the output includes the rope dims)."""
    kv = unpack_kv_fp8_v4(pages, V4Record(q.shape[3], rope))
    kv = kv.double() if q.dtype == torch.float64 else kv
    return sparse_mla_decode_ref(q, kv, indices, sm_scale, q.shape[3], sink=sink)
