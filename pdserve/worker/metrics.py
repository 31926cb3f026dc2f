"""A worker's Prometheus metrics.

pdserve_num_requests_running / _waiting / _holding_kv   pdserve_kv_transfer_bytes_total, _bytes_saved_total
pdserve_kv_blocks_used / pdserve_kv_blocks_total        pdserve_kv_transfer_seconds
pdserve_kv_window_blocks_used / _total (sliding-window block space, DeepSeek-V4)
pdserve_kv_blocks_cached (prefix cache: blocks no request holds, kept for a hit; not in _used)
pdserve_prefix_cache_queries_total / _hits_total (prompt tokens looked up / found cached, vLLM's)
pdserve_prefill_step_seconds, pdserve_decode_step_seconds  pdserve_kv_transfer_failures_total
pdserve_decode_batch_size                               pdserve_kv_lease_expirations_total
pdserve_prompt_tokens_total, pdserve_generation_tokens_total  pdserve_kv_load_recomputes_total
pdserve_request_success_total{finish_reason}            pdserve_kv_transfer_staged_total{side,result}
                                                        pdserve_kv_transfer_path_total{path}
                                 pdserve_kv_verified_loads_total, pdserve_kv_verify_failures_total
pdserve_spec_decode_num_drafts_total, _num_draft_tokens_total, _num_accepted_tokens_total,
_num_accepted_tokens_per_pos_total{position} (speculative decoding, vLLM's names)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.disagg.stats import TransferStats
from pdserve.engine.spec_decode.metrics import SpecDecodeStats
from pdserve.wire.metrics import BATCH_BUCKETS, STEP_BUCKETS


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.running = Gauge("pdserve_num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("pdserve_num_requests_waiting", "Requests waiting (incl. for remote KV)", registry=r)
        self.held = Gauge(
            "pdserve_num_requests_holding_kv", "Prefill: requests whose KV waits for a decode worker", registry=r
        )
        self.blocks_used = Gauge("pdserve_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.blocks_total = Gauge("pdserve_kv_blocks_total", "KV cache blocks in the pool", registry=r)
        self.blocks_cached = Gauge(
            "pdserve_kv_blocks_cached", "Prefix-cached KV blocks no request holds (evictable)", registry=r
        )
        self.prefix_queries = Counter(
            "pdserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hits = Counter("pdserve_prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r)
        self.window_blocks_used = Gauge("pdserve_kv_window_blocks_used", "Sliding-window KV blocks in use", registry=r)
        self.window_blocks_total = Gauge(
            "pdserve_kv_window_blocks_total", "Sliding-window KV blocks in the pool", registry=r
        )
        self.prefill_step = Histogram(
            "pdserve_prefill_step_seconds", "Engine steps that ran prompt tokens", buckets=STEP_BUCKETS, registry=r
        )
        self.decode_step = Histogram(
            "pdserve_decode_step_seconds", "Engine steps that only decoded", buckets=STEP_BUCKETS, registry=r
        )
        self.decode_batch = Histogram(
            "pdserve_decode_batch_size", "Sequences in a decode-only step", buckets=BATCH_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens prefilled here", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Tokens sampled here", registry=r)
        self.finished = Counter(
            "pdserve_request_success", "Finished requests by finish reason", ["finish_reason"], registry=r
        )
        self.transfer_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes read from prefill workers", registry=r)
        self.transfer_bytes_saved = Counter(
            "pdserve_kv_transfer_bytes_saved", "KV bytes not read: blocks this worker's prefix cache held", registry=r
        )
        self.transfer_time = Histogram(
            "pdserve_kv_transfer_seconds", "One request's KV read, post to completion", buckets=STEP_BUCKETS, registry=r
        )
        self.transfer_failures = Counter("pdserve_kv_transfer_failures", "Failed KV reads", registry=r)
        self.lease_expirations = Counter(
            "pdserve_kv_lease_expirations", "Prefill leases that expired unread", registry=r
        )
        self.recomputes = Counter(
            "pdserve_kv_load_recomputes",
            "Failed KV loads recomputed here (kv_load_failure_policy recompute)",
            registry=r,
        )
        self.staged = Counter(
            "pdserve_kv_transfer_staged",
            "Staged transfers (one slab) by side and result: staged, arena_full, not_staged, peer_copies",
            ["side", "result"],
            registry=r,
        )
        self.paths = Counter(
            "pdserve_kv_transfer_path",
            "Finished KV reads by how the bytes moved: cuda_ipc, staged, blocks, none",
            ["path"],
            registry=r,
        )
        self.verified = Counter(
            "pdserve_kv_verified_loads", "KV loads whose blocks matched prefill's checksums", registry=r
        )
        self.verify_failures = Counter(
            "pdserve_kv_verify_failures", "KV reads whose blocks did not match prefill's checksums", registry=r
        )
        self.spec_drafts = Counter(
            "pdserve_spec_decode_num_drafts", "Verify chunks (drafts of one sequence)", registry=r
        )
        self.spec_draft_tokens = Counter("pdserve_spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.spec_accepted = Counter("pdserve_spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.spec_accepted_pos = Counter(
            "pdserve_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each position of the drafts",
            ["position"],
            registry=r,
        )
        self._seen_spec = SpecDecodeStats(0)
        self._seen = TransferStats()  # what has been exported of the connector's counters
        self._seen_recomputes = 0
        self._seen_prefix = (0, 0)  # prefix-cache (queries, hits) exported so far

    def observe_step(self, seconds: float, is_prefill: bool, batch_size: int) -> None:
        if is_prefill:
            self.prefill_step.observe(seconds)
        else:
            self.decode_step.observe(seconds)
            self.decode_batch.observe(batch_size)

    def sync_prefix_cache(self, blocks_cached: int, queries: int, hits: int) -> None:
        self.blocks_cached.set(blocks_cached)
        self.prefix_queries.inc(queries - self._seen_prefix[0])
        self.prefix_hits.inc(hits - self._seen_prefix[1])
        self._seen_prefix = (queries, hits)

    def sync_spec_decode(self, stats: SpecDecodeStats) -> None:
        """Export what speculation counted since the last call (the engine loop's thread)."""
        seen = self._seen_spec
        self.spec_drafts.inc(stats.num_drafts - seen.num_drafts)
        self.spec_draft_tokens.inc(stats.num_draft_tokens - seen.num_draft_tokens)
        self.spec_accepted.inc(stats.num_accepted_tokens - seen.num_accepted_tokens)
        before = seen.accepted_per_pos + [0] * (len(stats.accepted_per_pos) - len(seen.accepted_per_pos))
        for pos, (n, old) in enumerate(zip(stats.accepted_per_pos, before)):
            self.spec_accepted_pos.labels(position=str(pos)).inc(n - old)
        seen.num_drafts, seen.num_draft_tokens = stats.num_drafts, stats.num_draft_tokens
        seen.num_accepted_tokens, seen.accepted_per_pos = stats.num_accepted_tokens, list(stats.accepted_per_pos)

    def sync_recomputes(self, total: int) -> None:
        self.recomputes.inc(total - self._seen_recomputes)
        self._seen_recomputes = total

    def sync_transfer(self, stats: TransferStats) -> None:
        """Export what the connector counted since the last call (same thread as the connector)."""
        seen = self._seen
        self.transfer_bytes.inc(stats.bytes_transferred - seen.bytes_transferred)
        self.transfer_bytes_saved.inc(stats.bytes_saved - seen.bytes_saved)
        seen.bytes_saved = stats.bytes_saved
        self.transfer_failures.inc(stats.transfers_failed - seen.transfers_failed)
        self.lease_expirations.inc(stats.lease_expirations - seen.lease_expirations)
        new = stats.transfers_done - seen.transfers_done
        if new > 0:
            for load in list(stats.recent_loads)[-new:]:
                self.transfer_time.observe(load.seconds)
        for (side, result), n in list(stats.staged.items()):
            self.staged.labels(side=side, result=result).inc(n - seen.staged.get((side, result), 0))
            seen.staged[(side, result)] = n
        for path, n in list(stats.paths.items()):
            self.paths.labels(path=path).inc(n - seen.paths.get(path, 0))
            seen.paths[path] = n
        self.verified.inc(stats.verified_loads - seen.verified_loads)
        self.verify_failures.inc(stats.verify_failures - seen.verify_failures)
        seen.verified_loads, seen.verify_failures = stats.verified_loads, stats.verify_failures
        seen.bytes_transferred = stats.bytes_transferred
        seen.transfers_failed = stats.transfers_failed
        seen.lease_expirations = stats.lease_expirations
        seen.transfers_done = stats.transfers_done
