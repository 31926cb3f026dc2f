"""The batch metadata one forward pass needs, built once per step by the ModelRunner.

Tokens of all scheduled sequences (prefill chunks and decode tokens alike) are concatenated into
one flat batch of T tokens. Attention is always "sparse MLA over slot ids": each token attends to
the KV records at `context_slots[t]` (dense models) or to the top-k of them chosen by the DSA
indexer (DeepSeek-V3.2). A slot is `block_id * block_size + offset` in the paged pool.

`StepInputs` is the compact form of a step (a few small integer tensors: no [T, C] context
matrix); `ForwardBatch.build` expands it with vectorized ops. Tensor-parallel rank 0 broadcasts
StepInputs, and every rank builds the same ForwardBatch from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepInputs:
    """One step's scheduled chunks. Legend: B sequences, T tokens in all, W longest block table."""

    input_ids: torch.Tensor  # [T] int64, tokens of every chunk, concatenated
    lens: torch.Tensor  # [B] int64, tokens of each chunk
    starts: torch.Tensor  # [B] int64, position of each chunk's first token in its sequence
    samples: torch.Tensor  # [B] bool, does the chunk end at a token that samples
    block_tables: torch.Tensor  # [B, W] int64, zero padded
    window_tables: torch.Tensor  # [B, W] int64, window-space blocks (-1: none; block_manager.py)
    state_slots: torch.Tensor  # [B] int64, each sequence's state-space slot (-1: none)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] int64, slot each token's KV record is written to
    context_slots: torch.Tensor  # [T, C] int32, slots of positions 0..pos (own included), -1 padded
    logits_indices: torch.Tensor  # [N] int64, rows of the hidden states to compute logits for
    starts: torch.Tensor  # [B] int64, tokens of each sequence already in the cache
    lens: torch.Tensor  # [B] int64, new tokens of each sequence (its rows, in order)
    block_tables: torch.Tensor  # [B, W] int64, zero padded (DeepSeek-V4 pages its state by these)
    window_tables: torch.Tensor  # [B, W] int64, -1 padded (DeepSeek-V4's sliding-window records)
    state_slots: torch.Tensor  # [B] int64 (DeepSeek-V4's compressor state)

    @classmethod
    def build(cls, step: StepInputs, block_size: int) -> "ForwardBatch":
        """Positions, slots and the causal context of every token, with no per-token Python."""
        bs, lens, starts, tables = block_size, step.lens, step.starts, step.block_tables
        B, width = tables.shape
        seq_idx = torch.repeat_interleave(torch.arange(B), lens)  # [T]
        first_row = torch.cumsum(lens, 0) - lens  # [B] first flat row of each sequence
        positions = starts[seq_idx] + torch.arange(len(seq_idx)) - first_row[seq_idx]  # [T]
        C = int((starts + lens).max())
        col = torch.arange(C)  # [C]
        seq_slots = tables.gather(1, (col // bs).clamp(max=width - 1).expand(B, C)) * bs + col % bs  # [B, C]
        context = torch.where(col[None, :] <= positions[:, None], seq_slots[seq_idx], -1)  # [T, C] causal
        last_rows = first_row + lens - 1  # [B]
        return cls(
            input_ids=step.input_ids,
            positions=positions,
            slot_mapping=seq_slots[seq_idx, positions],
            context_slots=context.to(torch.int32),
            logits_indices=last_rows[step.samples],
            starts=starts,
            lens=lens,
            block_tables=tables,
            window_tables=step.window_tables,
            state_slots=step.state_slots,
        )

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> "ForwardBatch":
        return ForwardBatch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))
