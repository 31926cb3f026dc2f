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

Per block (`pool_block_checksums`, `slab_block_checksums`): c[i] = sum over l of s[l, i] * (2 *
(l * n + i) + 1), so the checksum is the wrapping sum of the c[i] and that of any subset of the
blocks the sum of theirs. Prefill sends the token regions' c[i] too (KVHandle.block_checksums): a
decode worker that holds a prompt's first k blocks in its prefix cache reads only blocks k..n-1
and checks them against sum(c[k:]) (`pool_checksums` with `first`: the blocks are positions
first.. of the request's n).

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
from pdserve.model.kv_cache import TOKENS

# the torch path: ids in at most this many runs of consecutive blocks are summed in place, run by
# run (on the CPU always: no launch cost, and a gather there costs more than the sums); more runs on
# a GPU are gathered, at most CHUNK_BYTES at once (bounded scratch), and summed
MAX_RUNS = 16
CHUNK_BYTES = 64 << 20


def _weights(num_layers: int, n: int, device: torch.device) -> torch.Tensor:
    """Odd weights [Lr, n], one per (layer, block): 2 * (l * n + i) + 1."""
    return (torch.arange(num_layers * n, dtype=torch.int64, device=device) * 2 + 1).view(num_layers, n)


def _fold(words: torch.Tensor, weights: torch.Tensor, per_block: bool = False) -> torch.Tensor:
    """words [Lr, c, W] (any integer type), weights [Lr, c] -> the weighted sum, a 0-d int64
    (per_block: each block's, [c])."""
    terms = words.sum(-1, dtype=torch.int64) * weights
    return terms.sum(0) if per_block else terms.sum()


def wrap64(x: int) -> int:
    """x as the signed 64-bit number a wrapping int64 sum gives."""
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


def pool_checksums(
    regions: dict[str, torch.Tensor],
    layout: KVLayout,
    blocks: dict[str, list[int]],
    kernel: bool | None = None,
    first: dict[str, int] | None = None,
) -> dict[str, int]:
    """Each region's checksum over blocks[region] of every layer, read from the pool in place.
    kernel: the Triton kernel (default on a GPU), else the torch path (_torch_pool_sums).
    first: per region, the blocks are positions first.. of a request of first + len(blocks)
    blocks (default 0): the sum of that request's per-block checksums from position first on."""
    first = first or {}
    if any(first.values()):  # the blocks before first weigh nothing: -1 pads them
        blocks = {name: [-1] * first.get(name, 0) + ids for name, ids in blocks.items()}
    if _kernel(regions, layout, kernel):
        return _kernel_pool_checksums(regions, layout, blocks)
    return _to_host(layout, _torch_pool_sums(regions, layout, blocks))


def pool_block_checksums(
    regions: dict[str, torch.Tensor], layout: KVLayout, blocks: dict[str, list[int]], kernel: bool | None = None
) -> dict[str, list[int]]:
    """Each region's per-block checksums c[i] over blocks[region] (their wrapping sum is
    pool_checksums'); kernel as for pool_checksums."""
    if _kernel(regions, layout, kernel):
        return _kernel_pool_checksums(regions, layout, blocks, per_block=True)
    sums = _torch_pool_sums(regions, layout, blocks, per_block=True)
    return {r.name: s.tolist() for r, s in zip(layout.regions, sums)}


def totals(block_sums: dict[str, list[int]]) -> dict[str, int]:
    """Per region, the checksum of the blocks whose per-block checksums these are."""
    return {name: wrap64(sum(c)) for name, c in block_sums.items()}


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


def slab_block_checksums(
    slab: torch.Tensor, layout: KVLayout, counts: dict[str, int], kernel: bool | None = None
) -> dict[str, list[int]]:
    """slab_checksums per block, as pool_block_checksums."""
    parts, _ = slab_parts(layout, counts)
    use_kernel = slab.device.type == "cuda" if kernel is None else kernel
    out: dict[str, list[int]] = {}
    for r, part in zip(layout.regions, parts):
        if part.num_blocks == 0:
            out[r.name] = []
            continue
        words = _part_words(slab, part, r.num_layers, r.block_bytes)
        if use_kernel:
            acc = torch.zeros(part.num_blocks, dtype=torch.int64, device=slab.device)
            _checksum_blocks()(words, None, acc, per_block=True)
        else:
            acc = _fold(words, _weights(r.num_layers, part.num_blocks, slab.device), per_block=True)
        out[r.name] = acc.tolist()
    return out


def leased_checksums(
    regions: dict[str, torch.Tensor], layout: KVLayout, blocks: dict[str, list[int]], slab: torch.Tensor | None = None
) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Prefill: a leased request's checksums per region (KVHandle.checksums), and the token-space
    regions' per block (KVHandle.block_checksums); over its slab when it was gathered into one."""
    if slab is not None:
        per_block = slab_block_checksums(slab, layout, {k: len(v) for k, v in blocks.items()})
    else:
        per_block = pool_block_checksums(regions, layout, blocks)
    tokens = {r.name for r in layout.regions if r.space == TOKENS}
    return totals(per_block), {name: c for name, c in per_block.items() if name in tokens}


def expected_checksums(
    checksums: dict[str, int], block_checksums: dict[str, list[int]] | None, first: dict[str, int]
) -> dict[str, int]:
    """Decode: what a load's blocks must sum to, when each token region in `first` was read from
    that block on (the blocks before it are held here): the sum of its later blocks' checksums."""
    expected = dict(checksums)
    for name, k in first.items():
        expected[name] = wrap64(sum(block_checksums[name][k:]))
    return expected


def _kernel(regions: dict[str, torch.Tensor], layout: KVLayout, kernel: bool | None) -> bool:
    """Whether pool_checksums runs the kernel: as asked, else on a GPU (never with no regions)."""
    if not layout.regions:
        return False
    return regions[layout.regions[0].name].device.type == "cuda" if kernel is None else kernel


def _checksum_blocks():
    from pdserve_kernels.kv_checksum import checksum_blocks  # Triton: GPU installs (and the kernel tests)

    return checksum_blocks


def _kernel_pool_checksums(
    regions: dict[str, torch.Tensor], layout: KVLayout, blocks: dict[str, list[int]], per_block: bool = False
) -> dict[str, int] | dict[str, list[int]]:
    """One kernel launch per region with blocks. Every region's ids and zeroed accumulators (one
    per region, or per_block one per block) travel in one upload (from pinned memory on a GPU);
    one host sync reads the sums."""
    device = regions[layout.regions[0].name].device
    counts = [len(blocks.get(r.name, [])) for r in layout.regions]
    slots = counts if per_block else [1] * len(counts)
    host = [0] * sum(slots)  # [accumulators of each region | region 0's ids | region 1's ids | ...]
    for r in layout.regions:
        host += blocks.get(r.name, [])
    buf = torch.tensor(host, dtype=torch.int64, pin_memory=device.type == "cuda").to(device, non_blocking=True)
    checksum_blocks, acc, at = _checksum_blocks(), 0, sum(slots)
    for r, n, k in zip(layout.regions, counts, slots):
        if n:
            words = region_words(regions[r.name], r.block_bytes)
            checksum_blocks(words, buf[at : at + n], buf[acc : acc + k], per_block=per_block)
        at, acc = at + n, acc + k
    values = buf[: sum(slots)].tolist()
    out, acc = {}, 0
    for r, k in zip(layout.regions, slots):
        out[r.name] = values[acc : acc + k] if per_block else values[acc]
        acc += k
    return out


def _torch_pool_sums(
    regions: dict[str, torch.Tensor], layout: KVLayout, blocks: dict[str, list[int]], per_block: bool = False
) -> list[torch.Tensor]:
    """The torch path (the CPU's; on a GPU the benchmark's baseline): runs of consecutive ids
    summed in place (no copy), or, for ids in many runs on a GPU, gathered a chunk at a time.
    Ids < 0 (leading padding: pool_checksums' first) weigh nothing. per_block: [n] per region."""
    sums = []
    for r in layout.regions:
        ids = blocks.get(r.name, [])
        words = region_words(regions[r.name], r.block_bytes)  # [Lr, N, W]
        pad = next((i for i, b in enumerate(ids) if b >= 0), len(ids))  # leading -1s
        weights = _weights(r.num_layers, len(ids), words.device)[:, pad:]
        ids = ids[pad:]
        parts = [torch.zeros(pad, dtype=torch.int64, device=words.device)]
        runs = block_runs(ids, ids)
        if len(runs) <= MAX_RUNS or words.device.type != "cuda":
            at = 0
            for start, _, count in runs:
                parts.append(_fold(words[:, start : start + count], weights[:, at : at + count], True))
                at += count
        else:
            step = max(1, CHUNK_BYTES // (r.num_layers * r.block_bytes))
            for c0 in range(0, len(ids), step):
                chunk = torch.index_select(words, 1, _index(ids[c0 : c0 + step], words.device))
                parts.append(_fold(chunk, weights[:, c0 : c0 + step], True))
        per = torch.cat(parts)
        sums.append(per if per_block else per.sum())
    return sums


def _to_host(layout: KVLayout, sums: list[torch.Tensor]) -> dict[str, int]:
    """One host sync for every region's number."""
    values = torch.stack(sums).tolist() if sums else []
    return {r.name: v for r, v in zip(layout.regions, values)}


def mismatched(expected: dict[str, int], got: dict[str, int]) -> list[str]:
    """The regions whose checksums differ (a region missing on either side counts as differing)."""
    return sorted(name for name in expected.keys() | got.keys() if expected.get(name) != got.get(name))
