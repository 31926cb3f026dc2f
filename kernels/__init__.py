"""pdserve_kernels: Triton kernels for MLA (sparse decode, dense prefill), fused MoE, V4's hyper-connections and per-layer glue (kernels/mhc.py, glue.py, compress.py), the KV block copy of a same-host transfer and the KV checksum of a verified one, with PyTorch references.

Every kernel has a reference in `ref.py` with the same signature; the engine picks one through
`pdserve.model.ops`. The Triton kernels are imported on first use, so `import pdserve_kernels`
(and the references) work where Triton is not installed.
"""

from __future__ import annotations

import importlib

from pdserve_kernels.ref import (
    checksum_blocks_ref,
    copy_blocks_ref,
    fused_moe_ref,
    hc_mix_ref,
    indexer_topk_paged_ref,
    indexer_topk_ref,
    mla_prefill_attention_ref,
    paged_mla_decode_ref,
    sparse_mla_decode_ref,
)

_LAZY = {  # name -> module; fp8 / fp4 references and quantizers: pdserve_kernels.ref_fp8 / ref_fp4
    "sparse_mla_decode": "pdserve_kernels.sparse_mla",
    "sparse_mla_decode_fp8": "pdserve_kernels.sparse_mla",
    "sparse_mla_decode_fp8_v4": "pdserve_kernels.sparse_mla",
    "paged_mla_decode": "pdserve_kernels.sparse_mla",
    "fused_moe": "pdserve_kernels.fused_moe",
    "fused_moe_fp8": "pdserve_kernels.fused_moe_fp8",
    "fp8_linear": "pdserve_kernels.fp8_gemm",
    "fused_moe_fp4": "pdserve_kernels.fused_moe_fp4",
    "indexer_topk": "pdserve_kernels.indexer",
    "indexer_topk_paged": "pdserve_kernels.indexer",
    "mla_prefill_attention": "pdserve_kernels.mla_prefill",
    "hc_mix": "pdserve_kernels.hyper",
    "hc_pre": "pdserve_kernels.mhc",
    "hc_post": "pdserve_kernels.mhc",
    "rms_norm_rope": "pdserve_kernels.glue",
    "route": "pdserve_kernels.glue",
    "swiglu": "pdserve_kernels.glue",
    "compress_decode": "pdserve_kernels.compress",
    "compress_chunk": "pdserve_kernels.compress",
    "copy_blocks": "pdserve_kernels.block_copy",
    "checksum_blocks": "pdserve_kernels.kv_checksum",
}

__all__ = [
    "checksum_blocks_ref", "copy_blocks_ref", "fused_moe_ref", "hc_mix_ref", "indexer_topk_paged_ref", "indexer_topk_ref", "mla_prefill_attention_ref", "paged_mla_decode_ref", "sparse_mla_decode_ref", *_LAZY,
]  # fmt: skip


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pdserve_kernels' has no attribute {name!r}")
