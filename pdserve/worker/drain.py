"""A worker stopping on SIGTERM drains first: it refuses new requests (/health 503 "draining", so
routers stop choosing it; /internal/generate 503, which the router retries on another worker),
serves the open ones to their end and lets decode read the KV it holds for them, then exits 0.

    SIGTERM (server.py's _Server) -> Drain.start: draining -> Drain.wait, on a thread: until no
    request is open and no KV is held for a decode worker, or drain_timeout -> uvicorn's stop
    A second SIGTERM (or SIGINT) stops at once.

The worker's TP ranks ignore SIGTERM (engine/tp_rank.py): they keep stepping until rank 0 sends
STOP, and die with it if it is killed.
"""

from __future__ import annotations

import logging
import time

from pdserve.worker.async_engine import AsyncEngine

log = logging.getLogger("pdserve.worker")

POLL_S = 0.1


class Drain:
    def __init__(self, engine: AsyncEngine, timeout_s: float) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self.draining = False

    def start(self) -> None:
        self.draining = True
        log.info("stop signal: draining (new requests refused) for up to %g s", self.timeout_s)

    def busy(self) -> str | None:
        """What keeps the worker from exiting: open requests, KV held for decode; None once idle."""
        if not self.engine.alive:
            return None  # a failed engine serves nothing more
        held = self.engine.stats().num_held
        if self.engine.num_open or held:
            return f"{self.engine.num_open} requests open, {held} held for decode"
        return None

    def wait(self) -> bool:
        """Block until idle (True) or drain_timeout passes (False)."""
        deadline = time.monotonic() + self.timeout_s
        while (why := self.busy()) is not None:
            if time.monotonic() > deadline:
                log.warning("drain timeout (%g s) passed with %s: stopping anyway", self.timeout_s, why)
                return False
            time.sleep(POLL_S)
        log.info("drained: stopping")
        return True
