"""The paged KV pool of one worker.

Every region is paged by the same token blocks (the BlockManager's block ids): block b of a
sequence covers its positions [i * bs, (i + 1) * bs) when it is block_table[i]. A region is one
tensor `[Lr, num_blocks, records_per_block, dim]` (layer-major over the Lr model layers it serves),
so NIXL registers each once and block b of a layer is one contiguous byte range in every region.
What a block's records hold is the region's `KVRegionSpec`:

  tokens_per_record = 1   one record per token (records_per_block = bs); position p lives in
                          record p % bs of block block_table[p // bs]
  tokens_per_record = m   one record per m tokens (a compressor's entries, rate m: entry e pools
                          positions e*m .. e*m+m-1); entry e lives in the block holding position
                          e*m, record (e*m % bs) // m, so records_per_block = ceil(bs / m), and
                          m must divide bs or bs divide m
  tokens_per_record = 0   one record per sequence (PER_SEQUENCE): a compressor's running state.
                          Such a region is paged by the state space instead: `num_state_slots`
                          rows, one per sequence (its state_slot, engine/block_manager.py)
  last_tokens = K         (per-token regions) only the last K positions' records are ever read
                          again: a sliding window. Such a region is paged by the window block
                          space instead (its own `num_window_blocks` blocks, the sequence's
                          window_table, engine/block_manager.py): blocks that fall out of the
                          window are freed while the sequence runs, and a transfer moves only
                          the blocks holding the last K positions

Records: `dim` values of the pool dtype (`record` "values"), or a byte format of `dim` uint8
(`record` names it; `--kv-cache-dtype fp8`):
  DeepSeek-V3/V3.2: latent (kv_lora_rank + qk_rope_head_dim = 576 values per token; with fp8 the
  656-byte "fp8_ds_mla" record of pdserve_kernels.kv_fp8: 512 e4m3 + 4 fp32 scales + 64 bf16
  rope) and, for V3.2, index_k (the DSA indexer key, index_head_dim values per token), every layer.
  DeepSeek-V4: see deepseek_v4/cache.py (window, compressed entries, indexer keys, compressor
  state); with fp8 its K = V records (window, compressed entries) are "fp8_ds_v4" (kv_fp8.py, FlashMLA's V4
  layout: 584 bytes a token for V4-Flash), a format by pages: a block is one page whose records'
  values come first and their scales after them, so such a region is read by `layer_pages`
  (record r of block b is slot b * records_per_block + r, as `slots` numbers them), never by row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PER_SEQUENCE = 0  # tokens_per_record of a region with one record per sequence (the state space)
# byte record formats (`KVRegionSpec.record`, kernels/kv_fp8.py) -> how a block holds its records:
# "rows" (record r is bytes [r * dim, (r + 1) * dim) of the block) or "pages" (the block is one page)
BYTE_RECORDS = {"fp8_ds_mla": "rows", "fp8_ds_v4": "pages"}
TOKENS, WINDOW, STATE = "tokens", "window", "state"  # the block spaces a region can be paged by


@dataclass(frozen=True)
class KVRegionSpec:
    name: str
    dim: int  # values per record
    layers: tuple[int, ...] | None = None  # model layers with this region (None: all of them)
    tokens_per_record: int = 1  # 1: per token; m: per m tokens; PER_SEQUENCE (0): one per sequence
    last_tokens: int | None = None  # a later step reads only the records of the last this many tokens
    record: str = "values"  # "values": dim values of the pool dtype; else a byte format of dim uint8 (BYTE_RECORDS)

    def __post_init__(self) -> None:
        if self.record != "values" and self.record not in BYTE_RECORDS:
            raise ValueError(
                f"KV region {self.name!r}: unknown record format {self.record!r} (values, {', '.join(BYTE_RECORDS)})"
            )

    @property
    def byte_record(self) -> bool:
        return self.record != "values"

    @property
    def space(self) -> str:
        """The block space that pages this region: STATE (one record per sequence), WINDOW (only
        the last positions are kept) or TOKENS (the sequence's block table)."""
        if self.tokens_per_record == PER_SEQUENCE:
            return STATE
        return WINDOW if self.last_tokens is not None else TOKENS

    def layer_ids(self, num_layers: int) -> tuple[int, ...]:
        return tuple(range(num_layers)) if self.layers is None else self.layers

    def records_per_block(self, block_size: int) -> int:
        m = self.tokens_per_record
        if m == PER_SEQUENCE:
            return 1
        if m < 0 or (block_size % m and m % block_size):
            raise ValueError(
                f"KV region {self.name!r}: {m} tokens per record does not fit blocks of {block_size} tokens "
                "(one must divide the other: pick kv_block_size as a multiple or a divisor of every compress rate)"
            )
        return -(-block_size // m)


class KVCache:
    def __init__(
        self,
        specs: list[KVRegionSpec],
        num_layers: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_window_blocks: int = 0,
        num_state_slots: int = 0,
    ) -> None:
        """num_window_blocks: blocks of the window space (regions with last_tokens);
        num_state_slots: rows of the state space (PER_SEQUENCE regions), one per sequence."""
        self.specs = {s.name: s for s in specs}
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.num_window_blocks = num_window_blocks
        self.num_state_slots = num_state_slots
        self.block_size = block_size
        self.dtype = dtype
        window = {s.last_tokens for s in specs if s.space == WINDOW}
        if len(window) > 1:
            raise ValueError(f"KV regions with different windows {sorted(window)}: one window space holds one window")
        self.window_tokens: int | None = window.pop() if window else None
        if self.window_tokens is not None and num_window_blocks < 1:
            raise ValueError("a pool with a sliding-window region needs num_window_blocks >= 1")
        if any(s.space == STATE for s in specs) and num_state_slots < 1:
            raise ValueError("a pool with a per-sequence state region needs num_state_slots >= 1")
        self._row = {s.name: {l: i for i, l in enumerate(s.layer_ids(num_layers))} for s in specs}
        # zeros, not empty: a slot nobody wrote must never hold NaN that a masked lane could read
        self.regions: dict[str, torch.Tensor] = {
            s.name: torch.zeros(
                len(s.layer_ids(num_layers)),
                self.blocks_of(s),
                s.records_per_block(block_size),
                s.dim,
                dtype=torch.uint8 if s.byte_record else dtype,
                device=device,
            )
            for s in specs
        }

    def blocks_of(self, spec: KVRegionSpec) -> int:
        return {TOKENS: self.num_blocks, WINDOW: self.num_window_blocks, STATE: self.num_state_slots}[spec.space]

    def layer(self, name: str, layer: int) -> torch.Tensor:
        """Model layer `layer` of region `name`, flat: [num_blocks * records_per_block, dim]."""
        if BYTE_RECORDS.get(self.specs[name].record) == "pages":
            raise ValueError(
                f"region {name!r} holds {self.specs[name].record} pages (a record's scales sit at the end of its block): use layer_pages"
            )
        t = self.regions[name][self._row[name][layer]]
        return t.view(-1, t.shape[-1])

    def layer_pages(self, name: str, layer: int) -> torch.Tensor:
        """Model layer `layer` of region `name` by blocks: [blocks, records_per_block, dim]."""
        return self.regions[name][self._row[name][layer]]

    def slots(self, name: str, block_table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Flat record ids [end - start] (int64, rows of `layer(name, l)`) of tokens / entries
        start..end-1 of a sequence with `block_table` [n_blocks] int64 (its window table for a
        WINDOW region; a STATE region's record is row state_slot, no table needed)."""
        spec, bs = self.specs[name], self.block_size
        rpb = spec.records_per_block(bs)
        if spec.space == STATE:
            raise ValueError(f"region {name!r} has one record per sequence: index it by the sequence's state slot")
        first = (
            torch.arange(start, end, device=block_table.device) * spec.tokens_per_record
        )  # [n] first position of each record
        return block_table[first // bs] * rpb + (first % bs) // spec.tokens_per_record

    @staticmethod
    def bytes_per_block(
        specs: list[KVRegionSpec], num_layers: int, block_size: int, dtype: torch.dtype, space: str = TOKENS
    ) -> int:
        """Bytes of one block (one slot, for STATE) of a block space over all its regions."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        mine = [s for s in specs if s.space == space]
        return sum(
            s.dim * len(s.layer_ids(num_layers)) * s.records_per_block(block_size) * (1 if s.byte_record else itemsize)
            for s in mine
        )
