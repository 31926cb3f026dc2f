"""A circuit breaker per worker: stop sending requests to a worker that keeps failing them.

    closed --(threshold consecutive failed requests)--> open --(cooldown_s)--> half_open
      ^                                                   ^                       |
      +---------------- the trial request succeeds -------|-- the trial fails ----+

Health probes say whether a worker is up; the breaker says whether its requests succeed (a worker
can answer /health and still fail every request: a wrong peer list, a broken transfer path). While
open it takes no requests, whatever /health says; half-open lets one trial request through.
A refusal for being busy (429) or for bad input (4xx) is not a failure.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class BreakerState(enum.IntEnum):
    """Values are what the metrics gauge shows."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    def __init__(
        self, threshold: int = 5, cooldown_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if threshold < 1 or cooldown_s <= 0:
            raise ValueError(f"breaker needs threshold >= 1 and cooldown > 0, got {threshold} and {cooldown_s}")
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.failures = 0  # consecutive failed requests
        self.opens = 0  # times it opened
        self._open_until: float | None = None  # set while open or half-open
        self._trial = False  # half-open: the one trial request is in flight

    @property
    def state(self) -> BreakerState:
        if self._open_until is None:
            return BreakerState.CLOSED
        return BreakerState.OPEN if self.clock() < self._open_until else BreakerState.HALF_OPEN

    def allows(self) -> bool:
        """May a request go to this worker now? (no side effects)"""
        state = self.state
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN and not self._trial)

    def on_attempt(self) -> None:
        """A request was sent: in half-open it is the trial."""
        if self.state is BreakerState.HALF_OPEN:
            self._trial = True

    def on_end(self) -> None:
        """The request is over without a verdict (client left): a later one may be the trial."""
        self._trial = False

    def record_success(self) -> None:
        self.failures = 0
        self._open_until = None
        self._trial = False

    def record_failure(self) -> None:
        self.failures += 1
        if self.state is BreakerState.HALF_OPEN or (
            self.state is BreakerState.CLOSED and self.failures >= self.threshold
        ):
            self._open_until = self.clock() + self.cooldown_s
            self.opens += 1
        self._trial = False
