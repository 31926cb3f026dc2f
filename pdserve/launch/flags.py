"""What `pdserve launch` runs: the cluster YAML, merged with the default config where it leaves
out the model or the workers, then the serve flags a user expects to pass (vLLM's names), each
overriding one key, for the router or for every worker.

    load_cluster(file)    `router: {api_key: k}` alone is the default cluster (tiny-cpu) with a key
    apply_flags(cfg, ns)  the flags given, over cfg.model_dump() -> parse_config again

Both results are validated as a config file is, so a flag and a YAML key fail with the same message.
"""

from __future__ import annotations

import argparse
from typing import Any

import yaml

from pdserve.config import DEFAULT_CONFIG, ClusterConfig, ConfigError, find_config, parse_config
from pdserve.serve import json_object

# flag dest -> (section, key): "router" is the router's section, "workers" every worker's, "" the top level
FLAGS: dict[str, tuple[str, str]] = {
    "model": ("", "model"),
    "served_model_name": ("", "served_model_name"),
    "api_key": ("router", "api_key"),
    "port": ("router", "port"),
    "router_host": ("router", "host"),
    "tensor_parallel_size": ("workers", "tp_size"),
    "max_model_len": ("workers", "max_model_len"),
    "max_num_seqs": ("workers", "max_num_seqs"),
    "max_num_batched_tokens": ("workers", "max_num_batched_tokens"),
    "num_kv_blocks": ("workers", "num_kv_blocks"),
    "gpu_memory_utilization": ("workers", "gpu_memory_utilization"),
    "kv_cache_dtype": ("workers", "kv_cache_dtype"),
    "enforce_eager": ("workers", "enforce_eager"),
    "async_scheduling": ("workers", "async_scheduling"),
    "enable_prefix_caching": ("workers", "enable_prefix_caching"),
    "speculative_config": ("workers", "speculative_config"),
}
ROLE_PORTS = {"prefill_port": "prefill", "decode_port": "decode", "colocated_port": "colocated"}
WORKER_LISTS = tuple(ROLE_PORTS.values())


def load_cluster(name_or_path: str = DEFAULT_CONFIG) -> ClusterConfig:
    """A cluster YAML (a path or a name in configs/); one that leaves out the model or every worker
    list takes them from the default config."""
    path, default = find_config(name_or_path), find_config(DEFAULT_CONFIG)
    data = _read_yaml(path)
    if isinstance(data, dict) and path.resolve() != default.resolve():
        data = with_defaults(data, _read_yaml(default))
    return parse_config(data, str(path))


def with_defaults(data: dict, defaults: dict) -> dict:
    """`data` with what a cluster cannot lack taken from `defaults`: its model, and its workers
    when `data` lists none. Every other key left out takes the config models' default."""
    filled = dict(data)
    if "model" in defaults:
        filled.setdefault("model", defaults["model"])
    if not any(k in data for k in WORKER_LISTS):
        filled.update({k: defaults[k] for k in WORKER_LISTS if k in defaults})
    return filled


def _read_yaml(path) -> object:
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None


def add_launch_flags(p: argparse.ArgumentParser) -> None:
    """The flags over the config (every default: the config's)."""
    p.add_argument("--model", help="checkpoint folder (or tiny:<arch>), overrides the config's model")
    p.add_argument("--served-model-name", metavar="NAME", help="the model name clients send (default: the config's)")
    p.add_argument("--api-key", metavar="KEY", help="clients must send Authorization: Bearer KEY (router.api_key)")
    p.add_argument("--port", type=int, help="the router's port (router.port)")
    p.add_argument(
        "--router-host",
        metavar="ADDR",
        help="bind the router here (e.g. 0.0.0.0 in a container), overrides the config's router.host",
    )
    for dest, role in ROLE_PORTS.items():
        p.add_argument(
            f"--{dest.replace('_', '-')}",
            type=int,
            metavar="PORT",
            help=f"the first {role} worker's port; the next ones follow it",
        )
    w = "every worker's"
    p.add_argument("--tensor-parallel-size", type=int, metavar="N", help=f"{w} tp_size")
    p.add_argument("--max-model-len", type=int, metavar="N", help=f"{w} max_model_len")
    p.add_argument("--max-num-seqs", type=int, metavar="N", help=f"{w} max_num_seqs")
    p.add_argument("--max-num-batched-tokens", type=int, metavar="N", help=f"{w} max_num_batched_tokens")
    p.add_argument("--num-kv-blocks", type=int, metavar="N", help=f"{w} num_kv_blocks")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        metavar="F",
        help=f"{w} gpu_memory_utilization (each worker's share of its whole GPU)",
    )
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), help=f"{w} kv_cache_dtype")
    p.add_argument("--enforce-eager", action="store_true", default=None, help=f"{w} enforce_eager (no CUDA graphs)")
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"{w} async_scheduling (the overlapped engine loop; default: on CUDA)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"{w} enable_prefix_caching (on by default)",
    )
    p.add_argument(
        "--speculative-config",
        type=json_object,
        metavar="JSON",
        help=f"{w} speculative_config (vLLM's JSON; prefill workers take method mtp only, other methods skip them)",
    )


def apply_flags(cfg: ClusterConfig, args: argparse.Namespace) -> ClusterConfig:
    """cfg with every flag given; raises ConfigError as a bad config file does."""
    data: dict[str, Any] = cfg.model_dump(exclude_unset=True)
    given = {k: v for k, v in vars(args).items() if v is not None}
    changed = False
    for dest, (section, key) in FLAGS.items():
        if dest not in given:
            continue
        changed = True
        if section == "":
            data[key] = given[dest]
        elif section == "router":
            data.setdefault("router", {})[key] = given[dest]
        else:
            for role in WORKER_LISTS:
                if role == "prefill" and dest == "speculative_config" and given[dest].get("method") != "mtp":
                    continue  # drafts only decode: a prefill worker takes MTP alone (its layer's KV and state)
                for w in data.get(role, []):
                    w[key] = given[dest]
    for dest, role in ROLE_PORTS.items():
        if dest in given:
            changed = True
            for i, w in enumerate(data.get(role, [])):
                w["port"] = given[dest] + i
    return parse_config(data, "the config with launch's flags") if changed else cfg
