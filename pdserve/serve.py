"""`pdserve serve`: run one component - a worker (prefill | decode | colocated) or the router.

    flags, or --config FILE (what `pdserve launch` writes) -> ServeConfig (pdserve/serve_config.py)
        -> worker.build.build_worker | router.app.build_router_app -> uvicorn

Flags only collect what was given: every default, limit and choice is the config model's, so the
flags, a cluster YAML and a config file mean the same thing and fail with the same messages.
Workers bind 127.0.0.1 unless told otherwise, and refuse to bind elsewhere without a cluster
secret (every route but /health and /metrics needs it then). A worker fetches transfer metadata
only from its --peer workers: a decode worker's are its prefill workers (required), a prefill
worker's its decode workers (optional: with them it hands each request's KV to decode itself, a
notification between the engines, else the router posts the hand-off over HTTP).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from pdserve.config import DEFAULT_PORTS, resolve_model
from pdserve.serve_config import RouterServeConfig, ServeConfig, WorkerServeConfig
from pdserve.server import run_server, serve_router_processes

log = logging.getLogger("pdserve.serve")

# flag dest -> where it goes in the ServeConfig; "@" is the role's own section (worker | router)
WORKER_FLAGS = {
    "device": "worker.device", "dtype": "worker.dtype", "load_format": "worker.load_format", "tensor_parallel_size": "worker.tp_size",
    "kv_block_size": "worker.kv_block_size", "num_kv_blocks": "worker.num_kv_blocks",
    "gpu_memory_utilization": "worker.gpu_memory_utilization",
    "max_num_seqs": "worker.max_num_seqs", "max_num_batched_tokens": "worker.max_num_batched_tokens",
    "engine_id": "worker.engine_id", "advertise_host": "worker.advertise_host", "lease_seconds": "worker.lease_seconds",
    "max_open_requests": "worker.max_open_requests", "stall_timeout": "worker.stall_timeout", "drain_timeout": "worker.drain_timeout", "peer": "peers",
    "enforce_eager": "worker.enforce_eager", "async_scheduling": "worker.async_scheduling", "cuda_graph_max_bs": "worker.cuda_graph_max_bs", "kv_cache_dtype": "worker.kv_cache_dtype",
    "quantization": "worker.quantization", "fp4_moe_backend": "worker.fp4_moe_backend",
    "enable_prefix_caching": "worker.enable_prefix_caching", "speculative_config": "worker.speculative_config",
    "transfer_backend": "transfer.backend", "transfer_timeout": "transfer.timeout",
    "metadata_timeout": "transfer.metadata_timeout", "kv_load_failure_policy": "transfer.kv_load_failure_policy",
    "handoff_timeout": "transfer.handoff_timeout",
    "kv_transfer_staging": "transfer.staging.mode",
}  # fmt: skip
ROUTER_FLAGS = {
    "prefill": "prefill", "decode": "decode", "colocated": "colocated", "served_model_name": "served_model_name",
    "prefill_policy": "router.prefill_policy", "decode_policy": "router.decode_policy",
    "cache_threshold": "router.cache_aware.cache_threshold", "balance_abs_threshold": "router.cache_aware.balance_abs_threshold",
    "balance_rel_threshold": "router.cache_aware.balance_rel_threshold", "max_tree_size": "router.cache_aware.max_tree_size",
    "api_key": "router.api_key",
    "health_interval": "router.health_interval", "request_timeout": "router.request_timeout",
    "first_token_timeout": "router.first_token_timeout", "prefill_timeout": "router.prefill_timeout", "migration_limit": "router.migration_limit",
    "max_queued_requests": "router.max_queued_requests", "max_attempts": "router.max_attempts",
    "retry_backoff": "router.retry_backoff", "breaker_failures": "router.breaker_failures",
    "breaker_cooldown": "router.breaker_cooldown", "api_server_count": "router.api_server_count",
    "reasoning_parser": "router.reasoning_parser", "tool_call_parser": "router.tool_call_parser",
    "default_chat_template_kwargs": "router.default_chat_template_kwargs",
    "chat_encoder_revision": "router.chat_encoder_revision",
}  # fmt: skip
COMMON_FLAGS = {
    "role": "role",
    "model": "model",
    "cluster_secret": "cluster_secret",
    "host": "@.host",
    "port": "@.port",
    "max_model_len": "@.max_model_len",
}


def add_serve_args(p: argparse.ArgumentParser) -> None:
    # SUPPRESS: a flag not given leaves no attribute, so the config model's default applies
    add = functools.partial(p.add_argument, default=argparse.SUPPRESS)
    p.add_argument(
        "--config",
        dest="config_file",
        metavar="FILE",
        help="a component's ServeConfig (JSON or YAML; pdserve launch writes these)",
    )
    add("--role", help="prefill | decode | colocated | router")
    add("--host", help="bind address (default 127.0.0.1)")
    add("--port", help="default: router 8000, prefill 30000, decode 30001, colocated 30002")
    add("--model", metavar="DIR", help="checkpoint folder, or tiny:<arch> (the router reads its tokenizer)")
    add("--cluster-secret", help="shared secret for /internal/* (required when a worker binds beyond loopback)")
    add("--max-model-len", help="context length (router: an extra cap on the workers')")
    w = functools.partial(p.add_argument_group("worker").add_argument, default=argparse.SUPPRESS)
    w("--device", help="cpu | cuda | cuda:N")
    w("--dtype", help="auto | float32 | bfloat16 | float16")
    w(
        "--load-format",
        help="auto (the checkpoint's weights) | dummy (random weights from its config.json alone: benchmarks)",
    )
    w("--tensor-parallel-size", "-tp", help="ranks of this worker: GPUs from --device on, or gloo processes on cpu")
    w("--kv-block-size")
    w("--num-kv-blocks")
    w(
        "--gpu-memory-utilization",
        help="cuda: the share of the whole GPU this worker may use (weights, activations, KV pool; default 0.9)",
    )
    w("--max-num-seqs")
    w("--max-num-batched-tokens")
    w("--enforce-eager", action="store_true", help="no CUDA graphs: run every decode step eagerly")
    w(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        help="the overlapped engine loop: step n + 1 launched before step n's tokens are read (default: on CUDA)",
    )
    w("--kv-cache-dtype", help="auto (the model dtype) | fp8 (FP8 latent records, V3 / V3.2)")
    w(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="reuse the KV blocks of earlier prompts' shared prefixes (default on)",
    )
    w(
        "--quantization",
        "-q",
        help="weights: unset follows the checkpoint (FP8 block-scaled: kept FP8) | fp8 (require FP8) | none (dequantize at load)",
    )
    w(
        "--fp4-moe-backend",
        help="FP4 experts (V4): auto (per GPU, docs/kernels.md) | w4a16 | mxfp8 (MXFP8 activations, block-scaled e4m3 MMAs)",
    )
    w("--cuda-graph-max-bs", help="largest decode batch captured as a CUDA graph (default min(max-num-seqs, 256))")
    w(
        "--speculative-config",
        type=json_object,
        metavar="JSON",
        help='speculative decoding, vLLM\'s shape: \'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}\' (colocated or decode worker, V3 / V3.2 / V4)',
    )
    w("--engine-id", help="transfer agent name (default <role>-<port>)")
    w(
        "--advertise-host",
        help="the address other hosts reach this worker on, put in its KV handles (default: --host, or this host's name when --host is 0.0.0.0/::)",
    )
    w("--lease-seconds", help="prefill keeps a request's KV this long for decode")
    w("--transfer-backend", help="nixl")
    w("--transfer-timeout", help="seconds for one request's KV read")
    w("--metadata-timeout", help="seconds to fetch a PD peer's transfer metadata")
    w("--handoff-timeout", help="decode: seconds a request sent with its prefill waits for the hand-off (default 300)")
    w(
        "--peer",
        action="append",
        metavar="URL",
        help="a worker whose transfer metadata may be fetched (repeatable; decode: the prefill workers, prefill: the decode workers)",
    )
    w("--kv-transfer-staging", help="staged KV transfer, one slab a request: auto (on for GPU pools) | on | off")
    w(
        "--kv-load-failure-policy",
        help="decode: a failed KV read fails the request (fail) or computes the prompt here (recompute)",
    )
    w("--max-open-requests", help="requests admitted at once before 429 (default max(8 x max-num-seqs, 256))")
    w(
        "--stall-timeout",
        help="seconds without a finished engine step, while requests are open, before /health says 503 (default 60)",
    )
    w(
        "--drain-timeout",
        help="on SIGTERM: seconds to serve the open requests (new ones refused) before exiting (default 30)",
    )
    r = functools.partial(p.add_argument_group("router").add_argument, default=argparse.SUPPRESS)
    r("--prefill", action="append", metavar="URL")
    r("--decode", action="append", metavar="URL")
    r("--colocated", action="append", metavar="URL", help="a colocated (prefill + decode in one) worker")
    r("--prefill-policy", help="auto | round_robin | least_load | power_of_two | cache_aware")
    r("--decode-policy", help="round_robin | least_load | power_of_two | cache_aware")
    r("--cache-threshold", help="cache_aware: share of the prompt a worker must hold to win on cache (default 0.5)")
    r(
        "--balance-abs-threshold",
        help="cache_aware: in-flight gap (max - min) that, with the relative one, means imbalance",
    )
    r(
        "--balance-rel-threshold",
        help="cache_aware: in-flight ratio (max / min) that, with the absolute one, means imbalance",
    )
    r("--max-tree-size", help="cache_aware: prompt tokens remembered per worker (least recently used forgotten)")
    r("--api-key", help="clients must send Authorization: Bearer <key>")
    r(
        "--default-chat-template-kwargs",
        type=json_object,
        metavar="JSON",
        help="chat_template_kwargs a chat request gets unless it sets them, e.g. '{\"thinking\": true}'",
    )
    r("--served-model-name", help="the model name clients use (default: --model as given)")
    r("--health-interval", help="seconds between worker probes")
    r("--request-timeout", help="seconds a request may take in all")
    r("--first-token-timeout", help="seconds until a request's first token")
    r("--prefill-timeout", help="seconds a prefill worker has to return the first token and KV")
    r("--max-queued-requests", help="concurrent requests before 429")
    r("--max-attempts", help="workers of a role tried when one refuses, before the first token")
    r("--migration-limit", help="times a request moves to another worker when its worker fails mid-request (0: never)")
    r("--retry-backoff", help="seconds before the second try; doubles each try")
    r("--breaker-failures", help="consecutive failed requests that open a worker's circuit breaker")
    r("--breaker-cooldown", help="seconds an open breaker waits before a trial request")
    r("--reasoning-parser", help="auto (by the model) | none | deepseek_v4 | deepseek_r1: reasoning_content apart")
    r(
        "--tool-call-parser",
        help="auto (by the model) | none | deepseek_v4 | deepseek_v32 | deepseek_v31 | deepseek_v3",
    )
    r(
        "--chat-encoder-revision",
        help="DeepSeek-V4's built-in encoder: auto (by the checkpoint) | original | 0731 (its reasoning-effort texts)",
    )
    r(
        "--api-server-count",
        help="router processes sharing the port (default 1): each streamed token costs the router CPU",
    )


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def config_from_args(args: argparse.Namespace) -> WorkerServeConfig | RouterServeConfig:
    """The validated ServeConfig; raises ValueError with every problem (pydantic's messages)."""
    given = {k: v for k, v in vars(args).items() if k != "config_file"}
    if getattr(args, "config_file", None):
        if given:
            raise ValueError(
                f"--config takes the whole component; drop {', '.join('--' + k.replace('_', '-') for k in given)}"
            )
        data = yaml.safe_load(Path(args.config_file).read_text())
    else:
        data = _nest(given)
    try:
        return TypeAdapter(ServeConfig).validate_python(data)
    except ValidationError as err:
        lines = [f"  {'.'.join(str(p) for p in e['loc'][1:]) or '(top level)'}: {e['msg']}" for e in err.errors()]
        raise ValueError("invalid settings:\n" + "\n".join(lines)) from None


def _nest(given: dict[str, Any]) -> dict[str, Any]:
    role = given.get("role")
    if role is None:
        raise ValueError("--role is required: prefill | decode | colocated | router")
    section = "router" if role == "router" else "worker"
    flags = {**COMMON_FLAGS, **(ROUTER_FLAGS if role == "router" else WORKER_FLAGS)}
    unknown = [k for k in given if k not in flags]
    if unknown:
        raise ValueError(f"not a {role} flag: {', '.join('--' + k.replace('_', '-') for k in unknown)}")
    data: dict[str, Any] = {section: {"port": DEFAULT_PORTS.get(role, 0)}}
    for dest, value in given.items():
        *parents, leaf = flags[dest].replace("@", section).split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return data


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per upstream call drowns the log
    role = getattr(args, "role", "?")
    try:
        cfg = config_from_args(args)
        cfg = cfg.model_copy(update={"model": resolve_model(cfg.model)})  # tiny:<arch> -> its folder
        role = cfg.role
        if isinstance(cfg, RouterServeConfig):
            from pdserve.router.app import build_router_app

            app, host, port = (
                build_router_app(cfg),
                cfg.router.host,
                cfg.router.port,
            )  # with several processes: the settings checked here once
        else:
            from pdserve.worker.build import build_worker

            app, host, port = build_worker(cfg), cfg.worker.host, cfg.worker.port
    except (ValueError, FileNotFoundError, RuntimeError, yaml.YAMLError) as e:
        print(f"pdserve serve --role {role}: {e}", file=sys.stderr)
        return 2
    if isinstance(cfg, RouterServeConfig) and cfg.router.api_server_count > 1:
        return serve_router_processes(cfg)
    run_server(app, host, port, announce=f"pdserve {role} listening on http://{host}:{port}")
    return getattr(app.state, "exit_code", 0)  # a worker whose engine failed: non-zero (worker/failure.py)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve serve")
    add_serve_args(p)
    return run_serve(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
