"""`pdserve serve`: run one component - a worker (prefill | decode | both) or the router.

The launcher builds these command lines (pdserve/launch.py); the flag names are its contract.
A worker loads its model before it binds its port, so a port that answers is a worker that can
serve (its /health also checks the engine loop). Workers bind 127.0.0.1 unless told otherwise,
and refuse to bind elsewhere without --cluster-secret (every route but /health and /metrics needs
it then); on loopback their NIXL/UCX listeners stay on loopback too (UCX_NET_DEVICES=lo unless set).
A decode worker fetches NIXL metadata only from its --peer workers.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys

import uvicorn

from pdserve.server.policies import POLICY_NAMES

DEFAULT_PORTS = {"router": 8000, "prefill": 30000, "decode": 30001, "both": 30002}
LOOPBACK = ("127.0.0.1", "localhost", "::1")

log = logging.getLogger("pdserve.serve")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", required=True, choices=("prefill", "decode", "both", "router"))
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="default: router 8000, prefill 30000, decode 30001, both 30002")
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint folder (the router reads its tokenizer)")
    p.add_argument("--cluster-secret", help="shared secret for /internal/* (required when a worker binds beyond loopback)")
    p.add_argument("--max-model-len", type=int, help="context length (router: an extra cap on the workers')")
    w = p.add_argument_group("worker")
    w.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    w.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    w.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks of this worker: GPUs from --device on (cuda:N..N+tp-1), or gloo processes on cpu")
    w.add_argument("--kv-block-size", type=int, default=64)
    w.add_argument("--num-kv-blocks", type=int)
    w.add_argument("--max-num-seqs", type=int, default=256)
    w.add_argument("--max-num-batched-tokens", type=int)
    w.add_argument("--engine-id", help="NIXL agent name (default <role>-<port>)")
    w.add_argument("--lease-seconds", type=float, default=60.0, help="prefill keeps a request's KV this long for decode")
    w.add_argument("--transfer-backend", default="nixl", choices=("nixl", "fake"))
    w.add_argument("--transfer-timeout", type=float, default=30.0, help="seconds for one request's KV read")
    w.add_argument("--peer", action="append", default=[], metavar="URL", help="a worker whose NIXL metadata may be fetched (repeatable)")
    w.add_argument(
        "--kv-load-failure-policy", default="fail", choices=("fail", "recompute"),
        help="decode: a failed KV read fails the request (fail) or computes the prompt here (recompute)",
    )  # fmt: skip
    w.add_argument("--max-open-requests", type=int, help="requests admitted at once before 429 (default max(8 x max-num-seqs, 256))")
    r = p.add_argument_group("router")
    r.add_argument("--prefill", action="append", default=[], metavar="URL")
    r.add_argument("--decode", action="append", default=[], metavar="URL")
    r.add_argument("--colocated", action="append", default=[], metavar="URL", help="a role-both worker")
    r.add_argument("--prefill-policy", default="round_robin", choices=POLICY_NAMES)
    r.add_argument("--decode-policy", default="least_load", choices=POLICY_NAMES)
    r.add_argument("--api-key", help="clients must send Authorization: Bearer <key>")
    r.add_argument("--served-model-name", help="the model name clients use (default: --model as given)")
    r.add_argument("--health-interval", type=float, default=2.0, help="seconds between worker probes")
    r.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take in all")
    r.add_argument("--first-token-timeout", type=float, default=300.0, help="seconds until a request's first token")
    r.add_argument("--prefill-timeout", type=float, default=300.0, help="seconds a prefill worker has to return the first token and KV")
    r.add_argument("--max-queued-requests", type=int, default=1024, help="concurrent requests before 429")
    r.add_argument("--max-attempts", type=int, default=3, help="workers of a role tried when one refuses, before the first token")
    r.add_argument("--retry-backoff", type=float, default=0.05, help="seconds before the second try; doubles each try")
    r.add_argument("--breaker-failures", type=int, default=5, help="consecutive failed requests that open a worker's circuit breaker")
    r.add_argument("--breaker-cooldown", type=float, default=10.0, help="seconds an open breaker waits before a trial request")


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per upstream call drowns the log
    port = args.port or DEFAULT_PORTS[args.role]
    try:
        app = _router_app(args) if args.role == "router" else _worker_app(args, port)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"pdserve serve --role {args.role}: {e}", file=sys.stderr)
        return 2
    # keep-alive longer than any client's idle expiry (httpx: 5 s, uvicorn's default here too): else
    # the server closes an idle connection just as the router reuses it, and the POST gets ReadError
    config = uvicorn.Config(app, host=args.host, port=port, log_level="warning", lifespan="on", timeout_graceful_shutdown=5, timeout_keep_alive=75)
    log.info("pdserve %s listening on http://%s:%d", args.role, args.host, port)
    uvicorn.Server(config).run()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve serve")
    add_serve_args(p)
    return run_serve(p.parse_args(argv))


# -- router --
def _router_app(args: argparse.Namespace):
    from pdserve.server.router import RouterSettings, build_router_app

    if not (args.prefill or args.decode or args.colocated):
        raise ValueError("the router needs workers: --prefill URL and --decode URL, and/or --colocated URL")
    if bool(args.prefill) != bool(args.decode):
        raise ValueError("PD needs both --prefill and --decode workers")
    for name in ("health_interval", "request_timeout", "first_token_timeout", "prefill_timeout", "breaker_cooldown"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    for name in ("max_queued_requests", "max_attempts", "breaker_failures"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.retry_backoff < 0:
        raise ValueError("--retry-backoff must be >= 0")
    settings = RouterSettings(
        model_dir=args.model,
        served_model_name=args.served_model_name or args.model,
        vocab_size=_vocab_size(args.model),
        max_model_len=args.max_model_len,
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        api_key=args.api_key,
        cluster_secret=args.cluster_secret,
        health_interval=args.health_interval,
        request_timeout=args.request_timeout,
        max_queued_requests=args.max_queued_requests,
        first_token_timeout=args.first_token_timeout,
        prefill_timeout=args.prefill_timeout,
        max_attempts=args.max_attempts,
        retry_backoff=args.retry_backoff,
        breaker_failures=args.breaker_failures,
        breaker_cooldown=args.breaker_cooldown,
    )
    return build_router_app(settings, args.prefill, args.decode, args.colocated)


def _vocab_size(model_dir: str) -> int:
    import json

    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model folder {model_dir!r} has no config.json")
    with open(path) as f:
        return int(json.load(f)["vocab_size"])


# -- workers --
def _worker_app(args: argparse.Namespace, port: int):
    from pdserve import __version__
    from pdserve.disagg.factory import make_connector
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.server.async_engine import AsyncEngine
    from pdserve.server.metrics import WorkerMetrics
    from pdserve.server.protocol import SECRET_HEADER, WorkerInfo
    from pdserve.server.worker import WorkerState, build_worker_app

    if args.host not in LOOPBACK and not args.cluster_secret:
        raise ValueError(f"binding a worker to {args.host} exposes /internal/*: pass --cluster-secret (or bind 127.0.0.1)")
    if args.max_open_requests is not None and args.max_open_requests < 1:
        raise ValueError("--max-open-requests must be >= 1")
    if args.transfer_timeout <= 0 or args.lease_seconds <= 0:
        raise ValueError("--transfer-timeout and --lease-seconds must be > 0")
    if args.role == "decode" and args.transfer_backend == "nixl" and not args.peer:
        raise ValueError("a decode worker reads KV only from configured peers: pass --peer URL for each prefill worker")
    if args.host in LOOPBACK and args.transfer_backend == "nixl":
        os.environ.setdefault("UCX_NET_DEVICES", "lo")  # UCX listens on every interface otherwise
    engine_id = args.engine_id or f"{args.role}-{port}"
    config = EngineConfig(
        model=args.model,
        device=args.device,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=args.dtype,
        kv_block_size=args.kv_block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        **({"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}),
    )
    connector = None
    if args.role != "both":
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        extra = {
            "allowed_peers": args.peer,
            "metadata_headers": {SECRET_HEADER: args.cluster_secret} if args.cluster_secret else None,
            "metadata_timeout_s": min(5.0, args.transfer_timeout),  # the handshake is part of the transfer's time
        }
        connector = make_connector(
            args.transfer_backend,
            engine_id,
            model_id=_model_id(args.model),
            metadata_url=f"http://{host}:{port}/internal/kv_metadata",
            lease_s=args.lease_seconds,
            transfer_timeout_s=args.transfer_timeout,
            **(extra if args.transfer_backend == "nixl" else {}),
        )
    log.info("loading %s on %s for role %s", args.model, args.device, args.role)
    engine = LLMEngine(config, connector, kv_load_failure_policy=args.kv_load_failure_policy)
    metrics = WorkerMetrics()
    info = WorkerInfo(
        role=args.role,
        engine_id=engine_id,
        model=os.path.basename(os.path.abspath(args.model)),
        max_model_len=engine.max_model_len,
        kv_block_size=config.kv_block_size,
        num_kv_blocks=engine.block_manager.num_total_blocks,
        max_num_seqs=config.max_num_seqs,
        device=config.device,
        dtype=config.resolved_dtype(),
        transfer_backend=args.transfer_backend if connector is not None else None,
        pdserve_version=__version__,
    )
    state = WorkerState(
        engine=AsyncEngine(engine, metrics),
        info=info,
        metrics=metrics,
        max_open_requests=args.max_open_requests or max(8 * config.max_num_seqs, 256),
        kv_metadata=connector.agent_metadata() if connector is not None else None,
    )
    app = build_worker_app(state, args.cluster_secret)
    app.router.lifespan_context = _worker_lifespan(state, connector)
    return app


def _worker_lifespan(state, connector):
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        state.engine.start()
        try:
            yield
        finally:
            state.engine.stop()
            state.engine.engine.shutdown()  # tensor-parallel ranks
            if connector is not None:
                connector.shutdown()

    return lifespan


def _model_id(model_dir: str) -> str:
    """What the KV compatibility hash calls the model: a digest of its config.json (the same
    checkpoint at different paths on different hosts must match)."""
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        return "config-sha256:" + hashlib.sha256(f.read()).hexdigest()[:16]


if __name__ == "__main__":
    sys.exit(main())
