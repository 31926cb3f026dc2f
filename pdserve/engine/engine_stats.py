"""`EngineStats`: what an engine reports of its queues, pools and prefix cache (a worker's
/metrics and /health read it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int  # includes requests waiting for remote KV
    num_waiting_for_remote_kv: int
    num_held: int  # prefill role: finished requests whose blocks wait for the decode side
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    num_kv_load_recomputes: int = 0  # decode role: failed loads recomputed locally
    num_awaiting_handoff: int = 0  # decode role: waiting for prefill's hand-off (in num_waiting too)
    kv_window_blocks_used: int = 0  # sliding-window block space (DeepSeek-V4), block_manager.py
    kv_window_blocks_total: int = 0
    kv_state_slots_used: int = 0  # per-sequence state space (DeepSeek-V4's compressors)
    kv_state_slots_total: int = 0
    kv_blocks_cached: int = 0  # prefix cache: blocks no request holds, kept for a hit (not in kv_blocks_used)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (vLLM's counters)
    prefix_cache_hits: int = 0  # of them, found cached


def collect_stats(scheduler, block_manager, remote_kv) -> EngineStats:
    """The engine's numbers now (read on the step loop's thread)."""
    c = scheduler.counts()
    remote = remote_kv
    awaiting = remote.num_awaiting if remote is not None else 0
    cache = block_manager.prefix_cache
    return EngineStats(
        num_running=c.running,
        num_waiting=c.waiting + awaiting,
        num_waiting_for_remote_kv=c.waiting_for_remote_kv + awaiting,
        num_held=c.held,
        kv_blocks_used=block_manager.num_used_blocks,
        kv_blocks_total=block_manager.num_total_blocks,
        num_preemptions=c.preemptions,
        num_kv_load_recomputes=remote.num_kv_load_recomputes if remote is not None else 0,
        num_awaiting_handoff=awaiting,
        kv_window_blocks_used=block_manager.num_used_window_blocks,
        kv_window_blocks_total=block_manager.num_total_window_blocks,
        kv_state_slots_used=block_manager.num_used_state_slots,
        kv_state_slots_total=block_manager.num_total_state_slots,
        kv_blocks_cached=block_manager.num_cached_blocks,
        prefix_cache_queries=cache.queries if cache is not None else 0,
        prefix_cache_hits=cache.hits if cache is not None else 0,
    )
