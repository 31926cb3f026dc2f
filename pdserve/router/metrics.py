"""The router's Prometheus metrics.

pdserve_router_requests_total{route,status}         pdserve_router_worker_healthy{worker,role}
pdserve_router_requests_in_flight                   pdserve_router_worker_in_flight{worker,role}
pdserve_time_to_first_token_seconds                 pdserve_router_upstream_errors_total{role,kind}
pdserve_e2e_request_latency_seconds                 pdserve_router_retries_total{role}
pdserve_router_prompt_tokens_total                  pdserve_router_worker_breaker_state{worker,role}
pdserve_router_generation_tokens_total              pdserve_router_breaker_opens_total{worker,role}
pdserve_router_tool_parse_failures_total{reason}    (chat: model markup that stayed text, responses.py)
pdserve_router_cache_aware_routes_total{role,outcome}  cache_aware's choices: cache | cold | balance
pdserve_router_cache_aware_matched_tokens_total{role}  prompt tokens the chosen worker was believed to hold

Where the time goes, from the RequestTiming a worker sends with its first new token:
pdserve_router_ttft_breakdown_seconds{part}   queue | prefill (on the worker that made the first
                                              token) | other (router, HTTP: the rest of the span)
pdserve_router_pd_handoff_seconds{part}       PD, first token -> decode's first token: dispatch
                                              (what the router still waited for: decode's headers,
                                              its own POST of the hand-off) | decode_queue (waiting
                                              for blocks) | kv_transfer | first_decode | other
pdserve_router_pd_handoffs_total{via}         prefill (its engine notified decode's) | router
                                              (prefill could not: the router posted it)
pdserve_router_kv_transfer_bytes_total        KV bytes of those transfers (GB/s = this / the
                                              kv_transfer part's sum)
pdserve_router_kv_transfer_bytes_saved_total  KV bytes they did not move: blocks the decode
                                              worker's prefix cache held

With --api-server-count every router process writes to one Prometheus multiprocess folder and
render() reads them all: counters and histograms add up, in-flight gauges add up over the live
processes, a worker counts as healthy only if every process sees it so, and a breaker shows its
worst state.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.multiprocess import MultiProcessCollector

from pdserve.wire.metrics import LATENCY_BUCKETS, render
from pdserve.wire.protocol import RequestTiming


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "pdserve_router_requests", "Requests by route and HTTP status", ["route", "status"], registry=r
        )
        # gauges' multiprocess_mode: how the router's processes add up (--api-server-count; else unused)
        self.in_flight = Gauge(
            "pdserve_router_requests_in_flight",
            "Requests the router is serving now",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds", "Router arrival to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds", "Router arrival to last token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.worker_healthy = Gauge(
            "pdserve_router_worker_healthy",
            "1 if the worker's last probe succeeded",
            ["worker", "role"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.worker_in_flight = Gauge(
            "pdserve_router_worker_in_flight",
            "Router requests on the worker now",
            ["worker", "role"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.upstream_errors = Counter(
            "pdserve_router_upstream_errors", "Failed calls to workers", ["role", "kind"], registry=r
        )
        self.migrations = Counter(
            "pdserve_router_migrations", "Requests continued on another worker after theirs failed mid-request",
            ["role", "cause"], registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "pdserve_router_retries", "Requests sent to another worker after one refused", ["role"], registry=r
        )
        self.worker_breaker = Gauge(
            "pdserve_router_worker_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open", ["worker", "role"], registry=r,
            multiprocess_mode="livemax",
        )  # fmt: skip
        self.breaker_opens = Counter(
            "pdserve_router_breaker_opens", "Times a worker's circuit breaker opened", ["worker", "role"], registry=r
        )
        self.prompt_tokens = Counter("pdserve_router_prompt_tokens", "Prompt tokens of served requests", registry=r)
        self.generation_tokens = Counter("pdserve_router_generation_tokens", "Tokens returned to clients", registry=r)
        self.ttft_parts = Histogram(
            "pdserve_router_ttft_breakdown_seconds",
            "Time to first token by part: queue, prefill, other",
            ["part"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.handoff_parts = Histogram(
            "pdserve_router_pd_handoff_seconds",
            "PD first token to decode's first token by part",
            ["part"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.handoffs = Counter(
            "pdserve_router_pd_handoffs", "PD hand-offs by who delivered them to decode", ["via"], registry=r
        )
        self.kv_bytes = Counter(
            "pdserve_router_kv_transfer_bytes", "KV bytes decode workers read for the router's requests", registry=r
        )
        self.kv_bytes_saved = Counter(
            "pdserve_router_kv_transfer_bytes_saved",
            "KV bytes decode workers did not read for the router's requests (their prefix caches held them)",
            registry=r,
        )
        self.tool_parse_failures = Counter(
            "pdserve_router_tool_parse_failures",
            "Markup in model output that did not parse (a tool call, a think tag) and stayed text, by reason",
            ["reason"],
            registry=r,
        )

        self.cache_routes = Counter(
            "pdserve_router_cache_aware_routes",
            "cache_aware policy choices among several workers: cache (best prefix match), cold, balance (least loaded)",
            ["role", "outcome"],
            registry=r,
        )
        self.cache_matched = Counter(
            "pdserve_router_cache_aware_matched_tokens",
            "Prompt tokens the worker cache_aware chose was believed to hold",
            ["role"],
            registry=r,
        )

    def cache_route(self, role: str) -> Callable[[str, int], None]:
        """cache_aware's observer for one role's choices."""

        def observe(outcome: str, matched: int) -> None:
            self.cache_routes.labels(role, outcome).inc()
            self.cache_matched.labels(role).inc(matched)

        return observe

    def render(self) -> bytes:
        """The exposition: this process's registry, or every router process's (--api-server-count)."""
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return render(self.registry)
        whole = CollectorRegistry()
        MultiProcessCollector(whole)
        return render(whole)

    def observe_ttft(self, timing: RequestTiming | None, seconds: float) -> None:
        """The router's span to a request's first token (`seconds`), split by the worker's timing."""
        if timing is None:
            return
        self.ttft_parts.labels("queue").observe(timing.queue_s)
        self.ttft_parts.labels("prefill").observe(timing.compute_s)
        self.ttft_parts.labels("other").observe(max(0.0, seconds - timing.queue_s - timing.compute_s))

    def observe_handoff(self, timing: RequestTiming | None, seconds: float, dispatch_s: float = 0.0) -> None:
        """PD: the span from the first token to decode's first chunk (`seconds`), split likewise;
        `dispatch_s`: what the router waited for after the first token before reading decode's
        stream (decode's response headers, if not there yet; the hand-off's POST, if it made one)."""
        if timing is None:
            return
        worker = timing.queue_s + timing.compute_s + (timing.transfer_s or 0.0)
        self.handoff_parts.labels("dispatch").observe(dispatch_s)
        self.handoff_parts.labels("decode_queue").observe(timing.queue_s)
        if timing.transfer_s is not None:
            self.handoff_parts.labels("kv_transfer").observe(timing.transfer_s)
            self.kv_bytes.inc(timing.transfer_bytes or 0)
            self.kv_bytes_saved.inc(timing.transfer_bytes_saved or 0)
        self.handoff_parts.labels("first_decode").observe(timing.compute_s)
        self.handoff_parts.labels("other").observe(max(0.0, seconds - worker - dispatch_s))
