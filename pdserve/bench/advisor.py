"""PD advisor: does prefill-decode disaggregation pay here, and if not, why?

`advise` is a pure function of two result files (colocated, PD), the GPUs each
used and, when available, worker metrics (recorded per level by
`pdserve bench --metrics-url`, or read live). It returns one of four verdicts,
checked in this order:

  pd_helps_throughput   PD's peak throughput >= THROUGHPUT_GAIN x colocated's
  decode_bound          no such gain, PD throughput flat as concurrency grows
                        (and, with worker metrics, decode busy >= DECODE_BUSY):
                        the decode step is the ceiling, PD cannot raise it
  prefill_interference  no throughput gain, but PD cuts median TTFT or p99 ITL
                        by >= LATENCY_CUT at the highest common concurrency
  no_gain               none of the above

GPU counts come from the files (`deployment.gpus`: distinct GPUs behind the router, which
`pdserve bench` reads from its /workers) unless given; two processes sharing one GPU count once.
Where the files recorded the router's TTFT breakdown, the evidence says where TTFT goes on each
side and what PD's hand-off (queue, KV transfer, first decode step) adds before the second token.
Where a side reported prefix caching (usage cached_tokens, or the workers' counters), the evidence
gives each side's hit rate and prefill tokens computed: TTFT compared between a side that hits its
cache and one that does not measures the cache as much as the deployment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.bench.breakdown import HANDOFF_PARTS

THROUGHPUT_GAIN = 1.2  # PD/colocated peak output throughput that counts as a gain
FLAT_SCALING = 1.5  # throughput grows less than this from lowest to highest concurrency
MIN_CONCURRENCY_SPAN = 2  # highest/lowest concurrency needed to call throughput flat
DECODE_BUSY = 0.9  # decode busy fraction that makes decode the ceiling
LATENCY_CUT = 0.2  # fractional TTFT/ITL reduction that counts as interference removed

Level = dict[str, Any]


@dataclass
class Verdict:
    kind: str  # pd_helps_throughput | decode_bound | prefill_interference | no_gain
    headline: str
    evidence: list[str] = field(default_factory=list)
    numbers: dict[str, float | None] = field(default_factory=dict)


def _levels(doc: dict[str, Any]) -> dict[int, Level]:
    return {int(r["max_concurrency"]): r for r in doc["results"] if r.get("completed", 1) > 0}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _cut(colocated: float | None, pd: float | None) -> float | None:
    """Fraction by which PD lowers a latency (negative: PD raises it)."""
    r = _ratio(pd, colocated)
    return None if r is None else 1.0 - r


def _scaling(levels: dict[int, Level]) -> tuple[int, int, float | None]:
    lo, hi = min(levels), max(levels)
    return lo, hi, _ratio(levels[hi]["output_throughput"], levels[lo]["output_throughput"])


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def _num(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f} ms"


def _change(name: str, cut: float | None) -> str:
    if cut is None:
        return f"{name} n/a"
    return f"cuts {name} by {cut:.0%}" if cut >= 0 else f"raises {name} by {-cut:.0%}"


def _level_line(c: int, col: Level, pd: Level) -> str:
    return (
        f"c={c}: output {_num(col['output_throughput'])} -> {_num(pd['output_throughput'])} tok/s, "
        f"median TTFT {_num(col.get('median_ttft_ms'))} -> {_num(pd.get('median_ttft_ms'))} ms, "
        f"p99 ITL {_num(col.get('p99_itl_ms'))} -> {_num(pd.get('p99_itl_ms'))} ms, "
        f"median TPOT {_num(col.get('median_tpot_ms'))} -> {_num(pd.get('median_tpot_ms'))} ms (colocated -> PD)"
    )


def _worker_line(w: dict[str, Any]) -> str:
    return (
        f"workers over {_num(w.get('window_s'))} s: decode busy {_pct(w.get('decode_busy_fraction'))}, "
        f"mean decode step {_ms(w.get('mean_decode_step_ms'))} over {w.get('decode_steps', 0)} steps "
        f"(mean batch {_num(w.get('mean_decode_batch'))}); prefill busy {_pct(w.get('prefill_busy_fraction'))}, "
        f"mean prefill step {_ms(w.get('mean_prefill_step_ms'))}"
    )


@dataclass
class _Shape:
    """The measured numbers a verdict rests on (None where a file lacks the metric)."""

    gpu_ratio: float
    gain: float | None  # PD / colocated peak output throughput over the common levels
    lo: int  # PD's lowest and highest concurrency
    hi: int
    top: int  # highest concurrency in both files
    pd_scaling: float | None  # PD throughput at hi / at lo
    col_scaling: float | None
    tpot_growth: float | None  # PD median TPOT at hi / at lo
    ttft_cut: float | None  # at top
    itl_cut: float | None  # p99 ITL, at top
    workers: dict[str, Any] | None

    @property
    def busy(self) -> float | None:
        return self.workers.get("decode_busy_fraction") if self.workers else None

    @property
    def flat(self) -> bool:
        return (
            self.pd_scaling is not None and self.hi / self.lo >= MIN_CONCURRENCY_SPAN and self.pd_scaling < FLAT_SCALING
        )

    def numbers(self) -> dict[str, float | None]:
        w = self.workers or {}
        return {
            "gpu_ratio": self.gpu_ratio,
            "throughput_ratio": self.gain,
            "per_gpu_throughput_ratio": None if self.gain is None else self.gain / self.gpu_ratio,
            "pd_throughput_scaling": self.pd_scaling,
            "colocated_throughput_scaling": self.col_scaling,
            "pd_tpot_growth": self.tpot_growth,
            "ttft_cut": self.ttft_cut,
            "itl_p99_cut": self.itl_cut,
            "decode_busy_fraction": self.busy,
            "mean_decode_step_ms": w.get("mean_decode_step_ms"),
            "prefill_busy_fraction": w.get("prefill_busy_fraction"),
        }


def _measure(
    col_levels: dict[int, Level], pd_levels: dict[int, Level], gpu_ratio: float, workers: dict[str, Any] | None
) -> _Shape:
    common = sorted(set(col_levels) & set(pd_levels))
    if not common:
        raise ValueError(
            f"no concurrency level completed requests in both files (colocated: {sorted(col_levels)}, PD: {sorted(pd_levels)})"
        )
    top = common[-1]
    col, pd = col_levels[top], pd_levels[top]
    workers = workers or pd.get("worker_metrics")
    lo, hi, pd_scaling = _scaling(pd_levels)
    return _Shape(
        gpu_ratio=gpu_ratio,
        gain=_ratio(
            max(pd_levels[c]["output_throughput"] for c in common),
            max(col_levels[c]["output_throughput"] for c in common),
        ),
        lo=lo,
        hi=hi,
        top=top,
        pd_scaling=pd_scaling,
        col_scaling=_scaling(col_levels)[2],
        tpot_growth=_ratio(pd_levels[hi].get("median_tpot_ms"), pd_levels[lo].get("median_tpot_ms")),
        ttft_cut=_cut(col.get("median_ttft_ms"), pd.get("median_ttft_ms")),
        itl_cut=_cut(col.get("p99_itl_ms"), pd.get("p99_itl_ms")),
        workers=None if workers and "error" in workers else workers,  # a failed scrape recorded as an error
    )


def _parts(b: dict[str, Any], names: tuple[str, ...], key: str) -> str:
    return " + ".join(f"{name.replace('_', ' ')} {_num(b[key].get(name))}" for name in names)


def _ttft_lines(c: int, col: Level, pd: Level) -> list[str]:
    """Where TTFT goes at concurrency c, and PD's hand-off, from the router's breakdown (if recorded)."""
    lines = []
    for name, level in (("colocated", col), ("PD", pd)):
        b = level.get("ttft_breakdown") or {}
        if b.get("requests"):
            parts = _parts(b, ("queue", "prefill", "other"), "ttft_ms")
            lines.append(f"c={c}: {name} TTFT {_ms(b.get('router_mean_ttft_ms'))} (router, mean) = {parts} ms")
    b = pd.get("ttft_breakdown") or {}
    if b.get("handoff_ms"):
        h = b["handoff_ms"]
        total = sum(v for v in h.values() if v is not None)
        mb = b.get("kv_bytes_per_request")
        notes = [] if mb is None else [f"{mb / 1e6:.1f} MB a request at {_num(b.get('kv_gb_per_s'), 2)} GB/s"]
        via = b.get("handoffs_via") or {}
        if sum(via.values()):
            notes.append(
                f"{via.get('prefill', 0)} handed off engine to engine, {via.get('router', 0)} posted by the router"
            )
        kv = f" ({'; '.join(notes)})" if notes else ""
        lines.append(
            f"c={c}: PD hand-off, first token -> decode's first token, {total:.1f} ms (mean) = "
            f"{_parts(b, HANDOFF_PARTS, 'handoff_ms')} ms{kv}: "
            "the first token is prefill's, so this is PD's cost to the second token, not to TTFT"
        )
    return lines


def _evidence(col_levels: dict[int, Level], pd_levels: dict[int, Level], s: _Shape) -> list[str]:
    lines = [_level_line(c, col_levels[c], pd_levels[c]) for c in sorted(set(col_levels) & set(pd_levels))]
    lines += _ttft_lines(s.top, col_levels[s.top], pd_levels[s.top])
    lines.append(
        f"throughput from c={s.lo} to c={s.hi}: PD x{_num(s.pd_scaling, 2)}, colocated x{_num(s.col_scaling, 2)} "
        f"(concurrency x{s.hi / s.lo:.0f}); PD median TPOT x{_num(s.tpot_growth, 1)}"
    )
    lines += _cache_lines(s.top, col_levels[s.top], pd_levels[s.top])
    lines.append(
        _worker_line(s.workers) if s.workers else "no worker metrics (run bench with --metrics-url, or advise --live)"
    )
    for name, levels in (("colocated", col_levels), ("PD", pd_levels)):
        for c, r in sorted(levels.items()):
            if r.get("failed"):
                lines.append(f"warning: {name} c={c} had {r['failed']} failed requests; its numbers cover the rest")
    return lines


def _hit_rate(level: Level) -> tuple[float | None, int | None, str]:
    """A level's prefix-cache hit rate and prefill tokens computed: from the responses' usage, else
    from the workers' counters; (None, None, "") where neither reported."""
    if level.get("prefix_cache_hit_rate") is not None:
        return level["prefix_cache_hit_rate"], level.get("prefill_tokens_computed"), "usage"
    w = level.get("prefix_cache_workers") or {}
    if w.get("hit_rate") is not None:
        return w["hit_rate"], w.get("computed_tokens"), "worker counters"
    return None, None, ""


