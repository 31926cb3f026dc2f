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

Cost: one read of the request's bytes on the pool's device (a sum per run of consecutive blocks;
on a GPU, blocks in many runs are gathered first); one host sync for the few numbers.
benchmarks/transfer/bench_verify.py times it.

Legend: Lr layers of a region, N blocks in the pool, n blocks of the request, W words per block.
"""

from __future__ import annotations

import torch

from pdserve.disagg.layout import KVLayout, block_runs
from pdserve.disagg.staging import _index, _part_words, region_words, slab_parts

# ids in at most this many runs of consecutive blocks are summed in place, run by run (on the CPU
# always: no launch cost, and a gather there costs more than the sums); more runs on a GPU are
# gathered, at most CHUNK_BYTES at once (bounded scratch), and summed
MAX_RUNS = 16
CHUNK_BYTES = 64 << 20


def _weights(num_layers: int, n: int, device: torch.device) -> torch.Tensor:
    """Odd weights [Lr, n], one per (layer, block): 2 * (l * n + i) + 1."""
    return (torch.arange(num_layers * n, dtype=torch.int64, device=device) * 2 + 1).view(num_layers, n)


def _fold(words: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """words [Lr, c, W] (any integer type), weights [Lr, c] -> the weighted sum, a 0-d int64."""
    return (words.sum(-1, dtype=torch.int64) * weights).sum()


def pool_checksums(regions: dict[str, torch.Tensor], layout: KVLayout, blocks: dict[str, list[int]]) -> dict[str, int]:
    """Each region's checksum over blocks[region] of every layer, read from the pool: runs of
    consecutive ids summed in place (no copy), or, for ids in many runs on a GPU, gathered a chunk at a time."""
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
    return _to_host(layout, sums)


def slab_checksums(slab: torch.Tensor, layout: KVLayout, counts: dict[str, int]) -> dict[str, int]:
    """The same checksums over a gathered slab (staging.gather of blocks with these counts per region)."""
    parts, _ = slab_parts(layout, counts)
    sums = []
    for r, part in zip(layout.regions, parts):
        if part.num_blocks == 0:
            sums.append(torch.zeros((), dtype=torch.int64, device=slab.device))
            continue
        words = _part_words(slab, part, r.num_layers, r.block_bytes)
        sums.append(_fold(words, _weights(r.num_layers, part.num_blocks, slab.device)))
    return _to_host(layout, sums)


def _to_host(layout: KVLayout, sums: list[torch.Tensor]) -> dict[str, int]:
    """One host sync for every region's number."""
    values = torch.stack(sums).tolist() if sums else []
    return {r.name: v for r, v in zip(layout.regions, values)}


def mismatched(expected: dict[str, int], got: dict[str, int]) -> list[str]:
    """The regions whose checksums differ (a region missing on either side counts as differing)."""
    return sorted(name for name in expected.keys() | got.keys() if expected.get(name) != got.get(name))
