"""pdserve_kernels: Triton decode kernels for sparse MLA and fused MoE, with PyTorch references.

Every kernel has a reference in `ref.py` with the same signature; the engine picks one through
`pdserve.model.ops`.
"""

from pdserve_kernels.ref import fused_moe_ref, indexer_topk_ref, sparse_mla_decode_ref

__all__ = ["fused_moe_ref", "indexer_topk_ref", "sparse_mla_decode_ref"]
