"""`pdserve bench`: sweep concurrency levels against an OpenAI-compatible server,
plot result files, or advise on PD vs colocated.

    pdserve bench [--base-url URL] --concurrency 1,8,16 --num-prompts 6,24,32 [--out DIR | r.json] [--plot r.png]
        [--dataset random | sharegpt FILE | generated-shared-prefix | multi-turn | agentic]   (sources.py)
    pdserve bench plot a.json b.json -o out.png
    pdserve bench advise colocated.json pd.json [--colocated-gpus N --pd-gpus M] [--live --metrics-url URL ...]
      (GPU counts default to what the files recorded: the distinct GPUs behind the router)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import random
import sys
from collections.abc import Callable
from typing import Any

from pdserve.bench import advisor, agentic_report, breakdown, dataset, report, sources, workers
from pdserve.bench.client import WrongKey, fetch_models, run_level
from pdserve.bench.multiturn import run_conversations

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_OUT = "bench-results"  # a folder: each run's JSON is a new file in it


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve bench",
        description="Benchmark an OpenAI-compatible server over concurrency levels.",
        epilog="Also: `pdserve bench plot A.json B.json -o out.png` and `pdserve bench advise colocated.json pd.json`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--base-url",
        default=DEFAULT_BASE_URL,
        help="server root (where `pdserve launch` serves)",
    )
    p.add_argument("--model", help="model name to request (default: the first of /v1/models)")
    sources.add_dataset_args(p)
    p.add_argument("--concurrency", type=_int_list, default=[1, 8, 16], help="comma-separated levels")
    p.add_argument(
        "--num-prompts",
        type=_int_list,
        default=None,
        help="requests per level, one per concurrency level (default 6,24,32; multi-turn: conversations; agentic: sessions)",
    )
    p.add_argument(
        "--request-rate",
        type=_positive_float,
        default=float("inf"),
        help="Poisson arrivals in req/s (multi-turn: conversations/s; agentic: sessions/s; inf: all at once)",
    )
    p.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    p.add_argument(
        "--num-gpus",
        type=_positive_int,
        default=None,
        help="the deployment's GPUs, for throughput per GPU (default: the distinct GPUs behind a pdserve router)",
    )
    p.add_argument(
        "--slo", default=None, help="goodput SLO, e.g. ttft_ms=500,tpot_ms=50 (keys: ttft_ms, tpot_ms, e2el_ms)"
    )
    p.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    p.add_argument(
        "--api-key", default=None, help="sent as Authorization: Bearer KEY (None: $OPENAI_API_KEY or $PDSERVE_API_KEY)"
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (or its folder) sizing the random vocabulary")
    p.add_argument(
        "--metrics-url", action="append", default=[], help="a worker's /metrics to record per level (repeatable)"
    )
    p.add_argument(
        "--timeout", type=_positive_float, default=600.0, help="seconds a request may wait for its next byte"
    )
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bars")
    p.add_argument(
        "--save-output-ids",
        action="store_true",
        help="keep every answer's token ids in the results (to compare runs' tokens, e.g. with and without a cache)",
    )
    p.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help="results: a folder (made if missing; the file is pdserve-bench-<UTC time>.json in it) or a .json file",
    )
    p.add_argument("--plot", default=None, help="also write this PNG (needs matplotlib: pip install 'pdserve[bench]')")
    return p


def out_file(out: str) -> str:
    """--out as the results file: itself if it names a .json file, else a new file in that folder."""
    if out.endswith(".json"):
        return out
    os.makedirs(out, exist_ok=True)
    return os.path.join(out, datetime.datetime.now(datetime.UTC).strftime("pdserve-bench-%Y%m%d-%H%M%S.json"))


def api_key(given: str | None) -> str | None:
    """--api-key, else what the OpenAI clients read, else pdserve health's variable."""
    return given or os.environ.get("OPENAI_API_KEY") or os.environ.get("PDSERVE_API_KEY")


