"""ForwardBatch: the step metadata is O(T + B * W (+ prefill context)), never a [T, context] matrix,
and what it holds (positions, slots, rows, chunk boundaries) is exact."""

from __future__ import annotations

import torch

from pdserve.model.batch import ForwardBatch, StepInputs


def step(lens: list[int], starts: list[int], tables: list[list[int]]) -> StepInputs:
    B, W = len(lens), max(len(t) for t in tables)
    return StepInputs(
        input_ids=torch.zeros(sum(lens), dtype=torch.int64),
        lens=torch.tensor(lens),
        starts=torch.tensor(starts),
        samples=torch.ones(B, dtype=torch.bool),
        block_tables=torch.tensor([t + [0] * (W - len(t)) for t in tables]),
        window_tables=torch.full((B, W), -1),
        state_slots=torch.full((B,), -1),
    )


def test_rows_slots_and_chunks():
    # seq 0: decode at position 9 (blocks 3, 1, 4 of 4 tokens); seq 1: chunk of 3 at 4..6; seq 2: prompt of 2
    b = ForwardBatch.build(step([1, 3, 2], [9, 4, 0], [[3, 1, 4], [7, 2], [5]]), 4)
    assert b.positions.tolist() == [9, 4, 5, 6, 0, 1]
    assert b.slot_mapping.tolist() == [4 * 4 + 1, 2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 5 * 4 + 0, 5 * 4 + 1]
    assert b.seq_ids.tolist() == [0, 1, 1, 1, 2, 2] and b.context_lens.tolist() == [10, 5, 6, 7, 1, 2]
    assert b.decode_rows.tolist() == [0] and b.max_context == 10
    p = b.prefill
    assert p.rows.tolist() == [1, 2, 3, 4, 5] and p.cu_q.tolist() == [0, 3, 5] and p.cu_k.tolist() == [0, 7, 9]
    assert p.k_slots.tolist() == [28, 29, 30, 31, 8, 9, 10, 20, 21] and (p.max_q, p.max_k) == (3, 7)
    assert ForwardBatch.build(step([1, 1], [3, 0], [[1], [2]]), 4).prefill is None  # decodes only


def test_metadata_is_independent_of_tokens_times_context():
    """64 decodes at 128K context and one 8K-token chunk at the end of a 128K prompt: the metadata
    grows with the block tables and the chunk's context, not with tokens x context (which would be
    64 x 128K and 8K x 128K int32 entries: 32 MB and 4 GB)."""
    bs, C = 64, 131072
    W = C // bs
    decode = ForwardBatch.build(step([1] * 64, [C - 1] * 64, [list(range(W))] * 64), bs)
    T, B = 64, 64
    per_token = 8 * 3 + 4 * 2 + 8  # input_ids, positions, slot_mapping; seq_ids, context_lens; decode_rows
    per_seq = 8 * 2 + 8 + 8 + 4 * W + 8 * W  # starts, lens, logits row, state slot; tables (int32) + window tables
    assert decode.metadata_bytes() == T * per_token + B * per_seq
    assert decode.metadata_bytes() < 1.6e6  # vs 32 MB for a [T, C] int32 matrix

    chunk = ForwardBatch.build(step([8192], [C - 8192], [list(range(W))]), bs)
    S = C  # the chunk's context positions, once
    assert chunk.metadata_bytes() == 8192 * (8 * 3 + 4 * 2 + 8) + (8 * 4 + 12 * W) + 2 * 2 * 4 + 8 * S
    assert chunk.metadata_bytes() < 2e6 + 8 * S  # vs 4 GB for a [T, C] int32 matrix
