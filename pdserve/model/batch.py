"""The batch metadata one forward pass needs, built once per step by the ModelRunner.

Tokens of all scheduled sequences (prefill chunks and decode tokens alike) are concatenated into
one flat batch of T tokens. No [T, context] matrix is ever built: attention reads the paged pool
through the block tables, and each token carries only its sequence row and its context length
(query at position p sees positions 0..p of its sequence), so the metadata of a step is
O(T + B * W) however long the contexts are:

- dense MLA decode tokens: the paged decode kernel (`ops.paged_mla_decode`) computes each key's
  slot from the block table as it goes;
- dense MLA prefill chunks (more than one new token): the non-absorbed prefill kernel over each
  chunk's context (`prefill`: chunk rows, and the slots of its context positions, O(context));
- sparse layers (V3.2): the indexer scores the paged positions and hands attention [T, top-k] slots.

`StepInputs` is the compact form of a step (a few small integer tensors); `ForwardBatch.build`
expands it with vectorized ops. Tensor-parallel rank 0 broadcasts StepInputs, and every rank
builds the same ForwardBatch from it.

Legend: B sequences, T tokens in all, W longest block table, Tp tokens of prefill chunks, S
context positions of prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class StepInputs:
    """One step's scheduled chunks."""

    input_ids: torch.Tensor  # [T] int64, tokens of every chunk, concatenated
    lens: torch.Tensor  # [B] int64, tokens of each chunk
    starts: torch.Tensor  # [B] int64, position of each chunk's first token in its sequence
    samples: torch.Tensor  # [B] bool, does the chunk end at a token that samples
    block_tables: torch.Tensor  # [B, W] int64, zero padded
    window_tables: torch.Tensor  # [B, W] int64, window-space blocks (-1: none; block_manager.py)
    state_slots: torch.Tensor  # [B] int64, each sequence's state-space slot (-1: none)
    # [B] int64 where each sequence's new state record goes; None: back into state_slots (a
    # verify chunk of speculative decoding writes a spare slot: spec_decode/spare_states.py)
    state_dst: torch.Tensor | None = None


@dataclass
class PrefillChunks:
    """The chunks of more than one new token, for the non-absorbed prefill attention."""

    rows: torch.Tensor  # [Tp] int64, their tokens' rows in the flat batch, chunk after chunk
    cu_q: torch.Tensor  # [Bp + 1] int32, each chunk's rows in `rows`
    cu_k: torch.Tensor  # [Bp + 1] int32, each chunk's context (positions 0..its end) in k_slots
    k_slots: torch.Tensor  # [S] int64, slots of those context positions
    max_q: int  # longest chunk
    max_k: int  # longest context

    def to(self, device: torch.device | str) -> PrefillChunks:
        return PrefillChunks(
            self.rows.to(device),
            self.cu_q.to(device),
            self.cu_k.to(device),
            self.k_slots.to(device),
            self.max_q,
            self.max_k,
        )


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] int64, slot each token's KV record is written to
    seq_ids: torch.Tensor  # [T] int32, each token's sequence (row of block_tables)
    context_lens: torch.Tensor  # [T] int32, positions + 1: the keys 0..p a token attends to
    decode_rows: torch.Tensor  # [T - Tp] int64, rows of one-token chunks (absorbed paged decode; as_decode_rows: all)
    prefill: PrefillChunks | None  # chunks of more than one token; None when there are none (or as_decode_rows)
    logits_indices: torch.Tensor  # [N] int64, rows of the hidden states to compute logits for
    starts: torch.Tensor  # [B] int64, tokens of each sequence already in the cache
    lens: torch.Tensor  # [B] int64, new tokens of each sequence (its rows, in order)
    block_tables: torch.Tensor  # [B, W] int32, zero padded
    window_tables: torch.Tensor  # [B, W] int64, -1 padded (DeepSeek-V4's sliding-window records)
    state_slots: torch.Tensor  # [B] int64 (DeepSeek-V4's compressor state)
    block_size: int
    max_context: int  # longest context_lens entry (host int: sizes kernel grids without a sync)
    state_dst: torch.Tensor | None = None  # [B] int64 new state records' slots (None: state_slots)

    @classmethod
    def build(cls, step: StepInputs, block_size: int, as_decode_rows: bool = False) -> ForwardBatch:
        """Positions, slots and the per-token context, with no per-token Python. as_decode_rows:
        every token a decode row (no prefill chunks), as a CUDA graph runs a step of short chunks
        (speculative decoding's verify chunks; engine/cuda_graphs.py), for a model whose decode
        path is per token."""
        bs, lens, starts, tables = block_size, step.lens, step.starts, step.block_tables
        B = tables.shape[0]
        seq_idx = torch.repeat_interleave(torch.arange(B), lens)  # [T]
        first_row = torch.cumsum(lens, 0) - lens  # [B] first flat row of each sequence
        positions = starts[seq_idx] + torch.arange(len(seq_idx)) - first_row[seq_idx]  # [T]
        slot_mapping = tables[seq_idx, positions // bs] * bs + positions % bs
        last_rows = first_row + lens - 1  # [B]
        one = (lens[seq_idx] == 1) | as_decode_rows  # [T] tokens run as decode rows
        ends = starts + lens
        return cls(
            input_ids=step.input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            seq_ids=seq_idx.to(torch.int32),
            context_lens=(positions + 1).to(torch.int32),
            decode_rows=torch.nonzero(one).flatten(),
            prefill=_prefill_chunks(tables, lens, first_row, ends, bs) if not bool(one.all()) else None,
            logits_indices=last_rows[step.samples],
            starts=starts,
            lens=lens,
            block_tables=tables.to(torch.int32),
            window_tables=step.window_tables,
            state_slots=step.state_slots,
            block_size=bs,
            max_context=int(ends.max()) if B else 0,
            state_dst=step.state_dst,
        )

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> ForwardBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, (torch.Tensor, PrefillChunks)):
                moved[name] = value.to(device)
        return ForwardBatch(**moved)

    def metadata_bytes(self) -> int:
        """Bytes of every tensor in the batch (what a step builds and copies to the device)."""
        tensors = [getattr(self, f.name) for f in fields(self)]
        if self.prefill is not None:
            tensors += [getattr(self.prefill, f.name) for f in fields(self.prefill)]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _prefill_chunks(
    tables: torch.Tensor, lens: torch.Tensor, first_row: torch.Tensor, ends: torch.Tensor, bs: int
) -> PrefillChunks:
    """Rows and context slots of the chunks with more than one token (in batch order)."""
    chunks = torch.nonzero(lens > 1).flatten()  # [Bp]
    c_lens, c_ends = lens[chunks], ends[chunks]
    rows = torch.repeat_interleave(first_row[chunks] - torch.cumsum(c_lens, 0) + c_lens, c_lens) + torch.arange(
        int(c_lens.sum())
    )
    seq = torch.repeat_interleave(chunks, c_ends)  # [S] the chunk's sequence of each context position
    pos = torch.arange(len(seq)) - torch.repeat_interleave(torch.cumsum(c_ends, 0) - c_ends, c_ends)  # [S]
    zero = torch.zeros(1, dtype=torch.int32)
    return PrefillChunks(
        rows=rows,
        cu_q=torch.cat([zero, torch.cumsum(c_lens, 0).to(torch.int32)]),
        cu_k=torch.cat([zero, torch.cumsum(c_ends, 0).to(torch.int32)]),
        k_slots=tables[seq, pos // bs] * bs + pos % bs,
        max_q=int(c_lens.max()),
        max_k=int(c_ends.max()),
    )
