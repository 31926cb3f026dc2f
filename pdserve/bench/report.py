"""Per-level metrics, the printed table and the JSON file.

Field names follow `vllm bench serve` wherever the metric is the same
(`completed`, `request_throughput`, `mean_ttft_ms`, `p99_itl_ms`, `e2el` for
end-to-end latency, ...), so its plotting and comparison scripts read ours.
TPOT of one request is (e2el - ttft) / (output_tokens - 1); ITL is every gap
between token chunks. Latency statistics over no samples are null.

Prefix caching, from the responses' usage (`prompt_tokens_details.cached_tokens`, OpenAI's field):
prompt tokens served (`total_input_tokens`), found in the cache (`total_cached_tokens`), computed
(`prefill_tokens_computed` = served - cached) and `prefix_cache_hit_rate` (cached / served); all
null, with `cached_tokens_reported` false, unless every completed request's usage says. The
workers' own counters (pdserve_prefix_cache_*) are workers.py's. Multi-turn levels also give
median TTFT of first turns and of later turns (whose prompts the cache may hold); agentic levels
add agentic_report.py's fields.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from pdserve.bench.client import RequestOutput

PERCENTILES = (90, 99)
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft_ms=500,tpot_ms=50' -> {'ttft_ms': 500.0, 'tpot_ms': 50.0}."""
    slo: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad SLO entry {part!r}: expected KEY=MS with KEY one of {', '.join(SLO_KEYS)}")
        try:
            slo[key] = float(value)
        except ValueError:
            raise ValueError(f"bad SLO value in {part!r}: {value!r} is not a number of milliseconds") from None
        if slo[key] <= 0:
            raise ValueError(f"SLO {key} must be positive, got {value}")
    return slo


def _tpot(o: RequestOutput) -> float | None:
    return (o.latency - o.ttft) / (o.output_tokens - 1) if o.output_tokens > 1 else None


def _stats(name: str, seconds: list[float]) -> dict[str, float | None]:
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    empty = ms.size == 0
    out: dict[str, float | None] = {
        f"mean_{name}_ms": None if empty else float(ms.mean()),
        f"median_{name}_ms": None if empty else float(np.median(ms)),
        f"std_{name}_ms": None if empty else float(ms.std()),
    }
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = None if empty else float(np.percentile(ms, p))
    return out


def _is_good(o: RequestOutput, slo: dict[str, float]) -> bool:
    values = {"ttft_ms": o.ttft * 1000.0, "e2el_ms": o.latency * 1000.0}
    tpot = _tpot(o)
    values["tpot_ms"] = 0.0 if tpot is None else tpot * 1000.0
    return all(values[k] <= limit for k, limit in slo.items())


def _peak_concurrency(outputs: list[RequestOutput]) -> int:
    """Most requests in flight at once, from the successful requests' spans."""
    events = []
    for o in outputs:
        if o.success:
            events += [(o.start_time, 1), (o.start_time + o.latency, -1)]
    peak = now = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):
        now += step
        peak = max(peak, now)
    return peak