def _cache_lines(c: int, col: Level, pd: Level) -> list[str]:
    parts = []
    for name, level in (("colocated", col), ("PD", pd)):
        rate, computed, source = _hit_rate(level)
        if rate is not None:
            parts.append(
                f"{name} hit rate {_pct(rate)}, {computed} of {level.get('total_input_tokens')} prompt tokens computed ({source})"
            )
    return [f"c={c}: prefix cache: " + "; ".join(parts)] if parts else []


def _decide(s: _Shape) -> tuple[str, str]:
    """(kind, headline) in the order the module docstring gives."""
    uses = f"PD uses {s.gpu_ratio:.1f}x the GPUs for {_num(s.gain, 2)}x the throughput"
    latency = f"{_change('median TTFT', s.ttft_cut)} and {_change('p99 ITL', s.itl_cut)} at c={s.top}"
    span = f"x{_num(s.pd_scaling, 2)} from c={s.lo} to c={s.hi}"

    if s.gain is not None and s.gain >= THROUGHPUT_GAIN:
        per_gpu = s.gain / s.gpu_ratio
        tail = (
            ""
            if per_gpu >= 1.0
            else "; per GPU that is less than colocated, so colocated replicas on the same GPUs would serve more"
        )
        return "pd_helps_throughput", f"PD helps throughput: {uses} ({per_gpu:.2f}x per GPU); it {latency}{tail}."

    too_narrow = s.hi / s.lo < MIN_CONCURRENCY_SPAN  # flatness cannot be judged; the busy fraction decides alone
    busy_decode = s.busy is not None and s.busy >= DECODE_BUSY
    if (s.flat and (s.busy is None or busy_decode)) or (too_narrow and busy_decode):
        if s.workers:
            w = s.workers
            split = (
                f", split by time: decode busy {_pct(s.busy)} of the time at {_ms(w.get('mean_decode_step_ms'))} a step "
                f"(mean batch {_num(w.get('mean_decode_batch'))}), prefill busy {_pct(w.get('prefill_busy_fraction'))}"
            )
        else:
            split = f": median TPOT grows x{_num(s.tpot_growth, 1)} over the same range, so a step costs in proportion to the batch"
        return "decode_bound", (
            f"Decode-bound: {uses}; throughput is flat as concurrency grows ({span}); the decode step is the ceiling{split}. "
            "Faster decode kernels raise it; more prefill capacity or disaggregation do not."
        )

    if any(cut is not None and cut >= LATENCY_CUT for cut in (s.ttft_cut, s.itl_cut)):
        return "prefill_interference", f"Prefill interference: PD {latency}; {uses}."

    if s.flat and s.busy is not None:
        reason = f"throughput is flat ({span}) yet decode is busy only {_pct(s.busy)}: the ceiling is outside the decode step (router, KV transfer, scheduling)"
    else:
        reason = f"throughput still grows with concurrency ({span}): measure at higher concurrency"
    return "no_gain", f"No gain from PD: {uses}; it {latency}; {reason}."


