"""The FP8 KV record formats' packers and sizes (kernels/kv_fp8.py: the same on every device), called
as `ops.<name>` (ops.py re-exports them) like the kernels whose records they make.
"""

from __future__ import annotations

import torch


def fp8_record_bytes(d_v: int, tail: int) -> int:
    from pdserve_kernels.kv_fp8 import record_bytes

    return record_bytes(d_v, tail)


def pack_kv_fp8(kv: torch.Tensor, d_v: int) -> torch.Tensor:
    """[N, D] values -> [N, R] uint8 FP8 records (kernels/kv_fp8.py: the same on every device)."""
    from pdserve_kernels.kv_fp8 import pack_kv_fp8 as pack

    return pack(kv, d_v)


def unpack_kv_fp8(records: torch.Tensor, d_v: int, dim: int) -> torch.Tensor:
    """[N, R] uint8 FP8 records -> [N, dim] float32."""
    from pdserve_kernels.kv_fp8 import unpack_kv_fp8 as unpack

    return unpack(records, d_v, dim)


def fp8_v4_record_bytes(dim: int, rope: int) -> int:
    """Bytes of one fp8_ds_v4 record (V4-Flash: dim 512, rope 64 -> 584)."""
    from pdserve_kernels.kv_fp8 import V4Record

    return V4Record(dim, rope).bytes


def pack_kv_fp8_v4(kv: torch.Tensor, rope: int, page: int = 1) -> torch.Tensor:
    """[n, D] values -> fp8_ds_v4 pages [ceil(n / page), page, R] uint8 (page 1: one record a row)."""
    from pdserve_kernels.kv_fp8 import V4Record
    from pdserve_kernels.kv_fp8 import pack_kv_fp8_v4 as pack

    return pack(kv, page, V4Record(kv.shape[1], rope))


def store_kv_fp8_v4(pages: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, rope: int) -> None:
    """Quantize kv [n, D] into the fp8_ds_v4 records of `slots` [n] of pages [Nb, P, R], in place."""
    from pdserve_kernels.kv_fp8 import V4Record
    from pdserve_kernels.kv_fp8 import store_kv_fp8_v4 as store

    store(pages, slots, kv, V4Record(kv.shape[1], rope))


def gather_kv_fp8_v4(pages: torch.Tensor, slots: torch.Tensor, dim: int, rope: int, page: int = 1) -> torch.Tensor:
    """The fp8_ds_v4 records of `slots` [n] as new pages [ceil(n / page), page, R], slot i = the
    i-th of `slots` (bytes, no requantization)."""
    from pdserve_kernels.kv_fp8 import V4Record
    from pdserve_kernels.kv_fp8 import gather_kv_fp8_v4 as gather

    return gather(pages, slots, V4Record(dim, rope), page)
