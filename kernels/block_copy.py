"""Copy a request's KV blocks from one pool region to another in one launch, one pass.

    dst[l, dst_ids[i], :] = src[l, src_ids[i], :]    for every layer l and pair i

src and dst are one region each, `[L, N, W]` words (W words a block: staging.py views a block's
bytes as the widest integer type that divides it); their N may differ and src may be another
process's pool mapped through CUDA IPC (disagg/cuda_ipc.py). The library alternative,
`index_select` then `index_copy_`, reads and writes the bytes twice through a request-sized
temporary; a run-by-run `copy_` launches once per (run), 61-128 launches for an 8K-token V3
request. Grid (L * n, cdiv(W, BW)): a program moves BW words of one block of one layer.
No shared memory, so one config serves sm_90 and sm_120.

Legend: L layers of the region, N blocks of a pool, n blocks copied, W words a block, BW words a program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve_kernels._launch import cdiv

BLOCK_WORDS = 512  # per program: 4 KiB of int64 words (H200: 1.07x a contiguous copy; 1024-4096: 1.10-1.13x)
NUM_WARPS = 4


@triton.jit
def _copy_blocks_kernel(src, dst, src_ids, dst_ids, n, s_layer, s_block, d_layer, d_block, W, BW: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # int64 addressing: a region can pass 2^31 words
    layer, i = pid // n, pid % n
    s = tl.load(src_ids + i).to(tl.int64)
    d = tl.load(dst_ids + i).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BW + tl.arange(0, BW)
    ok = offs < W
    x = tl.load(src + layer * s_layer + s * s_block + offs, mask=ok)
    tl.store(dst + layer * d_layer + d * d_block + offs, x, mask=ok)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """dst[:, dst_ids] = src[:, src_ids] for src [L, Ns, W], dst [L, Nd, W] (same dtype, blocks
    contiguous), ids int32/int64 [n] on the device; queued on the current stream."""
    L, _, W = src.shape
    n = src_ids.numel()
    if dst.shape[0] != L or dst.shape[2] != W or dst.dtype != src.dtype or dst_ids.numel() != n:
        raise ValueError(f"copy_blocks: src {tuple(src.shape)} {src.dtype}, dst {tuple(dst.shape)} {dst.dtype}, {n} / {dst_ids.numel()} ids")
    if src.stride(2) != 1 or dst.stride(2) != 1:
        raise ValueError("copy_blocks: a block's words must be contiguous")
    if n == 0 or W == 0:
        return
    grid = (L * n, cdiv(W, BLOCK_WORDS))
    _copy_blocks_kernel[grid](
        src, dst, src_ids, dst_ids, n, src.stride(0), src.stride(1), dst.stride(0), dst.stride(1), W,
        BW=BLOCK_WORDS, num_warps=NUM_WARPS,
    )  # fmt: skip
