"""The V4Step of a step with chunks longer than one token (speculative decoding's verify steps,
prefill chunks, mixed steps) from kernels/v4_chunk_step.py: the fields `step.build_step` makes,
equal value for value, in 1 + (compressor rates) launches instead of ~200 a verify step (the key
buffer's rows, both ropes' cos / sin, and each rate's entry table, seen counts, visible rows and
group plan). Taken on the Triton path for every step `decode_step` does not take, up to
`MAX_B` sequences (the kernels' prefix sums run over all of them in every program); elsewhere
step.py builds it (and is the reference the tests hold these kernels to). Shapes come from host
ints alone (T, B, `max_context`), so a chunk graph (engine/cuda_graphs.py) captures it.
"""

from __future__ import annotations

from pdserve.model import ops
from pdserve.model.batch import ForwardBatch
from pdserve.model.deepseek_v4.step import EntryIndex, V4Step
from pdserve.model.rope import RotaryEmbedding

MAX_B = 256  # = kernels/v4_chunk_step.MAX_B (not imported here: the CPU path imports no triton)


def fused_chunk_step(batch: ForwardBatch, rotary: dict[str, RotaryEmbedding]) -> bool:
    """Whether `build_chunk_step` builds this step: a step of 1..MAX_B sequences with a chunk
    longer than one token (T > B), on the Triton path, with V4's two ropes."""
    B = batch.starts.shape[0]
    chunks = 0 < B <= MAX_B and batch.num_tokens > B
    return chunks and set(rotary) == {"main", "compress"} and ops.uses_triton(batch.positions)


def build_chunk_step(
    batch: ForwardBatch, rotary: dict[str, RotaryEmbedding], window: int, csa_rates: set[int], hca_rates: set[int]
) -> V4Step:
    """`step.build_step` of a step of chunks (`fused_chunk_step`), on the batch's device."""
    from pdserve_kernels.v4_chunk_step import chunk_rate_entries, chunk_window_rope

    dev = batch.positions.device
    ropes = {kind: (r.inv_freq(dev), r.attention_factor) for kind, r in rotary.items()}
    win, (main, compress) = chunk_window_rope(
        batch.positions, batch.seq_ids, batch.starts, batch.lens, batch.window_tables, batch.block_size, window,
        [ropes["main"], ropes["compress"]],
    )  # fmt: skip
    step = V4Step(
        input_ids=batch.input_ids, positions=batch.positions, seq_ids=batch.seq_ids,
        rope={"main": main, "compress": compress}, state_slots=batch.state_slots, state_dst=batch.state_dst, **win,
    )  # fmt: skip
    for m in sorted(csa_rates | hca_rates):
        got = chunk_rate_entries(
            batch.positions, batch.seq_ids, batch.starts, batch.lens, batch.block_tables, batch.block_size, m,
            batch.max_context // m, m in hca_rates, ropes["compress"],
        )  # fmt: skip
        step.entries[m] = EntryIndex.from_kernel(got, m, batch.max_context // m)
    return step
