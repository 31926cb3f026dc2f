"""DeepSeek-V4's cache in the paged KV pool: its kinds as regions of one KVCache, and what a
decode step reads of them.

Legend: D head_dim, Di index_head_dim, W sliding_window, mc / mh the CSA / HCA rates, n tokens of
a sequence in the cache, m a compressor's rate, E = n // m entries, P = n % m pending tokens.

Regions (kv_cache.py's KVRegionSpec), each paged by one block space (engine/block_manager.py):

| region          | layers | space  | record covers          | values per record                    |
| --------------- | ------ | ------ | ---------------------- | ------------------------------------ |
| window          | all    | window | 1 token (last W-1 kept) | D: the K=V record (normed, roped)   |
| csa_kv          | CSA    | tokens | mc tokens (one entry)  | D: compressed entry                  |
| csa_index_k     | CSA    | tokens | mc tokens (one entry)  | Di: the indexer's compressed key     |
| hca_kv          | HCA    | tokens | mh tokens (one entry)  | D: compressed entry                  |
| csa_state       | CSA    | state  | the sequence           | pending kv, gate [mc-1, 2D]; overlap kv, gate [mc, D] |
| csa_index_state | CSA    | state  | the sequence           | the same at Di                       |
| hca_state       | HCA    | state  | the sequence           | pending kv, gate [mh-1, D] x2        |

Entry e pools positions e*m .. e*m+m-1 (CSA: and the m before them, through the overlap), is
normed and roped at position e*m; a query at position p may see entries e < (p + 1) // m.
A state record: pending kv [m-1, C], pending gate [m-1, C] (raw logits of the P tokens of the
incomplete group; rows past P zero), then (overlap) overlap kv [m, D], overlap gate [m, D] (the
Ca half of the last complete group, with position bias); C = 2D with overlap, else D.
Invariant: E * m + P == n.

So a sequence's pool footprint is its compressed entries and indexer keys (token blocks, growing
~6.9 KB/token for V4-Flash in bf16), the blocks of its last W-1 positions (window blocks, freed
behind the window as it runs) and one state slot; all three are the BlockManager's to account,
and a prefill -> decode transfer moves the entries, the window's last W-1 positions and the state.
DeepseekV4ForCausalLM reads and writes these regions in place, all sequences of a step at once
(indices built on the device from the block tables, window tables and state slots: step.py).
"""

from __future__ import annotations

from pdserve.model import ops
from pdserve.model.config import ModelConfig
from pdserve.model.deepseek_v4.config import CSA, HCA
from pdserve.model.kv_cache import PER_SEQUENCE, KVRegionSpec


def kv_cache_specs(config: ModelConfig, kv_cache_dtype: str = "auto") -> list[KVRegionSpec]:
    """The pool's regions; kv_cache_dtype "fp8": the K = V records (window, entries) as
    fp8_ds_v4 records (584 bytes for V4-Flash), the indexer keys and states as values."""
    if kv_cache_dtype not in ("auto", "fp8"):
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r}: DeepSeek-V4 takes auto (the model dtype) or fp8 (fp8_ds_v4 records)"
        )
    v4, D, Di = config.v4, config.v4.head_dim, config.index_head_dim
    csa = tuple(i for i, t in enumerate(v4.layer_types) if t == CSA)
    hca = tuple(i for i, t in enumerate(v4.layer_types) if t == HCA)
    if kv_cache_dtype == "auto":
        kv = dict(dim=D)
    else:
        kv = dict(dim=ops.fp8_v4_record_bytes(D, config.qk_rope_head_dim), record="fp8_ds_v4")
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


def decode_attention_cost(
    config: ModelConfig, context: int, itemsize: float, record_bytes: int | None = None
) -> tuple[float, int]:
    """(KV values read, attention flops) of one sequence's decode step over all layers, n = context + 1
    positions: per layer the window min(n, W) records (D), CSA the indexer keys of all n // m entries
    (Di) and the top-k min(K, n // m) entries (D), HCA all n // m entries (D); the compressors'
    running state is not counted. record_bytes: a K = V record's bytes when it is a byte format
    (fp8_ds_v4), counted in values of itemsize bytes."""
    c, n = config, context + 1
    H, Hi, Di, K = c.num_attention_heads, c.index_n_heads, c.index_head_dim, c.index_topk
    v4, D = c.v4, c.v4.head_dim
    rec_values = record_bytes / itemsize if record_bytes else D
    values = flops = 0
    for layer, kind in enumerate(v4.layer_types):
        window = min(n, v4.sliding_window)
        entries = n // v4.compress_rate(layer) if kind in (CSA, HCA) else 0
        attended = min(K, entries) if kind == CSA else entries
        values += (window + attended) * rec_values + (entries * Di if kind == CSA else 0)
        flops += 4 * H * (window + attended) * D + (2 * Hi * entries * Di if kind == CSA else 0)
    return values, flops
