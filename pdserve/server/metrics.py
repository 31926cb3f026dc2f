"""Prometheus metrics of the router and the workers (names in the pdserve_ namespace, following
vLLM's where the meaning is the same). Each app owns its registry, so several apps can live in
one process (tests) without clashing.

Router                                              Workers
pdserve_router_requests_total{route,status}         pdserve_num_requests_running / _waiting
pdserve_router_requests_in_flight                   pdserve_kv_blocks_used / pdserve_kv_blocks_total
pdserve_time_to_first_token_seconds                 pdserve_prefill_step_seconds, pdserve_decode_step_seconds
pdserve_e2e_request_latency_seconds                 pdserve_decode_batch_size
pdserve_router_worker_healthy{worker,role}          pdserve_prompt_tokens_total, pdserve_generation_tokens_total
pdserve_router_worker_in_flight{worker,role}        pdserve_kv_transfer_bytes_total, pdserve_kv_transfer_seconds
pdserve_router_upstream_errors_total{role,kind}     pdserve_kv_transfer_failures_total
pdserve_router_retries_total{role}                  pdserve_kv_lease_expirations_total
pdserve_router_worker_breaker_state{worker,role}    pdserve_request_success_total{finish_reason}
pdserve_router_breaker_opens_total{worker,role}     pdserve_kv_load_recomputes_total
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdserve.disagg.lease import TransferStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
disable_created_metrics()  # no *_created samples: they double every counter's lines for nothing
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("pdserve_router_requests", "Requests by route and HTTP status", ["route", "status"], registry=r)
        self.in_flight = Gauge("pdserve_router_requests_in_flight", "Requests the router is serving now", registry=r)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Router arrival to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Router arrival to last token", buckets=_LATENCY_BUCKETS, registry=r)
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


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.running = Gauge("pdserve_num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("pdserve_num_requests_waiting", "Requests waiting (incl. for remote KV)", registry=r)
        self.held = Gauge("pdserve_num_requests_holding_kv", "Prefill: requests whose KV waits for a decode worker", registry=r)
        self.blocks_used = Gauge("pdserve_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.blocks_total = Gauge("pdserve_kv_blocks_total", "KV cache blocks in the pool", registry=r)
        self.prefill_step = Histogram("pdserve_prefill_step_seconds", "Engine steps that ran prompt tokens", buckets=_STEP_BUCKETS, registry=r)
        self.decode_step = Histogram("pdserve_decode_step_seconds", "Engine steps that only decoded", buckets=_STEP_BUCKETS, registry=r)
        self.decode_batch = Histogram("pdserve_decode_batch_size", "Sequences in a decode-only step", buckets=_BATCH_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens prefilled here", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Tokens sampled here", registry=r)
        self.finished = Counter("pdserve_request_success", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.transfer_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes read from prefill workers", registry=r)
        self.transfer_time = Histogram("pdserve_kv_transfer_seconds", "One request's KV read, post to completion", buckets=_STEP_BUCKETS, registry=r)
        self.transfer_failures = Counter("pdserve_kv_transfer_failures", "Failed KV reads", registry=r)
        self.lease_expirations = Counter("pdserve_kv_lease_expirations", "Prefill leases that expired unread", registry=r)
        self.recomputes = Counter("pdserve_kv_load_recomputes", "Failed KV loads recomputed here (kv_load_failure_policy recompute)", registry=r)
        self._seen = TransferStats()  # what has been exported of the connector's counters
        self._seen_recomputes = 0

    def observe_step(self, seconds: float, is_prefill: bool, batch_size: int) -> None:
        if is_prefill:
            self.prefill_step.observe(seconds)
        else:
            self.decode_step.observe(seconds)
            self.decode_batch.observe(batch_size)

    def sync_recomputes(self, total: int) -> None:
        self.recomputes.inc(total - self._seen_recomputes)
        self._seen_recomputes = total

    def sync_transfer(self, stats: TransferStats) -> None:
        """Export what the connector counted since the last call (same thread as the connector)."""
        seen = self._seen
        self.transfer_bytes.inc(stats.bytes_transferred - seen.bytes_transferred)
        self.transfer_failures.inc(stats.transfers_failed - seen.transfers_failed)
        self.lease_expirations.inc(stats.lease_expirations - seen.lease_expirations)
        new = stats.transfers_done - seen.transfers_done
        if new > 0:
            for s in list(stats.recent_transfer_seconds)[-new:]:
                self.transfer_time.observe(s)
        seen.bytes_transferred = stats.bytes_transferred
        seen.transfers_failed = stats.transfers_failed
        seen.lease_expirations = stats.lease_expirations
        seen.transfers_done = stats.transfers_done
