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
  tokens_per_record = 0   one record per block (PER_BLOCK): per-sequence state kept in the
                          sequence's first block (block_table[0])
  last_tokens = K         (per-token regions) only the last K positions' records are ever read
                          again: a sliding window; a transfer moves only the blocks holding them

Records (float32 / bf16 values; the record's byte format is the spec's `dim` x the pool dtype):
  DeepSeek-V3/V3.2: latent (kv_lora_rank + qk_rope_head_dim = 576 values per token) and, for
  V3.2, index_k (the DSA indexer key, index_head_dim per token), every layer.
  DeepSeek-V4: see v4_paged.py (window, compressed entries, indexer keys, compressor state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PER_BLOCK = 0  # tokens_per_record of a region with one record per block


@dataclass(frozen=True)
class KVRegionSpec:
    name: str
    dim: int  # values per record
    layers: tuple[int, ...] | None = None  # model layers with this region (None: all of them)
    tokens_per_record: int = 1  # 1: per token; m: per m tokens; PER_BLOCK (0): one per block
    last_tokens: int | None = None  # a later step reads only the records of the last this many tokens

    def layer_ids(self, num_layers: int) -> tuple[int, ...]:
        return tuple(range(num_layers)) if self.layers is None else self.layers

    def records_per_block(self, block_size: int) -> int:
        m = self.tokens_per_record
        if m == PER_BLOCK:
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
    ) -> None:
        self.specs = {s.name: s for s in specs}
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self._row = {s.name: {l: i for i, l in enumerate(s.layer_ids(num_layers))} for s in specs}
        # zeros, not empty: a slot nobody wrote must never hold NaN that a masked lane could read
        self.regions: dict[str, torch.Tensor] = {
            s.name: torch.zeros(
                len(s.layer_ids(num_layers)), num_blocks, s.records_per_block(block_size), s.dim, dtype=dtype, device=device
            )
            for s in specs
        }

    def layer(self, name: str, layer: int) -> torch.Tensor:
        """Model layer `layer` of region `name`, flat: [num_blocks * records_per_block, dim]."""
        t = self.regions[name][self._row[name][layer]]
        return t.view(-1, t.shape[-1])

    def slots(self, name: str, block_table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Flat record ids [end - start] (int64, rows of `layer(name, l)`) of tokens / entries
        start..end-1 of a sequence with `block_table` [n_blocks] int64."""
        spec, bs = self.specs[name], self.block_size
        rpb = spec.records_per_block(bs)
        if spec.tokens_per_record == PER_BLOCK:
            return block_table[:1].expand(end - start) * rpb
        first = torch.arange(start, end) * spec.tokens_per_record  # [n] first position of each record
        return block_table[first // bs] * rpb + (first % bs) // spec.tokens_per_record

    @staticmethod
    def bytes_per_block(specs: list[KVRegionSpec], num_layers: int, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return sum(s.dim * len(s.layer_ids(num_layers)) * s.records_per_block(block_size) for s in specs) * itemsize
