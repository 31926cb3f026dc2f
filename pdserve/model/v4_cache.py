"""What a later step of a DeepSeek-V4 sequence reads, and its size.

Legend: n tokens of the sequence seen so far, W sliding_window, D head_dim (512), Di
index_head_dim (128), m a compressor's rate (CSA: 4, HCA: 128), E = n // m complete groups,
P = n % m tokens of the incomplete group, C a compressor's projection width (HCA: D; CSA: 2*D
for the two overlapping series, Ca = [:D] feeding the *next* entry and Cb = [D:] the current one).

Per layer, by layer kind:
  - every layer: the window, the K=V records (normed, roped) of positions n-W+1 .. n-1. The next
    token attends to these plus itself.
  - HCA: a compressor (C = D, no overlap); CSA: a compressor (C = 2*D, with overlap) and an
    indexer (C = 2*Di, with overlap). A compressor keeps:
  - entries [E, D or Di]: compressed entry e pools positions e*m .. e*m+m-1 (CSA: and the m
    before them, through the overlap), is normed and roped at position e*m; a query at position
    p may see entries e < (p + 1) // m (all of its group's tokens are <= p).
  - pending kv / gate [P, C]: projected kv and raw gate logits of the P tokens of the incomplete
    group; they become one entry when the group fills up.
  - overlap kv / gate [m, D or Di] (CSA only): the Ca half of the last complete group (gate with
    position bias added); before the first group kv 0 and gate -inf, which give those slots
    softmax weight 0.
Invariant: E * m + P == n.

This is the model's view of one sequence's cache; the engine keeps it in the paged pool
(v4_paged.py's regions) and the model reads and writes it there (v4_step.py, v4_compressor.py).
"""

from __future__ import annotations

from pdserve.model.config import ModelConfig
from pdserve.model.config_v4 import CSA, HCA


def cache_bytes(config: ModelConfig, bytes_per_value: int = 2) -> dict[str, int | float]:
    """Cache-state sizes of one sequence over all layers, at `bytes_per_value` (2: bf16):
    "per_token": growth per token (compressed entries and indexer keys), "window": the sliding
    windows (fixed once n >= W-1), "running_max": the compressors' running state at its largest."""
    v4, D, Di = config.v4, config.v4.head_dim, config.index_head_dim
    per_token = window = running = 0.0
    for i, kind in enumerate(v4.layer_types):
        window += (v4.sliding_window - 1) * D
        m = v4.compress_rate(i)
        if kind == HCA:
            per_token += D / m
            running += (m - 1) * 2 * D  # pending kv + gate
        elif kind == CSA:
            per_token += (D + Di) / m
            running += (m - 1) * 2 * (2 * D + 2 * Di) + m * 2 * (D + Di)  # pending (two series) + overlap
    b = bytes_per_value
    return {"per_token": per_token * b, "window": int(window * b), "running_max": int(running * b)}
