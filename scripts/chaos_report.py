"""The chaos run's verdict and report (scripts/chaos.py): what every client saw, per fault.

A request is charged to the latest fault whose window (from the fault to serving again, + 5 s)
holds its end. Client-visible failures: an OpenAI error, a lost connection, a hang, or an answer
that is not its prompt's uninterrupted one. Duplicated and missing tokens: an answer's token ids
against that uninterrupted answer (difflib's alignment: tokens only in the answer are duplicated,
tokens only in the reference are missing; a different token counts as both). Retried: requests
the client sent again (a 503 with Retry-After, a 429, a refused connection), as the openai client
does; not failures, but counted.
"""

from __future__ import annotations

import argparse
import difflib
from dataclasses import asdict

from scripts.chaos_faults import Fault
from scripts.chaos_load import Load, Outcome

WINDOW_MARGIN_S = 5.0


def token_diff(got: list[int], want: list[int]) -> tuple[int, int]:
    """(duplicated, missing) tokens of an answer against the uninterrupted one."""
    duplicated = missing = 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=want, b=got, autojunk=False).get_opcodes():
        if op in ("insert", "replace"):
            duplicated += j2 - j1
        if op in ("delete", "replace"):
            missing += i2 - i1
    return duplicated, missing


def verdict(args: argparse.Namespace, load: Load, faults: list[Fault], blocks, want, after, duration: float) -> dict:
    outs = load.outcomes
    windows = [(f, f.at, f.at + (f.serving_again_s or args.serve_again) + WINDOW_MARGIN_S) for f in faults]
    unexplained: list[Outcome] = []
    kinds: dict[str, int] = {}
    codes: dict[str, int] = {}
    totals = {"duplicated_tokens": 0, "missing_tokens": 0, "wrong_answers": 0}
    for o in outs:
        dup, miss = token_diff(o.token_ids, load.references[o.prompt]) if o.kind in ("ok", "short") else (0, 0)
        if o.kind == "ok" and (dup or miss):
            o.kind, o.message = "short", f"{dup} duplicated, {miss} missing tokens"
        kinds[o.kind] = kinds.get(o.kind, 0) + 1
        if o.kind == "error":
            codes[o.code or "?"] = codes.get(o.code or "?", 0) + 1
        totals["duplicated_tokens"] += dup
        totals["missing_tokens"] += miss
        totals["wrong_answers"] += o.kind == "short"
        hit = next((f for f, a, b in reversed(windows) if a <= o.end <= b), None)  # the latest fault
        if hit is not None:
            hit.duplicated_tokens += dup
            hit.missing_tokens += miss
            hit.retried += o.retries > 0
        if o.kind == "ok":
            continue
        if hit is None:
            unexplained.append(o)
            continue
        hit.failed += 1
        hit.errors += o.kind == "error"
        hit.connections_lost += o.kind == "connection_lost"
    lost_off_router = [o for o in outs if o.kind == "connection_lost"
                       and not any(f.target == "router" and a <= o.end <= b for f, a, b in windows)]  # fmt: skip
    checks = {
        f"{args.faults} faults made": len(faults) == args.faults,
        "serving again after every fault": all(f.serving_again_s is not None for f in faults),
        "every answer full, no token duplicated or missing": kinds.get("short", 0) == 0,
        "no request past request_timeout": kinds.get("hang", 0) == 0,
        "connections lost only when the router died": not lost_off_router,
        "errors only while a fault is repaired": not unexplained,
        "greedy tokens as before": after == want,
        "0 KV blocks held at the end": not any(blocks.values()),
    }
    if args.workers_per_role > 1:
        checks["0 client-visible failures for worker faults"] = not any(f.failed for f in faults if f.worker_fault)
    return {
        "ok": all(checks.values()),
        "checks": checks,
        "requests": len(outs),
        "outcomes": kinds,
        "error_codes": codes,
        "error_messages": sorted({o.message for o in outs if o.kind == "error"}),
        "bad_answers": sorted({o.message for o in outs if o.kind in ("short", "hang")})[:10],
        **totals,
        "unexplained": [asdict(o) | {"token_ids": None} for o in unexplained[:10]],
        "faults": [
            asdict(f) | {"at": round(f.at - outs[0].start, 2) if outs else 0, "what": f.describe()} for f in faults
        ],  # fmt: skip
        "blocks_at_end": blocks,
        "duration_s": round(duration, 1),
        "args": dict(vars(args)),
    }


def report_text(r: dict) -> str:
    lines = [f"{r['requests']} requests in {r['duration_s']} s: {r['outcomes']}; error codes {r['error_codes']}"]
    lines += [f"  error: {m}" for m in r["error_messages"][:8]]
    lines += [f"  bad answer: {m}" for m in r["bad_answers"][:8]]
    lines.append(f"duplicated tokens {r['duplicated_tokens']}, missing tokens {r['missing_tokens']}")
    lines.append(
        "| fault | at (s) | serving again (s) | client-visible failures | duplicated / missing tokens | retried |"
    )
    lines.append("| --- | ---: | ---: | --- | ---: | ---: |")
    for f in r["faults"]:
        failed = f"{f['failed']}" + (
            f" ({f['errors']} errors, {f['connections_lost']} connections lost)" if f["failed"] else ""
        )
        lines.append(
            f"| {f['what']} | {f['at']} | {f['serving_again_s']} | {failed} |"
            f" {f['duplicated_tokens']} / {f['missing_tokens']} | {f['retried']} |"
        )
    lines.append(f"KV blocks at the end: {r['blocks_at_end']}")
    lines += [f"[{'ok' if v else 'FAILED'}] {k}" for k, v in r["checks"].items()]
    return "\n".join(lines)
