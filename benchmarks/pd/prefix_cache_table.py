"""The table of benchmarks/pd/prefix_cache_bench.sh: each deployment (PD, colocated) with and without
the prefix cache, per concurrency level, from the `pdserve bench --dataset multi-turn` files it wrote.

    python -m benchmarks.pd.prefix_cache_table OUT_DIR      (reads OUT_DIR/{pd,colocated}{,-nocache}.json)

Writes OUT_DIR/summary.json and prints one row per run and level, then per deployment and level
the ratios the issue's "done when" asks for (no cache / cache): median TTFT >= 3x, prefill tokens
computed >= 5x, and how many answers came out token for token the same (greedy, --save-output-ids).
Prefill tokens computed: prompt tokens - cached tokens, from the responses' usage; where a run
reported no cached tokens, the prefill workers' pdserve_prefix_cache_* counters; a run without
the cache that reported neither computed every prompt token (said so in `computed_from`).
PD runs whose bench read the decode worker's /metrics too also give the KV its loads moved (MB)
and the share of the prompts' KV its prefix cache held, not moved (decode-side prefix caching).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

RUNS = (("pd", True), ("pd", False), ("colocated", True), ("colocated", False))
TTFT_GOAL = 3.0
COMPUTED_GOAL = 5.0


def _file(out: str, deployment: str, cache: bool) -> str:
    return os.path.join(out, f"{deployment}{'' if cache else '-nocache'}.json")


def computed(level: dict[str, Any], cache: bool) -> tuple[int | None, str]:
    """Prefill tokens computed in a level, and where the number comes from."""
    if level.get("prefill_tokens_computed") is not None:
        return level["prefill_tokens_computed"], "usage"
    workers = level.get("prefix_cache_workers") or {}
    if workers.get("computed_tokens") is not None:
        return workers["computed_tokens"], "worker counters"
    if not cache:
        return level.get("total_input_tokens"), "all prompt tokens (no cache)"
    return None, "not reported"


def row(deployment: str, cache: bool, level: dict[str, Any]) -> dict[str, Any]:
    n, source = computed(level, cache)
    decode = (level.get("prefix_cache_workers") or {}).get("decode") or {}
    read = decode.get("kv_bytes_read")
    return {
        "deployment": deployment,
        "prefix_caching": cache,
        "concurrency": level["max_concurrency"],
        "completed": level["completed"],
        "failed": level["failed"],
        "median_ttft_ms": level.get("median_ttft_ms"),
        "median_ttft_first_turn_ms": level.get("median_ttft_first_turn_ms"),
        "median_ttft_later_turns_ms": level.get("median_ttft_later_turns_ms"),
        "prompt_tokens": level.get("total_input_tokens"),
        "prefill_tokens_computed": n,
        "computed_from": source,
        "hit_rate": level.get("prefix_cache_hit_rate"),
        "kv_mb_read": read / 1e6 if read else None,
        "kv_saved_pct": None if decode.get("saved_fraction") is None else 100 * decode["saved_fraction"],
        "output_throughput": level.get("output_throughput"),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _same_answers(on: dict[str, Any], off: dict[str, Any]) -> tuple[int, int] | None:
    a, b = on.get("output_ids"), off.get("output_ids")
    if a is None or b is None or len(a) != len(b):
        return None
    return sum(x == y and bool(x) for x, y in zip(a, b)), len(a)


def compare(deployment: str, on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    c_on, c_off = computed(on, True)[0], computed(off, False)[0]
    ttft = _ratio(off.get("median_ttft_ms"), on.get("median_ttft_ms"))
    fewer = _ratio(c_off, c_on)
    same = _same_answers(on, off)
    return {
        "deployment": deployment,
        "concurrency": on["max_concurrency"],
        "ttft_ratio": ttft,
        "later_turns_ttft_ratio": _ratio(off.get("median_ttft_later_turns_ms"), on.get("median_ttft_later_turns_ms")),
        "computed_ratio": fewer,
        "same_answers": None if same is None else f"{same[0]}/{same[1]}",
        "done": ttft is not None and fewer is not None and ttft >= TTFT_GOAL and fewer >= COMPUTED_GOAL,
    }


def summarize(out: str) -> dict[str, Any]:
    docs = {}
    for deployment, cache in RUNS:
        path = _file(out, deployment, cache)
        if os.path.exists(path):
            with open(path) as f:
                docs[(deployment, cache)] = {r["max_concurrency"]: r for r in json.load(f)["results"]}
    rows = [row(d, c, lvl) for (d, c), levels in docs.items() for _, lvl in sorted(levels.items())]
    comparisons = []
    for deployment in ("pd", "colocated"):
        on, off = docs.get((deployment, True), {}), docs.get((deployment, False), {})
        comparisons += [compare(deployment, on[c], off[c]) for c in sorted(set(on) & set(off))]
    return {
        "runs": rows,
        "comparisons": comparisons,
        "missing": [_file(out, d, c) for d, c in RUNS if (d, c) not in docs],
    }


def _cell(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str, int]]) -> str:
    cells = [[h for h, _, _ in columns]] + [[_cell(r.get(k), d) for _, k, d in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_summary(s: dict[str, Any]) -> str:
    runs = _table(
        [{**r, "hit_pct": None if r["hit_rate"] is None else 100 * r["hit_rate"]} for r in s["runs"]],
        [
            ("deployment", "deployment", 0), ("cache", "prefix_caching", 0), ("conc", "concurrency", 0),
            ("done", "completed", 0), ("fail", "failed", 0), ("TTFT med ms", "median_ttft_ms", 1),
            ("1st turn", "median_ttft_first_turn_ms", 1), ("later turns", "median_ttft_later_turns_ms", 1),
            ("prompt tok", "prompt_tokens", 0), ("computed", "prefill_tokens_computed", 0),
            ("hit %", "hit_pct", 1), ("from", "computed_from", 0), ("KV read MB", "kv_mb_read", 1),
            ("KV saved %", "kv_saved_pct", 1),
        ],
    )  # fmt: skip
    ratios = _table(
        s["comparisons"],
        [
            ("deployment", "deployment", 0), ("conc", "concurrency", 0), ("TTFT x", "ttft_ratio", 2),
            ("later turns TTFT x", "later_turns_ttft_ratio", 2), ("computed x", "computed_ratio", 2),
            ("same answers", "same_answers", 0), (f"done (>= {TTFT_GOAL:g}x, >= {COMPUTED_GOAL:g}x)", "done", 0),
        ],
    )  # fmt: skip
    missing = "".join(f"\nmissing: {m}" for m in s["missing"])
    return f"{runs}\n\nno cache / cache:\n{ratios}{missing}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the folder prefix_cache_bench.sh wrote")
    args = p.parse_args()
    s = summarize(args.out)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(s, f, indent=2)
        f.write("\n")
    print(format_summary(s))


if __name__ == "__main__":
    main()