def check_plotting() -> None:
    """Before any work: plotting needs matplotlib, an optional extra."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            "plotting needs matplotlib, which is not installed: pip install 'pdserve[bench]' (or pip install matplotlib)"
        ) from None


def _check(args: argparse.Namespace) -> None:
    if args.plot:
        check_plotting()
    sources.check_dataset(args)
    if len(args.concurrency) != len(args.num_prompts):
        raise ValueError(
            f"--concurrency has {len(args.concurrency)} levels but --num-prompts has {len(args.num_prompts)}"
        )


def _resolve_model(args: argparse.Namespace) -> tuple[str, list[dict[str, Any]]]:
    """The model to request and the server's /v1/models entries (empty if it has none to give)."""
    try:
        models = asyncio.run(fetch_models(args.base_url, args.api_key))
    except WrongKey:
        raise  # a model name would not help: every request would be refused
    except Exception as e:  # an unreachable server or one without /v1/models
        if args.model is None:
            raise ValueError(f"cannot list models at {args.base_url}/v1/models ({e}); pass --model") from None
        return args.model, []
    model = args.model or (models[0].get("id") if models else None)
    if model is None:
        raise ValueError(f"{args.base_url}/v1/models lists no model; pass --model")
    return model, models


def _level(
    args: argparse.Namespace,
    model: str,
    requests: sources.Workload,
    concurrency: int,
    rng: random.Random,
    slo: dict[str, float],
    gpus: int | None,
) -> dict[str, Any]:
    from tqdm import tqdm

    before = _try_scrape(args.metrics_url)
    router_before = _try(breakdown.scrape, args.base_url, args.api_key)
    convs = [r for r in requests if isinstance(r, dataset.Conversation)]
    total = sum(c.turns for c in convs) if convs else len(requests)
    with tqdm(total=total, desc=f"c={concurrency}", disable=args.disable_tqdm) as bar:
        runner = run_conversations if convs else run_level
        run = runner(
            args.base_url, args.endpoint, model, convs or requests, concurrency, args.request_rate, rng, args.api_key,
            args.timeout, on_done=lambda _: bar.update(1),
        )  # fmt: skip
        outputs, duration = asyncio.run(run)
    result = report.level_metrics(outputs, duration, concurrency, args.request_rate, slo)
    if args.save_output_ids:
        result["output_ids"] = [o.output_ids for o in outputs]
    router_after = _try(breakdown.scrape, args.base_url, args.api_key)
    if isinstance(router_before, str) or isinstance(router_after, str):
        result["ttft_breakdown"] = {"error": router_before if isinstance(router_before, str) else router_after}
    else:
        result["ttft_breakdown"] = breakdown.breakdown(router_before, router_after)
    if args.metrics_url:
        after = _try_scrape(args.metrics_url)
        if isinstance(before, str) or isinstance(after, str):
            result["worker_metrics"] = {"error": before if isinstance(before, str) else after}
        else:
            result["worker_metrics"] = workers.worker_stats(before, after, duration)
            result["prefix_cache_workers"] = workers.prefix_cache_stats(args.metrics_url, before, after)
    if args.dataset[0] == "agentic":
        result.update(agentic_report.level_fields(outputs, result, gpus))
    return result


def _try(read: Callable[..., Any], *args: Any) -> Any:
    """What read(*args) gives, or its error as text: a server that is not pdserve's router has no
    breakdown, and that never stops the benchmark."""
    try:
        return read(*args)
    except ValueError as e:
        return str(e)


def _try_scrape(urls: list[str]) -> list[workers.Scrape] | str:
    """A scrape, or its error as text: missing metrics never stop the benchmark."""
    try:
        return workers.scrape(urls) if urls else []
    except ValueError as e:
        return str(e)


