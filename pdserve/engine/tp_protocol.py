"""Rank 0 -> ranks 1..N-1 step messages, as tensors broadcast on the control group (no pickle).

Every message is a fixed header, then (for some commands) one int64 payload:

    header  int64[8]: [PROTOCOL_VERSION, command, a, b, c, d, e, 0]
    FORWARD   a=T, b=B, c=W   payload [T + 4B + 2*B*W + d*B]: input_ids | lens | starts | samples |
              d=1: state_dst  state_slots | block_tables | window_tables | state_dst (d = 1 only)
              e=1: fed        then the step's input_ids [T] again (device group), with the tokens
                              of the step still in flight that the payload's only has as 0
                              (the overlapped loop: rank 0 writes them on its device, launched_step.py)
    MTP       as FORWARD      the MTP layer's forward (spec_decode/mtp.py) over those inputs; then
                              its input rows of the model's dtype (device group): [T, H], V4's
                              residual streams [T, N, H] (spec_decode/mtp_handoff.py's row_shape)
    SYNC_KV   a=n, b=m, c=k   payload [n + m + k]: token-space block ids | window block ids |
                              state slots whose KV rank 0 then broadcasts (device group)
    COPY      a=n             payload [3n]: (space, src, dst) triples, space an index into SPACES:
                              whole blocks / slots the rank copies in its own pool (prefix checkpoints)
    STOP      -               no payload; the rank leaves its loop and exits 0
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from pdserve.distributed.group import TPGroup
from pdserve.model.batch import StepInputs
from pdserve.model.kv_cache import STATE, TOKENS, WINDOW

PROTOCOL_VERSION = 6
SPACES = (TOKENS, WINDOW, STATE)
HEADER_LEN = 8


class Command(enum.IntEnum):
    FORWARD = 1
    SYNC_KV = 2
    STOP = 3
    COPY = 4
    MTP = 5


@dataclass
class SpaceIds:
    """Block ids in each block space of the pool (model/kv_cache.py: TOKENS, WINDOW, STATE)."""

    tokens: list[int]
    window: list[int]
    state: list[int]

    def of(self, space: str) -> list[int]:
        return getattr(self, space)


@dataclass
class Message:
    command: Command
    step: StepInputs | None = None  # FORWARD, MTP
    ids: SpaceIds | None = None  # SYNC_KV
    copies: list[tuple[str, int, int]] | None = None  # COPY: (space, src, dst)
    fed: bool = False  # FORWARD: the input ids follow on the device group


def _header(command: Command, a: int = 0, b: int = 0, c: int = 0, d: int = 0, e: int = 0) -> torch.Tensor:
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[:7] = torch.tensor([PROTOCOL_VERSION, int(command), a, b, c, d, e])
    return h


def send_forward(group: TPGroup, step: StepInputs, command: Command = Command.FORWARD, fed: bool = False) -> None:
    """FORWARD (the model's step) or MTP (the MTP layer's forward: the caller broadcasts its input next).
    fed: the caller broadcasts the step's input ids next (device group)."""
    B, W = step.block_tables.shape
    dst = [] if step.state_dst is None else [step.state_dst]
    group.broadcast_control(_header(command, step.input_ids.numel(), B, W, len(dst), int(fed)))
    payload = torch.cat(
        [
            step.input_ids,
            step.lens,
            step.starts,
            step.samples.to(torch.int64),
            step.state_slots,
            step.block_tables.reshape(-1),
            step.window_tables.reshape(-1),
            *dst,
        ]
    )
    group.broadcast_control(payload.to(torch.int64).contiguous())


def send_sync_kv(group: TPGroup, ids: SpaceIds) -> None:
    group.broadcast_control(_header(Command.SYNC_KV, len(ids.tokens), len(ids.window), len(ids.state)))
    group.broadcast_control(torch.tensor(ids.tokens + ids.window + ids.state, dtype=torch.int64))


def send_copies(group: TPGroup, copies: list[tuple[str, int, int]]) -> None:
    group.broadcast_control(_header(Command.COPY, len(copies)))
    flat = [v for space, src, dst in copies for v in (SPACES.index(space), src, dst)]
    group.broadcast_control(torch.tensor(flat, dtype=torch.int64))


def send_stop(group: TPGroup) -> None:
    group.broadcast_control(_header(Command.STOP))


def receive(group: TPGroup) -> Message:
    """Ranks 1..N-1: block until rank 0's next message."""
    h = torch.empty(HEADER_LEN, dtype=torch.int64)
    group.broadcast_control(h)
    version, command, a, b, c, d, e = h[:7].tolist()
    if version != PROTOCOL_VERSION:
        raise RuntimeError(f"TP rank {group.rank}: step message version {version}, expected {PROTOCOL_VERSION}")
    command = Command(command)
    if command is Command.STOP:
        return Message(command)
    if command is Command.COPY:
        flat = torch.empty(3 * a, dtype=torch.int64)
        group.broadcast_control(flat)
        return Message(command, copies=[(SPACES[k], src, dst) for k, src, dst in flat.view(a, 3).tolist()])
    if command is Command.SYNC_KV:
        ids = torch.empty(a + b + c, dtype=torch.int64)
        group.broadcast_control(ids)
        tokens, window, state = (t.tolist() for t in ids.split([a, b, c]))
        return Message(command, ids=SpaceIds(tokens, window, state))
    T, B, W = a, b, c
    payload = torch.empty(T + 4 * B + 2 * B * W + d * B, dtype=torch.int64)
    group.broadcast_control(payload)
    ids, lens, starts, samples, slots, tables, windows, *dst = payload.split([T, B, B, B, B, B * W, B * W] + [B] * d)
    step = StepInputs(
        input_ids=ids,
        lens=lens,
        starts=starts,
        samples=samples.bool(),
        block_tables=tables.view(B, W),
        window_tables=windows.view(B, W),
        state_slots=slots,
        state_dst=dst[0] if dst else None,
    )
    return Message(command, step=step, fed=bool(e))
