"""The router's view of its workers: who is healthy, what each one is, how loaded it is.

A prober GETs every worker's /health each `interval` seconds, and /internal/info when a worker is
new or restarted (its engine id changed). A worker is routable only after a successful probe.
A request that cannot reach a worker marks it down at once (the next good probe takes it back),
so a dead worker stops receiving traffic within one request, not one probe interval. Apart from
health, each worker has a circuit breaker fed by its requests' outcomes (breaker.py): requests go
only to workers that are healthy and whose breaker allows it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from pydantic import ValidationError

from pdserve.router.breaker import BreakerState, CircuitBreaker
from pdserve.router.metrics import RouterMetrics
from pdserve.wire.errors import OpenAIError
from pdserve.wire.protocol import WorkerHealth, WorkerInfo

log = logging.getLogger("pdserve.router")

PoolRole = Literal["prefill", "decode", "colocated"]
PROBE_TIMEOUT_S = 5.0  # each request of a probe
PROBE_DEADLINE_S = 3 * PROBE_TIMEOUT_S  # the whole probe: /health, /internal/info and any wait for a connection
DOWN_PROBE_INTERVAL_S = 1.0
RETRY_AFTER_S = 2  # what a 503 for "no worker can serve now" tells clients


@dataclass
class Worker:
    url: str
    role: PoolRole
    healthy: bool = False
    reason: str | None = "not probed yet"
    info: WorkerInfo | None = None
    last_health: WorkerHealth | None = None
    in_flight: int = 0
    failures: int = 0  # consecutive failed probes or calls
    last_probe: float | None = None  # monotonic
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)

    @property
    def name(self) -> str:
        return self.url.split("://", 1)[-1]

    def snapshot(self) -> dict[str, Any]:
        h = self.last_health
        return {
            "url": self.url,
            "role": self.role,
            "healthy": self.healthy,
            "reason": self.reason,
            "in_flight": self.in_flight,
            "consecutive_failures": self.failures,
            "breaker": self.breaker.state.name.lower(),
            "breaker_failures": self.breaker.failures,
            "breaker_opens": self.breaker.opens,
            "seconds_since_probe": None if self.last_probe is None else round(time.monotonic() - self.last_probe, 3),
            "engine_id": self.info.engine_id if self.info else None,
            "max_model_len": self.info.max_model_len if self.info else None,
            "device": self.info.device if self.info else None,
            "gpus": self.info.gpus if self.info else None,
            "num_requests_running": h.num_requests_running if h else None,
            "num_requests_waiting": h.num_requests_waiting if h else None,
            "kv_blocks_used": h.kv_blocks_used if h else None,
            "kv_blocks_total": h.kv_blocks_total if h else None,
        }


class WorkerPool:
    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        colocated: list[str],
        metrics: RouterMetrics,
        *,
        breaker_failures: int = 5,
        breaker_cooldown_s: float = 10.0,
    ) -> None:
        def make(url: str, role: PoolRole) -> Worker:
            return Worker(_clean(url), role, breaker=CircuitBreaker(breaker_failures, breaker_cooldown_s))

        self.workers = (
            [make(u, "prefill") for u in prefill]
            + [make(u, "decode") for u in decode]
            + [make(u, "colocated") for u in colocated]
        )
        self.metrics = metrics
        self.prober_error: str | None = None  # set if the prober ever stops: the pool's view is then stale
        for w in self.workers:
            self._export(w)

    def healthy(self, role: PoolRole) -> list[Worker]:
        return [w for w in self.workers if w.role == role and w.healthy]

    def available(self, role: PoolRole) -> list[Worker]:
        """Healthy and not cut off by an open breaker (a half-open one counts: it takes a trial)."""
        return [w for w in self.healthy(role) if w.breaker.state is not BreakerState.OPEN]

    def candidates(self, role: PoolRole) -> list[Worker]:
        """Workers a request may be sent to now."""
        return [w for w in self.healthy(role) if w.breaker.allows()]

    def can_pd(self) -> bool:
        return bool(self.available("prefill")) and bool(self.available("decode"))

    def can_serve(self) -> bool:
        return self.prober_error is None and (self.can_pd() or bool(self.available("colocated")))

    def missing(self) -> str:
        """Why no request can be served now, naming the roles that have no available worker."""
        if self.prober_error is not None:
            return self.prober_error
        roles = [r for r in ("prefill", "decode", "colocated") if any(w.role == r for w in self.workers)]
        down = [r for r in roles if not self.available(r)]
        return "no available " + " or ".join(f"{r} worker" for r in down) if down else "no available worker"

    def unavailable(self) -> OpenAIError:
        """The 503 for a request that arrives while no (prefill, decode) pair or colocated worker can serve."""
        return OpenAIError(
            503, f"{self.missing()}: the cluster cannot serve now (restarting?); retry shortly",
            code="no_healthy_workers", headers={"Retry-After": str(RETRY_AFTER_S)},
        )  # fmt: skip

    def max_model_len(self) -> int | None:
        """The smallest context any known worker allows (a request must fit wherever it lands)."""
        lens = [w.info.max_model_len for w in self.workers if w.info is not None]
        return min(lens) if lens else None

    def mark_down(self, w: Worker, reason: str) -> None:
        if w.healthy:
            log.warning("worker %s (%s) marked down: %s", w.url, w.role, reason)
        w.healthy, w.reason = False, reason
        w.failures += 1
        self._export(w)

    def acquire(self, w: Worker) -> None:
        w.in_flight += 1
        w.breaker.on_attempt()
        self.metrics.worker_in_flight.labels(w.name, w.role).set(w.in_flight)

    def release(self, w: Worker) -> None:
        w.in_flight -= 1
        w.breaker.on_end()
        self.metrics.worker_in_flight.labels(w.name, w.role).set(w.in_flight)

    def report(self, w: Worker, ok: bool) -> None:
        """A request's outcome on w, for its circuit breaker."""
        opens = w.breaker.opens
        if ok:
            w.breaker.record_success()
        else:
            w.breaker.record_failure()
        if w.breaker.opens != opens:
            log.warning(
                "worker %s (%s): circuit breaker opened after %d failed requests", w.url, w.role, w.breaker.failures
            )
            self.metrics.breaker_opens.labels(w.name, w.role).inc()
        self._export(w)

    # -- probing --
    async def run(self, client: httpx.AsyncClient, interval: float, headers: dict[str, str]) -> None:
        """Probe every `interval` seconds; while a worker is down, at least every second (a worker
        that is starting or restarting is taken back as soon as it can serve). The first round is
        the caller's (the router probes once before it accepts a connection), so this one waits
        first. Should this loop ever end other than by cancellation, the router stops serving and
        /health says why."""
        try:
            while True:
                down = any(not w.healthy for w in self.workers)
                await asyncio.sleep(min(interval, DOWN_PROBE_INTERVAL_S) if down else interval)
                await self.probe_all(client, headers)
        except Exception as e:
            log.critical("the worker prober stopped; this router serves nothing until restarted", exc_info=True)
            self.prober_error = f"the worker prober stopped ({type(e).__name__}: {e}); restart the router"
            raise

    async def probe_all(self, client: httpx.AsyncClient, headers: dict[str, str]) -> None:
        await asyncio.gather(*(self.probe(client, w, headers) for w in self.workers))
        for w in self.workers:  # an open breaker turns half-open with time alone
            self._export(w)

    async def probe(self, client: httpx.AsyncClient, w: Worker, headers: dict[str, str]) -> None:
        """One probe of w. Whatever goes wrong marks w down with the reason; nothing escapes, so a
        surprise from the HTTP stack (uvloop raises RuntimeError on a transport closed under it)
        cannot end the prober and leave the pool's view frozen."""
        try:
            async with asyncio.timeout(PROBE_DEADLINE_S):  # bounds the probe as a whole, pool waits included
                health = await self._probe(client, w, headers)
        except (httpx.HTTPError, ValidationError, _Unhealthy, TimeoutError) as e:
            w.last_probe = time.monotonic()
            if isinstance(e, (httpx.TimeoutException, TimeoutError)) and w.healthy and w.failures == 0:
                w.failures = 1  # a busy worker may answer late once; twice in a row is down
                return
            self.mark_down(w, _reason(e))
            return
        except Exception as e:  # noqa: BLE001 - not expected: logged with its traceback, counted as a failed probe
            log.exception("probing worker %s (%s) failed unexpectedly", w.url, w.role)
            w.last_probe = time.monotonic()
            self.mark_down(w, f"probe failed: {type(e).__name__}: {e}")
            return
        w.last_probe = time.monotonic()
        w.last_health = health
        if not w.healthy:
            log.info("worker %s (%s, engine %s) is healthy", w.url, w.role, health.engine_id)
        w.healthy, w.reason, w.failures = True, None, 0
        self._export(w)

    async def _probe(self, client: httpx.AsyncClient, w: Worker, headers: dict[str, str]) -> WorkerHealth:
        resp = await client.get(f"{w.url}/health", timeout=PROBE_TIMEOUT_S)
        health = WorkerHealth.model_validate_json(resp.content)
        if resp.status_code != 200:
            raise _Unhealthy(f"/health answered {resp.status_code}: {health.reason}")
        if w.info is None or (w.info.engine_id, w.info.instance_id) != (health.engine_id, health.instance_id):
            w.info = await self._info(client, w, headers)
        if w.info.role != w.role:
            raise _Unhealthy(f"configured as {w.role} but the worker's role is {w.info.role}")
        return health

    async def _info(self, client: httpx.AsyncClient, w: Worker, headers: dict[str, str]) -> WorkerInfo:
        resp = await client.get(f"{w.url}/internal/info", headers=headers, timeout=PROBE_TIMEOUT_S)
        if resp.status_code != 200:
            raise _Unhealthy(f"/internal/info answered {resp.status_code} (cluster secret?)")
        return WorkerInfo.model_validate_json(resp.content)

    def _export(self, w: Worker) -> None:
        self.metrics.worker_healthy.labels(w.name, w.role).set(1 if w.healthy else 0)
        self.metrics.worker_breaker.labels(w.name, w.role).set(int(w.breaker.state))


class _Unhealthy(Exception):
    pass


def _reason(e: Exception) -> str:
    if isinstance(e, _Unhealthy):
        return str(e)
    if isinstance(e, ValidationError):
        return "its /health answer is not a pdserve worker's"
    if isinstance(e, TimeoutError):
        return f"the probe did not finish within {PROBE_DEADLINE_S:g} s"
    return f"unreachable: {type(e).__name__}: {e}".rstrip(": ")


def _clean(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"worker URL {url!r} must start with http:// or https://")
    return url
