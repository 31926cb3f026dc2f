"""KV checksums: prefill sums a request's blocks per region when it leases them (the numbers travel
in the KVHandle), decode sums the blocks it wrote once a load has landed and compares.

Per region, over the request's n needed blocks of each of its Lr layers (layout.region_blocks):

    s[l, i]  = sum of block i's words in layer l           (int64 words, wrapping)
    checksum = sum over (l, i) of s[l, i] * (2 * (l * n + i) + 1)   (wrapping, mod 2^64)

A flipped byte changes one word by d != 0 (mod 2^64), so s[l, i] changes by d and the checksum by
d * w for an odd w: odd numbers are invertible mod 2^64, so d * w != 0 and the flip is always
caught (any number of changes within one word, too). Two blocks swapped (or a block read into the
wrong place, or from the wrong layer) change the checksum by (w_a - w_b) * (s_a - s_b): caught
unless the two blocks' word sums agree modulo 2^(63 - a few bits), which random-looking KV never
does by chance. Words swapped inside one block are not caught (no transfer moves less than a
block's run). Regions are checked separately, so a region's blocks read into another are caught.

Cost: one read of the request's bytes where they lie, no copy, and one host sync for the few
numbers. On a GPU, one Triton launch per region (pdserve_kernels/kv_checksum.py: each program sums
a chunk of one block in a few layers and adds its weighted sum into the region's accumulator with
an atomic), however many runs the ids fall in, after one upload of every region's ids and zeroed
accumulators. On the CPU, torch sums run by run of consecutive blocks (no launch cost there).
benchmarks/transfer/bench_verify.py times both paths against a device copy and a network READ.

Legend: Lr layers of a region, N blocks in the pool, n blocks of the request, W words per block.
"""

from __future__ import annotations

import torch

from pdserve.disagg.layout import KVLayout, block_runs
from pdserve.disagg.staging import _index, _part_words, region_words, slab_parts

# the torch path: ids in at most this many runs of consecutive blocks are summed in place, run by
# run (on the CPU always: no launch cost, and a gather there costs more than the sums); more runs on
# a GPU are gathered, at most CHUNK_BYTES at once (bounded scratch), and summed
MAX_RUNS = 16
CHUNK_BYTES = 64 << 20


def _weights(num_layers: int, n: int, device: torch.device) -> torch.Tensor:
    """Odd weights [Lr, n], one per (layer, block): 2 * (l * n + i) + 1."""
    return (torch.arange(num_layers * n, dtype=torch.int64, device=device) * 2 + 1).view(num_layers, n)


