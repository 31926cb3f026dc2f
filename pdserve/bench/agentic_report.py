"""What an agentic level reports beyond every level's fields, and its table.

    sessions, sessions_completed     sessions sent; those whose every turn succeeded
    turns_per_session                mean turns sent per session
    mean/median_session_output_tps   per completed session: its output tokens / the seconds it waited
                                     on the server (its turns' end-to-end latencies summed; the think
                                     time between turns is the agent's, not the server's)
    gpus, output_throughput_per_gpu  the deployment's GPUs (--num-gpus, else those behind a pdserve
                                     router; null: not known) and output_throughput / gpus
    context_lens                     per request: prompt + answer tokens (usage); null where it failed
    mean_context_by_turn             per turn index: the mean context reached by the sessions there
    max_context_len                  the longest context any turn reached
    kv_bytes_moved, kv_moved_from    KV bytes decode workers read from prefill workers over the level:
                                     their own counters ("workers", by --metrics-url), else the
                                     router's ("router"); 0 with no hand-off (colocated); null where
                                     neither says

TTFT percentiles and the prefill tokens computed and cached are report.py's (from usage) and
workers.py's (the workers' counters). Outputs come conversation by conversation, each starting at
its turn 0 (multiturn.py), which is how they are split into sessions here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pdserve.bench.client import RequestOutput
from pdserve.bench.report import render_rows


def split_sessions(outputs: list[RequestOutput]) -> list[list[RequestOutput]]:
    """A level's outputs cut into sessions, each starting at its turn 0."""
    sessions: list[list[RequestOutput]] = []
    for o in outputs:
        if o.turn == 0 or not sessions:
            sessions.append([])
        sessions[-1].append(o)
    return sessions


def level_fields(outputs: list[RequestOutput], result: dict[str, Any], gpus: int | None) -> dict[str, Any]:
    """The agentic fields of one level; `result` is the level's other fields (throughput, KV metrics)."""
    sessions = split_sessions(outputs)
    done = [s for s in sessions if all(o.success for o in s)]
    waited = [(sum(o.output_tokens for o in s), sum(o.latency for o in s)) for s in done]
    tps = [tokens / seconds for tokens, seconds in waited if seconds > 0]
    contexts = [o.prompt_tokens + o.output_tokens if o.success else None for o in outputs]
    by_turn: dict[int, list[int]] = {}
    for o, context in zip(outputs, contexts):
        if context is not None:
            by_turn.setdefault(o.turn, []).append(context)
    moved, source = kv_moved(result)
    return {
        "sessions": len(sessions),
        "sessions_completed": len(done),
        "turns_per_session": len(outputs) / len(sessions) if sessions else None,
        "mean_session_output_tps": float(np.mean(tps)) if tps else None,
        "median_session_output_tps": float(np.median(tps)) if tps else None,
        "gpus": gpus,
        "output_throughput_per_gpu": result["output_throughput"] / gpus if gpus else None,
        "context_lens": contexts,
        "mean_context_by_turn": [
            float(np.mean(by_turn[k])) if k in by_turn else None for k in range(max(by_turn, default=-1) + 1)
        ],
        "max_context_len": max((max(cs) for cs in by_turn.values()), default=None),
        "kv_bytes_moved": moved,
        "kv_moved_from": source,
    }


def kv_moved(result: dict[str, Any]) -> tuple[int | None, str | None]:
    """KV bytes moved to decode workers over the level, and whose counters said so."""
    workers = result.get("prefix_cache_workers") or {}
    if any(w.get("loads_kv") for w in workers.get("workers") or []):
        return workers["decode"]["kv_bytes_read"], "workers"
    router = result.get("ttft_breakdown") or {}
    if "kv_transfers" in router:  # a pdserve router: kv_transfers is 0 without a hand-off
        per_request = router.get("kv_bytes_per_request") or 0.0
        return round(per_request * router["kv_transfers"]), "router"
    return None, None


def _done(r: dict[str, Any]) -> str:
    return f"{r.get('sessions_completed', '-')}/{r.get('sessions', '-')}"


def _mb(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / 1e6


COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], Any], int], ...] = (
    ("conc", lambda r: r.get("max_concurrency"), 0),
    ("sessions", _done, 0),
    ("turns", lambda r: r.get("turns_per_session"), 1),
    ("TTFT p50", lambda r: r.get("median_ttft_ms"), 1),
    ("TTFT p99", lambda r: r.get("p99_ttft_ms"), 1),
    ("tok/s/session", lambda r: r.get("median_session_output_tps"), 1),
    ("tok/s/GPU", lambda r: r.get("output_throughput_per_gpu"), 1),
    ("prompt tok", lambda r: r.get("total_input_tokens"), 0),
    ("cached", lambda r: r.get("total_cached_tokens"), 0),
    ("computed", lambda r: r.get("prefill_tokens_computed"), 0),
    ("KV moved MB", lambda r: _mb(r.get("kv_bytes_moved")), 1),
    ("max ctx", lambda r: r.get("max_context_len"), 0),
)


def _cell(value: Any, digits: int) -> str:
    if value is None:
        return "-"
    return value if isinstance(value, str) else f"{value:.{digits}f}"


def format_table(results: list[dict[str, Any]]) -> str:
    """One row per level: sessions done / sent, TTFT (ms), output tok/s per session (median) and per
    GPU, prompt tokens cached and computed, KV moved, the longest context. '-': not known."""
    rows = [[h for h, _, _ in COLUMNS]]
    rows += [[_cell(get(r), d) for _, get, d in COLUMNS] for r in results]
    return render_rows(rows)
