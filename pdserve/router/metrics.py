"""The router's Prometheus metrics.

pdserve_router_requests_total{route,status}         pdserve_router_worker_healthy{worker,role}
pdserve_router_requests_in_flight                   pdserve_router_worker_in_flight{worker,role}
pdserve_time_to_first_token_seconds                 pdserve_router_upstream_errors_total{role,kind}
pdserve_e2e_request_latency_seconds                 pdserve_router_retries_total{role}
pdserve_router_prompt_tokens_total                  pdserve_router_worker_breaker_state{worker,role}
pdserve_router_generation_tokens_total              pdserve_router_breaker_opens_total{worker,role}
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.wire.metrics import LATENCY_BUCKETS


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("pdserve_router_requests", "Requests by route and HTTP status", ["route", "status"], registry=r)
        self.in_flight = Gauge("pdserve_router_requests_in_flight", "Requests the router is serving now", registry=r)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Router arrival to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Router arrival to last token", buckets=LATENCY_BUCKETS, registry=r)
        self.worker_healthy = Gauge("pdserve_router_worker_healthy", "1 if the worker's last probe succeeded", ["worker", "role"], registry=r)
        self.worker_in_flight = Gauge("pdserve_router_worker_in_flight", "Router requests on the worker now", ["worker", "role"], registry=r)
        self.upstream_errors = Counter("pdserve_router_upstream_errors", "Failed calls to workers", ["role", "kind"], registry=r)
        self.retries = Counter("pdserve_router_retries", "Requests sent to another worker after one refused", ["role"], registry=r)
        self.worker_breaker = Gauge(
            "pdserve_router_worker_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open", ["worker", "role"], registry=r
        )
        self.breaker_opens = Counter("pdserve_router_breaker_opens", "Times a worker's circuit breaker opened", ["worker", "role"], registry=r)
        self.prompt_tokens = Counter("pdserve_router_prompt_tokens", "Prompt tokens of served requests", registry=r)
        self.generation_tokens = Counter("pdserve_router_generation_tokens", "Tokens returned to clients", registry=r)
