"""The paged KV pool of one worker.

One region per kind of per-token record, each a single tensor `[L, num_blocks, block_size, dim]`
(layer-major, so layer l viewed flat is `[num_blocks * block_size, dim]` and a slot id is
`block_id * block_size + offset` in every layer). Few large tensors, so NIXL registers each once.

Records (DeepSeek-V3/V3.2, bf16 or float32):
  latent : kv_lora_rank normalized latent, then qk_rope_head_dim roped key (512 + 64 = 576)
  index_k: the DSA indexer key, index_head_dim values (V3.2 only)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVRegionSpec:
    name: str
    dim: int  # values per token per layer


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
        self.specs = specs
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        # zeros, not empty: a slot nobody wrote must never hold NaN that a masked lane could read
        self.regions: dict[str, torch.Tensor] = {
            s.name: torch.zeros(num_layers, num_blocks, block_size, s.dim, dtype=dtype, device=device)
            for s in specs
        }

    def layer(self, name: str, layer: int) -> torch.Tensor:
        """Layer `layer` of region `name`, flat: [num_blocks * block_size, dim]."""
        return self.regions[name][layer].view(self.num_blocks * self.block_size, -1)

    @staticmethod
    def bytes_per_block(specs: list[KVRegionSpec], num_layers: int, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return sum(s.dim for s in specs) * num_layers * block_size * itemsize
