"""What a worker's KV pool looks like from outside, and the byte ranges a request's blocks occupy.

The pool (pdserve.model.kv_cache.KVCache) is a few layer-major regions, each one tensor
`[Lr, N, rpb, dim]` over the Lr model layers it serves (`layers`), all paged by the same token
blocks. What a block holds is the region's spec, not the model type: `records_per_block` records
of `record_bytes` each, a record covering `tokens_per_record` tokens (1: per token; m: one
compressed entry per m tokens; 0: one record per sequence, a compressor's running state). Block b
of region layer l is the contiguous byte range

    base + (l * N + b) * block_bytes,   block_bytes = rpb * record_bytes

so a request's transfer is one descriptor per (region, layer, run of consecutive block ids), over
the blocks of the request that a later step reads in that region (`needed_blocks`: every block;
the state record; the blocks of the last `last_tokens` positions for a window). Each region is
paged by one of the pool's block spaces (`space`, model/kv_cache.py): TOKENS (the sequence's
block table), WINDOW (`last_tokens` set: its window table, blocks behind the window freed) or
STATE (one record per sequence: its state slot); N is that space's size (block_manager.py).
Runs are merged only where both sides are consecutive: prefill blocks [4, 5, 6] read into decode
blocks [9, 10, 11] are one descriptor per layer, into [9, 11, 12] they are two.

Legend: Lr layers of a region, N blocks in the pool, bs tokens per block, rpb records per block.
"""

from __future__ import annotations

import hashlib
import json

import torch
from pydantic import BaseModel, ConfigDict, field_validator

from pdserve.model.kv_cache import BYTE_RECORDS, STATE, TOKENS, WINDOW, KVCache

KV_LAYOUT_VERSION = 3

# (address, length in bytes, device id): NIXL's transfer descriptor
Descriptor = tuple[int, int, int]


