"""The TP step message (engine/tp_protocol.py) through a recording control group: a FORWARD
(or an MTP forward) arrives on ranks 1..N-1 as rank 0 sent it, with and without the verify chunks'
state_dst."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import tp_protocol as protocol
from pdserve.model.batch import StepInputs


class Wire:
    """Rank 0's broadcasts, replayed in order into a receiving rank's tensors."""

    rank = 1

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def broadcast_control(self, t: torch.Tensor) -> None:
        self.sent.append(t.clone())

    def replay(self) -> Wire:
        sent, other = list(self.sent), Wire()
        other.broadcast_control = lambda t: t.copy_(sent.pop(0))
        return other


def _step(state_dst: torch.Tensor | None) -> StepInputs:
    return StepInputs(
        input_ids=torch.tensor([5, 6, 7, 8, 9]),
        lens=torch.tensor([1, 4]),
        starts=torch.tensor([11, 3]),
        samples=torch.tensor([True, True]),
        block_tables=torch.tensor([[0, 1, 2], [3, 4, 0]]),
        window_tables=torch.tensor([[-1, 7, 8], [9, -1, -1]]),
        state_slots=torch.tensor([2, 0]),
        state_dst=state_dst,
    )


@pytest.mark.parametrize("command", [protocol.Command.FORWARD, protocol.Command.MTP])
@pytest.mark.parametrize("state_dst", [None, torch.tensor([2, 5])])
def test_a_forward_arrives_as_sent(state_dst, command):
    """FORWARD, and MTP (the MTP layer's forward over the same inputs: spec_decode/mtp.py)."""
    wire = Wire()
    sent = _step(state_dst)
    protocol.send_forward(wire, sent, command)
    msg = protocol.receive(wire.replay())
    got = msg.step
    assert msg.command is command
    for name in ("input_ids", "lens", "starts", "samples", "block_tables", "window_tables", "state_slots"):
        assert torch.equal(getattr(got, name), getattr(sent, name)), name
    assert (got.state_dst is None) if state_dst is None else torch.equal(got.state_dst, state_dst)
