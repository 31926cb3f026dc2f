"""A worker whose engine has failed exits, for its supervisor (`pdserve launch`, systemd,
Kubernetes) to start a fresh one: a live worker with a dead engine would answer 503 for ever.

    watch_engine (event loop, every WATCH_INTERVAL_S)
        a TP rank exited? -> engine.fail(why)       (rank 0 may sit in a collective it never leaves)
        TP > 1 and a step unfinished for stall_timeout with requests open? -> a rank stopped
                          answering (SIGSTOP, a hung collective: gloo and NCCL would wait for
                          COLLECTIVE_TIMEOUT) -> engine.fail(why), kill the ranks (rank 0's
                          collective then returns with an error, and the worker can exit)
        engine.error set  -> log it, wait EXIT_DELAY_S (/health is 503 with the reason meanwhile,
                             the failed requests' last chunks go out) -> exit_process(EXIT_CODE)
    exit_process: uvicorn's graceful stop (serve.py's app.state.request_stop; else SIGTERM to
                  itself), after which `pdserve serve` exits app.state.exit_code; as a bound,
                  os._exit after HARD_EXIT_S if that stop hangs (an engine thread stuck in a
                  collective with a dead rank)
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Callable

from fastapi import FastAPI

from pdserve.worker.async_engine import AsyncEngine

log = logging.getLogger("pdserve.worker")

WATCH_INTERVAL_S = 0.2
EXIT_DELAY_S = 1.0
HARD_EXIT_S = 20.0
EXIT_CODE = 3  # not 0, so a restart policy of on-failure restarts it; 1 and 2 are start-up errors


async def watch_engine(
    engine: AsyncEngine, role: str, exit_process: Callable[[int], None], stopping: threading.Event
) -> None:
    """Runs for the worker's life; returns after asking the process to exit once the engine failed.
    stopping: set on a stop signal (its process group's ranks get it too: that is no failure)."""
    while engine.error is None:
        await asyncio.sleep(WATCH_INTERVAL_S)
        if stopping.is_set():
            return
        dead = engine.dead_rank()
        if dead is not None:
            log.error("%s", dead)
            engine.fail(dead)
            continue
        hung = hung_rank(engine)
        if hung is not None:
            log.error("%s", hung)
            engine.fail(hung)
            engine.engine.runner.ranks.kill()
    log.error("the %s worker's engine failed (%s): exiting for its supervisor to restart it", role, engine.error)
    await asyncio.sleep(EXIT_DELAY_S)
    exit_process(EXIT_CODE)


def hung_rank(engine: AsyncEngine) -> str | None:
    """At TP > 1, a step that has not finished for the stall timeout while requests are open: a
    rank stopped answering (a step takes milliseconds; the first ones' compiles, seconds). None
    at TP1, where a stall only makes /health 503."""
    if engine.engine.runner.ranks is None:
        return None
    stalled = engine.stalled()
    return None if stalled is None else f"a tensor-parallel rank stopped answering: {stalled}"


def exit_process(app: FastAPI, code: int) -> None:
    """Stop this process as a stop signal does; `pdserve serve` then exits app.state.exit_code."""
    app.state.exit_code = code
    timer = threading.Timer(HARD_EXIT_S, os._exit, (code,))
    timer.daemon = True
    timer.start()
    stop = getattr(app.state, "request_stop", None)  # serve.py's: uvicorn's own stop, no signal re-raised
    if stop is not None:
        stop()
    else:
        os.kill(os.getpid(), signal.SIGTERM)
