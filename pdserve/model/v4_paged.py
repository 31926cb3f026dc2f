"""DeepSeek-V4 on the paged KV pool: its cache kinds as regions of one KVCache, and the model run
with the DeepseekForCausalLM interface (`forward(batch, kv_cache)`, `compute_logits`,
`kv_cache_specs()`, `num_layers`) that the engine drives.

Legend: D head_dim, Di index_head_dim, W sliding_window, mc / mh the CSA / HCA rates, n tokens of
a sequence in the cache, bs tokens per block, E = n // m entries, P = n % m pending tokens.

Regions (kv_cache.py's KVRegionSpec), each paged by one block space (engine/block_manager.py):

| region          | layers | space  | record covers          | values per record                    |
| --------------- | ------ | ------ | ---------------------- | ------------------------------------ |
| window          | all    | window | 1 token (last W-1 kept) | D: the K=V record (normed, roped)   |
| csa_kv          | CSA    | tokens | mc tokens (one entry)  | D: compressed entry                  |
| csa_index_k     | CSA    | tokens | mc tokens (one entry)  | Di: the indexer's compressed key     |
| hca_kv          | HCA    | tokens | mh tokens (one entry)  | D: compressed entry                  |
| csa_state       | CSA    | state  | the sequence           | pending kv, gate [mc-1, 2D] x2, overlap kv, gate [mc, D] x2 |
| csa_index_state | CSA    | state  | the sequence           | the same at Di                       |
| hca_state       | HCA    | state  | the sequence           | pending kv, gate [mh-1, D] x2        |

A state record: pending kv [m-1, C], pending gate [m-1, C] (raw logits; rows past P zero), then
(overlap) overlap kv [m, D], overlap gate [m, D] (with position bias); C = 2D with overlap, else D.

So a sequence's pool footprint is its compressed entries and indexer keys (token blocks, growing
~6.9 KB/token for V4-Flash in bf16), the blocks of its last W-1 positions (window blocks, freed
behind the window as it runs) and one state slot; all three are the BlockManager's to account,
and a prefill -> decode transfer moves the entries, the window's last W-1 positions and the state.
DeepseekV4ForCausalLM reads and writes these regions in place, all sequences of a step at once
(indices built on the device from the block tables, window tables and state slots: v4_step.py):
no per-sequence gather, no host sync. The window region is paged by the pool's window space (the
sequence's window_table, engine/block_manager.py): it holds blocks only for the last W-1
positions and the step's new ones, and the block manager frees the blocks that fall out of the
window as the sequence runs.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.model import ops
from pdserve.model.batch import ForwardBatch
from pdserve.model.config import ModelConfig
from pdserve.model.config_v4 import CSA, HCA
from pdserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from pdserve.model.kv_cache import PER_SEQUENCE, KVCache, KVRegionSpec

def v4_kv_specs(config: ModelConfig, kv_cache_dtype: str = "auto") -> list[KVRegionSpec]:
    """The pool's regions; kv_cache_dtype "fp8": the K = V records (window, entries) as
    fp8_ds_v4 records (584 bytes for V4-Flash), the indexer keys and states as values."""
    v4, D, Di = config.v4, config.v4.head_dim, config.index_head_dim
    csa = tuple(i for i, t in enumerate(v4.layer_types) if t == CSA)
    hca = tuple(i for i, t in enumerate(v4.layer_types) if t == HCA)
    kv = dict(dim=D) if kv_cache_dtype == "auto" else dict(dim=ops.fp8_v4_record_bytes(D, config.qk_rope_head_dim), record="fp8_ds_v4")
    specs = [KVRegionSpec("window", last_tokens=v4.sliding_window - 1, **kv)]
    if csa:
        mc = v4.csa_rate
        specs += [
            KVRegionSpec("csa_kv", layers=csa, tokens_per_record=mc, **kv),
            KVRegionSpec("csa_index_k", Di, csa, mc),
            KVRegionSpec("csa_state", _state_dim(D, mc, True), csa, PER_SEQUENCE),
            KVRegionSpec("csa_index_state", _state_dim(Di, mc, True), csa, PER_SEQUENCE),
        ]
    if hca:
        mh = v4.hca_rate
        specs += [
            KVRegionSpec("hca_kv", layers=hca, tokens_per_record=mh, **kv),
            KVRegionSpec("hca_state", _state_dim(D, mh, False), hca, PER_SEQUENCE),
        ]
    return [s for s in specs if s.dim > 0]


def _state_dim(dim: int, rate: int, overlap: bool) -> int:
    width = 2 * dim if overlap else dim
    return 2 * (rate - 1) * width + (2 * rate * dim if overlap else 0)


class PagedDeepseekV4(nn.Module):
    """DeepseekV4ForCausalLM (`self.model`) with the engine's model interface."""

    # decode graphs need a forward without host syncs: the pool path has none, and the routed
    # experts run in one kernel a layer (fused_moe with V4's clamp, or fused_moe_fp4)
    supports_cuda_graphs = True

    def __init__(self, model: DeepseekV4ForCausalLM) -> None:
        super().__init__()
        self.model = model
        self.config = model.config
        self.num_layers = model.num_layers

    def kv_cache_specs(self, kv_cache_dtype: str = "auto") -> list[KVRegionSpec]:
        if kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: DeepSeek-V4 takes auto (the model dtype) or fp8 (fp8_ds_v4 records)")
        return v4_kv_specs(self.config, kv_cache_dtype)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Runs every token of the batch; writes what each sequence's cache gains; returns
        final-normed hidden [T, hidden]."""
        return self.model(batch, kv_cache)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


def region_bytes(config: ModelConfig, block_size: int, itemsize: int) -> dict[str, dict[str, int]]:
    """Per region of the V4 pool: "block" (bytes of one block over the region's layers) and
    "record" (bytes of one record of one layer) at `itemsize` bytes per value."""
    out = {}
    for s in v4_kv_specs(config):
        layers = len(s.layer_ids(config.num_hidden_layers))
        out[s.name] = {"record": s.dim * itemsize, "block": layers * s.records_per_block(block_size) * s.dim * itemsize}
    return out
