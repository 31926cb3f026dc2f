"""Gather / scatter of whole KV blocks between a pool region and a contiguous slab, at copy speed.

    gather:  out[l, j, :] = src[l, ids[j], :]      (every layer l of the region, j < n)
    scatter: dst[l, ids[j], :] = slab[l, j, :]

Both tensors are integer words (the bytes of a block as int64 / int32 / ...: the values' dtype does
not matter). `torch.index_select` / `index_copy_` along the block axis of a [L, N, W] tensor run at
about a third of a device copy's rate on the H200 (docs/pd-gpu.md); here each program moves one
BLOCK-word tile of one (layer, block) row with wide contiguous loads and stores.

Legend: L layers of a region, N blocks in the pool, n blocks moved, W words a block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve_kernels._launch import cdiv

BLOCK = 2048  # words a program: 16 KiB of int64


@triton.jit
def _copy_rows_kernel(src_ptr, dst_ptr, ids_ptr, n, N, W, SCATTER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # l * n + j
    layer = row // n
    j = row % n
    block = tl.load(ids_ptr + j).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < W
    pool_row = (layer.to(tl.int64) * N + block) * W
    slab_row = row.to(tl.int64) * W
    if SCATTER:
        tl.store(dst_ptr + pool_row + offs, tl.load(src_ptr + slab_row + offs, mask=mask), mask=mask)
    else:
        tl.store(dst_ptr + slab_row + offs, tl.load(src_ptr + pool_row + offs, mask=mask), mask=mask)


def _check(pool: torch.Tensor, slab: torch.Tensor, ids: torch.Tensor) -> None:
    if pool.dim() != 3 or slab.dim() != 3 or pool.dtype != slab.dtype or pool.shape[0] != slab.shape[0] or pool.shape[2] != slab.shape[2]:
        raise ValueError(f"block copy: pool {tuple(pool.shape)} {pool.dtype} and slab {tuple(slab.shape)} {slab.dtype} must be [L, N, W] and [L, n, W] of one dtype")
    if not (pool.is_contiguous() and slab.is_contiguous()):
        raise ValueError("block copy: pool and slab must be contiguous")
    if ids.dim() != 1 or ids.numel() != slab.shape[1]:
        raise ValueError(f"block copy: {ids.numel()} block ids for a slab of {slab.shape[1]} blocks")


def _launch(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, pool: torch.Tensor, scatter: bool) -> None:
    L, N, W = pool.shape
    n = ids.numel()
    if L * n and W:
        _copy_rows_kernel[(L * n, cdiv(W, BLOCK))](src, dst, ids, n, N, W, SCATTER=scatter, BLOCK=BLOCK)


def gather_blocks(src: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
    """out [L, n, W] = src [L, N, W] at blocks ids [n] (int32 / int64, on src's device)."""
    _check(src, out, ids)
    _launch(src, out, ids, src, scatter=False)


def scatter_blocks(slab: torch.Tensor, ids: torch.Tensor, dst: torch.Tensor) -> None:
    """dst [L, N, W] at blocks ids [n] = slab [L, n, W]."""
    _check(dst, slab, ids)
    _launch(slab, dst, ids, dst, scatter=True)
