"""The per-sequence cache state of DeepSeek-V4: everything a later step of the sequence reads.

Legend: n tokens of the sequence seen so far, W sliding_window, D head_dim (512), Di
index_head_dim (128), m a compressor's rate (CSA: 4, HCA: 128), E = n // m complete groups,
P = n % m tokens of the incomplete group, C a compressor's projection width (HCA: D; CSA: 2*D
for the two overlapping series, Ca = [:D] feeding the *next* entry and Cb = [D:] the current one).

Per layer (LayerState), by layer kind:
  - sliding only: `window` [min(n, W-1), D], the K=V records (normed, roped) of positions
    n-len(window) .. n-1. The next token attends to these plus itself.
  - HCA: `window` and `compressor` (CompressorState with C = D, no overlap).
  - CSA: `window`, `compressor` (C = 2*D, with overlap) and `indexer` (C = 2*Di, with overlap).
CompressorState:
  - `entries` [E, D or Di]: compressed entry e pools positions e*m .. e*m+m-1 (CSA: and the
    m before them, through the overlap), is normed and roped at position e*m; a query at
    position p may see entries e < (p + 1) // m (all of its group's tokens are <= p).
  - `pending_kv` / `pending_gate` [P, C]: projected kv and raw gate logits of the P tokens of
    the incomplete group; they become one entry when the group fills up.
  - `overlap_kv` / `overlap_gate` [m, D or Di] (CSA only): the Ca half of the last complete
    group (gate with position bias added); before the first group kv 0 and gate -inf, which
    give those slots softmax weight 0.
Invariant: len(entries) * m + len(pending_kv) == n.

Tensors are replaced (never resized in place), so a state may be copied or moved freely.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.model.config import ModelConfig
from pdserve.model.config_v4 import CSA, HCA


@dataclass
class CompressorState:
    entries: torch.Tensor  # [E, Dc] compressed entries, normed + roped
    pending_kv: torch.Tensor  # [P, C] kv projections of the incomplete group
    pending_gate: torch.Tensor  # [P, C] gate logits of the incomplete group (no position bias)
    overlap_kv: torch.Tensor | None = None  # [m, Dc] CSA: Ca of the last complete group
    overlap_gate: torch.Tensor | None = None  # [m, Dc] CSA: its gate logits + position bias

    @classmethod
    def empty(cls, dim: int, rate: int, overlap: bool, dtype: torch.dtype, device) -> "CompressorState":
        width = 2 * dim if overlap else dim
        new = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        state = cls(entries=new(0, dim), pending_kv=new(0, width), pending_gate=new(0, width))
        if overlap:
            state.overlap_kv = new(rate, dim)
            state.overlap_gate = torch.full((rate, dim), float("-inf"), dtype=dtype, device=device)
        return state


@dataclass
class LayerState:
    window: torch.Tensor  # [min(n, W-1), D] K=V of the last positions
    compressor: CompressorState | None = None  # CSA / HCA
    indexer: CompressorState | None = None  # CSA


@dataclass
class SequenceState:
    """One sequence's cache: `num_tokens` positions seen, one LayerState per layer."""

    num_tokens: int = 0
    layers: list[LayerState] = field(default_factory=list)

    @classmethod
    def empty(cls, config: ModelConfig, dtype: torch.dtype = torch.float32, device="cpu") -> "SequenceState":
        v4 = config.v4
        layers = []
        for i, kind in enumerate(v4.layer_types):
            st = LayerState(window=torch.zeros(0, v4.head_dim, dtype=dtype, device=device))
            if kind in (CSA, HCA):
                rate = v4.compress_rate(i)
                st.compressor = CompressorState.empty(v4.head_dim, rate, kind == CSA, dtype, device)
            if kind == CSA:
                st.indexer = CompressorState.empty(config.index_head_dim, rate, True, dtype, device)
            layers.append(st)
        return cls(num_tokens=0, layers=layers)


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