def bench(argv: list[str]) -> int:
    args = run_parser().parse_args(argv)
    args.api_key = api_key(args.api_key)
    try:
        _check(args)
        slo = report.parse_slo(args.slo)
        model, models = _resolve_model(args)
        make_requests, vocab = sources.prompt_source(args, model, models)
        args.out = out_file(args.out)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    deployment = _try(breakdown.deployment, args.base_url, args.api_key)
    gpus = args.num_gpus or (None if isinstance(deployment, str) else deployment["gpus"] or None)  # 0: CPU workers
    results = []
    for i, (concurrency, num) in enumerate(zip(args.concurrency, args.num_prompts)):
        rng = random.Random(f"{args.seed}:{i}")  # each level its own prompts, the same on every run
        results.append(_level(args, model, make_requests(num, rng), concurrency, rng, slo, gpus))

    config = {k: v for k, v in vars(args).items() if k != "api_key"}
    config["request_rate"] = "inf" if args.request_rate == float("inf") else args.request_rate
    config["vocab"] = vocab
    doc = {
        "results": results,
        "config": config,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "server": {"base_url": args.base_url, "endpoint": args.endpoint, "model": model, "models": models},
        "deployment": {"error": deployment} if isinstance(deployment, str) else deployment,
        "client": {"host": platform.node(), "python": platform.python_version()},
    }
    print(report.format_table(results))
    if _caching_shown(args, results):
        print(report.format_cache_table(results))
    if args.dataset[0] == "agentic":
        print(agentic_report.format_table(results))
    parts = breakdown.format_table(results)
    if parts:
        print(parts)
    report.write_json(args.out, doc)
    print(f"wrote {args.out}")
    if args.plot:
        from pdserve.bench.plot import plot_runs, run_label

        plot_runs([(run_label(args.out), doc)], args.plot, title=f"{model} @ {args.base_url}")
        print(f"wrote {args.plot}")
    return 0 if any(r["completed"] for r in results) else 1


def _caching_shown(args: argparse.Namespace, results: list[dict[str, Any]]) -> bool:
    """The prefix-cache table: for the workloads made for it, or wherever a cache reported."""
    return args.dataset[0] in ("generated-shared-prefix", *sources.CONVERSATIONS) or any(
        r.get("cached_tokens_reported") or (r.get("prefix_cache_workers") or {}).get("queries") for r in results
    )


def plot_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench plot", description="Plot result files against concurrency.")
    p.add_argument("files", nargs="+", help="results JSON files, one line each")
    p.add_argument("-o", "--out", required=True, help="PNG to write")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    try:
        check_plotting()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from pdserve.bench.plot import plot_runs, run_label

    try:
        runs = [(run_label(f), report.read_results(f)) for f in args.files]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    plot_runs(runs, args.out, args.title)
    print(f"wrote {args.out}")
    return 0


def advise_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="pdserve bench advise", description="Verdict on PD vs colocated from two result files."
    )
    p.add_argument("colocated", help="results JSON of the colocated deployment")
    p.add_argument("pd", help="results JSON of the PD deployment")
    p.add_argument(
        "--colocated-gpus", type=int, default=None, help="default: the GPUs the colocated file records (else 1)"
    )
    p.add_argument("--pd-gpus", type=int, default=None, help="default: the GPUs the PD file records (else 2)")
    p.add_argument("--live", action="store_true", help="also read the running workers' /metrics for --watch seconds")
    p.add_argument("--metrics-url", action="append", default=[], help="a worker's /metrics (repeatable; with --live)")
    p.add_argument("--watch", type=_positive_float, default=30.0, help="seconds of live metrics to read")
    args = p.parse_args(argv)
    try:
        if args.live and not args.metrics_url:
            raise ValueError("--live needs at least one --metrics-url")
        colocated, pd = report.read_results(args.colocated), report.read_results(args.pd)
        live = workers.watch(args.metrics_url, args.watch) if args.live else None
        verdict = advisor.advise(colocated, pd, args.colocated_gpus, args.pd_gpus, live)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(advisor.format_verdict(verdict))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "plot":
        return plot_main(argv[1:])
    if argv and argv[0] == "advise":
        return advise_main(argv[1:])
    return bench(argv)
