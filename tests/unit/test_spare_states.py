"""spec_decode/spare_states.py without a model: a verify chunk on a pool with state gets a spare
slot (or loses its drafts when none is free), and after the acceptance its sequence keeps the new
state only when the accepted end lies in the chunk end's group of every rate; otherwise it keeps
its old slot and goes back to recompute. No slot is lost either way."""

from __future__ import annotations

import pytest

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request
from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.spare_states import SpareStates
from pdserve.sampling_params import SamplingParams


def _verifying(blocks: BlockManager, n: int, k: int, rid: str = "a") -> ScheduledSeq:
    """A sequence with n computed tokens and one to decode, scheduled with k drafts."""
    seq = Sequence(Request(request_id=rid, prompt_token_ids=list(range(n + 1)), params=SamplingParams()))
    blocks.allocate(seq, n + 1 + k, n + 1 + k)
    seq.num_computed_tokens = n
    seq.spec_token_ids = [7] * k
    return ScheduledSeq.of(seq, 1 + k)


@pytest.mark.parametrize(
    "n,k,accepted,keeps",
    [
        # (n_acc, n_end) with rates 4 (CSA) and 16 (HCA)
        (20, 3, 3, True),  # every draft accepted
        (20, 2, 0, True),  # 21 and 23: one CSA group (20..23), one HCA group
        (21, 3, 0, False),  # 22 and 25: a rejected position (24) opened a CSA group
        (14, 1, 0, False),  # 15 and 16: 16 opens a CSA and an HCA group
        (13, 1, 0, True),  # 14 and 15
        (29, 3, 2, True),  # 32 and 33: the accepted end itself opened the group
        (30, 3, 1, True),  # 32 and 34
        (30, 3, 0, False),  # 31 and 34: 32 opened a group
    ],
)
def test_the_state_kept_after_the_acceptance(n, k, accepted, keeps):
    blocks = BlockManager(64, 4, num_state_slots=3)
    s = _verifying(blocks, n, k)
    spare = SpareStates(blocks, {4, 16})
    old = s.seq.state_slot
    spare.begin(SchedulerOutput(scheduled=[s]))
    new = s.state_dst
    assert new >= 0 and new != old and blocks.num_used_state_slots == 2
    s.seq.num_computed_tokens = n + 1 + accepted  # what the engine counts before settling
    spare.settle(s)
    assert s.state_dst == -1 and blocks.num_used_state_slots == 1
    if keeps:
        assert s.seq.state_slot == new and s.seq.num_computed_tokens == n + 1 + accepted
    else:
        assert s.seq.state_slot == old and s.seq.num_computed_tokens == n and spare.num_recomputes == 1
    assert spare.num_kept == (keeps and accepted < k)


def test_no_free_slot_means_no_drafts_this_step():
    blocks = BlockManager(64, 4, num_state_slots=2)
    a, b = _verifying(blocks, 10, 2, "a"), _verifying(blocks, 10, 2, "b")
    SpareStates(blocks, {4}).begin(SchedulerOutput(scheduled=[a, b]))
    assert (a.state_dst, a.num_spec, a.num_tokens) == (-1, 0, 1) and a.seq.spec_token_ids == []
    assert (b.state_dst, b.num_spec, b.num_tokens) == (-1, 0, 1)
