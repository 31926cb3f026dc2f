"""The `pdserve` command: launch, serve, make-tiny-model, bench, bench-engine, health.

Subcommands import their modules only when run, so `pdserve --help` does not load torch.
`serve`, `bench` and `bench-engine` own their flags: their argv goes to their own parsers untouched.
"""

from __future__ import annotations

import argparse
import json
import sys

from pdserve.config import DEFAULT_CONFIG, TINY_ARCHS


def _serve(argv: list[str]) -> int:
    from pdserve.serve import add_serve_args, run_serve

    p = argparse.ArgumentParser(prog="pdserve serve", description="Run one component: a worker or the router.")
    add_serve_args(p)
    return run_serve(p.parse_args(argv)) or 0


def _bench(argv: list[str]) -> int:
    from pdserve.bench.cli import main as bench_main

    return bench_main(argv) or 0


def _bench_engine(argv: list[str]) -> int:
    from pdserve.bench.engine.cli import main as bench_engine_main

    return bench_engine_main(argv) or 0


def _launch(args: argparse.Namespace) -> int:
    from pdserve.config import ConfigError
    from pdserve.launch import launch
    from pdserve.launch.flags import apply_flags, load_cluster

    flags = argparse.Namespace(
        **{k: v for k, v in vars(args).items() if k not in ("config", "log_dir", "run", "command")}
    )
    try:
        cfg = apply_flags(load_cluster(args.config), flags)
    except ConfigError as err:
        print(f"pdserve launch: {err}", file=sys.stderr)
        return 2
    return launch(cfg, log_dir=args.log_dir)


def _make_tiny_model(args: argparse.Namespace) -> int:
    from pdserve.tiny_model import make_tiny_model

    try:
        overrides = dict(_config_value(kv) for kv in args.set)
        make_tiny_model(args.out_dir, args.arch, args.seed, overrides, args.dtype, args.device)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    changed = f", {args.dtype}, {len(overrides)} config keys set" if overrides else ""
    print(
        f"wrote a {'random' if overrides else 'tiny'} {args.arch} checkpoint (seed {args.seed}{changed}) to {args.out_dir}"
    )
    return 0


def _config_value(text: str) -> tuple[str, object]:
    """'hidden_size=7168' -> ('hidden_size', 7168): the value is JSON (a bare word is a string)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--set takes KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _health(args: argparse.Namespace) -> int:
    from pdserve.health_cli import run_health

    return run_health(args)


def _restart(args: argparse.Namespace) -> int:
    from pdserve.launch.restart_cli import run_restart

    return run_restart(args)


def build_parser() -> argparse.ArgumentParser:
    from pdserve.health_cli import add_health_args
    from pdserve.launch.flags import add_launch_flags

    p = argparse.ArgumentParser(
        prog="pdserve", description="Prefill-decode disaggregated serving for DeepSeek-style models."
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    lp = sub.add_parser("launch", help="start router + workers from a cluster config and supervise them")
    lp.add_argument(
        "--config", default=DEFAULT_CONFIG, help=f"a YAML file or a name in configs/ (default {DEFAULT_CONFIG})"
    )
    lp.add_argument(
        "--log-dir",
        help="per-process logs (default: the config's log_dir, else a new folder per launch under ~/.cache/pdserve/logs, kept; logs/latest points at the newest)",
    )
    add_launch_flags(lp)  # the serve flags over the config: --model, --api-key, --port, ...
    lp.set_defaults(run=_launch)

    # serve and bench parse their own flags (see _serve, _bench); listed here for --help.
    sub.add_parser(
        "serve", help="run one component (worker or router); `pdserve serve --help` for flags", add_help=False
    )
    sub.add_parser("bench", help="benchmark a running server; `pdserve bench --help` for flags", add_help=False)
    sub.add_parser(
        "bench-engine",
        help="decode steps of the engine on one GPU against their floor (random weights); `pdserve bench-engine --help`",
        add_help=False,
    )

    mp = sub.add_parser("make-tiny-model", help="write a small random checkpoint + byte-level tokenizer")
    mp.add_argument("out_dir", metavar="DIR")
    mp.add_argument("--arch", choices=TINY_ARCHS, default="deepseek_v3")
    mp.add_argument("--seed", type=int, default=0)
    mp.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change a config.json key (JSON value), e.g. hidden_size=7168; repeatable",
    )
    mp.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights' dtype")
    mp.add_argument("--device", default="cpu", help="draw the weights here (cuda: a mid-size model in seconds)")
    mp.set_defaults(run=_make_tiny_model)

    hp = sub.add_parser("health", help="GET /health on the router and workers; exit 0 only if all are healthy")
    add_health_args(hp)
    hp.set_defaults(run=_health)

    from pdserve.launch.restart_cli import add_restart_args

    rp = sub.add_parser("restart", help="restart processes of a running launch one at a time (workers drain first)")
    add_restart_args(rp)
    rp.set_defaults(run=_restart)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        return _serve(argv[1:])
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    if argv and argv[0] == "bench-engine":
        return _bench_engine(argv[1:])
    args = build_parser().parse_args(argv)
    return args.run(args)