def level_metrics(
    outputs: list[RequestOutput],
    duration: float,
    max_concurrency: int,
    request_rate: float,
    slo: dict[str, float],
) -> dict[str, Any]:
    ok = [o for o in outputs if o.success]
    total_in = sum(o.prompt_tokens for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    tpots = [t for t in map(_tpot, ok) if t is not None]
    good = sum(_is_good(o, slo) for o in ok) if slo else None
    result: dict[str, Any] = {
        "max_concurrency": max_concurrency,
        "request_rate": "inf" if request_rate == float("inf") else request_rate,
        "num_prompts": len(outputs),
        "duration": duration,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": None if good is None else good / duration,
        "good_completed": good,
        "input_throughput": total_in / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_concurrent_requests": _peak_concurrency(outputs),
        "usage_reported": all(o.usage_reported for o in ok),
    }
    result.update(_cache_fields(ok))
    if any(o.turn for o in outputs):
        result["median_ttft_first_turn_ms"] = _median_ms([o.ttft for o in ok if o.turn == 0])
        result["median_ttft_later_turns_ms"] = _median_ms([o.ttft for o in ok if o.turn > 0])
    result.update(_stats("ttft", [o.ttft for o in ok]))
    result.update(_stats("tpot", tpots))
    result.update(_stats("itl", [gap for o in ok for gap in o.itl]))
    result.update(_stats("e2el", [o.latency for o in ok]))
    result.update(
        {
            "input_lens": [o.prompt_tokens for o in outputs],
            "output_lens": [o.output_tokens for o in outputs],
            "cached_lens": [o.cached_tokens for o in outputs],
            "turns": [o.turn for o in outputs],
            "ttfts": [o.ttft for o in outputs],
            "itls": [[round(gap, 6) for gap in o.itl] for o in outputs],  # s, to the microsecond
            "start_times": [o.start_time for o in outputs],
            "errors": [o.error for o in outputs],
            "error_counts": dict(Counter(o.error for o in outputs if not o.success)),
        }
    )
    return result


def _median_ms(seconds: list[float]) -> float | None:
    return float(np.median(seconds)) * 1000.0 if seconds else None


def _cache_fields(ok: list[RequestOutput]) -> dict[str, Any]:
    served = sum(o.prompt_tokens for o in ok)
    reported = bool(ok) and all(o.cached_tokens is not None for o in ok)
    cached = sum(o.cached_tokens or 0 for o in ok) if reported else None
    return {
        "cached_tokens_reported": reported,
        "total_cached_tokens": cached,
        "prefill_tokens_computed": None if cached is None else served - cached,
        "prefix_cache_hit_rate": None if cached is None or not served else cached / served,
    }


def _fmt(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


TABLE_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("conc", "max_concurrency", 0),
    ("done", "completed", 0),
    ("fail", "failed", 0),
    ("dur s", "duration", 2),
    ("req/s", "request_throughput", 2),
    ("out tok/s", "output_throughput", 1),
    ("tot tok/s", "total_token_throughput", 1),
    ("TTFT med", "median_ttft_ms", 1),
    ("TTFT p99", "p99_ttft_ms", 1),
    ("TPOT med", "median_tpot_ms", 1),
    ("ITL med", "median_itl_ms", 1),
    ("ITL p99", "p99_itl_ms", 1),
    ("E2E med", "median_e2el_ms", 1),
    ("good/s", "request_goodput", 2),
)


def format_table(results: list[dict[str, Any]]) -> str:
    """One row per level; latencies in ms."""
    rows = [[h for h, _, _ in TABLE_COLUMNS]]
    for r in results:
        rows.append([_fmt(r.get(key), d) if d else str(r.get(key, "-")) for _, key, d in TABLE_COLUMNS])
    lines = render_rows(rows).splitlines()
    for r in results:
        for error, count in (r.get("error_counts") or {}).items():
            lines.append(f"c={r['max_concurrency']}: {count} failed: {error}")
    return "\n".join(lines)


CACHE_COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], Any], int], ...] = (
    ("conc", lambda r: r.get("max_concurrency"), 0),
    ("prompt tok", lambda r: r.get("total_input_tokens"), 0),
    ("cached", lambda r: r.get("total_cached_tokens"), 0),
    ("computed", lambda r: r.get("prefill_tokens_computed"), 0),
    ("hit %", lambda r: _pct(r.get("prefix_cache_hit_rate")), 1),
    ("workers hit %", lambda r: _pct((r.get("prefix_cache_workers") or {}).get("hit_rate")), 1),
    ("workers computed", lambda r: (r.get("prefix_cache_workers") or {}).get("computed_tokens"), 0),
    ("KV read MB", lambda r: _mb(((r.get("prefix_cache_workers") or {}).get("decode") or {}).get("kv_bytes_read")), 1),
    (
        "KV saved %",
        lambda r: _pct(((r.get("prefix_cache_workers") or {}).get("decode") or {}).get("saved_fraction")),
        1,
    ),
    ("TTFT med", lambda r: r.get("median_ttft_ms"), 1),
    ("TTFT 1st turn", lambda r: r.get("median_ttft_first_turn_ms"), 1),
    ("TTFT later", lambda r: r.get("median_ttft_later_turns_ms"), 1),
)


def _pct(rate: float | None) -> float | None:
    return None if rate is None else rate * 100.0


def _mb(nbytes: int | None) -> float | None:
    """Bytes as MB; None where no decode worker's metrics were read (or it loaded nothing)."""
    return nbytes / 1e6 if nbytes else None


def format_cache_table(results: list[dict[str, Any]]) -> str:
    """Prefix caching per level: prompt tokens served, cached, computed (by the responses' usage and
    by the workers' counters), hit rates, the decode workers' KV bytes read and the share of the
    prompts' KV their prefix caches held (not read), TTFT. '-': not reported."""
    rows = [[h for h, _, _ in CACHE_COLUMNS]]
    for r in results:
        rows.append(["-" if get(r) is None else f"{get(r):.{d}f}" for _, get, d in CACHE_COLUMNS])
    return render_rows(rows)


def render_rows(rows: list[list[str]]) -> str:
    """A header row and data rows as right-aligned columns, a rule under the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str, doc: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


def read_results(path: str) -> dict[str, Any]:
    """A results file written by `pdserve bench` (or vllm-shaped: {"results": [...]})."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read results file {path}: {e}") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list) or not doc["results"]:
        raise ValueError(f"{path} is not a pdserve bench results file (no non-empty 'results' list)")
    for i, r in enumerate(doc["results"]):
        if "max_concurrency" not in r or "output_throughput" not in r:
            raise ValueError(f"{path}: results[{i}] lacks max_concurrency or output_throughput")
    return doc