DEFAULT_GPUS = {"colocated": 1, "PD": 2}  # when neither the files nor the caller say


def _gpus(name: str, doc: dict[str, Any], given: int | None) -> tuple[int, str]:
    """(GPU count, where it came from): the caller's, else the file's deployment, else the default."""
    if given is not None:
        return given, "given"
    d = doc.get("deployment") or {}
    if d.get("gpus"):
        roles = ", ".join(f"{n} {role}" for role, n in sorted((d.get("workers") or {}).items()))
        return int(d["gpus"]), f"read from the run ({roles} worker(s) on {d['gpus']} GPU(s))"
    return DEFAULT_GPUS[name], "assumed: the file records no GPUs (pass --colocated-gpus / --pd-gpus)"


def advise(
    colocated: dict[str, Any],
    pd: dict[str, Any],
    colocated_gpus: int | None = None,
    pd_gpus: int | None = None,
    workers: dict[str, Any] | None = None,
) -> Verdict:
    """Verdict on PD vs colocated from two `pdserve bench` result documents.
    GPU counts: as given, else from each file's deployment, else 1 and 2.
    `workers` (a `workers.worker_stats` dict, e.g. read live) overrides what the PD file recorded
    at its highest common concurrency."""
    (n_col, col_src), (n_pd, pd_src) = _gpus("colocated", colocated, colocated_gpus), _gpus("PD", pd, pd_gpus)
    if n_col <= 0 or n_pd <= 0:
        raise ValueError(f"GPU counts must be positive, got colocated={n_col} pd={n_pd}")
    col_levels, pd_levels = _levels(colocated), _levels(pd)
    shape = _measure(col_levels, pd_levels, n_pd / n_col, workers)
    kind, headline = _decide(shape)
    evidence = [
        f"GPUs: colocated {n_col} ({col_src}); PD {n_pd} ({pd_src})",
        *_shared(pd),
        *_evidence(col_levels, pd_levels, shape),
    ]
    numbers = {**shape.numbers(), "colocated_gpus": n_col, "pd_gpus": n_pd, **_breakdown_numbers(pd_levels[shape.top])}
    numbers["colocated_prefix_cache_hit_rate"] = _hit_rate(col_levels[shape.top])[0]
    numbers["pd_prefix_cache_hit_rate"] = _hit_rate(pd_levels[shape.top])[0]
    return Verdict(kind, headline, evidence, numbers)


