"""Staged KV transfer: a request's scattered blocks gathered into one contiguous slab, moved as one
descriptor, scattered into the other pool's blocks (TensorRT-LLM's cache transceiver does the same).

    prefill                                              decode
    on_prefill_finished: gather(kv, blocks) -> slab      start_load: landing slab, READ slab -> landing
      (one index_select per region into the staging        (1 descriptor instead of one per
       arena, registered with NIXL once at start-up)        (region, layer, run))
    lease holds the slab (and the blocks)                poll_loads: READ done -> scatter(landing, kv,
    release / expiry / abort: free the slab                blocks) -> free the landing slab

A slab is the request's regions one after another, each `[Lr, n, rpb, dim]` (its n needed blocks
of every layer, in sequence order: layout.region_blocks) starting on a SLAB_ALIGN boundary, so both
sides compute the same parts from the layout and the block counts alone. Bytes are moved as the
widest integer words that divide a block (the values' dtype does not matter: FP8 records are bytes).

Legend: Lr layers of a region, N blocks in the pool, n blocks of the request, rpb records per block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.disagg.layout import KVLayout

SLAB_ALIGN = 256  # bytes: every region part (and every slab) starts on this boundary
MIB = 1 << 20


def _align(n: int) -> int:
    return -(-n // SLAB_ALIGN) * SLAB_ALIGN


class ArenaAllocator:
    """First-fit offsets in [0, capacity), SLAB_ALIGN-aligned. Plain Python, no torch."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity > 0 else []  # (offset, size), sorted
        self._used: dict[int, int] = {}  # offset -> size

    def alloc(self, nbytes: int) -> int | None:
        """The offset of nbytes of room, None when no free range is large enough."""
        size = _align(max(nbytes, 1))
        for i, (off, room) in enumerate(self._free):
            if room >= size:
                self._free[i : i + 1] = [(off + size, room - size)] if room > size else []
                self._used[off] = size
                return off
        return None

    def free(self, offset: int) -> None:
        size = self._used.pop(offset)
        self._free.append((offset, size))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for off, room in self._free:  # coalesce neighbours
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + room)
            else:
                merged.append((off, room))
        self._free = merged

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    @property
    def num_slabs(self) -> int:
        return len(self._used)


@dataclass(frozen=True)
class SlabPart:
    region: str
    offset: int  # bytes from the slab's start
    num_blocks: int  # n: blocks of this region in the slab
    nbytes: int  # Lr * n * block_bytes


def slab_parts(layout: KVLayout, counts: dict[str, int]) -> tuple[list[SlabPart], int]:
    """(each region's part of a slab holding counts[region] blocks of it, the slab's bytes)."""
    parts, off = [], 0
    for r in layout.regions:
        n = counts.get(r.name, 0)
        nbytes = r.num_layers * n * r.block_bytes
        parts.append(SlabPart(r.name, off, n, nbytes))
        off += _align(nbytes)
    return parts, off


def payload_bytes(layout: KVLayout, blocks: dict[str, list[int]]) -> int:
    """The KV bytes of a slab holding these blocks (its parts without the alignment padding)."""
    return sum(p.nbytes for p in slab_parts(layout, {k: len(v) for k, v in blocks.items()})[0])


def _words(t: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """t's bytes as the widest integer type dividing a block (fewer, larger elements to copy)."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if block_bytes % size == 0 and (t.data_ptr() % size == 0):
            return t.view(torch.uint8).view(dtype)
    return t.view(torch.uint8)


def region_words(kv_region: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """A region [Lr, N, rpb, dim] as words [Lr, N, block words]."""
    lr, n = kv_region.shape[:2]
    return _words(kv_region.view(lr, n, -1), block_bytes)


def _part_words(slab: torch.Tensor, part: SlabPart, num_layers: int, block_bytes: int) -> torch.Tensor:
    """A slab part (slab: uint8 [slab bytes]) as words [Lr, n, block words]."""
    raw = slab[part.offset : part.offset + part.nbytes]
    return _words(raw, block_bytes).view(num_layers, part.num_blocks, -1)


def _index(ids: list[int], device: torch.device) -> torch.Tensor:
    t = torch.tensor(ids, dtype=torch.int64)
    if (
        device.type == "cuda"
    ):  # pinned (PyTorch's caching host allocator): an upload from pageable memory waits for itself
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def gather(
    regions: dict[str, torch.Tensor], layout: KVLayout, blocks: dict[str, list[int]], slab: torch.Tensor
) -> None:
    """Copy blocks[region] of every layer of each region into the slab (uint8 [slab bytes], from
    slab_parts of the same counts); one index_select per region. Queued on the current stream."""
    parts, _ = slab_parts(layout, {k: len(v) for k, v in blocks.items()})
    for r, part in zip(layout.regions, parts):
        if part.num_blocks == 0:
            continue
        src = region_words(regions[r.name], r.block_bytes)
        out = _part_words(slab, part, r.num_layers, r.block_bytes)
        torch.index_select(src, 1, _index(blocks[r.name], src.device), out=out)


def scatter(
    slab: torch.Tensor, layout: KVLayout, blocks: dict[str, list[int]], regions: dict[str, torch.Tensor]
) -> None:
    """The inverse of gather: the slab's parts into blocks[region] of every layer of each region."""
    parts, _ = slab_parts(layout, {k: len(v) for k, v in blocks.items()})
    for r, part in zip(layout.regions, parts):
        if part.num_blocks == 0:
            continue
        dst = region_words(regions[r.name], r.block_bytes)
        dst.index_copy_(1, _index(blocks[r.name], dst.device), _part_words(slab, part, r.num_layers, r.block_bytes))


def synchronize(t: torch.Tensor) -> None:
    """Wait for the work queued on t's device (a gathered slab must be whole before a peer reads it,
    a scattered one before its landing room is reused)."""
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


class StagingArena:
    """One registered byte buffer on the pool's device and its allocator."""

    def __init__(self, capacity_bytes: int, device: torch.device) -> None:
        self.buffer = torch.zeros(capacity_bytes, dtype=torch.uint8, device=device)
        self.allocator = ArenaAllocator(capacity_bytes)

    @property
    def addr(self) -> int:
        return self.buffer.data_ptr()

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_bytes

    def alloc(self, nbytes: int) -> int | None:
        return self.allocator.alloc(nbytes)

    def free(self, offset: int) -> None:
        self.allocator.free(offset)

    def slab(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buffer[offset : offset + nbytes]
