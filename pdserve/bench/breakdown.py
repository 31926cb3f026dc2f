"""Where a request's time to first token goes, read from the router's /metrics, and what the
deployment is (workers and GPUs), read from its /workers.

Two scrapes of the router around a level give each part's mean over that level's requests
(router/metrics.py names them):

    TTFT (router arrival -> first token) = queue + prefill + other, on the worker that made the
        first token (PD: the prefill worker; other = router, HTTP, network)
    PD hand-off (first token -> decode's first token) = dispatch + decode_queue + kv_transfer
        + first_decode + other, with the KV bytes per request and their rate (bytes / transfer
        seconds); dispatch = what the router still waited for after the first token (its own
        turn back to decode's stream under load; decode's response headers; its POST of the
        hand-off when prefill could not send it), other = what no part names; and how many
        hand-offs went engine to engine (via prefill) or through the router

In pdserve the first token is prefill's: PD's KV transfer is not in TTFT but in the hand-off, the
wait for the second token.
"""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

TTFT = "pdserve_router_ttft_breakdown_seconds"
HANDOFF = "pdserve_router_pd_handoff_seconds"
KV_BYTES = "pdserve_router_kv_transfer_bytes_total"
KV_SAVED = "pdserve_router_kv_transfer_bytes_saved_total"
HANDOFFS = "pdserve_router_pd_handoffs_total"
ROUTER_TTFT = "pdserve_time_to_first_token_seconds"
TTFT_PARTS = ("queue", "prefill", "other")
HANDOFF_PARTS = ("dispatch", "decode_queue", "kv_transfer", "first_decode", "other")

Scrape = dict[str, float]  # "name" or "name{part}" -> value


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def parse(text: str) -> Scrape:
    """The breakdown's samples from Prometheus text: histogram sums and counts by part."""
    out: Scrape = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_sum", "_count")) and family.name in (TTFT, HANDOFF, ROUTER_TTFT):
                key = f"{s.name}{{{s.labels['part']}}}" if "part" in s.labels else s.name
                out[key] = float(s.value)
            elif s.name in (KV_BYTES, KV_SAVED):
                out[s.name] = float(s.value)
            elif s.name == HANDOFFS:
                out[f"{s.name}{{{s.labels.get('via', '')}}}"] = float(s.value)
    return out


def scrape(base_url: str, api_key: str | None = None, timeout: float = 10.0) -> Scrape:
    """The router's breakdown samples; raises ValueError when /metrics cannot be read."""
    url = base_url.rstrip("/") + "/metrics"
    try:
        resp = httpx.get(url, headers=_headers(api_key), timeout=timeout)
        resp.raise_for_status()
        return parse(resp.text)
    except (httpx.HTTPError, ValueError) as e:
        raise ValueError(f"cannot read router metrics from {url}: {e}") from e


def _delta(before: Scrape, after: Scrape, family: str, part: str | None, stat: str) -> float:
    key = f"{family}_{stat}" + (f"{{{part}}}" if part else "")
    return after.get(key, 0.0) - before.get(key, 0.0)


def _mean_ms(before: Scrape, after: Scrape, family: str, part: str | None = None) -> float | None:
    n = _delta(before, after, family, part, "count")
    return _delta(before, after, family, part, "sum") / n * 1000.0 if n else None


def breakdown(before: Scrape, after: Scrape) -> dict[str, Any]:
    """Mean ms of each part over the requests between two scrapes (None where none had it)."""
    n_pd = int(_delta(before, after, HANDOFF, "first_decode", "count"))
    n_kv = int(_delta(before, after, HANDOFF, "kv_transfer", "count"))
    kv_s = _delta(before, after, HANDOFF, "kv_transfer", "sum")
    kv_bytes = after.get(KV_BYTES, 0.0) - before.get(KV_BYTES, 0.0)
    kv_saved = after.get(KV_SAVED, 0.0) - before.get(KV_SAVED, 0.0)
    return {
        "requests": int(_delta(before, after, TTFT, "prefill", "count")),
        "router_mean_ttft_ms": _mean_ms(before, after, ROUTER_TTFT),
        "ttft_ms": {p: _mean_ms(before, after, TTFT, p) for p in TTFT_PARTS},
        "pd_requests": n_pd,
        "handoff_ms": {p: _mean_ms(before, after, HANDOFF, p) for p in HANDOFF_PARTS} if n_pd else None,
        "kv_transfers": n_kv,
        "kv_bytes_per_request": kv_bytes / n_kv if n_kv else None,
        "kv_bytes_saved_per_request": kv_saved / n_kv if n_kv else None,  # decode-side prefix caching
        "kv_gb_per_s": kv_bytes / kv_s / 1e9 if n_kv and kv_s > 0 else None,
        "handoffs_via": {
            via: int(after.get(f"{HANDOFFS}{{{via}}}", 0.0) - before.get(f"{HANDOFFS}{{{via}}}", 0.0))
            for via in ("prefill", "router")
        },
    }


def deployment(base_url: str, api_key: str | None = None, timeout: float = 10.0) -> dict[str, Any]:
    """Workers per role and distinct GPUs (by UUID) behind a pdserve router; raises ValueError."""
    url = base_url.rstrip("/") + "/workers"
    try:
        resp = httpx.get(url, headers=_headers(api_key), timeout=timeout)
        resp.raise_for_status()
        rows = resp.json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read the deployment from {url}: {e}") from e
    roles: dict[str, int] = {}
    for w in rows:
        roles[w["role"]] = roles.get(w["role"], 0) + 1
    gpus = sorted({g for w in rows for g in (w.get("gpus") or [])})
    return {"workers": roles, "gpus": len(gpus), "gpu_ids": gpus, "devices": [w.get("device") for w in rows]}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def format_table(results: list[dict[str, Any]]) -> str:
    """One row per level: TTFT's parts and, for PD, the hand-off's (mean ms)."""
    head = [
        "conc",
        "TTFT",
        "queue",
        "prefill",
        "other",
        "handoff: dispatch",
        "dec queue",
        "KV xfer",
        "first dec",
        "other",
        "KV MB/req",
        "KV saved MB/req",
        "KV GB/s",
    ]
    rows = [head]
    for r in results:
        b = r.get("ttft_breakdown") or {}
        if "error" in b or not b:
            continue
        t, h = b["ttft_ms"], b.get("handoff_ms") or {}
        mb, saved = b.get("kv_bytes_per_request"), b.get("kv_bytes_saved_per_request")
        rows.append(
            [str(r["max_concurrency"]), _ms(b.get("router_mean_ttft_ms")), *(_ms(t.get(p)) for p in TTFT_PARTS), *(_ms(h.get(p)) for p in HANDOFF_PARTS),
             _ms(None if mb is None else mb / 1e6), _ms(None if saved is None else saved / 1e6),
             "-" if b.get("kv_gb_per_s") is None else f"{b['kv_gb_per_s']:.2f}"]
        )  # fmt: skip
    if len(rows) == 1:
        return ""
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "mean ms per request (router's TTFT and its parts; PD: first token -> decode's first token)\n" + "\n".join(
        lines
    )
