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

Posting a copy is most of a small one's time, and a post often comes right after the host slept,
when every host step takes several times as long (docs/pd-gpu.md). So a BoundCopy does the checks, the compile and the argument
binding once for a (src, dst) pair and a stream, and each launch after is the compiled kernel's
own, its id arrays passed as integer addresses: no Triton argument binding, no per-pointer driver
query (Triton asks CUDA about every tensor pointer at each launch).

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
def _copy_blocks_kernel(
    src, dst, src_ids, dst_ids, n, s_layer, s_block, d_layer, d_block, W, L, BW: tl.constexpr, LG: tl.constexpr
):
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


def _check(src: torch.Tensor, dst: torch.Tensor) -> None:
    if (
        src.dim() != 3
        or dst.dim() != 3
        or dst.shape[0] != src.shape[0]
        or dst.shape[2] != src.shape[2]
        or dst.dtype != src.dtype
    ):
        raise ValueError(f"copy_blocks: src {tuple(src.shape)} {src.dtype}, dst {tuple(dst.shape)} {dst.dtype}")
    if src.stride(2) != 1 or dst.stride(2) != 1:
        raise ValueError("copy_blocks: a block's words must be contiguous")


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """dst[:, dst_ids] = src[:, src_ids] for src [L, Ns, W], dst [L, Nd, W] (same dtype, blocks
    contiguous); ids int32/int64 [n], on the device or in pinned host memory. Queued on the
    current stream."""
    _check(src, dst)
    L, _, W = src.shape
    n = src_ids.numel()
    if dst_ids.numel() != n:
        raise ValueError(f"copy_blocks: {n} source ids but {dst_ids.numel()} destination ids")
    if n == 0 or W == 0:
        return
    grid = (n, cdiv(W, BLOCK_WORDS), cdiv(L, LAYER_GROUP))
    _copy_blocks_kernel[grid](src, dst, src_ids, dst_ids, n, src.stride(0), src.stride(1), dst.stride(0), dst.stride(1), W, L,
                              BW=BLOCK_WORDS, LG=LAYER_GROUP, num_warps=NUM_WARPS)  # fmt: skip


class BoundCopy:
    """copy_blocks for one (src, dst) pair of CUDA tensors on one stream, checked and compiled once
    (at the module's tile as it is then). A call takes int64 id arrays by address: 16-byte aligned,
    readable by the kernel (device memory, or pinned host memory at its device address:
    pdserve/disagg/cuda_ipc.py, device_address)."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, stream: torch.cuda.Stream) -> None:
        _check(src, dst)
        L, _, W = src.shape
        ids = torch.zeros(
            2, dtype=torch.int64, device=src.device
        )  # aligned int64 ids: the specialization every call uses
        rest = (src.stride(0), src.stride(1), dst.stride(0), dst.stride(1), W, L)
        kernel = _copy_blocks_kernel.warmup(
            src, dst, ids, ids, 2, *rest, BW=BLOCK_WORDS, LG=LAYER_GROUP, num_warps=NUM_WARPS, grid=(1,)
        )
        self._kernel = (
            kernel.result() if hasattr(kernel, "result") else kernel
        )  # (a future where Triton compiles in the background)
        self._src, self._dst, self._rest = src.data_ptr(), dst.data_ptr(), (*rest, BLOCK_WORDS, LAYER_GROUP)
        self._grid_yz = (cdiv(W, BLOCK_WORDS), cdiv(L, LAYER_GROUP))
        self._stream = stream.cuda_stream
        self._tensors = (src, dst)  # the addresses stay valid while this lives

    def __call__(self, src_ids: int, dst_ids: int, n: int) -> None:
        """Queue the copy of n blocks; src_ids / dst_ids: addresses of n int64 ids each."""
        if (src_ids | dst_ids) & 15:
            raise ValueError("BoundCopy: id arrays must start 16-byte aligned (the kernel was compiled for that)")
        if n > 0 and self._grid_yz[0] > 0:
            self._kernel[(n, *self._grid_yz)](
                self._src, self._dst, src_ids, dst_ids, n, *self._rest, stream=self._stream
            )
