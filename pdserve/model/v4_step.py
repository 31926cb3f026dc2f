"""One DeepSeek-V4 forward's metadata (V4Step), built once per step and read by every layer.

Legend: T tokens of the step (all sequences, flat), B sequences, L_b new tokens of sequence b,
n_b its tokens before the step, W sliding_window, w_b = min(n_b, W-1) window records it brings,
m a compressor's rate, E_b = (n_b + L_b) // m its entries after the step, Em = max_b E_b,
R rope dims.

Every layer's attention is one `ops.sparse_mla_decode` over one flat key buffer [N, D]:

    rows [0, Sw)           the window records of sequence 0, 1, ..., B-1 (Sw = sum_b w_b)
    rows [Sw, Sw + T)      the step's new kv, in the flat batch's order
    rows [Sw + T, N)       the compressed entries of sequence 0, 1, ..., B-1 (CSA / HCA layers)

The first two parts have the same layout in every layer (every layer keeps the same window), and
the entry counts depend only on the rate, so the indices are built here once:
  - `window` [T, W]: the rows of positions (p - W, p] of each query, -1 before position 0;
  - `visible[m]` [T, Em]: entry e of the query's own sequence (its row in the entries part,
    sum_{b' < b} E_b' + e) where e < (p + 1) // m (all of the entry's tokens are <= p), else -1.
    CSA layers hand these to the indexer as its candidates; its picks index the same part;
  - `dense[m]` [T, W + Em]: the window plus every visible entry (shifted by `entry_base`), the
    whole index list of an HCA layer of rate m.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.model.rope import RotaryEmbedding


@dataclass
class V4Step:
    """B sequences' new tokens, concatenated; indices int32 with -1 padding."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, each token's position in its sequence
    rows: list[slice]  # [B] each sequence's rows of the flat batch
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # "main" / "compress" -> cos, sin [T, R/2]
    compress_rotary: RotaryEmbedding  # for compressed entries (position e * m)
    window: torch.Tensor  # [T, W] key-buffer rows of each query's window
    entry_base: int  # Sw + T: the first row of the entries part
    visible: dict[int, torch.Tensor] = field(default_factory=dict)  # rate -> [T, Em] entry rows
    dense: dict[int, torch.Tensor] = field(default_factory=dict)  # rate -> [T, W + Em] HCA indices

    def with_entries(self, entry_rows: torch.Tensor) -> torch.Tensor:
        """entry_rows [T, k] (rows of the entries part, -1 pad) -> attention indices [T, W + k]."""
        shifted = torch.where(entry_rows >= 0, entry_rows + self.entry_base, -1)
        return torch.cat([self.window, shifted.to(torch.int32)], dim=1)


def window_rows(positions: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, window: int) -> torch.Tensor:
    """positions [T]; starts / lens [B] (n_b, L_b) -> [T, W] int32 key-buffer rows of the
    positions (p - W, p], ascending; -1 for positions below 0."""
    B, device = starts.shape[0], positions.device
    seq = torch.repeat_interleave(torch.arange(B, device=device), lens)  # [T]
    kept = starts.clamp(max=window - 1)  # [B] w_b
    first_window_row = torch.cumsum(kept, 0) - kept  # [B]
    first_new_row = kept.sum() + torch.cumsum(lens, 0) - lens  # [B]
    n, s = starts[seq][:, None], seq[:, None]
    pos = positions[:, None] - window + 1 + torch.arange(window, device=device)  # [T, W]
    old = first_window_row[s] + pos - (n - kept[s])  # a record the sequence brings
    new = first_new_row[s] + pos - n  # a token of this step
    rows = torch.where(pos < n, old, new)
    return torch.where(pos >= 0, rows, -1).to(torch.int32)


def visible_entries(positions: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, rate: int) -> torch.Tensor:
    """-> [T, Em] int32: rows (in the entries part) of the entries each query may see, -1 pad."""
    B, device = starts.shape[0], positions.device
    seq = torch.repeat_interleave(torch.arange(B, device=device), lens)  # [T]
    counts = (starts + lens) // rate  # [B] E_b
    first = torch.cumsum(counts, 0) - counts  # [B]
    e = torch.arange(int(counts.max()) if B else 0, device=device)  # [Em]
    seen = e[None, :] < ((positions + 1) // rate)[:, None]  # [T, Em]
    return torch.where(seen, first[seq][:, None] + e[None, :], -1).to(torch.int32)


def build_step(
    input_ids: torch.Tensor,
    starts: list[int],
    lens: list[int],
    rotary: dict[str, RotaryEmbedding],
    window: int,
    csa_rates: set[int],
    hca_rates: set[int],
) -> V4Step:
    """The metadata of one forward over B sequences: sequence b has starts[b] tokens cached and
    lens[b] new ones (input_ids [T], concatenated)."""
    device = input_ids.device
    starts_t = torch.tensor(starts, device=device)
    lens_t = torch.tensor(lens, device=device)
    first_row = torch.cumsum(lens_t, 0) - lens_t  # [B]
    seq = torch.repeat_interleave(torch.arange(len(lens), device=device), lens_t)  # [T]
    positions = starts_t[seq] + torch.arange(input_ids.shape[0], device=device) - first_row[seq]
    bounds = [0, *torch.cumsum(lens_t, 0).tolist()]
    step = V4Step(
        input_ids=input_ids,
        positions=positions,
        rows=[slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])],
        rope={kind: r(positions) for kind, r in rotary.items()},
        compress_rotary=rotary["compress"],
        window=window_rows(positions, starts_t, lens_t, window),
        entry_base=sum(min(n, window - 1) for n in starts) + input_ids.shape[0],
    )
    for m in csa_rates | hca_rates:
        step.visible[m] = visible_entries(positions, starts_t, lens_t, m)
    for m in hca_rates:
        step.dense[m] = step.with_entries(step.visible[m])
    return step
