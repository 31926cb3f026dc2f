"""A region's KV checksum over a request's blocks, read in place: one launch, no gather.

    acc += sum over (l, i) of s[l, i] * (2 * (l * n + i) + 1)        (int64, wrapping mod 2^64)
    s[l, i] = sum over w of words[l, ids[i], w]                      (each word as an int64)

or, per block (`per_block`), acc[i] += sum over l of s[l, i] * (2 * (l * n + i) + 1): the terms of
block i alone, so the checksum of any subset of the blocks is the sum of theirs (a decode worker
that reads only the blocks after those it holds in its prefix cache checks just those).

the number pdserve/disagg/checksum.py defines (its docstring says why it catches every flipped
byte). words is a region `[L, N, W]` viewed as integer words (staging.region_words: the widest type
dividing a block) or a slab part (ids None: blocks 0..N-1); a word is widened as torch's
`sum(dtype=int64)` does (int16/int32 sign-extended, uint8 zero-extended), so the number is the
torch path's, bit for bit.

Grid (m, cdiv(W, BW), cdiv(L, LG)): a program reads BW words of one block in each of LG layers
(unrolled: the loads are in flight together), adds each word times its (layer, block)'s weight
into a [BW] vector, reduces it once and adds the total into acc with one atomic. Wrapping adds
commute and w * (a + b) = w * a + w * b mod 2^64, so weighting word by word, splitting a block
over programs and the order they finish in all leave the formula's number. No shared memory beyond
the one reduction's scratch.

Launching through Triton binds the arguments and asks CUDA about every tensor pointer each time;
the pools and slab parts repeat, so a CUDA launch after the first reuses the compiled kernel with
the pointers as integers (as block_copy.BoundCopy does), keyed by everything Triton specializes on.

Legend: L layers of the region, N blocks in the pool (or slab part), W words a block, m ids
(n of them real: -1 pads), BW words a program and layer, LG layers a program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve_kernels import configs
from pdserve_kernels._launch import capability, cdiv

INT_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)  # what staging.region_words gives


@triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["ids", "acc"])
def _checksum_kernel(
    words,
    ids,
    acc,
    n,
    s_layer,
    s_block,
    W,
    L,
    N,
    BW: tl.constexpr,
    LG: tl.constexpr,
    IDS: tl.constexpr,
    PER_BLOCK: tl.constexpr,
):
    i = tl.program_id(0)  # the block's position in the request: its weight
    if IDS:
        b = tl.load(ids + i).to(tl.int64)  # int64 addressing: a region can pass 2^31 words
    else:
        b = i.to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BW + tl.arange(0, BW)
    ok = (offs < W) & (b >= 0) & (b < N)  # -1 padding (and an id past the pool) adds nothing
    first = tl.program_id(2) * LG
    # weighted word by word, reduced once: no barrier between the layers' loads
    total = tl.zeros((BW,), dtype=tl.int64)
    for j in tl.static_range(LG):
        layer = (first + j).to(tl.int64)
        x = tl.load(words + layer * s_layer + b * s_block + offs, mask=ok & (layer < L), other=0)
        total += x.to(tl.int64) * (2 * (layer * n + i) + 1)
    tl.atomic_add(acc + i * PER_BLOCK, tl.sum(total, axis=0), sem="relaxed")


def _check(words: torch.Tensor, ids: torch.Tensor | None, acc: torch.Tensor, num_acc: int) -> None:
    if words.dim() != 3 or words.dtype not in INT_WORDS or words.stride(2) != 1:
        raise ValueError(
            f"checksum_blocks: words {tuple(words.shape)} {words.dtype}: [L, N, W] integer words, W contiguous"
        )
    if acc.dtype != torch.int64 or acc.numel() < num_acc or acc.device != words.device or acc.stride(0) != 1:
        raise ValueError(
            f"checksum_blocks: acc must be int64 [>= {num_acc}], contiguous, on {words.device}, "
            f"got {acc.dtype} {tuple(acc.shape)} on {acc.device}"
        )
    if ids is not None and (
        ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or ids.device != words.device
    ):
        raise ValueError(f"checksum_blocks: ids must be int32/int64 [m] on {words.device}")
    if ids is not None and ids.numel() > 1 and ids.stride(0) != 1:
        raise ValueError("checksum_blocks: ids must be contiguous")


_BOUND: dict[tuple, object] = {}  # specialization -> the compiled kernel (CUDA)


def checksum_blocks(
    words: torch.Tensor, ids: torch.Tensor | None, acc: torch.Tensor, n: int | None = None, per_block: bool = False
) -> None:
    """acc[0] += the checksum of blocks ids of every layer of words [L, N, W] (integer words, W
    contiguous); ids int32/int64 [m] on words' device, < 0 skipped (padding), or None for blocks
    0..N-1 (a slab part); n: the request's block count the weights use (default m). acc: int64 on
    the same device, zeroed by the caller; per_block: acc [>= m], acc[i] += block i's own terms.
    Queued on the current stream: no host sync."""
    L, N, W = words.shape
    m = N if ids is None else ids.numel()
    _check(words, ids, acc, m if per_block else 1)
    n = m if n is None else n
    if m == 0 or W == 0 or L == 0:
        return
    cfg = configs.checksum_config(capability(words.device))
    bw = max(16, cfg.block_bytes // words.element_size())
    grid = (m, cdiv(W, bw), cdiv(L, cfg.layer_group))
    ints = (n, words.stride(0), words.stride(1), W, L, N)
    consts = dict(BW=bw, LG=cfg.layer_group, IDS=ids is not None, PER_BLOCK=int(per_block))
    id_arg = acc if ids is None else ids  # not read without ids: any pointer will do
    if words.device.type != "cuda":
        _checksum_kernel[grid](words, id_arg, acc, *ints, **consts, num_warps=cfg.num_warps)
        return
    with torch.cuda.device(words.device):
        # what the compiled kernel was specialized on: the word and id types, the words pointer's
        # 16-byte alignment, the exact strides and sizes, the tile (not n, not the alignment of ids / acc)
        aligned = words.data_ptr() % 16 == 0
        key = (words.device.index, words.dtype, id_arg.dtype, aligned, *ints[1:], *consts.values(), cfg)
        kernel = _BOUND.get(key)
        if kernel is None:
            kernel = _checksum_kernel[grid](words, id_arg, acc, *ints, **consts, num_warps=cfg.num_warps)
            _BOUND[key] = kernel
        else:  # on the current stream of words' device (the runner asks the driver, as Triton's launch does)
            kernel[grid](words.data_ptr(), id_arg.data_ptr(), acc.data_ptr(), *ints, *consts.values())
