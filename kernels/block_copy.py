"""Copy a request's KV blocks from one pool region to another in one launch, one pass.

    dst[l, dst_ids[i], :] = src[l, src_ids[i], :]    for every layer l and pair i

src and dst are one region each, `[L, N, W]` words (W words a block: staging.py views a block's
bytes as the widest integer type that divides it); their N may differ and src may be another
process's pool mapped through CUDA IPC (disagg/cuda_ipc.py). The library alternative,
`index_select` then `index_copy_`, reads and writes the bytes twice through a request-sized
temporary; a run-by-run `copy_` launches once per (run), 61-128 launches for an 8K-token V3
request. Grid (n, cdiv(W, BW), cdiv(L, LG)): a program moves BW words of one block in LG layers,
so it reads its two ids once - and they may sit in pinned host memory (the same-host copy writes
them there instead of uploading them: one CUDA call less to post a copy). No shared memory, so one
config serves sm_90 and sm_120.

Posting a copy is most of a small one's time (H200: ~0.1 ms warm against 0.05 ms to copy 64 MiB),
so with an explicit `stream` a launch after the first goes straight to the compiled kernel,
skipping Triton's argument binding (33 -> 20 us) and the stream switch (14 us).

Legend: L layers of the region, N blocks of a pool, n blocks copied, W words a block, BW words a
program, LG layers a program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve_kernels._launch import cdiv

BLOCK_WORDS = 512  # per program and layer: 4 KiB of int64 words
LAYER_GROUP = 8  # layers a program copies
NUM_WARPS = 4


@triton.jit(do_not_specialize=["n"])
def _copy_blocks_kernel(src, dst, src_ids, dst_ids, n, s_layer, s_block, d_layer, d_block, W, L, BW: tl.constexpr, LG: tl.constexpr):
    i = tl.program_id(0)
    s = tl.load(src_ids + i).to(tl.int64)  # int64 addressing: a region can pass 2^31 words
    d = tl.load(dst_ids + i).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BW + tl.arange(0, BW)
    ok = offs < W
    first = tl.program_id(2) * LG
    for j in tl.static_range(LG):
        layer = (first + j).to(tl.int64)
        m = ok & (layer < L)
        x = tl.load(src + layer * s_layer + s * s_block + offs, mask=m)
        tl.store(dst + layer * d_layer + d * d_block + offs, x, mask=m)


def _spec(v: int) -> tuple[bool, bool, bool]:
    """What Triton specializes an int argument on: == 1, divisible by 16, fits in int32."""
    return v == 1, v % 16 == 0, -(2**31) <= v < 2**31


_COMPILED: dict[tuple, object] = {}  # specialization -> Triton's compiled kernel (explicit-stream launches)


def copy_blocks(
    src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor, stream: torch.cuda.Stream | None = None
) -> None:
    """dst[:, dst_ids] = src[:, src_ids] for src [L, Ns, W], dst [L, Nd, W] (same dtype, blocks
    contiguous); ids int32/int64 [n], on the device or in pinned host memory. Queued on `stream`
    (default: the current one)."""
    L, _, W = src.shape
    n = src_ids.numel()
    if dst.shape[0] != L or dst.shape[2] != W or dst.dtype != src.dtype or dst_ids.numel() != n:
        raise ValueError(f"copy_blocks: src {tuple(src.shape)} {src.dtype}, dst {tuple(dst.shape)} {dst.dtype}, {n} / {dst_ids.numel()} ids")
    if src.stride(2) != 1 or dst.stride(2) != 1:
        raise ValueError("copy_blocks: a block's words must be contiguous")
    if n == 0 or W == 0:
        return
    grid = (n, cdiv(W, BLOCK_WORDS), cdiv(L, LAYER_GROUP))
    args = (src, dst, src_ids, dst_ids, n, src.stride(0), src.stride(1), dst.stride(0), dst.stride(1), W, L)
    if stream is None or not src.is_cuda:
        _copy_blocks_kernel[grid](*args, BW=BLOCK_WORDS, LG=LAYER_GROUP, num_warps=NUM_WARPS)
        return
    # the key holds everything the compiled kernel was specialized on: the device, dtypes, each
    # pointer's 16-byte alignment, each int's _spec (n: only its width), the constants
    ptrs = (src, dst, src_ids, dst_ids)
    key = (src.device.index, src.dtype, src_ids.dtype, dst_ids.dtype, BLOCK_WORDS, LAYER_GROUP, NUM_WARPS, n < 2**31,
           *(t.data_ptr() % 16 == 0 for t in ptrs), *(_spec(v) for v in args[5:]))  # fmt: skip
    kernel = _COMPILED.get(key)
    if kernel is None:  # the first launch of this specialization: through Triton's binder, which compiles it
        with torch.cuda.stream(stream):
            _COMPILED[key] = _copy_blocks_kernel[grid](*args, BW=BLOCK_WORDS, LG=LAYER_GROUP, num_warps=NUM_WARPS)
        return
    kernel[grid](*args, BLOCK_WORDS, LAYER_GROUP, stream=stream.cuda_stream)
