"""Cluster configuration (configs/*.yaml): which processes `pdserve launch` runs and where.

One router, then either prefill + decode workers (PD) or colocated workers (role both), or all
three. Validated data with clear messages; `load_config` accepts a path or a name from configs/.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# configs/ sits beside the package in the source tree (the repo is installed editable).
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = "tiny-cpu"
TINY_ARCHS = ("deepseek_v3", "deepseek_v32", "deepseek_v4")
TINY_PREFIX = "tiny:"  # model "tiny:<arch>": the tiny random checkpoint, made in the cache on first use
POLICIES = Literal["round_robin", "least_load", "power_of_two"]


class ConfigError(ValueError):
    """A config that cannot be found, parsed or validated; the message says where and why."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RouterConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    prefill_policy: POLICIES = "round_robin"
    decode_policy: POLICIES = "least_load"
    api_key: str | None = None
    health_interval: float = Field(2.0, gt=0)  # seconds between worker probes
    request_timeout: float = Field(600.0, gt=0)
    max_queued_requests: int | None = Field(None, ge=1)


class WorkerConfig(_Strict):
    port: int = Field(ge=1, le=65535)
    host: str = "127.0.0.1"
    device: Literal["cpu", "cuda"] = "cpu"
    gpus: list[int] = Field(default_factory=list)
    tp_size: int = Field(1, ge=1)  # the worker's tensor_parallel_size: one rank per GPU of gpus; on cpu, gloo processes
    numa_node: int | Literal["auto"] | None = None  # None: not pinned; auto: its GPUs' node
    cpus: str | None = None  # narrow the node to these CPUs, a cpulist such as "0-7"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    kv_block_size: int = Field(64, ge=1)
    num_kv_blocks: int | None = Field(None, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    lease_seconds: float = Field(60.0, gt=0)  # prefill keeps KV this long for decode to pull
    engine_id: str | None = None  # default: "<role>-<index>-<port>"

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, gpus: list[int]) -> list[int]:
        if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
            raise ValueError(f"gpus must be distinct non-negative GPU indices, got {gpus}")
        return gpus

    @field_validator("numa_node")
    @classmethod
    def _numa(cls, node: int | str | None) -> int | str | None:
        if isinstance(node, int) and node < 0:
            raise ValueError(f"numa_node must be >= 0, 'auto' or null, got {node}")
        return node

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, cpus: str | None) -> str | None:
        if cpus is not None:
            from pdserve.numa import parse_cpulist

            if not parse_cpulist(cpus):
                raise ValueError("cpus must name at least one CPU, e.g. '0-7'")
        return cpus

    @model_validator(mode="after")
    def _placement(self) -> "WorkerConfig":
        if self.device == "cuda":
            if not self.gpus:
                raise ValueError("a cuda worker needs gpus, e.g. gpus: [0]")
            if self.tp_size != len(self.gpus):
                raise ValueError(f"tp_size ({self.tp_size}) must equal the number of gpus ({self.gpus})")
        else:
            if self.gpus:
                raise ValueError(f"a cpu worker takes no gpus (got {self.gpus}); set device: cuda")
            if self.numa_node == "auto":
                raise ValueError("numa_node 'auto' follows the worker's GPUs; a cpu worker needs a node number or null")
        if self.cpus is not None and self.numa_node is None:
            raise ValueError("cpus narrows a NUMA node: set numa_node too")
        return self


class TransferConfig(_Strict):
    backend: Literal["nixl", "fake"] = "nixl"
    timeout: float = Field(30.0, gt=0)  # seconds for one request's KV pull
    ucx: dict[str, str | int | float] = Field(default_factory=dict)  # UCX_* env for the workers

    @field_validator("ucx")
    @classmethod
    def _ucx(cls, env: dict[str, str | int | float]) -> dict[str, str | int | float]:
        bad = [k for k in env if not k.startswith("UCX_")]
        if bad:
            raise ValueError(f"transfer.ucx holds UCX_* environment variables only; not: {bad}")
        return env

    def env(self) -> dict[str, str]:
        return {k: str(v) for k, v in self.ucx.items()}


class ClusterConfig(_Strict):
    model: str  # checkpoint folder, or "tiny:<arch>"
    served_model_name: str | None = None
    router: RouterConfig = Field(default_factory=RouterConfig)
    prefill: list[WorkerConfig] = Field(default_factory=list)
    decode: list[WorkerConfig] = Field(default_factory=list)
    colocated: list[WorkerConfig] = Field(default_factory=list)
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    cluster_secret: str | None = None  # shared by router and workers; None: a fresh one per launch
    log_dir: str = "logs"
    startup_timeout: float = Field(900.0, gt=0)  # seconds for every process to report healthy
    stop_grace_seconds: float = Field(10.0, gt=0)  # SIGTERM, then SIGKILL after this long

    @field_validator("model")
    @classmethod
    def _model(cls, model: str) -> str:
        if not model.strip():
            raise ValueError("model must be a checkpoint folder or 'tiny:<arch>'")
        if model.startswith(TINY_PREFIX) and model[len(TINY_PREFIX) :] not in TINY_ARCHS:
            raise ValueError(f"unknown tiny model {model!r}; choose one of {[TINY_PREFIX + a for a in TINY_ARCHS]}")
        return model

    @model_validator(mode="after")
    def _topology(self) -> "ClusterConfig":
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("PD needs both prefill and decode workers (or use colocated workers only)")
        if not self.prefill and not self.colocated:
            raise ValueError("no workers: list prefill + decode workers, colocated workers, or both")
        seen: dict[int, str] = {self.router.port: "router"}
        for name, w in self.named_workers():
            if w.port in seen:
                raise ValueError(f"port {w.port} is used by both {seen[w.port]} and {name}")
            seen[w.port] = name
        return self

    def named_workers(self) -> list[tuple[str, WorkerConfig]]:
        """('prefill-0', cfg), ..., ('decode-0', cfg), ..., ('colocated-0', cfg), ..."""
        groups = (("prefill", self.prefill), ("decode", self.decode), ("colocated", self.colocated))
        return [(f"{role}-{i}", w) for role, workers in groups for i, w in enumerate(workers)]


def find_config(name_or_path: str) -> Path:
    """A path as given, else configs/<name> or configs/<name>.yaml."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    for candidate in (CONFIG_DIR / name_or_path, CONFIG_DIR / f"{name_or_path}.yaml"):
        if candidate.is_file():
            return candidate
    known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.is_dir() else []
    raise ConfigError(f"config {name_or_path!r} not found (not a file; shipped configs in {CONFIG_DIR}: {known})")


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"  {where}: {e['msg']}")
    return "\n".join(lines)


def parse_config(data: object, source: str = "<config>") -> ClusterConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{source} is not a valid pdserve config:\n{_format_errors(err)}") from None


def load_config(name_or_path: str = DEFAULT_CONFIG) -> ClusterConfig:
    path = find_config(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    return parse_config(data, str(path))
