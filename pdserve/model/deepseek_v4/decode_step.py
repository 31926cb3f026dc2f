"""A decode step's V4Step from kernels/v4_step.py: the fields `step.build_step` makes, equal value for
value, in 1 + (compressor rates) launches instead of ~110 (the window rows, both ropes' cos / sin,
and each rate's entry table, seen counts, visible rows and group plan). Taken where every chunk is
one token and the ops take the Triton kernels; elsewhere step.py builds it (and is the reference
the tests hold these kernels to).
"""

from __future__ import annotations

from pdserve.model import ops
from pdserve.model.batch import ForwardBatch
from pdserve.model.deepseek_v4.step import EntryIndex, V4Step
from pdserve.model.rope import RotaryEmbedding


def fused_decode_step(batch: ForwardBatch, rotary: dict[str, RotaryEmbedding]) -> bool:
    """Whether `build_decode_step` builds this step: a decode step (one token a sequence) on the
    Triton path, with V4's two ropes."""
    one_each = batch.prefill is None and batch.num_tokens == batch.starts.shape[0]
    return one_each and set(rotary) == {"main", "compress"} and ops.uses_triton(batch.positions)


def build_decode_step(
    batch: ForwardBatch, rotary: dict[str, RotaryEmbedding], window: int, csa_rates: set[int], hca_rates: set[int]
) -> V4Step:
    """`step.build_step` of a decode step (`fused_decode_step`), on the batch's device."""
    from pdserve_kernels.v4_step import rate_entries, window_rope

    dev = batch.positions.device
    ropes = {kind: (r.inv_freq(dev), r.attention_factor) for kind, r in rotary.items()}
    rows, write, (main, compress) = window_rope(
        batch.positions, batch.seq_ids, batch.window_tables, batch.block_size, window,
        [ropes["main"], ropes["compress"]],
    )  # fmt: skip
    step = V4Step(
        input_ids=batch.input_ids, positions=batch.positions, seq_ids=batch.seq_ids,
        rope={"main": main, "compress": compress}, window=rows, window_write=write, window_src=None,
        window_old=None, state_slots=batch.state_slots,
    )  # fmt: skip
    for m in sorted(csa_rates | hca_rates):
        got = rate_entries(
            batch.positions, batch.seq_ids, batch.starts, batch.decode_rows, batch.block_tables,
            batch.block_size, m, batch.max_context // m, m in hca_rates, ropes["compress"],
        )  # fmt: skip
        d = batch.decode_rows  # a decode step's group u is sequence u's one group
        step.entries[m] = EntryIndex.from_kernel(got, m, batch.max_context // m, seq=d, last=d, start=batch.starts)
    return step