def _shared(pd: dict[str, Any]) -> list[str]:
    """A note when PD's workers outnumber its GPUs: prefill and decode then take turns on them."""
    d = pd.get("deployment") or {}
    workers = sum((d.get("workers") or {}).values())
    if not d.get("gpus") or workers <= d["gpus"]:
        return []
    return [
        f"PD runs {workers} workers on {d['gpus']} GPU(s): prefill and decode processes share them (time-sliced), "
        "so PD can keep prefill out of decode's batches but adds no compute; its KV moves within a GPU"
    ]


def _breakdown_numbers(pd: Level) -> dict[str, float | None]:
    b = pd.get("ttft_breakdown") or {}
    h = b.get("handoff_ms") or {}
    return {
        "pd_ttft_prefill_ms": (b.get("ttft_ms") or {}).get("prefill"),
        "pd_kv_transfer_ms": h.get("kv_transfer"),
        "pd_handoff_ms": sum(v for v in h.values() if v is not None) if h else None,
        "pd_kv_gb_per_s": b.get("kv_gb_per_s"),
    }


def format_verdict(v: Verdict) -> str:
    lines = [f"verdict: {v.kind}", v.headline, "evidence:"]
    lines += [f"  - {e}" for e in v.evidence]
    return "\n".join(lines)