class KVRegionLayout(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    num_layers: int  # Lr: len(layers)
    layers: list[int]  # the model layers this region serves, in region-row order
    num_blocks: int
    block_size: int  # tokens per block
    tokens_per_record: int  # 1: per token, m: per m tokens (compressed), 0: one record per block
    records_per_block: int
    dim: int  # values per record
    dtype: str  # torch dtype name of the values, e.g. "bfloat16"
    record_bytes: int  # bytes of one record
    record: str = "values"  # its format: dim values of dtype, or a named byte format (BYTE_RECORDS:
    # "fp8_ds_mla", "fp8_ds_v4"); part of the compat hash, so pools of different records refuse each other
    last_tokens: int | None = None  # only the last this many positions' records are read (sliding window)
    bytes: int  # whole region: Lr * N * rpb * record_bytes

    @field_validator("record")
    @classmethod
    def _known_record(cls, v: str) -> str:
        if v != "values" and v not in BYTE_RECORDS:
            raise ValueError(
                f"unknown KV record format {v!r} (values, {', '.join(BYTE_RECORDS)}): a peer on another pdserve version?"
            )
        return v

    @property
    def space(self) -> str:
        """The block space paging this region (as KVRegionSpec.space)."""
        if self.tokens_per_record == 0:
            return STATE
        return WINDOW if self.last_tokens is not None else TOKENS

    def needed_blocks(self, num_blocks: int, num_tokens: int) -> range:
        """Indices into a sequence's block list (num_blocks blocks, num_tokens tokens) whose
        records of this region a later step of the sequence reads (STATE: its one record)."""
        if self.space == STATE:
            return range(min(1, num_blocks))
        if self.last_tokens is not None:
            return range(min(num_blocks, max(0, num_tokens - self.last_tokens) // self.block_size), num_blocks)
        return range(num_blocks)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one layer (the unit a descriptor covers a whole number of)."""
        return self.bytes // (self.num_layers * self.num_blocks)


class KVLayout(BaseModel):
    """The pool's regions in registration order. Crosses processes inside the peer info."""

    model_config = ConfigDict(frozen=True)

    version: int = KV_LAYOUT_VERSION
    regions: list[KVRegionLayout]

    @classmethod
    def from_kv_cache(cls, kv: KVCache) -> KVLayout:
        regions = []
        for name, t in kv.regions.items():
            num_layers, num_blocks, rpb, dim = t.shape
            spec = kv.specs[name]
            regions.append(
                KVRegionLayout(
                    name=name,
                    num_layers=num_layers,
                    layers=list(spec.layer_ids(kv.num_layers)),
                    num_blocks=num_blocks,
                    block_size=kv.block_size,
                    tokens_per_record=spec.tokens_per_record,
                    records_per_block=rpb,
                    dim=dim,
                    dtype=str(t.dtype).removeprefix("torch."),
                    record_bytes=dim * t.element_size(),
                    record=spec.record,
                    last_tokens=spec.last_tokens,
                    bytes=t.numel() * t.element_size(),
                )
            )
        return cls(regions=regions)

    def _size(self, space: str) -> int:
        return next((r.num_blocks for r in self.regions if r.space == space), 0)

    @property
    def num_blocks(self) -> int:
        """Blocks of the token space."""
        return self._size(TOKENS)

    @property
    def num_window_blocks(self) -> int:
        """Blocks of the window space (0: none)."""
        return self._size(WINDOW)

    @property
    def num_state_slots(self) -> int:
        """Slots of the state space (0: none)."""
        return self._size(STATE)

    def request_bytes(self, num_tokens: int) -> dict[str, int]:
        """Bytes a transfer of a num_tokens-token request moves, per region."""
        nb = -(-num_tokens // self.regions[0].block_size) if self.regions else 0
        return {r.name: len(r.needed_blocks(nb, num_tokens)) * r.block_bytes * r.num_layers for r in self.regions}

    def record_signature(self) -> list[dict]:
        """What two workers must share to exchange blocks: everything but the pool size."""
        return [r.model_dump(exclude={"num_blocks", "bytes"}) for r in self.regions]


def compat_hash(model_id: str, dtype: torch.dtype | str, layout: KVLayout, block_size: int, version: str) -> str:
    """sha256 hex over what makes one worker's KV blocks readable by another.

    The pool size (num_blocks) is left out: prefill and decode pools may differ in size."""
    doc = {
        "model_id": model_id,
        "dtype": str(dtype).removeprefix("torch."),
        "layout_version": layout.version,
        "layout": layout.record_signature(),
        "block_size": block_size,
        "pdserve_version": version,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def block_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """Pair src_ids[i] -> dst_ids[i] and merge runs consecutive on both sides.

    Returns (src_start, dst_start, count) triples, in order."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


Runs = dict[str, list[tuple[int, int, int]]]  # region name -> (src_start, dst_start, count) runs


def region_runs(src: dict[str, list[int]], dst: dict[str, list[int]]) -> Runs:
    """block_runs of each region's source and destination blocks (region_blocks of both sides)."""
    return {name: block_runs(src[name], dst[name]) for name in src}


def region_blocks(
    layout: KVLayout,
    block_ids: list[int],
    num_tokens: int,
    window: list[int] | None = None,
    state_slot: int = -1,
    side: str = "prefill",
) -> dict[str, list[int]]:
    """One side's block ids, per region, of the blocks a later step reads there (needed_blocks), in
    sequence order: token regions from block_ids, window regions from that side's window table at
    the same indices, state regions its state slot. What a staged slab holds (staging.py)."""
    out = {}
    for r in layout.regions:
        idx = r.needed_blocks(len(block_ids), num_tokens)
        if r.space == TOKENS:
            out[r.name] = [block_ids[i] for i in idx]
        elif r.space == WINDOW:
            out[r.name] = [_window_id(window, i, side) for i in idx]
        elif len(idx):
            if state_slot < 0:
                raise ValueError(f"region {r.name!r} holds per-sequence state but {side} has no state slot")
            out[r.name] = [state_slot]
        else:
            out[r.name] = []
    return out


def skip_reused(
    layout: KVLayout, num_reused: int, src: dict[str, list[int]], dst: dict[str, list[int]]
) -> dict[str, int]:
    """Drop the first num_reused blocks of each token-space region from both sides' region_blocks:
    the decode pool holds them already (its prefix cache). Returns, per token region, how many were
    dropped (empty when none)."""
    if num_reused == 0:
        return {}
    first = {}
    for r in layout.regions:
        if r.space != TOKENS:
            continue
        if not 0 < num_reused <= len(dst[r.name]):
            raise ValueError(f"{num_reused} reused blocks of a request of {len(dst[r.name])}")
        src[r.name], dst[r.name] = src[r.name][num_reused:], dst[r.name][num_reused:]
        first[r.name] = num_reused
    return first


def _window_id(table: list[int] | None, i: int, side: str) -> int:
    if table is None or i >= len(table) or table[i] < 0:
        raise ValueError(f"{side} has no window block for token block {i}, which holds positions a later step reads")
    return table[i]


def check_block_ids(block_ids: list[int], num_blocks: int, side: str) -> None:
    if not block_ids or (min(block_ids) >= 0 and max(block_ids) < num_blocks):  # in C: this runs before every load
        return
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"{side} block ids {bad[:8]} out of range for a pool of {num_blocks} blocks")


def check_load_ids(layout: KVLayout, ids: tuple[list[int], list[int], int], side: str) -> None:
    """One side's (block ids, window block ids (-1: none), state slot (-1: none)) of a load, in
    range of that side's pool; ValueError names the first out of range."""
    blocks, window, state = ids
    check_block_ids(blocks, layout.num_blocks, side)
    check_block_ids([b for b in window if b >= 0], layout.num_window_blocks, f"{side} window")
    check_block_ids([state] if state >= 0 else [], layout.num_state_slots, f"{side} state")


def build_descriptors(
    layout: KVLayout, base_addrs: dict[str, int], dev_id: int, runs: Runs | list[tuple[int, int, int]], side: int
) -> list[Descriptor]:
    """One descriptor per (region, layer, run), in that order, for one side of a transfer.

    runs: per region (block_runs of both sides' region_blocks), or one list for every region. side: 0 for the run's source
    block ids (the prefill pool), 1 for its destination (decode). Both sides built from the same
    runs have equal lengths entry by entry."""
    descs: list[Descriptor] = []
    for r in layout.regions:
        base, bb = base_addrs[r.name], r.block_bytes
        mine = runs[r.name] if isinstance(runs, dict) else runs
        for layer in range(r.num_layers):
            layer_base = base + layer * r.num_blocks * bb
            for run in mine:
                descs.append((layer_base + run[side] * bb, run[2] * bb, dev_id))
    return descs


def region_addrs(kv: KVCache) -> dict[str, int]:
    """Base address of each region's tensor (they are contiguous: KVCache allocates them whole)."""
    for name, t in kv.regions.items():
        if not t.is_contiguous():
            raise ValueError(f"KV region {name!r} is not contiguous; it cannot be registered as one range")
    return {name: t.data_ptr() for name, t in kv.regions.items()}


def device_id(kv: KVCache) -> int:
    """NIXL's device id: the CUDA index for VRAM, 0 for host memory."""
    t = next(iter(kv.regions.values()))
    return max(t.get_device(), 0)