def _fold(words: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """words [Lr, c, W] (any integer type), weights [Lr, c] -> the weighted sum, a 0-d int64."""
    return (words.sum(-1, dtype=torch.int64) * weights).sum()


def pool_checksums(
    regions: dict[str, torch.Tensor], layout: KVLayout, blocks: dict[str, list[int]], kernel: bool | None = None
) -> dict[str, int]:
    """Each region's checksum over blocks[region] of every layer, read from the pool in place.
    kernel: the Triton kernel (default on a GPU), else the torch path (_torch_pool_sums)."""
    if _kernel(regions, layout, kernel):
        return _kernel_pool_checksums(regions, layout, blocks)
    return _to_host(layout, _torch_pool_sums(regions, layout, blocks))


def slab_checksums(
    slab: torch.Tensor, layout: KVLayout, counts: dict[str, int], kernel: bool | None = None
) -> dict[str, int]:
    """The same checksums over a gathered slab (staging.gather of blocks with these counts per
    region); kernel as for pool_checksums."""
    parts, _ = slab_parts(layout, counts)
    use_kernel = slab.device.type == "cuda" if kernel is None else kernel
    if use_kernel:
        acc = torch.zeros(len(parts), dtype=torch.int64, device=slab.device)
        for k, (r, part) in enumerate(zip(layout.regions, parts)):
            if part.num_blocks:
                _checksum_blocks()(_part_words(slab, part, r.num_layers, r.block_bytes), None, acc[k : k + 1])
        return {r.name: v for r, v in zip(layout.regions, acc.tolist())}
    sums = []
    for r, part in zip(layout.regions, parts):
        if part.num_blocks == 0:
            sums.append(torch.zeros((), dtype=torch.int64, device=slab.device))
            continue
        words = _part_words(slab, part, r.num_layers, r.block_bytes)
        sums.append(_fold(words, _weights(r.num_layers, part.num_blocks, slab.device)))
    return _to_host(layout, sums)


def _kernel(regions: dict[str, torch.Tensor], layout: KVLayout, kernel: bool | None) -> bool:
    """Whether pool_checksums runs the kernel: as asked, else on a GPU (never with no regions)."""
    if not layout.regions:
        return False
    return regions[layout.regions[0].name].device.type == "cuda" if kernel is None else kernel


def _checksum_blocks():
    from pdserve_kernels.kv_checksum import checksum_blocks  # Triton: GPU installs (and the kernel tests)

    return checksum_blocks


def _kernel_pool_checksums(
    regions: dict[str, torch.Tensor], layout: KVLayout, blocks: dict[str, list[int]]
) -> dict[str, int]:
    """One kernel launch per region with blocks. Every region's ids and a zeroed accumulator per
    region travel in one upload (from pinned memory on a GPU); one host sync reads the sums."""
    device = regions[layout.regions[0].name].device
    num = len(layout.regions)
    host = [0] * num  # [R accumulators | region 0's ids | region 1's ids | ...]
    for r in layout.regions:
        host += blocks.get(r.name, [])
    buf = torch.tensor(host, dtype=torch.int64, pin_memory=device.type == "cuda").to(device, non_blocking=True)
    checksum_blocks, at = _checksum_blocks(), num
    for k, r in enumerate(layout.regions):
        n = len(blocks.get(r.name, []))
        if n:
            checksum_blocks(region_words(regions[r.name], r.block_bytes), buf[at : at + n], buf[k : k + 1])
        at += n
    return {r.name: v for r, v in zip(layout.regions, buf[:num].tolist())}


def _torch_pool_sums(
    regions: dict[str, torch.Tensor], layout: KVLayout, blocks: dict[str, list[int]]
) -> list[torch.Tensor]:
    """The torch path (the CPU's; on a GPU the benchmark's baseline): runs of consecutive ids
    summed in place (no copy), or, for ids in many runs on a GPU, gathered a chunk at a time."""
    sums = []
    for r in layout.regions:
        ids = blocks.get(r.name, [])
        words = region_words(regions[r.name], r.block_bytes)  # [Lr, N, W]
        total = torch.zeros((), dtype=torch.int64, device=words.device)
        if ids:
            weights = _weights(r.num_layers, len(ids), words.device)
            runs = block_runs(ids, ids)
            if len(runs) <= MAX_RUNS or words.device.type != "cuda":
                at = 0
                for start, _, count in runs:
                    total += _fold(words[:, start : start + count], weights[:, at : at + count])
                    at += count
            else:
                step = max(1, CHUNK_BYTES // (r.num_layers * r.block_bytes))
                for c0 in range(0, len(ids), step):
                    chunk = torch.index_select(words, 1, _index(ids[c0 : c0 + step], words.device))
                    total += _fold(chunk, weights[:, c0 : c0 + step])
        sums.append(total)
    return sums


def _to_host(layout: KVLayout, sums: list[torch.Tensor]) -> dict[str, int]:
    """One host sync for every region's number."""
    values = torch.stack(sums).tolist() if sums else []
    return {r.name: v for r, v in zip(layout.regions, values)}


def mismatched(expected: dict[str, int], got: dict[str, int]) -> list[str]:
    """The regions whose checksums differ (a region missing on either side counts as differing)."""
    return sorted(name for name in expected.keys() | got.keys() if expected.get(name) != got.get(name))
