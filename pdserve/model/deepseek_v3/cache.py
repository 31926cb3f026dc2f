"""DeepSeek-V3 / V3.2's cache in the paged KV pool, and what a decode step reads of it.

Legend: R kv_lora_rank + rope dims (one latent record), Di index_head_dim, K index_topk, H heads,
Hi indexer heads, n positions a query attends.

Regions (kv_cache.py's KVRegionSpec), all in the token space, every layer:
  - latent: one MLA record a token, R values (or, kv_cache_dtype "fp8", a 656-byte fp8_ds_mla
    record: kernels/kv_fp8.py);
  - index_k (V3.2 only): the indexer's key a token, Di values.
"""

from __future__ import annotations

from pdserve.model import ops
from pdserve.model.config import ModelConfig
from pdserve.model.kv_cache import KVRegionSpec


def kv_cache_specs(config: ModelConfig, kv_cache_dtype: str = "auto") -> list[KVRegionSpec]:
    """kv_cache_dtype "fp8": the latent as 656-byte FP8 records (kernels/kv_fp8.py)."""
    c = config
    if kv_cache_dtype == "fp8":
        if c.kv_lora_rank % 128:
            raise ValueError(
                f"kv_cache_dtype fp8 needs kv_lora_rank a multiple of 128 (one scale per 128 values), got {c.kv_lora_rank}"
            )
        size = ops.fp8_record_bytes(c.kv_lora_rank, c.qk_rope_head_dim)
        specs = [KVRegionSpec("latent", size, record="fp8_ds_mla")]
    else:
        specs = [KVRegionSpec("latent", c.kv_lora_rank + c.qk_rope_head_dim)]
    if c.has_indexer:
        specs.append(KVRegionSpec("index_k", c.index_head_dim))
    return specs


def decode_attention_cost(
    config: ModelConfig, context: int, itemsize: float, record_bytes: int | None = None
) -> tuple[float, int]:
    """(KV values read, attention flops) of one sequence's decode step over all layers, n = context + 1
    positions: dense MLA all n latent records; V3.2 the indexer keys of all n positions and the
    top-k min(K, n) latent records. record_bytes: the latent record's bytes when it is a byte
    format (fp8_ds_mla), counted in values of itemsize bytes."""
    c, n = config, context + 1
    H, Hi, Di, K = c.num_attention_heads, c.index_n_heads, c.index_head_dim, c.index_topk
    rec = c.kv_lora_rank + c.qk_rope_head_dim
    rec_values = record_bytes / itemsize if record_bytes else rec
    keys = min(K, n) if c.has_indexer else n
    values = flops = 0
    for _ in range(c.num_hidden_layers):
        values += keys * rec_values + (n * Di if c.has_indexer else 0)
        flops += 2 * H * keys * (rec + c.kv_lora_rank) + (2 * Hi * n * Di if c.has_indexer else 0)
    return values, flops
