"""What the workers' /metrics say about a window of load: how busy decode and
prefill were and how long a step took.

Two scrapes (before, after) of each worker's Prometheus text give deltas of the
step-time histograms: busy fraction = seconds spent in steps / wall seconds,
mean step = seconds / steps. Samples are summed over label sets, so a worker
that labels by model or rank still reads as one engine.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Names the workers export (pdserve/worker/metrics.py).
DECODE_STEP = "pdserve_decode_step_seconds"  # histogram
PREFILL_STEP = "pdserve_prefill_step_seconds"  # histogram
DECODE_BATCH = "pdserve_decode_batch_size"  # histogram
RUNNING = "pdserve_num_requests_running"  # gauge
PREFIX_QUERIES = "pdserve_prefix_cache_queries_total"  # counter: prompt tokens looked up in the prefix cache
PREFIX_HITS = "pdserve_prefix_cache_hits_total"  # counter: of those, tokens found
BLOCKS_CACHED = "pdserve_kv_blocks_cached"  # gauge: blocks kept for reuse, not in use
KV_READ = "pdserve_kv_transfer_bytes_total"  # counter: KV bytes a decode worker's loads moved
KV_SAVED = "pdserve_kv_transfer_bytes_saved_total"  # counter: of its loads, bytes its prefix cache held

Scrape = dict[str, float]  # sample name (e.g. pdserve_decode_step_seconds_sum) -> value summed over labels


def metrics_url(url: str) -> str:
    """http://host:port -> http://host:port/metrics; a URL with a path is kept."""
    return url.rstrip("/") + "/metrics" if urlsplit(url).path in ("", "/") else url


def parse_metrics(text: str) -> Scrape:
    out: Scrape = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(("_bucket", "_created")):
                continue
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


def scrape(urls: list[str], timeout: float = 10.0) -> list[Scrape]:
    """One scrape of every worker; raises ValueError naming the worker that fails."""
    scrapes = []
    for url in urls:
        try:
            resp = httpx.get(metrics_url(url), timeout=timeout)
            resp.raise_for_status()
            scrapes.append(parse_metrics(resp.text))
        except (httpx.HTTPError, ValueError) as e:
            raise ValueError(f"cannot read metrics from {metrics_url(url)}: {e}") from e
    return scrapes


def _delta(before: Scrape, after: Scrape, name: str) -> float | None:
    if name not in after:
        return None
    return after[name] - before.get(name, 0.0)


def _phase(before: list[Scrape], after: list[Scrape], hist: str, window_s: float) -> dict[str, Any]:
    """Steps, mean step time and busy fraction of the busiest worker for one step histogram."""
    steps = seconds = 0.0
    busiest = None
    for b, a in zip(before, after):
        count, total = _delta(b, a, hist + "_count"), _delta(b, a, hist + "_sum")
        if count is None or total is None:
            continue
        steps += count
        seconds += total
        busiest = max(busiest or 0.0, total / window_s)
    return {
        "steps": int(steps),
        "mean_step_ms": seconds / steps * 1000.0 if steps else None,
        "busy_fraction": None if busiest is None else min(busiest, 1.0),
    }


def worker_stats(
    before: list[Scrape], after: list[Scrape], window_s: float, running: list[float] | None = None
) -> dict[str, Any]:
    """JSON-able summary of a window between two scrapes of the same workers."""
    if window_s <= 0:
        raise ValueError(f"window must be positive, got {window_s} s")
    decode = _phase(before, after, DECODE_STEP, window_s)
    prefill = _phase(before, after, PREFILL_STEP, window_s)
    batch_n = sum(_delta(b, a, DECODE_BATCH + "_count") or 0.0 for b, a in zip(before, after))
    batch_sum = sum(_delta(b, a, DECODE_BATCH + "_sum") or 0.0 for b, a in zip(before, after))
    return {
        "window_s": window_s,
        "decode_steps": decode["steps"],
        "mean_decode_step_ms": decode["mean_step_ms"],
        "decode_busy_fraction": decode["busy_fraction"],
        "prefill_steps": prefill["steps"],
        "mean_prefill_step_ms": prefill["mean_step_ms"],
        "prefill_busy_fraction": prefill["busy_fraction"],
        "mean_decode_batch": batch_sum / batch_n if batch_n else None,
        "mean_running": sum(running) / len(running) if running else None,
    }


def prefix_cache_stats(urls: list[str], before: list[Scrape], after: list[Scrape]) -> dict[str, Any]:
    """Prompt tokens the workers looked up in their prefix caches over a window, and found: summed
    over the workers that export the counters and load no KV (null where none does), and per
    worker. A worker that loaded KV (a decode worker) counts apart, in `decode`: the bytes its loads
    moved and those its cache held, and the prompt tokens it found cached."""
    per_worker = []
    for url, b, a in zip(urls, before, after):
        queries, hits = _delta(b, a, PREFIX_QUERIES), _delta(b, a, PREFIX_HITS)
        if queries is None or hits is None:
            continue
        read, saved = _delta(b, a, KV_READ) or 0.0, _delta(b, a, KV_SAVED) or 0.0
        per_worker.append(
            {"url": url, "queries": int(queries), "hits": int(hits), "blocks_cached": a.get(BLOCKS_CACHED),
             "kv_bytes_read": int(read), "kv_bytes_saved": int(saved), "loads_kv": read + saved > 0}
        )  # fmt: skip
    computing = [w for w in per_worker if not w["loads_kv"]]
    loading = [w for w in per_worker if w["loads_kv"]]
    read, saved = sum(w["kv_bytes_read"] for w in loading), sum(w["kv_bytes_saved"] for w in loading)
    decode = {
        "kv_bytes_read": read,
        "kv_bytes_saved": saved,
        "saved_fraction": saved / (read + saved) if read + saved else None,
        "hits": sum(w["hits"] for w in loading),
    }
    if not computing:
        return {"queries": None, "hits": None, "computed_tokens": None, "hit_rate": None, "decode": decode,
                "workers": per_worker}  # fmt: skip
    queries = sum(w["queries"] for w in computing)
    hits = sum(w["hits"] for w in computing)
    return {
        "queries": queries,
        "hits": hits,
        "computed_tokens": queries - hits,
        "hit_rate": hits / queries if queries else None,
        "decode": decode,
        "workers": per_worker,
    }


def watch(urls: list[str], seconds: float, interval: float = 1.0) -> dict[str, Any]:
    """Scrape now, sample running requests every `interval` s for `seconds`, scrape again."""
    t0 = time.monotonic()
    before = scrape(urls)
    running = []
    while time.monotonic() - t0 < seconds:
        time.sleep(min(interval, max(0.0, seconds - (time.monotonic() - t0))))
        now = scrape(urls)
        running.append(sum(s.get(RUNNING, 0.0) for s in now))
    after = scrape(urls)
    return worker_stats(before, after, time.monotonic() - t0, running)
