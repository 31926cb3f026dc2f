"""Per-request timing a worker takes around its engine's steps (the engine keeps no clocks).

    add()            arrival                     (the HTTP handler, on the event loop)
    step(...)        first step that ran it      (the engine thread, after each step:
                     end of the step that          t0 = step start, t1 = step end)
                     sampled its first token here
    connector        KV read posted and done     (decode: TransferStats.load_of)
                     the hand-off's arrival      (decode: a request sent before prefill finished
                                                  counts from its hand-off, TransferStats.handoffs)

The first output with a new token gets a RequestTiming (wire/protocol.py), whose parts add up to
arrival -> that step's end. All times are time.monotonic() of this process.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.disagg.stats import TransferStats
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.outputs import RequestOutput
from pdserve.wire.protocol import RequestTiming


@dataclass
class _Clock:
    arrived: float
    tokens_before: int  # output tokens it arrives with (decode: prefill's first token)
    scheduled: float | None = None  # start of the first step that ran it


class RequestTimer:
    def __init__(self) -> None:
        self._clocks: dict[str, _Clock] = {}

    def add(self, request_id: str, now: float, tokens_before: int) -> None:
        self._clocks[request_id] = _Clock(now, tokens_before)

    def on_step(self, sched: SchedulerOutput | None, t0: float) -> None:
        """Engine thread, after a step that started at t0."""
        for s in sched.scheduled if sched is not None else ():
            clock = self._clocks.get(s.seq.request_id)
            if clock is not None and clock.scheduled is None:
                clock.scheduled = t0

    def first_token(self, out: RequestOutput, t1: float, transfers: TransferStats | None) -> RequestTiming | None:
        """The request's timing if `out` (from the step that ended at t1) holds its first new token
        here; forgets the request once it has one or is finished. transfers: the connector's
        counters, where a decode request's finished KV read is found."""
        clock = self._clocks.get(out.request_id)
        if clock is None:
            return None
        if sum(len(c.token_ids) for c in out.outputs) <= clock.tokens_before:
            if out.finished:
                del self._clocks[out.request_id]
            return None
        del self._clocks[out.request_id]
        arrived = clock.arrived
        if transfers is not None:  # decode: from the hand-off, if it came later
            arrived = max(arrived, transfers.handoffs.pop(out.request_id, arrived))
        load = transfers.load_of(out.request_id) if transfers is not None else None
        if load is not None:  # posted after arrival, done before the step that ran it ended
            return RequestTiming(
                queue_s=max(0.0, load.started - arrived),
                transfer_s=load.seconds,
                transfer_bytes=load.nbytes,
                transfer_bytes_saved=load.nbytes_saved,
                compute_s=max(0.0, t1 - load.finished),  # max: float rounding of started + seconds
            )
        # a step may start just before an add() it then picks up: it ran from arrival on
        scheduled = max(arrived, clock.scheduled if clock.scheduled is not None else t1)
        return RequestTiming(queue_s=scheduled - arrived, compute_s=t1 - scheduled)

    def forget(self, request_id: str) -> None:
        self._clocks.pop(request_id, None)
